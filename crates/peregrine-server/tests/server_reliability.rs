//! The server against hostile or unlucky clients and its own bugs: slow-loris and idle
//! connections, the connection limit, a panicking generation, oversized fields, `n` sharing one
//! prefill, SIGTERM under load, and disconnected streams giving back their KV.

mod support;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Reply, Server};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Seconds until the server closes `stream` (EOF or reset), reading whatever arrives; `None`
/// if it is still open after `limit`.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<f64> {
    let start = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 1024];
    while start.elapsed() < limit {
        match stream.read(&mut buf) {
            Ok(0) => return Some(start.elapsed().as_secs_f64()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(start.elapsed().as_secs_f64()),
        }
    }
    None
}

/// The value of an unlabelled metric.
fn metric(server: &Server, name: &str) -> f64 {
    let text = server.get("/metrics").body;
    let line = text.lines().find(|l| l.split(' ').next() == Some(name));
    let value = line.and_then(|l| l.split(' ').nth(1));
    value
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// A slow-loris (a request head sent a byte at a time) is dropped at the header timeout, counted
/// from its first byte; a connection that sends nothing is held to the (longer) idle timeout.
#[test]
fn a_slow_loris_is_closed_after_the_header_timeout() {
    let server = Server::start(&["--header-timeout", "1", "--idle-timeout", "30"]);
    let mut quiet = TcpStream::connect(&server.addr).unwrap();
    let mut loris = TcpStream::connect(&server.addr).unwrap();
    loris
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let start = Instant::now();
    let mut closed = None;
    for byte in b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        .iter()
        .cycle()
    {
        if loris.write_all(&[*byte]).is_err() {
            closed = Some(start.elapsed().as_secs_f64());
            break;
        }
        if let Some(t) = closed_within(&mut loris, Duration::from_millis(200)) {
            closed = Some(start.elapsed().as_secs_f64() - 0.2 + t);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the slow-loris is still open"
        );
    }
    let closed = closed.unwrap();
    // Closed at the header timeout (1 s), give or take the watchdog's 100 ms tick.
    assert!(
        closed > 0.8,
        "closed after {closed:.2} s, before the header timeout"
    );
    assert_eq!(closed_within(&mut quiet, Duration::from_millis(300)), None);
    assert_eq!(
        metric(&server, "peregrine_connections_header_timeout_total"),
        1.0
    );
    assert_eq!(
        metric(&server, "peregrine_connections_idle_timeout_total"),
        0.0
    );
}

/// An idle keep-alive connection is closed at the idle timeout, after its request.
#[test]
fn an_idle_keep_alive_connection_is_closed() {
    let server = Server::start(&["--idle-timeout", "1"]);
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let closed = closed_within(&mut stream, Duration::from_secs(10)).expect("closed");
    assert!(closed > 0.7, "closed after {closed:.2} s");
    assert_eq!(
        metric(&server, "peregrine_connections_idle_timeout_total"),
        1.0
    );
}

/// Over `--max-connections`, a connection gets a readable 503 and is closed; once one closes,
/// the next connection is served.
#[test]
fn a_connection_over_the_limit_is_refused_cleanly() {
    let server = Server::start(&["--max-connections", "2"]);
    // The test's own /health probe has closed; give the server a moment to count it gone.
    std::thread::sleep(Duration::from_millis(200));
    let held: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(&server.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let refused = server.get("/health");
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["error"]["code"], "too_many_connections");
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(server.get("/health").status, 200);
    assert!(metric(&server, "peregrine_connections_refused_total") >= 1.0);
}

/// A panic inside generation ends that request with a 500 (or, streamed, an error event and
/// `[DONE]`), is logged with the request id, and the worker goes on serving.
#[test]
fn an_injected_panic_fails_one_request_and_the_next_succeeds() {
    let server = Server::start(&["--test-panic-marker", "PANIC-HERE"]);
    let failed = server.post("/v1/chat/completions", &chat("PANIC-HERE", json!({})));
    assert_eq!(failed.status, 500, "{}", failed.body);
    let message = failed.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(message.contains("panic marker"), "{message}");
    let streamed = server.post(
        "/v1/chat/completions",
        &chat("PANIC-HERE", json!({"stream": true})),
    );
    let events = streamed.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error", "{events:?}");
    for _ in 0..2 {
        let ok = server.post("/v1/chat/completions", &chat("hello", json!({})));
        assert_eq!(ok.status, 200, "{}", ok.body);
        assert!(ok.json()["choices"][0]["finish_reason"].is_string());
    }
    assert_eq!(metric(&server, "peregrine_internal_errors_total"), 2.0);
    let log = server.log();
    let logged = log
        .lines()
        .filter(|l| l.contains(" error: ") && l.contains("panic marker"));
    assert_eq!(
        logged.filter(|l| l.starts_with("request id=")).count(),
        2,
        "{log}"
    );
}

/// Oversized fields are 400s naming the field, before any work.
#[test]
fn oversized_fields_are_rejected_by_name() {
    let server = Server::start(&[]);
    let cases = [
        (json!({"stop": "a".repeat(1 << 20)}), "stop"),
        (json!({"stop": ["ok", "b".repeat(2000)]}), "stop[1]"),
        (
            json!({"logit_bias": (0..2000).map(|i| (i.to_string(), json!(1))).collect::<serde_json::Map<_, _>>()}),
            "logit_bias",
        ),
        (
            json!({"tools": vec![json!({"type": "function"}); 300]}),
            "tools",
        ),
    ];
    for (extra, param) in cases {
        let reply = server.post("/v1/chat/completions", &chat("hi", extra));
        assert_eq!(reply.status, 400, "{param}: {}", reply.body);
        assert_eq!(reply.json()["error"]["param"], param);
    }
    let many = vec![json!({"role": "user", "content": "x"}); 5000];
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": many}),
    );
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"]["param"], "messages");
    let parts = vec![json!({"type": "text", "text": "x"}); 2000];
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": parts}]});
    let reply = server.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"]["param"], "messages[0].content");
}

/// `n = 4` prefills the prompt once (the prompt cache off, so it cannot be what saves the
/// prefills), and each choice decodes its own continuation to the end.
#[test]
fn n_choices_share_one_prefill() {
    let server = Server::start(&["--prompt-cache-entries", "0"]);
    let before = metric(&server, "peregrine_prefills_total");
    let body = chat(
        "Once upon a time",
        json!({"n": 4, "seed": 7, "temperature": 1.0}),
    );
    let reply = server.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choices = reply.json()["choices"].as_array().unwrap().clone();
    assert_eq!(choices.len(), 4);
    assert!(choices.iter().all(|c| c["finish_reason"].is_string()));
    assert_eq!(metric(&server, "peregrine_prefills_total") - before, 1.0);
    // Seeded choices are reproducible one by one: choice j of n equals the request seeded j.
    let again = server.post("/v1/chat/completions", &body).json();
    assert_eq!(again["choices"], reply.json()["choices"]);
    let texts: Vec<&Value> = choices.iter().map(|c| &c["message"]["content"]).collect();
    assert!(texts.windows(2).any(|w| w[0] != w[1]), "{texts:?}");
}

/// SIGTERM with 16 streams running on SmolLM2 (slow enough on CPU that most are still running
/// or waiting at the deadline): every stream ends with a final event and `[DONE]`, the ones
/// cancelled with an error event, and the process exits 0 within `--shutdown-timeout`.
#[test]
fn sigterm_ends_every_stream_cleanly() {
    let model = support::real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut server = Server::start_model(
        &model,
        &[
            "--shutdown-timeout",
            "3",
            "--queue-size",
            "32",
            "--prompt-cache-entries",
            "0",
        ],
    );
    let body = chat(
        "Tell me a long story",
        json!({"stream": true, "max_tokens": 200, "ignore_eos": true}),
    );
    let readers: Vec<_> = (0..16)
        .map(|_| {
            let mut stream = server.open(
                "POST",
                "/v1/chat/completions",
                &[],
                body.to_string().as_bytes(),
                None,
            );
            std::thread::spawn(move || {
                let mut raw = vec![];
                let _ = stream.read_to_end(&mut raw);
                raw
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let start = Instant::now();
    server.terminate();
    let status = server
        .wait_exit(Duration::from_secs(10))
        .expect("the server exits");
    let took = start.elapsed().as_secs_f64();
    assert!(status.success(), "{status:?}\n{}", server.log());
    assert!(took < 3.5, "exited after {took:.2} s; the deadline is 3 s");
    let mut cancelled_streams = 0;
    for reader in readers {
        let raw = reader.join().unwrap();
        let reply = Reply::parse(&raw);
        assert_eq!(reply.status, 200);
        let events = reply.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        let finished = last["choices"][0]["finish_reason"].is_string();
        let cancelled = last["error"]["code"] == "server_shutting_down";
        assert!(finished || cancelled, "{last}");
        cancelled_streams += usize::from(cancelled);
    }
    assert!(
        cancelled_streams > 0,
        "no stream was still running at the deadline"
    );
}

/// Polls `metric` until `done` holds of it, for at most 20 s; returns its last value.
fn wait_for_metric(server: &Server, name: &str, done: impl Fn(f64) -> bool) -> f64 {
    let start = Instant::now();
    loop {
        let value = metric(server, name);
        if done(value) || start.elapsed() > Duration::from_secs(20) {
            return value;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Disconnected streams give back their KV at the next step, as `/metrics` shows: with three
/// SmolLM2 streams decoding together, closing two drops the running count to one and the live
/// KV bytes below what three held; closing the last brings both to zero long before any stream
/// could have finished its 2000 tokens.
#[test]
fn disconnected_streams_free_their_kv_at_the_next_step() {
    let model = support::real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let server = Server::start_model(&model, &["--parallel", "3", "--prompt-cache-entries", "0"]);
    let body = chat(
        "Tell me a long story",
        json!({"stream": true, "max_tokens": 2000, "ignore_eos": true}),
    );
    let mut streams: Vec<_> = (0..3)
        .map(|_| {
            let stream = server.open(
                "POST",
                "/v1/chat/completions",
                &[],
                body.to_string().as_bytes(),
                None,
            );
            let mut reader = BufReader::new(stream);
            // The role chunk, then two tokens: this stream's prompt is in its cache.
            let mut events = 0;
            while events < 3 {
                let mut line = String::new();
                let n = reader.read_line(&mut line).unwrap();
                assert!(n > 0, "the stream ended before its third event");
                events += usize::from(line.starts_with("data: "));
            }
            reader
        })
        .collect();
    let name = "peregrine_running_sequences";
    assert_eq!(wait_for_metric(&server, name, |n| n == 3.0), 3.0);
    let kv_three = metric(&server, "peregrine_kv_bytes");
    assert!(kv_three > 0.0, "three decoding streams hold no KV");
    streams.truncate(1);
    assert_eq!(wait_for_metric(&server, name, |n| n == 1.0), 1.0);
    let kv_one = metric(&server, "peregrine_kv_bytes");
    assert!(
        kv_one > 0.0 && kv_one < kv_three,
        "one stream holds {kv_one} KV bytes, three held {kv_three}"
    );
    streams.clear();
    assert_eq!(wait_for_metric(&server, name, |n| n == 0.0), 0.0);
    assert_eq!(metric(&server, "peregrine_kv_bytes"), 0.0);
}

/// `--stream-experts` reads experts from the files while serving: a file cut short under the
/// server ends the request that reads past its end with a 500 naming the file, and the server
/// keeps serving once the file is whole again. No crash, no SIGBUS: safetensors experts are
/// positioned reads; the GGUF file's Q8_0 experts are multiplied from its mapping, paged in
/// when read, and every use of one read earlier (prefetched, guessed) first checks that the
/// file still has its length (a cut between that check and the multiply: the guard tested in
/// `peregrine-models`' `streamed_experts.rs`). For a GGUF file and an HF safetensors folder.
#[test]
fn a_truncated_expert_file_fails_the_request_by_name_and_the_server_keeps_serving() {
    let fixtures = support::fixture().join("../..");
    for (from, file) in [
        ("qwen3_moe/gguf/model-q8_0.gguf", "model-q8_0.gguf"),
        ("qwen3_moe/hf", "model.safetensors"),
    ] {
        let dir = std::env::temp_dir().join(format!(
            "peregrine-stream-fault-{}-{}",
            std::process::id(),
            file
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let source = fixtures.join(from);
        let model = match source.is_dir() {
            true => {
                for f in std::fs::read_dir(&source).unwrap() {
                    let f = f.unwrap().path();
                    std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
                }
                dir.clone()
            }
            false => {
                std::fs::copy(&source, dir.join(file)).unwrap();
                dir.join(file)
            }
        };
        let path = dir.join(file);
        let whole = std::fs::read(&path).unwrap();
        let flags = ["--stream-experts", "--stream-speculate", "--parallel", "1"];
        let server = Server::start_model(&model, &flags);
        let ask = || {
            server.post(
                "/v1/chat/completions",
                &chat("Hello there", json!({"temperature": 0})),
            )
        };
        let first = ask();
        assert_eq!(first.status, 200, "{from}: {}", first.body);
        let reads = metric(&server, "peregrine_expert_reads_total");
        assert!(reads > 0.0, "{from}: experts were read");
        // Every routed expert's read starts before the layer asks for it, some on a guess made
        // a layer earlier, unless the expert was still mapped from an earlier use (GGUF).
        let kept = metric(&server, "peregrine_expert_cache_hits_total");
        assert_eq!(
            metric(&server, "peregrine_expert_reads_prefetched_total") + kept,
            reads
        );
        let guesses = metric(&server, "peregrine_expert_guesses_total");
        let hits = metric(&server, "peregrine_expert_guess_hits_total");
        assert!(
            guesses > 0.0 && hits <= guesses,
            "{from}: {hits} of {guesses} guesses"
        );
        // Cut the file in the middle: the experts of the later layers lie past it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(whole.len() as u64 / 2)
            .unwrap();
        let broken = ask();
        assert_eq!(broken.status, 500, "{from}: {}", broken.body);
        let message = broken.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.contains(&path.display().to_string()) && message.contains("expert"),
            "{from}: the error names the expert and the file: {message}"
        );
        std::fs::write(&path, &whole).unwrap();
        let again = ask();
        assert_eq!(again.status, 200, "{from}: {}", again.body);
        assert_eq!(
            again.json()["choices"][0]["message"],
            first.json()["choices"][0]["message"],
            "{from}: the same answer once the file is whole"
        );
        drop(server);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
