//! Speculative decoding with the model's own multi-token-prediction layer (`--spec-mtp`) on the
//! fixtures that carry one (DeepSeek-V3: MLA and experts; Qwen3-Next, Qwen3.5 and Qwen3.5-MoE:
//! delta-net and attention over recurrent states), and with Gemma 4's assistant on the Gemma 4 fixture (sliding and
//! full layers, KV-shared ones among them): greedy output equals the plain run's token for
//! token, alone, in a batch, and from the prompt cache; a model without the layer is refused
//! by name.

mod cli_support;

use std::path::PathBuf;
use std::sync::Arc;

use cli_support::peregrine;
use peregrine_engine::sampling::SamplingParams;
use peregrine_engine::speculative::{AssistantDraft, DraftSource, MtpDraft};
use peregrine_engine::{
    Engine, EngineConfig, Event, KvOptions, LoadOptions, Prompt, Request, SpeculativeConfig,
};
use peregrine_models::Gemma4Assistant;

/// The targets, each with what drafts for it: its MTP layer, or Gemma 4's assistant.
const ARCHS: [&str; 5] = [
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma4_text",
];

fn drafter(arch: &str) -> Arc<dyn DraftSource> {
    match arch {
        "gemma4_text" => {
            let dir = fixture("gemma4_assistant");
            let assistant = Gemma4Assistant::load(&dir, &LoadOptions::default()).unwrap();
            Arc::new(AssistantDraft(Arc::new(assistant)))
        }
        _ => Arc::new(MtpDraft),
    }
}

fn fixture(arch: &str) -> PathBuf {
    cli_support::fixture(arch)
}

fn config(draft: Option<&str>, parallel: usize, prompt_cache_entries: usize) -> EngineConfig {
    EngineConfig {
        speculative: draft.map(|arch| SpeculativeConfig {
            source: drafter(arch),
            max_draft: 3,
            adaptive: false,
        }),
        kv: KvOptions::default(),
        parallel,
        prompt_cache_entries,
        ..EngineConfig::default()
    }
}

fn request(prompt: &[u32], n: usize) -> Request {
    let mut r = Request::new(Prompt::Tokens(prompt.to_vec()));
    r.sampling = SamplingParams::greedy();
    r.max_tokens = Some(n);
    r.ignore_eos = true;
    r
}

fn tokens(stream: impl IntoIterator<Item = Event>) -> (Vec<u32>, usize) {
    let (mut out, mut cached) = (Vec::new(), 0);
    for event in stream {
        match event {
            Event::Delta { tokens, .. } => out.extend(tokens),
            Event::Error(e) => panic!("{e}"),
            Event::Done { usage, .. } => cached = usage.cached_tokens,
        }
    }
    (out, cached)
}

/// Prompts of different lengths under the fixtures' 512-token vocabulary.
fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 37 + salt * 11) % 61 + 3) as u32)
        .collect()
}

#[test]
fn mtp_drafts_leave_greedy_output_unchanged() {
    for arch in ARCHS {
        let model = fixture(arch);
        let plain = Engine::load(&model, config(None, 1, 0)).unwrap();
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(9 + 8 * i, i)).collect();
        let want: Vec<Vec<u32>> = (prompts.iter())
            .map(|p| tokens(plain.submit(request(p, 40)).unwrap()).0)
            .collect();
        // Alone.
        let engine = Engine::load(&model, config(Some(arch), 1, 0)).unwrap();
        for (p, want) in prompts.iter().zip(&want) {
            assert_eq!(
                &tokens(engine.submit(request(p, 40)).unwrap()).0,
                want,
                "{arch}"
            );
        }
        let stats = engine.speculation_stats();
        assert!(
            stats.rounds >= 20 && stats.drafted >= 60,
            "{arch}: {stats:?}"
        );
        // Batched: three speculating sequences share every pass.
        let engine = Engine::load(&model, config(Some(arch), 3, 0)).unwrap();
        let streams: Vec<_> = (prompts.iter())
            .map(|p| engine.submit(request(p, 40)).unwrap())
            .collect();
        for (stream, want) in streams.into_iter().zip(&want) {
            assert_eq!(&tokens(stream).0, want, "{arch}, batched");
        }
        eprintln!("{arch}: {:?}", engine.speculation_stats());
    }
}

/// A second request sharing the first one's prompt and reply resumes from its cache entry, the
/// head's memory with it (the entry is trimmed back within the kept hidden states), and still
/// matches the plain run.
#[test]
fn mtp_drafting_resumes_from_the_prompt_cache() {
    for arch in ARCHS {
        let model = fixture(arch);
        let first = prompt(20, 5);
        let plain = Engine::load(&model, config(None, 1, 0)).unwrap();
        let reply = tokens(plain.submit(request(&first, 24)).unwrap()).0;
        let mut second = [first.clone(), reply.clone()].concat();
        second.extend([7, 8, 9]);
        let want = tokens(plain.submit(request(&second, 24)).unwrap()).0;
        let engine = Engine::load(&model, config(Some(arch), 1, 4)).unwrap();
        assert_eq!(
            tokens(engine.submit(request(&first, 24)).unwrap()).0,
            reply,
            "{arch}"
        );
        let rounds = engine.speculation_stats().rounds;
        let (got, cached) = tokens(engine.submit(request(&second, 24)).unwrap());
        assert_eq!(got, want, "{arch}");
        assert!(cached > first.len(), "{arch}: reused {cached} tokens");
        let stats = engine.speculation_stats();
        assert!(
            stats.rounds >= rounds + 6,
            "{arch}: the head drafts again: {stats:?}"
        );
    }
}

/// `generate --spec-mtp` (and `--draft-model` naming Gemma 4's assistant) prints the plain
/// greedy text; on a model without the layer it is refused, naming the flag and the
/// alternatives, and the assistant is refused for a model that is not Gemma 4.
#[test]
fn the_cli_takes_spec_mtp_and_refuses_a_model_without_the_layer() {
    let run = |arch: &str, extra: &[&str]| {
        let model = fixture(arch);
        let mut a = vec!["generate", "--model", model.to_str().unwrap()];
        a.extend(["--prompt", "one two three one two", "--temperature", "0"]);
        a.extend(["--max-tokens", "24"]);
        a.extend(extra);
        peregrine(&a)
    };
    let assistant = fixture("gemma4_assistant");
    let assistant = ["--draft-model", assistant.to_str().unwrap()];
    for (arch, flags) in [
        ("deepseek_v3", &["--spec-mtp"][..]),
        ("qwen3_next", &["--spec-mtp"]),
        ("qwen3_5", &["--spec-mtp"]),
        ("qwen3_5_moe", &["--spec-mtp"]),
        ("gemma4_text", &assistant),
    ] {
        let (plain, drafted) = (run(arch, &[]), run(arch, flags));
        let err = String::from_utf8_lossy(&drafted.stderr);
        assert!(drafted.status.success(), "{err}");
        assert_eq!(drafted.stdout, plain.stdout, "{arch}");
    }
    let refused = |flags: &[&str], words: &[&str]| {
        let out = run("llama", flags);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(words.iter().all(|w| err.contains(w)), "{err}");
    };
    refused(&["--spec-mtp"], &["--spec-mtp", "--draft-model"]);
    refused(&assistant, &["gemma4_assistant", "Gemma 4 models"]);
}
