//! The top-level `examples/` run on the tiny fixture and print what the engine computes
//! in-process for the same input (cargo builds the examples with the tests).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use peregrine::engine::ChatMessage;
use peregrine::sampling::token_logprobs;
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

use crate::common::repo_root;

fn fixture() -> PathBuf {
    repo_root().join("tests/fixtures/llama/hf")
}

/// An example's binary, built next to this test's (`target/<profile>/examples/NAME`).
fn example(name: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is not built (cargo test builds it)",
        path.display()
    );
    Command::new(path)
}

fn run(mut cmd: Command, stdin: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Greedy text of `prompt` from an engine in this process.
fn greedy(engine: &Engine, prompt: Prompt, max_tokens: usize) -> String {
    let mut request = Request::new(prompt);
    request.max_tokens = Some(max_tokens);
    request.sampling.temperature = 0.0;
    let events = engine.submit(request).unwrap();
    events
        .filter_map(|e| match e {
            Event::Delta { text, .. } => Some(text),
            Event::Error(e) => panic!("{e}"),
            _ => None,
        })
        .collect()
}

fn engine() -> Engine {
    Engine::load(&fixture(), EngineConfig::default()).unwrap()
}

#[test]
fn stream_prints_the_greedy_completion() {
    let out = run(example("stream"), "");
    let expected = greedy(
        &engine(),
        Prompt::Text("The capital of France is".into()),
        32,
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert!(String::from_utf8_lossy(&out.stderr).contains("prompt tokens"));
}

#[test]
fn chat_keeps_the_conversation() {
    let out = run(example("chat"), "Hello\nAnd again\n");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let replies: Vec<&str> = stdout.split("> ").skip(1).collect();
    assert_eq!(replies.len(), 2, "{stdout}");
    let engine = engine();
    let mut history = vec![
        ChatMessage::text("system", "You are a concise assistant."),
        ChatMessage::text("user", "Hello"),
    ];
    let chat = |history: &[ChatMessage]| Prompt::Chat {
        messages: history.to_vec(),
        template_kwargs: Default::default(),
    };
    let first = greedy(&engine, chat(&history), 64);
    assert_eq!(replies[0], format!("{first}\n"));
    history.push(ChatMessage::text("assistant", first));
    history.push(ChatMessage::text("user", "And again"));
    assert_eq!(
        replies[1],
        format!("{}\n", greedy(&engine, chat(&history), 64))
    );
}

#[test]
fn score_prints_the_perplexity() {
    let out = run(example("score"), "");
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let engine = engine();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(4);
    let ids = engine.tokenizer().encode(&text, true).unwrap();
    let logits = engine
        .logits(&ids, 0..ids.len())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    // The sampler's log-probabilities: an implementation the example does not use.
    let nll: f64 = (logits.iter().zip(&ids[1..]))
        .map(|(row, &next)| -token_logprobs(row, next, 0).logprob as f64)
        .sum::<f64>()
        / (ids.len() - 1) as f64;
    assert_eq!(printed["tokens"], ids.len() - 1);
    let got = printed["mean_nll"].as_f64().unwrap();
    assert!((got - nll).abs() < 1e-4, "{got} vs {nll}");
}

#[test]
fn device_runs_on_the_named_device() {
    let mut cmd = example("device");
    cmd.arg("cpu");
    let out = run(cmd, "");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "Cpu: generated 8 tokens"
    );
    let mut cmd = example("device");
    let out = cmd.arg("tpu").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown device `tpu`"));
}

#[test]
fn service_answers_a_completion() {
    let mut child = example("service")
        .arg("--once")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap()
        .to_string();
    let mut stream = TcpStream::connect(&addr).unwrap();
    let prompt = "Once upon a time";
    write!(
        stream,
        "POST /complete HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{prompt}",
        prompt.len()
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    assert!(child.wait().unwrap().success());
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    let reply: serde_json::Value = serde_json::from_str(body).unwrap();
    let expected = greedy(&engine(), Prompt::Text(prompt.into()), 32);
    assert_eq!(reply["text"], expected, "{raw}");
}

/// `describe_image` on the VLM fixture prints what an in-process engine answers to the same
/// picture and question (the picture's 16 tokens in a 54-token prompt).
#[test]
fn describe_image_answers_as_the_engine_does() {
    let out = run(example("describe_image"), "");
    let dir = repo_root().join("tests/fixtures/vlm/gemma3");
    let engine = Engine::load(&dir.join("hf"), EngineConfig::default()).unwrap();
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let picture = peregrine::models::vision::decode_image(&png, &Default::default()).unwrap();
    let parts = serde_json::json!([{"type": "image"},
        {"type": "text", "text": "Describe this image in one sentence."}]);
    let message = ChatMessage {
        content: parts,
        ..ChatMessage::text("user", "")
    };
    let mut request = Request::new(Prompt::Chat {
        messages: vec![message],
        template_kwargs: Default::default(),
    });
    request.images = vec![std::sync::Arc::new(picture)];
    request.max_tokens = Some(32);
    request.sampling.temperature = 0.0;
    let mut expected = String::new();
    for event in engine.submit(request).unwrap() {
        if let Event::Delta { text, .. } = event {
            expected.push_str(&text);
        }
    }
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[54 prompt tokens"), "{stderr}");
}
