//! Continuous batching: sequences decoded together in one forward pass give exactly what each
//! gives alone, and a cancelled one gives its KV back at the next step.

use std::time::{Duration, Instant};

use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

use crate::common::real_model;

/// Request `i` of the test: prompts of different lengths and token budgets, greedy.
fn request(i: usize) -> Request {
    let words = [
        "red", "river", "stone", "market", "violin", "winter", "lantern", "orbit",
    ];
    let text: Vec<&str> = (0..3 + 7 * i)
        .map(|j| words[(i + j * 3) % words.len()])
        .collect();
    let mut r = Request::new(Prompt::Text(format!("Story {i}: {}.", text.join(" "))));
    r.max_tokens = Some(6 + 3 * (i % 5));
    r.sampling.temperature = 0.0;
    r.ignore_eos = true;
    r
}

/// The generated tokens of one stream, failing on an error event.
fn tokens(stream: peregrine::engine::EventStream) -> Vec<u32> {
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

fn engine(file: &str, parallel: usize) -> Engine {
    let config = EngineConfig {
        parallel,
        // Small chunks and budget: prompts arrive while others decode and are cut into
        // several passes beside them.
        prefill_size: 32,
        batch_tokens: 48,
        prompt_cache_entries: 0,
        ..EngineConfig::default()
    };
    Engine::load(&real_model(file), config).expect("model loads")
}

/// 16 requests of different lengths, started 20 ms apart, through an engine that decodes them
/// together: each one's tokens equal those it gets alone. The CPU kernels are batch-invariant
/// (tests in peregrine-models' batch_invariance.rs), so the match is bitwise, not top-1.
#[test]
fn concurrent_requests_return_their_solo_outputs() {
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let solo = engine(file, 1);
        let want: Vec<Vec<u32>> = (0..16)
            .map(|i| tokens(solo.submit(request(i)).unwrap()))
            .collect();
        drop(solo);
        let batched = engine(file, 16);
        let streams: Vec<_> = (0..16)
            .map(|i| {
                std::thread::sleep(Duration::from_millis(20));
                batched.submit(request(i)).unwrap()
            })
            .collect();
        let got: Vec<Vec<u32>> = streams.into_iter().map(tokens).collect();
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(got, want, "{file}: request {i} differs from its solo run");
        }
        let (steps, rows) = batched.batch_steps();
        assert!(
            steps > 0 && rows as f64 / steps as f64 > 2.0,
            "{file}: {steps} batched passes carried {rows} sequences: they did not run together"
        );
    }
}

/// A stream dropped mid-generation leaves the batch at the next step, and its KV bytes go
/// back to the engine while the other sequence goes on.
#[test]
fn a_cancelled_sequence_frees_its_kv_at_the_next_step() {
    let engine = engine("SmolLM2-135M-Instruct.Q4_1.gguf", 4);
    let long = |n| {
        let mut r = request(3);
        r.max_tokens = Some(n);
        r
    };
    let mut kept = engine.submit(long(400)).unwrap();
    let mut dropped = engine.submit(long(400)).unwrap();
    // Both decoding: wait for a token from each.
    for s in [&mut kept, &mut dropped] {
        assert!(matches!(s.next(), Some(Event::Delta { .. })));
    }
    let (running, both) = (engine.running(), engine.kv_bytes_in_use());
    assert_eq!(running, 2, "two sequences run");
    drop(dropped);
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.running() != 1 && Instant::now() < deadline {
        assert!(
            matches!(kept.next(), Some(Event::Delta { .. })),
            "the other goes on"
        );
    }
    assert_eq!(engine.running(), 1, "the cancelled sequence left");
    let one = engine.kv_bytes_in_use();
    assert!(
        one < both * 3 / 4,
        "KV in use went from {both} to {one} bytes: the cancelled sequence kept its cache"
    );
    // And a sequence that finishes leaves the count too, though the engine then waits idle.
    drop(kept);
    tokens(engine.submit(request(0)).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.running() != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(engine.running(), 0, "an idle engine runs no sequence");
}
