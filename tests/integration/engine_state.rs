//! Engine-wide state visible to a server: live KV bytes across running sequences.

use std::time::{Duration, Instant};

use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

use crate::common::real_model;

#[test]
fn kv_bytes_in_use_follow_running_sequences() {
    let engine = Engine::load(
        &real_model("SmolLM2-135M-Instruct.Q4_1.gguf"),
        EngineConfig::default(),
    )
    .expect("model loads");
    assert_eq!(engine.kv_bytes_in_use(), 0, "idle engine holds no KV");
    let mut request = Request::new(Prompt::Text("Once upon a time".into()));
    request.max_tokens = Some(8);
    request.ignore_eos = true;
    let mut stream = engine.submit(request).unwrap();
    let mut seen_running = 0;
    for event in &mut stream {
        match event {
            Event::Delta { .. } if seen_running == 0 => seen_running = engine.kv_bytes_in_use(),
            Event::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    assert!(seen_running > 0, "a running sequence holds KV bytes");
    // The sequence gives its bytes back as its worker finishes, just after the last event.
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine.kv_bytes_in_use() != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        engine.kv_bytes_in_use(),
        0,
        "finished sequences give their KV back"
    );
}
