//! The prompt cache on the real models: a request that shares a long prefix with an earlier one
//! prefills only the rest, reports the reused tokens, and generates exactly what an engine
//! without a prompt cache generates (greedy, the same KV precision).

use peregrine::engine::{ChatMessage, KvOptions, KvQuant, KvRequest};
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

use crate::common::real_model;

/// A system message of a few hundred tokens, as agents send, shared by every request below.
fn system() -> String {
    let rule = "Answer briefly and precisely; if a question is ambiguous, say which reading \
                you answer; never invent a source; prefer metric units; name the year of any figure. ";
    rule.repeat(12)
}

fn chat(turns: &[(&str, &str)]) -> Prompt {
    let mut messages = vec![ChatMessage::text("system", system())];
    messages.extend(
        turns
            .iter()
            .map(|&(role, text)| ChatMessage::text(role, text.to_string())),
    );
    Prompt::Chat {
        messages,
        template_kwargs: Default::default(),
    }
}

/// Greedy text of `prompt` and the prompt tokens the cache supplied.
fn run(engine: &Engine, prompt: Prompt) -> (String, usize, usize) {
    run_kv(engine, prompt, KvRequest::default())
}

/// [`run`] with the request's own KV choices.
fn run_kv(engine: &Engine, prompt: Prompt, kv: KvRequest) -> (String, usize, usize) {
    let mut request = Request::new(prompt);
    request.kv = kv;
    request.sampling.temperature = 0.0;
    request.max_tokens = Some(24);
    let mut text = String::new();
    for event in engine.submit(request).unwrap() {
        match event {
            Event::Delta { text: t, .. } => text.push_str(&t),
            Event::Done { usage, .. } => return (text, usage.prompt_tokens, usage.cached_tokens),
            Event::Error(e) => panic!("{e}"),
        }
    }
    panic!("no Done event")
}

/// Three requests: a first question (nothing cached), another question after the same system
/// message (its prefix is reused from a trimmed copy of the first), and the first conversation
/// continued (its prompt and answer, as far as the template renders them as generated).
fn check(file: &str) {
    let load = |entries: usize| {
        let config = EngineConfig {
            prompt_cache_entries: entries,
            ..Default::default()
        };
        Engine::load(&real_model(file), config).expect("model loads")
    };
    let (cached, uncached) = (load(4), load(0));
    let first = chat(&[("user", "What is the boiling point of water at sea level?")]);
    let (answer, prompt_tokens, reused) = run(&cached, first.clone());
    assert!(
        prompt_tokens > 200 && reused == 0,
        "{file}: {prompt_tokens} / {reused}"
    );
    assert_eq!(answer, run(&uncached, first).0, "{file}: the first request");

    let other = chat(&[("user", "How far is the Moon from the Earth?")]);
    let (text, prompt_tokens, reused) = run(&cached, other.clone());
    let want = run(&uncached, other).0;
    eprintln!("{file}: second request reused {reused} of {prompt_tokens} prompt tokens");
    assert!(
        reused > 200 && reused < prompt_tokens,
        "{file}: reused {reused}"
    );
    assert_eq!(
        text, want,
        "{file}: a trimmed copy of the first request's cache"
    );

    let turns = [
        ("user", "What is the boiling point of water at sea level?"),
        ("assistant", answer.as_str()),
        ("user", "And on the top of Mount Everest?"),
    ];
    let (text, prompt_tokens, reused) = run(&cached, chat(&turns));
    eprintln!("{file}: the continued conversation reused {reused} of {prompt_tokens}");
    assert!(reused > 200, "{file}: reused {reused}");
    assert_eq!(
        text,
        run(&uncached, chat(&turns)).0,
        "{file}: the continued conversation"
    );
    let stats = cached.prompt_cache_stats();
    assert_eq!((stats.hits, stats.misses), (2, 1), "{file}: {stats:?}");
}

#[test]
fn smollm2_prompt_cache_reuses_prefixes_exactly() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf");
}

/// Gemma 3's sliding layers (window 512) keep what a rollback to the shared prefix needs at
/// these lengths.
#[test]
fn gemma3_prompt_cache_reuses_prefixes_exactly() {
    check("gemma-3-270m-q4_k_m.gguf");
}

/// A request's `kv_bits` gives what an engine storing KV that way by default gives, and its
/// cache is not reused by a request storing KV otherwise.
#[test]
fn per_request_kv_choices_apply_and_keep_their_cache_apart() {
    let file = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let engine = Engine::load(&real_model(file), EngineConfig::default()).unwrap();
    let q8 = KvOptions {
        quant: Some(KvQuant {
            bits: 8,
            group_size: 32,
        }),
        ..KvOptions::default()
    };
    let config = EngineConfig {
        kv: q8,
        prompt_cache_entries: 0,
        ..Default::default()
    };
    let q8_engine = Engine::load(&real_model(file), config).unwrap();
    let prompt = chat(&[("user", "Name three rivers in Europe.")]);
    let choice = KvRequest {
        kv_bits: Some(8),
        kv_group_size: Some(32),
        turbo_kv: None,
    };
    let (text, _, _) = run_kv(&engine, prompt.clone(), choice);
    assert_eq!(
        text,
        run(&q8_engine, prompt.clone()).0,
        "kv_bits 8 per request"
    );
    let (_, prompt_tokens, reused) = run(&engine, prompt.clone());
    assert_eq!(
        reused, 0,
        "an f16 request reused a q8 cache ({prompt_tokens} tokens)"
    );
    let (_, _, reused) = run_kv(&engine, prompt, choice);
    assert!(reused > 200, "the q8 request's own cache: reused {reused}");
}
