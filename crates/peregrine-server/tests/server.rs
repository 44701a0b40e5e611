//! Black-box tests of `peregrine serve` over raw HTTP with the tiny llama fixture: every error
//! row of the OpenAI error contract, API keys, and `reasoning_content` for think templates.

mod support;

use std::io::Read;

use serde_json::{Value, json};
use support::{Reply, Server};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn chat(content: &str) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": content}],
           "temperature": 0, "max_tokens": 12})
}

fn with(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

fn assert_error(reply: &Reply, status: u16, param: Option<&str>, what: &str) {
    assert_eq!(reply.status, status, "{what}: {}", reply.body);
    let error = &reply.json()["error"];
    let kind = error["type"].as_str().unwrap_or_default();
    let expected_kind = match status {
        500.. => "server_error",
        _ => "invalid_request_error",
    };
    assert_eq!(kind, expected_kind, "{what}: {}", reply.body);
    assert_eq!(error["param"].as_str(), param, "{what}: {}", reply.body);
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}"
    );
    assert!(
        error.get("code").is_some(),
        "{what}: code must be present (maybe null)"
    );
}

/// Every 4xx/5xx row of the contract, against one server with `--queue-size 0` (a busy worker
/// means 503) and `--max-body-mb 1`.
#[test]
fn every_error_row_has_status_type_and_param() {
    let server = Server::start(&["--parallel", "1", "--queue-size", "0", "--max-body-mb", "1"]);
    // 503 first, while the only worker is idle: the first of two prompts takes the worker, the
    // second finds no room.
    let two = json!({"model": "tiny", "prompt": ["hi", "there"], "max_tokens": 12});
    let reply = server.post(COMPLETIONS, &two);
    assert_error(&reply, 503, None, "queue full");
    assert_eq!(reply.json()["error"]["code"], "queue_full");

    let long = "word ".repeat(400);
    let bad_chat: Vec<(Value, &str)> = vec![
        (json!({"temperature": 0}), "messages"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": [{"role": "bot", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": 1, "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": ["hi"]}), "messages[0]"),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0]",
        ),
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"temperature": -1}), "temperature"),
        (json!({"temperature": 101}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"top_k": 1.5}), "top_k"),
        (json!({"min_p": 2}), "min_p"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"frequency_penalty": 3}), "frequency_penalty"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": "5"}), "max_tokens"),
        (
            json!({"max_completion_tokens": -1}),
            "max_completion_tokens",
        ),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"stop": 5}), "stop"),
        (json!({"stop": ["a", 3]}), "stop[1]"),
        (json!({"stop": [""]}), "stop[0]"),
        (json!({"stream": "yes"}), "stream"),
        (json!({"stream_options": 3}), "stream_options"),
        (
            json!({"stream_options": {"include_usage": "y"}}),
            "stream_options.include_usage",
        ),
        (json!({"seed": "x"}), "seed"),
        (json!({"logprobs": "yes"}), "logprobs"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
        ),
        (json!({"chat_template_kwargs": []}), "chat_template_kwargs"),
        (json!({"kv_bits": 5}), "kv_bits"),
        (json!({"kv_bits": 16}), "kv_bits"),
        (json!({"kv_bits": "8"}), "kv_bits"),
        (json!({"kv_group_size": 48}), "kv_group_size"),
        (json!({"turbo_kv": "yes"}), "turbo_kv"),
        (json!({"kv_bits": 8, "turbo_kv": true}), "turbo_kv"),
        // The fixture's heads are 16 wide: groups of 32 cannot tile them (the engine's check).
        (json!({"kv_bits": 8, "kv_group_size": 32}), "kv_group_size"),
        (json!({"user": 5}), "user"),
        (json!({"model": 5}), "model"),
    ];
    for (patch, param) in bad_chat {
        let mut body = with(chat("hi"), patch.clone());
        if patch.get("messages").is_none() && param == "messages" {
            body.as_object_mut().unwrap().remove("messages");
        }
        assert_error(
            &server.post(CHAT, &body),
            400,
            Some(param),
            &patch.to_string(),
        );
    }
    let reply = server.post(CHAT, &chat(&long));
    assert_error(&reply, 400, Some("messages"), "context length");
    assert_eq!(reply.json()["error"]["code"], "context_length_exceeded");
    let reply = server.post(CHAT, &with(chat("hi"), json!({"model": "nope"})));
    assert_error(&reply, 404, Some("model"), "unknown model");
    assert_eq!(reply.json()["error"]["code"], "model_not_found");

    let bad_completions: Vec<(Value, &str)> = vec![
        (json!({}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": ["a", 5]}), "prompt[1]"),
        (json!({"prompt": [1, -1]}), "prompt"),
        (json!({"prompt": [999999]}), "prompt"),
        (json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "a", "logprobs": true}), "logprobs"),
        (json!({"prompt": "a", "echo": "y"}), "echo"),
        (json!({"prompt": "a", "max_tokens": -5}), "max_tokens"),
        (json!({"prompt": long}), "prompt"),
    ];
    for (body, param) in bad_completions {
        let what = body.to_string();
        let body = with(json!({"model": "tiny"}), body);
        assert_error(&server.post(COMPLETIONS, &body), 400, Some(param), &what);
    }
    // OpenAI's spec requires `model`; a request without one is refused, not guessed.
    let reply = server.post(COMPLETIONS, &json!({"prompt": "a"}));
    assert_error(&reply, 400, Some("model"), "no model");
    let mut no_model = chat("hi");
    no_model.as_object_mut().unwrap().remove("model");
    assert_error(
        &server.post(CHAT, &no_model),
        400,
        Some("model"),
        "no model",
    );

    for (body, what) in [
        ("{not json", "malformed"),
        ("[1, 2]", "not an object"),
        ("", "empty"),
    ] {
        let reply = server.send("POST", CHAT, &[], body.as_bytes());
        assert_error(&reply, 400, None, what);
    }
    for (method, path) in [
        ("GET", CHAT),
        ("PUT", COMPLETIONS),
        ("DELETE", "/v1/models"),
        ("POST", "/health"),
    ] {
        let reply = server.send(method, path, &[], b"");
        assert_error(&reply, 405, None, &format!("{method} {path}"));
        assert!(
            reply.header("allow").is_some(),
            "405 names the allowed method"
        );
    }
    assert_error(&server.get("/nope"), 404, None, "unknown route");
    assert_error(&server.get("/v1/model"), 404, None, "unknown route");
    let reply = server.get("/v1/models/nope");
    assert_error(&reply, 404, Some("model"), "unknown model id");

    // 413: the declared length is over the limit; the server answers without reading it.
    let mut stream = server.open("POST", CHAT, &[], b"{", Some(2 << 20));
    let mut raw = vec![];
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("invalid_request_error"), "{text}");
}

#[test]
fn api_key_is_required_on_v1_routes() {
    let server = Server::start(&["--api-key", "sekret"]);
    assert_eq!(server.get("/health").status, 200, "health stays open");
    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong")],
        vec![("Authorization", "sekret")],
    ] {
        let reply = server.send("GET", "/v1/models", &headers, b"");
        assert_eq!(reply.status, 401, "{headers:?}");
        assert_eq!(reply.json()["error"]["code"], "invalid_api_key");
        assert_eq!(reply.json()["error"]["param"], Value::Null);
    }
    let ok = [("Authorization", "Bearer sekret")];
    assert_eq!(server.send("GET", "/v1/models", &ok, b"").status, 200);
    let body = chat("hi").to_string();
    assert_eq!(server.send("POST", CHAT, &ok, body.as_bytes()).status, 200);
}

/// A request's `moe_top_k` answers as the same top-k set at load (`--moe-top-k`), while a
/// request without it keeps the model's; values the model cannot take are refused by name.
#[test]
fn a_requests_moe_top_k_answers_as_that_top_k_set_at_load() {
    let moe = support::fixture().join("../../qwen3_moe/hf");
    let body = |extra: Value| {
        let base = json!({"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6], "temperature": 0,
                          "max_tokens": 16, "ignore_eos": true, "logprobs": 1});
        with(base, extra)
    };
    let answer = |server: &Server, extra: Value| {
        let reply = server.post(COMPLETIONS, &body(extra));
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["choices"][0]["logprobs"]["token_logprobs"].clone()
    };
    let (server, one_at_load) = (
        Server::start_model(&moe, &[]),
        Server::start_model(&moe, &["--moe-top-k", "1"]),
    );
    let routed = answer(&server, json!({"moe_top_k": 1}));
    assert_eq!(routed, answer(&one_at_load, json!({})));
    assert_ne!(
        routed,
        answer(&server, json!({})),
        "top-k 1 changes nothing?"
    );
    assert_eq!(
        answer(&server, json!({"moe_top_k": 2})),
        answer(&server, json!({}))
    );
    for (value, what) in [
        (json!(0), "range"),
        (json!(3), "between 1 and the 2"),
        (json!("1"), "integer"),
    ] {
        let reply = server.post(COMPLETIONS, &body(json!({"moe_top_k": value})));
        assert_error(&reply, 400, Some("moe_top_k"), what);
    }
    let dense = Server::start(&[]);
    let reply = dense.post(COMPLETIONS, &body(json!({"moe_top_k": 1})));
    assert_error(&reply, 400, Some("moe_top_k"), "no experts");
}

/// The chat page and its files are served at `/` without the API key (they hold no secret) and
/// with a policy that keeps them to this origin; `--no-webui` takes them away.
#[test]
fn the_chat_page_is_served_and_can_be_turned_off() {
    let server = Server::start(&["--api-key", "sekret"]);
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    assert!(
        page.body.contains("<title>Peregrine chat</title>"),
        "{}",
        page.body
    );
    let policy = page.header("content-security-policy").unwrap();
    assert!(policy.contains("connect-src 'self'"), "{policy}");
    let script = server.get("/webui/app.js");
    assert_eq!(script.status, 200);
    assert!(
        script
            .header("content-type")
            .unwrap()
            .starts_with("text/javascript")
    );
    assert!(script.body.contains("/v1/chat/completions"));
    assert_eq!(server.get("/webui/none.js").status, 404);
    let post = server.send("POST", "/", &[], b"{}");
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), Some("GET"));

    let api_only = Server::start(&["--no-webui"]);
    assert_eq!(api_only.get("/").status, 404);
    assert_eq!(api_only.get("/webui/app.js").status, 404);
    assert_eq!(api_only.get("/health").status, 200);
}

/// A template that opens a think block in the generation prompt sends the output to
/// `reasoning_content`, identically whole and streamed.
#[test]
fn think_blocks_go_to_reasoning_content() {
    let dir = std::env::temp_dir().join(format!("peregrine-think-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(support::fixture().join(file), dir.join(file)).unwrap();
    }
    let config = std::fs::read_to_string(support::fixture().join("tokenizer_config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["chat_template"] = json!(
        "{# a reasoning template: </think> #}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
    );
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let server = support::Server::start_model(&dir, &[]);
    let whole = server.post(CHAT, &chat("hi")).json();
    let message = &whole["choices"][0]["message"];
    let reasoning = message["reasoning_content"]
        .as_str()
        .expect("reasoning_content");
    assert!(!reasoning.is_empty());
    assert_eq!(
        message["content"], "",
        "the random model never closes the block"
    );
    let streamed = server.post(CHAT, &with(chat("hi"), json!({"stream": true})));
    let mut text = String::new();
    for event in streamed.events() {
        if event != "[DONE]" {
            let chunk: Value = serde_json::from_str(&event).unwrap();
            let delta = &chunk["choices"][0]["delta"];
            assert!(
                delta["content"].as_str().is_none_or(str::is_empty),
                "{chunk}"
            );
            text += delta["reasoning_content"].as_str().unwrap_or("");
        }
    }
    assert_eq!(text, reasoning);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The server: a request may opt out (`"speculative": false`, and a non-boolean is a 400
/// naming the field), and `/metrics` counts drafted and kept tokens.
#[test]
fn the_server_reports_speculation_and_lets_a_request_opt_out() {
    let server = Server::start(&["--spec-ngram", "--draft-fixed"]);
    let body = |speculative: serde_json::Value| {
        json!({
            "model": "tiny",
            "prompt": "one two three one two three one two",
            "max_tokens": 24,
            "temperature": 0,
            "speculative": speculative,
        })
    };
    let drafted = |server: &Server| {
        let text = server.get("/metrics").body;
        let line = (text.lines())
            .find(|l| l.starts_with("peregrine_speculative_drafted_tokens_total "))
            .unwrap_or_else(|| panic!("no drafted counter in {text}"))
            .to_string();
        line.split(' ').nth(1).unwrap().parse::<u64>().unwrap()
    };
    let off = server.post("/v1/completions", &body(json!(false)));
    assert_eq!(off.status, 200, "{}", off.body);
    assert_eq!(drafted(&server), 0, "an opted-out request drafts nothing");
    let on = server.post("/v1/completions", &body(json!(true)));
    assert_eq!(on.status, 200);
    assert!(drafted(&server) > 0);
    assert_eq!(
        on.json()["choices"][0]["text"],
        off.json()["choices"][0]["text"],
        "greedy text is the same either way"
    );
    let bad = server.post("/v1/completions", &body(json!("yes")));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "speculative");
}
