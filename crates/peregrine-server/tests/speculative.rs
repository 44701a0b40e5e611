//! Speculative decoding: greedy output with drafts equals greedy output without them, token for
//! token, on every cache kind (rejected drafts are rolled back exactly) and on the real models;
//! sampled output keeps the target's distribution with a poor draft; the CLI and the server take
//! the flags (the server's side is in server.rs).

mod cli_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cli_support::{peregrine, peregrine_ok, real_model, scratch};
use peregrine_engine::sampling::{Sampler, SamplingParams};
use peregrine_engine::speculative::{
    DraftContext, DraftModel, DraftSource, Drafter, PromptLookup, Proposal,
};
use peregrine_engine::{
    CausalLm, Engine, EngineConfig, EngineError, Event, ExpertOptions, KvOptions, KvQuant,
    LoadOptions, Prompt, Request, SpeculativeConfig, TurboOptions,
};

/// A drafter that knows the right continuation (the plain run's tokens): each round it proposes
/// that continuation for its first `right` tokens and wrong ones after, `right` cycling through
/// 0..=max (so every rollback depth and the bonus token are exercised), or always 0.
struct Scripted {
    truth: Arc<Vec<u32>>,
    always_wrong: bool,
}

struct ScriptedRun {
    truth: Arc<Vec<u32>>,
    always_wrong: bool,
    round: usize,
}

impl DraftSource for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn start(&self, _: &Arc<dyn CausalLm>, _: &SamplingParams, _: &KvOptions) -> Box<dyn Drafter> {
        Box::new(ScriptedRun {
            truth: self.truth.clone(),
            always_wrong: self.always_wrong,
            round: 0,
        })
    }
}

impl Drafter for ScriptedRun {
    fn propose(
        &mut self,
        context: DraftContext,
        max: usize,
        out: &mut Proposal,
    ) -> Result<(), EngineError> {
        let generated = context.generated;
        out.clear();
        self.round += 1;
        let right = if self.always_wrong {
            0
        } else {
            self.round % (max + 1)
        };
        for i in 0..max {
            let truth = self.truth.get(generated.len() + i).copied().unwrap_or(0);
            // A neighbour of the right token is wrong (the fixtures' vocabularies are 512+).
            out.tokens
                .push(if i < right { truth } else { (truth + 1) % 500 });
        }
        Ok(())
    }
}

fn config(kv: KvOptions, speculative: Option<SpeculativeConfig>) -> EngineConfig {
    EngineConfig {
        kv,
        speculative,
        prompt_cache_entries: 0,
        ..EngineConfig::default()
    }
}

fn fixed(source: Arc<dyn DraftSource>, max_draft: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        source,
        max_draft,
        adaptive: false,
    })
}

/// `n` greedy tokens after `prompt`.
fn greedy(engine: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut r = Request::new(Prompt::Tokens(prompt.to_vec()));
    r.sampling = SamplingParams::greedy();
    r.max_tokens = Some(n);
    r.ignore_eos = true;
    tokens(engine.submit(r).expect("submitted"))
}

fn tokens(stream: impl IntoIterator<Item = Event>) -> Vec<u32> {
    let mut out = Vec::new();
    for event in stream {
        match event {
            Event::Delta { tokens, .. } => out.extend(tokens),
            Event::Error(e) => panic!("{e}"),
            Event::Done { .. } => {}
        }
    }
    out
}

/// A prompt of `len` tokens below 500 that repeats itself (prompt lookup finds matches).
fn prompt(len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 37) % 61 + 3) as u32).collect()
}

/// Greedy output through a drafter that is always wrong, and through one that is right for
/// 0..=4 tokens a round, equals the output without drafts, on `model` with `kv`.
fn check_rollback(model: &Path, kv: KvOptions, prompt: &[u32], n: usize, what: &str) {
    let plain = greedy(&Engine::load(model, config(kv, None)).unwrap(), prompt, n);
    for always_wrong in [true, false] {
        let source = Arc::new(Scripted {
            truth: Arc::new(plain.clone()),
            always_wrong,
        });
        let engine = Engine::load(model, config(kv, fixed(source, 4))).unwrap();
        let out = greedy(&engine, prompt, n);
        assert_eq!(out, plain, "{what}, always wrong: {always_wrong}");
        let stats = engine.speculation_stats();
        assert!(stats.drafted >= n as u64 / 2, "{what}: {stats:?}");
        match always_wrong {
            true => assert_eq!(stats.accepted, 0, "{what}: {stats:?}"),
            false => assert!(
                stats.accepted > 0 && stats.accepted < stats.drafted,
                "{what}: {stats:?}"
            ),
        }
    }
}

fn fixture(arch: &str) -> PathBuf {
    cli_support::fixture(arch)
}

/// Rejected drafts roll back exactly on every cache kind: full attention in f32 and f16,
/// quantized 8- and 4-bit, TurboQuant across its hot window, a sliding window past its end
/// (the Gemma 3 fixture's window is 8), and recurrent states (Mamba 2; Qwen3-Next's hybrid of
/// delta-net and attention layers). Checked to fail when the cache is not trimmed back.
#[test]
fn wrong_drafts_leave_greedy_output_unchanged_on_every_cache_kind() {
    let f16 = KvOptions::default();
    let f32 = KvOptions { dtype: None, ..f16 };
    let prompt = prompt(24);
    for (arch, what) in [
        ("llama", "f16"),
        ("gemma3", "sliding window 8"),
        ("mamba2", "recurrent"),
        ("qwen3_next", "hybrid recurrent"),
    ] {
        check_rollback(&fixture(arch), f16, &prompt, 40, what);
    }
    check_rollback(&fixture("llama"), f32, &prompt, 40, "f32");
    // The real SmolLM2 (head_dim 64) for the quantized kinds: the fixtures' heads are 16 wide.
    let smol = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let quant = |bits, group_size| KvOptions {
        quant: Some(KvQuant { bits, group_size }),
        ..f16
    };
    check_rollback(&smol, quant(8, 64), &prompt, 32, "kv_bits 8");
    check_rollback(&smol, quant(4, 32), &prompt, 32, "kv_bits 4");
    let turbo = KvOptions {
        turbo: Some(TurboOptions {
            hot_window: 8,
            threshold: 16,
            ..TurboOptions::default()
        }),
        ..f16
    };
    check_rollback(&smol, turbo, &prompt, 32, "TurboQuant, hot window 8");
}

/// Sequences that speculate share batched passes with each other and with plain ones: each
/// returns its solo plain output.
#[test]
fn speculating_sequences_batch_with_others() {
    let model = fixture("llama");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(10 + 7 * i)).collect();
    let plain_engine = Engine::load(&model, config(KvOptions::default(), None)).unwrap();
    let plain: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy(&plain_engine, p, 30))
        .collect();
    let lookup = fixed(Arc::new(PromptLookup::default()), 3);
    let engine = Engine::load(
        &model,
        EngineConfig {
            parallel: 4,
            ..config(KvOptions::default(), lookup)
        },
    )
    .unwrap();
    let streams: Vec<_> = (prompts.iter().enumerate())
        .map(|(i, p)| {
            let mut r = Request::new(Prompt::Tokens(p.clone()));
            r.sampling = SamplingParams::greedy();
            r.max_tokens = Some(30);
            r.ignore_eos = true;
            r.speculative = i % 2 == 0; // half of them opt out
            engine.submit(r).unwrap()
        })
        .collect();
    for (i, stream) in streams.into_iter().enumerate() {
        assert_eq!(tokens(stream), plain[i], "request {i}");
    }
    let (steps, rows) = engine.batch_steps();
    assert!(
        rows > steps,
        "the requests shared passes: {steps} steps, {rows} rows"
    );
    assert!(engine.speculation_stats().drafted > 0);
}

/// The file made by `peregrine quantize`: SmolLM2's Q4_1 weights dequantized to f32 (kept
/// between runs beside the test binary).
fn smollm2_f32() -> PathBuf {
    let out = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .join("SmolLM2-135M-Instruct.f32.gguf");
    if !out.exists() {
        let dir = scratch("f32-copy");
        let tmp = dir.join("f32.gguf");
        let source = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
        let run = peregrine(&[
            "quantize",
            "--model",
            source.to_str().unwrap(),
            "--format",
            "gguf",
            "--type",
            "f32",
            "--out",
            tmp.to_str().unwrap(),
        ]);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        std::fs::rename(&tmp, &out).unwrap();
    }
    out
}

/// The pairs: SmolLM2 in f32 drafted by its own Q4_1 file, and Gemma 3 270M past its
/// 512-token sliding window by prompt lookup; greedy output equals the plain run's.
#[test]
fn greedy_output_is_unchanged_on_the_real_models() {
    let draft_file = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let target = smollm2_f32();
    let draft = DraftModel::load(&draft_file, &LoadOptions::default(), 512).unwrap();
    let chat = "Write a Python function that returns the squares of a list, then explain it.";
    let plain_engine = Engine::load(&target, config(KvOptions::default(), None)).unwrap();
    let ids = plain_engine
        .prompt_ids(&Prompt::Chat {
            messages: vec![peregrine_engine::ChatMessage::text("user", chat)],
            template_kwargs: Default::default(),
        })
        .unwrap();
    let plain = greedy(&plain_engine, &ids, 64);
    drop(plain_engine);
    let engine = Engine::load(
        &target,
        config(KvOptions::default(), fixed(Arc::new(draft), 4)),
    );
    let engine = engine.unwrap();
    assert_eq!(
        greedy(&engine, &ids, 64),
        plain,
        "SmolLM2 f32 with its Q4_1 draft"
    );
    let stats = engine.speculation_stats();
    assert!(
        stats.acceptance_rate() > 0.5,
        "a Q4_1 copy mostly agrees: {stats:?}"
    );

    let gemma = real_model("gemma-3-270m-q4_k_m.gguf");
    let long = prompt(600);
    let plain = greedy(
        &Engine::load(&gemma, config(KvOptions::default(), None)).unwrap(),
        &long,
        40,
    );
    let lookup = fixed(Arc::new(PromptLookup::default()), 4);
    let engine = Engine::load(&gemma, config(KvOptions::default(), lookup)).unwrap();
    assert_eq!(greedy(&engine, &long, 40), plain, "Gemma 3 past its window");
    assert!(engine.speculation_stats().drafted > 0);
}

/// At temperature 1 with top-k 3 (27 outcomes for three tokens), the first three tokens of
/// 20,000 runs drafted by a poor draft (the fixture's 3-bit MLX copy, two tokens a round) follow
/// the model's exact joint distribution, computed from its logits: Pearson's chi-square over the
/// outcomes stays below 54.05, the 0.001 critical value for 26 degrees of freedom (the runs are
/// seeded, so the test is deterministic). A verifier that kept every draft fails it (checked).
#[test]
fn sampled_output_keeps_the_models_distribution_with_a_poor_draft() {
    const RUNS: usize = 20_000;
    const CHOICES: usize = 1_000;
    let model = fixture("llama");
    let draft_dir = model.parent().unwrap().join("mlx-q3-g32");
    let draft = DraftModel::load(&draft_dir, &LoadOptions::default(), 512).unwrap();
    let engine = Engine::load(
        &model,
        config(KvOptions::default(), fixed(Arc::new(draft), 2)),
    );
    let engine = engine.unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 3,
        ..SamplingParams::default()
    };
    let prompt = vec![5u32, 77, 300, 12, 41];
    // The exact joint distribution of the three tokens, from the model's logits.
    let dist = |ids: &[u32]| {
        let row = engine.logits(ids, ids.len() - 1..ids.len()).unwrap();
        let mut logits = row.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut d = peregrine_engine::sampling::Distribution::default();
        Sampler::new(params.clone()).distribution(&mut logits, &[], &[], &mut d);
        d.probs().to_vec()
    };
    let mut exact = std::collections::HashMap::new();
    for (a, pa) in dist(&prompt) {
        let pa_ids = [prompt.as_slice(), &[a]].concat();
        for (b, pb) in dist(&pa_ids) {
            for (c, pc) in dist(&[pa_ids.as_slice(), &[b]].concat()) {
                exact.insert([a, b, c], pa as f64 * pb as f64 * pc as f64);
            }
        }
    }
    assert_eq!(exact.len(), 27);
    let mut counts = std::collections::HashMap::new();
    for r in 0..RUNS / CHOICES {
        let mut request = Request::new(Prompt::Tokens(prompt.clone()));
        request.sampling = SamplingParams {
            seed: Some((r * CHOICES) as u64),
            ..params.clone()
        };
        request.max_tokens = Some(3);
        request.ignore_eos = true;
        for stream in engine.submit_choices(request, CHOICES).unwrap() {
            let t = tokens(stream);
            *counts.entry([t[0], t[1], t[2]]).or_insert(0usize) += 1;
        }
    }
    let stray: Vec<_> = counts.keys().filter(|k| !exact.contains_key(*k)).collect();
    assert!(
        stray.is_empty(),
        "outcomes the model cannot produce: {stray:?}"
    );
    let chi2: f64 = (exact.iter())
        .map(|(k, p)| {
            let (o, e) = (*counts.get(k).unwrap_or(&0) as f64, p * RUNS as f64);
            (o - e).powi(2) / e
        })
        .sum();
    let stats = engine.speculation_stats();
    eprintln!(
        "chi-square {chi2:.1}, acceptance {:.3}",
        stats.acceptance_rate()
    );
    assert!(
        chi2 < 54.05,
        "chi-square {chi2:.1} over 27 outcomes; {stats:?}"
    );
    // The draft is poor but not useless: both verification branches ran many times.
    let rate = stats.acceptance_rate();
    assert!(
        (0.1..0.9).contains(&rate),
        "acceptance {rate:.3}: {stats:?}"
    );
    assert!(stats.drafted >= RUNS as u64, "{stats:?}");
}

/// `generate --draft-model` and `--spec-ngram` print the plain greedy text; a draft with
/// another vocabulary is refused at load, naming the file and both sizes.
#[test]
fn the_cli_takes_a_draft_model_and_refuses_a_foreign_vocabulary() {
    let model = fixture("llama");
    let model = model.to_str().unwrap();
    let draft = fixture("llama").parent().unwrap().join("mlx-q8-g64");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "one two three one two",
        ];
        a.extend(["--temperature", "0", "--max-tokens", "24"]);
        a.extend(extra);
        String::from_utf8(peregrine_ok(&a).stdout).unwrap()
    };
    let plain = args(&[]);
    assert_eq!(args(&["--draft-model", draft.to_str().unwrap()]), plain);
    assert_eq!(args(&["--spec-ngram", "--num-draft-tokens", "3"]), plain);
    let foreign = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = peregrine(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--draft-model",
        foreign.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("SmolLM2") && err.contains("49152") && err.contains("tokenizer"),
        "{err}"
    );
}

/// A token's logprob as reported: id, logprob, the top alternatives.
type Logprob = (u32, f32, Vec<(u32, f32)>);

/// Everything a plain run reports, for comparison: tokens, text, logprobs, finish, stop string.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<Logprob>,
    finish: Option<peregrine_engine::FinishReason>,
    stop: Option<String>,
    cached: usize,
}

fn outcome(engine: &Engine, request: Request) -> Outcome {
    let mut o = Outcome {
        tokens: vec![],
        text: String::new(),
        logprobs: vec![],
        finish: None,
        stop: None,
        cached: 0,
    };
    for event in engine.submit(request).unwrap() {
        match event {
            Event::Delta {
                text,
                tokens,
                logprobs,
            } => {
                o.text.push_str(&text);
                o.tokens.extend(tokens);
                (o.logprobs).extend(logprobs.into_iter().map(|l| (l.id, l.logprob, l.top)));
            }
            Event::Done {
                finish,
                stop_string,
                usage,
                ..
            } => {
                o.finish = Some(finish);
                o.stop = stop_string;
                o.cached = usage.cached_tokens;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    o
}

/// A stop string met inside a run of kept drafts, logprobs, and a second request served from
/// the prompt cache (whose entry a speculating choice left) all come out as without drafts.
#[test]
fn stop_strings_logprobs_and_the_prompt_cache_match_plain_decoding() {
    let model = fixture("llama");
    let with_cache = |speculative| EngineConfig {
        prompt_cache_entries: 4,
        ..config(KvOptions::default(), speculative)
    };
    let plain = Engine::load(&model, with_cache(None)).unwrap();
    let request = |stop: Vec<String>| {
        let mut r = Request::new(Prompt::Tokens(prompt(24)));
        r.sampling = SamplingParams::greedy();
        r.max_tokens = Some(40);
        r.logprobs = Some(2);
        r.stop = stop;
        r
    };
    let free = outcome(&plain, request(vec![]));
    // A stop string from the middle of the free run's text.
    let chars: Vec<char> = free.text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let mut expected = outcome(&plain, request(vec![stop.clone()]));
    expected.cached = 0;
    assert_eq!(expected.stop.as_deref(), Some(stop.as_str()));
    let source = Arc::new(Scripted {
        truth: Arc::new(free.tokens.clone()),
        always_wrong: false,
    });
    let engine = Engine::load(&model, with_cache(fixed(source, 4))).unwrap();
    let mut first = outcome(&engine, request(vec![stop.clone()]));
    first.cached = 0;
    assert_eq!(first, expected);
    let mut again = outcome(&engine, request(vec![stop.clone()]));
    assert!(
        again.cached > 0,
        "the second request reuses the first's cache"
    );
    again.cached = 0;
    assert_eq!(again, expected);
    assert!(engine.speculation_stats().accepted > 0);
}

/// A draft model's caches count in a request's KV reservation: at the smallest budget a plain
/// request fits, the same request drafting with a model of the same shape is refused (400
/// naming `max_tokens`), and fits at twice the budget.
#[test]
fn a_draft_models_cache_counts_in_the_kv_budget() {
    let model = fixture("llama");
    let draft_dir = model.parent().unwrap().join("mlx-q8-g64");
    let engine = |budget: usize| {
        let draft = DraftModel::load(&draft_dir, &LoadOptions::default(), 512).unwrap();
        let config = EngineConfig {
            kv_budget: Some(budget),
            ..config(KvOptions::default(), fixed(Arc::new(draft), 4))
        };
        Engine::load(&model, config).unwrap()
    };
    let submit = |engine: &Engine, speculative: bool| {
        let mut r = Request::new(Prompt::Tokens(prompt(8)));
        r.max_tokens = Some(200);
        r.speculative = speculative;
        engine.submit(r).map(drop)
    };
    // The smallest budget (to 1 %) that a plain request fits.
    let (mut lo, mut hi) = (1usize, 64 << 20);
    while hi - lo > hi / 100 {
        let mid = lo + (hi - lo) / 2;
        match submit(&engine(mid), false) {
            Ok(()) => hi = mid,
            Err(_) => lo = mid,
        }
    }
    let at = engine(hi);
    assert!(submit(&at, false).is_ok());
    match submit(&at, true) {
        Err(EngineError::Unsupported { param, .. }) => assert_eq!(param, "max_tokens"),
        other => panic!("a drafting request beyond the budget: {other:?}"),
    }
    assert!(submit(&engine(2 * hi), true).is_ok());
}

/// With the experts streamed from disk, drafts are capped at one token a pass (each drafted
/// token's experts are more reads in the verifying pass), whatever the configuration asks;
/// output is unchanged. The scripted drafter proposes as many tokens as it is allowed.
#[test]
fn streamed_experts_cap_drafts_at_one_token_a_pass() {
    let (model, prompt) = (fixture("qwen3_moe"), prompt(24));
    let plain = Engine::load(&model, config(KvOptions::default(), None)).unwrap();
    let plain = greedy(&plain, &prompt, 30);
    let truth = Arc::new(plain.clone());
    let lookup = fixed(
        Arc::new(Scripted {
            truth,
            always_wrong: false,
        }),
        8,
    );
    let engine = Engine::load(
        &model,
        EngineConfig {
            experts: ExpertOptions {
                stream: true,
                ..ExpertOptions::default()
            },
            ..config(KvOptions::default(), lookup)
        },
    )
    .unwrap();
    assert_eq!(greedy(&engine, &prompt, 30), plain);
    let stats = engine.speculation_stats();
    assert!(
        stats.rounds > 5 && stats.drafted == stats.rounds,
        "{stats:?}"
    );
}
