//! Speculative decoding with the model's own multi-token-prediction layer (`--spec-mtp`) on the
//! fixtures that carry one (DeepSeek-V3: MLA and experts; Qwen3-Next: delta-net and attention
//! over recurrent states): greedy output equals the plain run's token for token, alone, in a
//! batch, and from the prompt cache; a model without the layer is refused by name.

mod cli_support;

use std::path::PathBuf;
use std::sync::Arc;

use cli_support::peregrine;
use peregrine_engine::sampling::SamplingParams;
use peregrine_engine::speculative::MtpDraft;
use peregrine_engine::{
    Engine, EngineConfig, Event, KvOptions, Prompt, Request, SpeculativeConfig,
};

const ARCHS: [&str; 2] = ["deepseek_v3", "qwen3_next"];

fn fixture(arch: &str) -> PathBuf {
    cli_support::fixture(arch)
}

fn config(mtp: bool, parallel: usize, prompt_cache_entries: usize) -> EngineConfig {
    EngineConfig {
        speculative: mtp.then(|| SpeculativeConfig {
            source: Arc::new(MtpDraft),
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
        let plain = Engine::load(&model, config(false, 1, 0)).unwrap();
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(9 + 8 * i, i)).collect();
        let want: Vec<Vec<u32>> = (prompts.iter())
            .map(|p| tokens(plain.submit(request(p, 40)).unwrap()).0)
            .collect();
        // Alone.
        let engine = Engine::load(&model, config(true, 1, 0)).unwrap();
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
        let engine = Engine::load(&model, config(true, 3, 0)).unwrap();
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
        let plain = Engine::load(&model, config(false, 1, 0)).unwrap();
        let reply = tokens(plain.submit(request(&first, 24)).unwrap()).0;
        let mut second = [first.clone(), reply.clone()].concat();
        second.extend([7, 8, 9]);
        let want = tokens(plain.submit(request(&second, 24)).unwrap()).0;
        let engine = Engine::load(&model, config(true, 1, 4)).unwrap();
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

/// `generate --spec-mtp` prints the plain greedy text; on a model without the layer it is
/// refused, naming the flag and the alternatives.
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
    for arch in ARCHS {
        let (plain, mtp) = (run(arch, &[]), run(arch, &["--spec-mtp"]));
        assert!(
            mtp.status.success(),
            "{}",
            String::from_utf8_lossy(&mtp.stderr)
        );
        assert_eq!(mtp.stdout, plain.stdout, "{arch}");
    }
    let out = run("llama", &["--spec-mtp"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--spec-mtp") && err.contains("--draft-model"),
        "{err}"
    );
}
