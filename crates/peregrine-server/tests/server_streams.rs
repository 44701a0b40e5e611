//! Happy paths of `peregrine serve` over raw HTTP with the tiny llama fixture: streamed and
//! whole answers agree at temperature 0, the SSE framing rules, stop strings, `max_tokens`,
//! `n`, logprobs, 16 concurrent streams, disconnects and graceful shutdown.

mod support;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::Server;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": content}],
           "temperature": 0, "max_tokens": max_tokens, "an_unknown_field": {"is": "ignored"}})
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens})
}

fn with(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

/// A streamed answer, checked against the SSE rules; returns the text per choice, the finish
/// reasons per choice and the usage chunk.
fn stream(server: &Server, path: &str, body: &Value) -> (Vec<String>, Vec<String>, Value) {
    let body = with(
        body.clone(),
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let reply = server.post(path, &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    let events = reply.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        reply.body
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let ids: std::collections::BTreeSet<_> = chunks.iter().map(|c| c["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one id per stream");
    let created: std::collections::BTreeSet<_> =
        chunks.iter().map(|c| c["created"].to_string()).collect();
    assert_eq!(created.len(), 1, "one created per stream");
    let usage = chunks.last().unwrap();
    assert_eq!(
        usage["choices"],
        json!([]),
        "the usage chunk has no choices"
    );
    let (mut texts, mut finishes) = (vec![], vec![]);
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["usage"], Value::Null, "usage only in the last chunk");
        let choice = &chunk["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        if texts.len() <= i {
            texts.resize(i + 1, String::new());
            finishes.resize(i + 1, String::new());
        }
        assert!(
            finishes[i].is_empty(),
            "nothing after a choice's finish_reason"
        );
        if let Some(f) = choice["finish_reason"].as_str() {
            finishes[i] = f.to_string();
        }
        let delta = if path == CHAT {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        if path == CHAT {
            let first = texts[i].is_empty() && choice["delta"]["content"] == "";
            assert_eq!(
                choice["delta"].get("role").is_some(),
                first,
                "role only first: {chunk}"
            );
        }
        texts[i].push_str(delta.as_str().unwrap_or(""));
    }
    assert!(
        finishes.iter().all(|f| !f.is_empty()),
        "every choice finishes"
    );
    (texts, finishes, usage["usage"].clone())
}

#[test]
fn stream_equals_whole_answer_at_temperature_zero() {
    let server = Server::start(&[]);
    for (path, body) in [
        (CHAT, chat("Tell me a story", 24)),
        (COMPLETIONS, completion("Once upon", 24)),
    ] {
        let whole = server.post(path, &body).json();
        let choice = &whole["choices"][0];
        let text = if path == CHAT {
            &choice["message"]["content"]
        } else {
            &choice["text"]
        };
        let (texts, finishes, usage) = stream(&server, path, &body);
        assert_eq!(texts, vec![text.as_str().unwrap().to_string()], "{path}");
        assert_eq!(finishes[0], choice["finish_reason"].as_str().unwrap());
        // The same counts; the streamed request, second with this prompt, takes all of it
        // but its last token from the prompt cache when it is long enough to be kept (the
        // chat one), the whole one nothing.
        let counts = |u: &Value| {
            let n = |k: &str| u[k].as_u64().unwrap();
            (
                n("prompt_tokens"),
                n("completion_tokens"),
                n("total_tokens"),
            )
        };
        assert_eq!(counts(&usage), counts(&whole["usage"]), "{path}");
        let cached = |u: &Value| {
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        };
        assert_eq!(cached(&whole["usage"]), 0, "{path}");
        let want = if path == CHAT {
            counts(&usage).0 - 1
        } else {
            0
        };
        assert_eq!(cached(&usage), want, "{path}: {usage}");
        assert!(whole["id"].as_str().unwrap().starts_with(if path == CHAT {
            "chatcmpl-"
        } else {
            "cmpl-"
        }));
        let object = if path == CHAT {
            "chat.completion"
        } else {
            "text_completion"
        };
        assert_eq!(whole["object"], object);
        assert_eq!(whole["model"], "tiny");
        assert_required(&whole, path);
    }
}

/// The fields OpenAI's OpenAPI schema marks required (some nullable) are all present.
fn assert_required(whole: &Value, path: &str) {
    let has = |v: &Value, keys: &[&str]| {
        for k in keys {
            assert!(v.get(k).is_some(), "`{k}` missing in {v}");
        }
    };
    has(
        whole,
        &["id", "object", "created", "model", "choices", "usage"],
    );
    has(
        &whole["usage"],
        &["prompt_tokens", "completion_tokens", "total_tokens"],
    );
    let choice = &whole["choices"][0];
    has(choice, &["index", "logprobs", "finish_reason"]);
    if path == CHAT {
        has(&choice["message"], &["role", "content", "refusal"]);
    } else {
        has(choice, &["text"]);
    }
}

#[test]
fn limits_stops_n_and_logprobs() {
    let server = Server::start(&[]);
    // max_tokens: exactly that many tokens and `length`.
    let reply = server
        .post(
            COMPLETIONS,
            &with(completion("a", 7), json!({"ignore_eos": true})),
        )
        .json();
    assert_eq!(reply["usage"]["completion_tokens"], 7);
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    let reply = server
        .post(
            CHAT,
            &with(
                chat("hi", 50),
                json!({"max_completion_tokens": 3, "ignore_eos": true}),
            ),
        )
        .json();
    assert_eq!(
        reply["usage"]["completion_tokens"], 3,
        "max_completion_tokens wins"
    );

    // Stop strings, as a string and as an array, are honoured and not returned.
    let base = with(completion("The", 40), json!({"ignore_eos": true}));
    let full = server.post(COMPLETIONS, &base).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "the fixture writes enough text: {full:?}");
    let stop: String = chars[8..11].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];
    for stop_field in [json!(stop), json!(["\u{1}never", stop])] {
        let reply = server
            .post(
                COMPLETIONS,
                &with(base.clone(), json!({"stop": stop_field})),
            )
            .json();
        assert_eq!(reply["choices"][0]["text"], expected, "stop {stop_field}");
        assert_eq!(reply["choices"][0]["finish_reason"], "stop");
        let (texts, _, _) = stream(
            &server,
            COMPLETIONS,
            &with(base.clone(), json!({"stop": stop_field})),
        );
        assert_eq!(texts[0], expected, "streamed stop {stop_field}");
    }

    // n: two choices with their own indices; the same seed gives the same text at temperature 1.
    let sampled = with(
        chat("hi", 10),
        json!({"temperature": 1.0, "seed": 42, "n": 2}),
    );
    let a = server.post(CHAT, &sampled).json();
    let b = server.post(CHAT, &sampled).json();
    assert_eq!(a["choices"].as_array().unwrap().len(), 2);
    assert_eq!(a["choices"][1]["index"], 1);
    assert_eq!(a["choices"], b["choices"], "same seed, same text");
    let (texts, _, _) = stream(&server, CHAT, &sampled);
    assert_eq!(texts.len(), 2);

    // Logprobs: chat's top_logprobs are sorted and as many as asked.
    let reply = server
        .post(
            CHAT,
            &with(chat("hi", 5), json!({"logprobs": true, "top_logprobs": 3})),
        )
        .json();
    let content = reply["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        reply["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in &content {
        let top: Vec<f64> = entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]), "sorted: {top:?}");
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
    }
    let reply = server
        .post(
            COMPLETIONS,
            &with(completion("a", 4), json!({"logprobs": 2, "echo": true})),
        )
        .json();
    let lp = &reply["choices"][0]["logprobs"];
    assert_eq!(
        lp["tokens"].as_array().unwrap().len(),
        lp["top_logprobs"].as_array().unwrap().len()
    );
    assert!(
        reply["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with('a'),
        "echo"
    );
}

#[test]
fn sixteen_concurrent_streams_match_their_solo_runs() {
    let server = Server::start(&["--parallel", "4", "--queue-size", "16"]);
    let prompts: Vec<String> = (0..16).map(|i| format!("prompt number {i}")).collect();
    let solo: Vec<String> = prompts
        .iter()
        .map(|p| {
            server.post(COMPLETIONS, &completion(p, 16)).json()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| stream(&server, COMPLETIONS, &completion(p, 16)).0.remove(0)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, solo);
    let metrics = server.get("/metrics").body;
    assert!(
        metrics.contains("peregrine_requests_total{path=\"/v1/completions\",status=\"200\"} 32"),
        "{metrics}"
    );
    assert!(
        metrics.contains("peregrine_time_to_first_token_seconds_count 32"),
        "{metrics}"
    );
}

#[test]
fn a_disconnected_stream_frees_its_slot() {
    let server = Server::start(&["--parallel", "1", "--queue-size", "0"]);
    let body = with(
        completion("a", 240),
        json!({"ignore_eos": true, "stream": true}),
    );
    // Until the worker waits for work, a request with no queue gets 503; retry until it streams.
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no stream started"
        );
        let stream = server.open("POST", COMPLETIONS, &[], body.to_string().as_bytes(), None);
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if !line.starts_with("HTTP/1.1 200") {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        while !line.starts_with("data: ") {
            line.clear();
            let n = reader.read_line(&mut line).unwrap();
            assert!(n > 0, "the stream ended before its first event");
        }
        break; // dropping the reader disconnects mid-stream
    }
    // With no queue, a new request is refused (503) until the slot is free again.
    let start = Instant::now();
    while server.post(COMPLETIONS, &completion("b", 2)).status != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the slot was not freed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.log().contains("status=499") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        server.log().contains("status=499"),
        "the disconnect is logged:\n{}",
        server.log()
    );
}

#[test]
fn models_health_cors_and_graceful_shutdown() {
    let mut server = Server::start(&["--cors"]);
    let health = server.get("/health").json();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["model"], "tiny");
    assert_eq!(health["context_length"], 256);
    let models = server.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(server.get("/v1/models/tiny").json()["id"], "tiny");
    let preflight = server.send("OPTIONS", CHAT, &[("Origin", "http://x")], b"");
    assert_eq!(preflight.status, 204);
    assert_eq!(preflight.header("access-control-allow-origin"), Some("*"));
    assert!(
        preflight
            .header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
    assert_eq!(
        server
            .get("/v1/models")
            .header("access-control-allow-origin"),
        Some("*")
    );
    let logged =
        |log: &str| log.contains("request id=") && log.contains("path=/v1/models status=200");
    let log = server.log_until(logged);
    assert!(logged(&log), "{log}");

    server.terminate();
    let exit = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server exits on SIGTERM");
    assert!(exit.success(), "{exit:?}");
}
