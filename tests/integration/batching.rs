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

/// The KV budget: with room for one request's reservation, three submitted together run one
/// at a time (the others wait, nothing fails), each gives its solo tokens, the KV in use never
/// passes what the running request reserved, and everything is given back at the end. A
/// request that could never fit is refused, naming the field; one without `max_tokens` runs
/// to the positions that fit and ends with `length`.
#[test]
fn requests_wait_for_the_kv_budget_and_never_pass_it() {
    let file = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let solo = engine(file, 1);
    let want: Vec<Vec<u32>> = (0..3)
        .map(|i| tokens(solo.submit(request(i)).unwrap()))
        .collect();
    // One request's reservation, as the engine reckons it while the request runs.
    let mut stream = solo.submit(request(2)).unwrap();
    assert!(matches!(stream.next(), Some(Event::Delta { .. })));
    let (one, _) = solo.kv_reserved();
    assert!(one > 0, "a running request reserves KV");
    tokens(stream);
    drop(solo);

    let budget = one * 3 / 2;
    let config = EngineConfig {
        parallel: 4,
        kv_budget: Some(budget),
        prompt_cache_entries: 0,
        ..EngineConfig::default()
    };
    let engine = Engine::load(&real_model(file), config).expect("model loads");
    assert_eq!(engine.kv_reserved(), (0, budget));
    let streams: Vec<_> = (0..3).map(|i| engine.submit(request(i)).unwrap()).collect();
    let collect = std::thread::spawn(move || streams.into_iter().map(tokens).collect::<Vec<_>>());
    let (mut most_running, mut most_reserved, mut most_in_use) = (0, 0, 0);
    while !collect.is_finished() {
        most_running = most_running.max(engine.running());
        most_reserved = most_reserved.max(engine.kv_reserved().0);
        most_in_use = most_in_use.max(engine.kv_bytes_in_use());
        std::thread::sleep(Duration::from_millis(1));
    }
    // Request 2 has the longest prompt and budget: its reservation bounds every request's
    // real cache (the estimate is an upper bound, or the budget means nothing).
    assert!(
        most_in_use > 0 && most_in_use <= one,
        "{most_in_use} bytes in use, reserved {one}"
    );
    let got = collect.join().unwrap();
    assert_eq!(
        got, want,
        "requests that waited for the budget give their solo tokens"
    );
    assert_eq!(
        most_running, 1,
        "only one request's reservation fits at a time"
    );
    assert!(
        most_reserved <= budget,
        "reserved {most_reserved} of {budget}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.kv_reserved().0 != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        engine.kv_reserved().0,
        0,
        "finished requests give their reservation back"
    );

    // Never fits: refused up front, naming max_tokens.
    let mut huge = request(0);
    huge.max_tokens = Some(100_000);
    let err = engine
        .submit(huge)
        .err()
        .expect("a request over the budget is refused");
    assert!(
        matches!(
            &err,
            peregrine::EngineError::Unsupported {
                param: "max_tokens",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.is_client_error() && err.to_string().contains("KV budget"),
        "{err}"
    );
    // No max_tokens: runs to the positions that fit, then ends with `length`.
    let mut open = request(0);
    open.max_tokens = None;
    let (mut reason, mut generated) = (None, 0);
    for event in engine.submit(open).unwrap() {
        match event {
            Event::Delta { tokens, .. } => generated += tokens.len(),
            Event::Done { finish, .. } => reason = Some(finish),
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(reason, Some(peregrine::FinishReason::Length));
    assert!(
        generated > 0 && generated < engine.max_context(),
        "{generated} tokens"
    );
}
