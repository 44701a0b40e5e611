//! Anthropic Messages, OpenAI Responses and a Gemma 4 tool template over raw HTTP with the tiny
//! llama fixture: streamed and whole answers agree at temperature 0, the event sequences are in
//! the specs' order, the Responses store answers `GET`, `DELETE` and `previous_response_id`,
//! errors take each API's shape, and Gemma 4's call syntax is read where the template writes it.

mod support;

use serde_json::{Value, json};
use support::{Reply, Server};

/// The `(event, data)` pairs of a named-event SSE body.
fn named_events(reply: &Reply) -> Vec<(String, Value)> {
    (reply.body.split("\n\n"))
        .filter_map(|block| {
            let event = block.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = block.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((event.to_string(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

fn message_body(max_tokens: usize) -> Value {
    json!({"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "system": "be brief",
           "messages": [{"role": "user", "content": "hello there"}]})
}

#[test]
fn anthropic_messages_whole_and_streamed_agree() {
    let server = Server::start(&[]);
    let whole = server.post("/v1/messages", &message_body(6));
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    assert_eq!(whole["type"], "message");
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(whole["usage"]["output_tokens"], 6);
    assert_eq!(whole["stop_reason"], "max_tokens");
    let text = whole["content"][0]["text"].as_str().unwrap().to_string();

    let mut body = message_body(6);
    body["stream"] = json!(true);
    let reply = server.post("/v1/messages", &body);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    let events = named_events(&reply);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds[..2], ["message_start", "ping"]);
    assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
    for (kind, data) in &events {
        assert_eq!(data["type"], kind.as_str(), "the data names its event");
    }
    let streamed: String = (events.iter())
        .filter(|(k, _)| k == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);
    let (_, delta) = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 6);
    // A stop string taken from the answer itself ends the same request early, and is named.
    let stop: String = text.chars().skip(1).take(2).collect();
    let mut stopped = message_body(6);
    stopped["stop_sequences"] = json!([stop]);
    let stopped = server.post("/v1/messages", &stopped).json();
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{stopped}");
    assert_eq!(stopped["stop_sequence"], stop.as_str());
    let start = &events[0].1["message"]["usage"]["input_tokens"];
    let counted = server.post("/v1/messages/count_tokens", &message_body(6));
    assert_eq!(
        &counted.json()["input_tokens"],
        start,
        "count_tokens counts the prompt"
    );
}

#[test]
fn anthropic_errors_take_anthropic_shape() {
    let server = Server::start(&["--api-key", "k"]);
    let key = [("x-api-key", "k"), ("content-type", "application/json")];
    let send =
        |body: &Value| server.send("POST", "/v1/messages", &key, body.to_string().as_bytes());
    let mut no_max = message_body(4);
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let cases = [
        (no_max, "max_tokens"),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "stop_sequences": [""], "messages": [{"role": "user", "content": "x"}]}),
            "stop_sequences[0]",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            "messages[0].content[0]",
        ),
    ];
    for (body, field) in cases {
        let reply = send(&body);
        assert_eq!(reply.status, 400, "{}", reply.body);
        let error = reply.json();
        assert_eq!(error["type"], "error");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{field}: {message}");
    }
    let reply = server.send(
        "POST",
        "/v1/messages",
        &[],
        message_body(4).to_string().as_bytes(),
    );
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json()["error"]["type"], "authentication_error");
    assert_eq!(send(&message_body(2)).status, 200, "x-api-key is honoured");
}

#[test]
fn responses_stream_store_and_previous_response() {
    let server = Server::start(&[]);
    let body = json!({"model": "tiny", "input": "hello there", "instructions": "be brief",
                      "max_output_tokens": 5, "temperature": 0});
    let whole = server.post("/v1/responses", &body);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    assert_eq!(whole["object"], "response");
    assert_eq!(whole["status"], "incomplete");
    assert_eq!(whole["instructions"], "be brief");
    assert_eq!(whole["usage"]["output_tokens"], 5);
    let text = whole["output"][0]["content"][0]["text"].as_str().unwrap();

    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let events = named_events(&server.post("/v1/responses", &streamed_body));
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds[..3],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added"
        ]
    );
    assert_eq!(kinds.last(), Some(&"response.incomplete"));
    let seqs: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    let streamed: String = (events.iter())
        .filter(|(k, _)| k == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);

    let id = whole["id"].as_str().unwrap();
    let stored = server.get(&format!("/v1/responses/{id}"));
    assert_eq!(stored.json()["output"], whole["output"]);
    let next = json!({"model": "tiny", "input": "and then?", "previous_response_id": id,
                      "max_output_tokens": 2});
    let next = server.post("/v1/responses", &next).json();
    assert_eq!(next["previous_response_id"], id);
    let first_prompt = whole["usage"]["input_tokens"].as_u64().unwrap();
    assert!(next["usage"]["input_tokens"].as_u64().unwrap() > first_prompt);
    let deleted = server.send("DELETE", &format!("/v1/responses/{id}"), &[], b"");
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(server.get(&format!("/v1/responses/{id}")).status, 404);
    let gone = json!({"model": "tiny", "input": "x", "previous_response_id": id});
    let reply = server.post("/v1/responses", &gone);
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["param"], "previous_response_id");
    let bad = json!({"model": "tiny", "input": "x", "max_output_tokens": 0});
    assert_eq!(
        server.post("/v1/responses", &bad).json()["error"]["param"],
        "max_output_tokens"
    );
}

/// The llama fixture with a chat template that writes Gemma 4's tool syntax: tools declared as
/// `<|tool>declaration:…<tool|>`, earlier calls as `<|tool_call>call:…<tool_call|>`, results as
/// `<|tool_response>…`, and an empty thought channel after the generation prompt unless
/// `enable_thinking` is set (the official template's shape).
fn gemma4_tools_fixture(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("peregrine-gemma4-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(support::fixture()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.join("tokenizer_config.json");
    let mut tokenizer: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    tokenizer["chat_template"] = json!(concat!(
        "{%- if tools %}<|turn>system\n{%- for t in tools %}<|tool>declaration:",
        "{{ t['function']['name'] }}<tool|>{%- endfor %}<turn|>\n{%- endif %}",
        "{%- for m in messages %}{%- if m['role'] == 'tool' %}<|tool_response>response:",
        "{{ m['content'] }}<tool_response|>{%- else %}<|turn>{{ m['role'] }}\n{{ m['content'] or '' }}",
        "{%- for c in m['tool_calls'] or [] %}<|tool_call>call:{{ c['function']['name'] }}",
        "{{ c['function']['arguments'] | tojson }}<tool_call|>{%- endfor %}<turn|>\n{%- endif %}",
        "{%- endfor %}{%- if add_generation_prompt %}<|turn>model\n",
        "{%- if not enable_thinking %}<|channel>thought\n<channel|>{%- endif %}{%- endif %}"
    ));
    std::fs::write(&config, tokenizer.to_string()).unwrap();
    dir
}

/// A template in Gemma 4's syntax selects its call parser: output in Gemma 4's call syntax (held
/// there by a `grammar`, the random model would not write it) comes back as a call, and so does
/// a forced call (spelled in the Hermes tags the tool grammar holds it to, which that parser
/// also reads), whole and streamed, after a history with an earlier call and its result.
#[test]
fn gemma4_template_forced_call_whole_and_streamed() {
    let dir = gemma4_tools_fixture("tools");
    let server = Server::start_model(&dir, &[]);
    let tools = json!([{"type": "function", "function": {"name": "get_time",
        "description": "The time now", "parameters": {"type": "object", "properties": {}}}}]);
    let mut body = json!({"model": "tiny", "max_tokens": 120, "temperature": 0,
        "tools": tools, "tool_choice": "required", "messages": [
            {"role": "user", "content": "what time is it"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            {"role": "user", "content": "and now?"}]});
    let whole = server.post("/v1/chat/completions", &body);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let choice = &whole.json()["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(
        (&call["name"], &call["arguments"]),
        (&json!("get_time"), &json!("{}"))
    );

    body["stream"] = json!(true);
    let reply = server.post("/v1/chat/completions", &body);
    let chunks: Vec<Value> = (reply.events().iter())
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let names: Vec<&Value> = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"].get("name"))
        .collect();
    assert_eq!(names, [&json!("get_time")]);
    let last = chunks
        .iter()
        .rev()
        .find(|c| !c["choices"][0]["finish_reason"].is_null());
    assert_eq!(last.unwrap()["choices"][0]["finish_reason"], "tool_calls");

    let native = json!({"model": "tiny", "max_tokens": 120, "temperature": 0, "tools": tools,
        "messages": [{"role": "user", "content": "time in UTC?"}],
        "grammar": "start: \"Checking.<|tool_call>call:get_time{zone:<|\\\"|>UTC<|\\\"|>}<tool_call|>\""});
    let reply = server.post("/v1/chat/completions", &native);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choice = &reply.json()["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    assert_eq!(choice["message"]["content"], "Checking.");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(
        (&call["name"], &call["arguments"]),
        (&json!("get_time"), &json!(r#"{"zone":"UTC"}"#))
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A template with Gemma 4's thought channel: a thinking answer's channel becomes
/// `reasoning_content`, whole and streamed (the channel's markers are control tokens in Gemma
/// 4's vocabulary, kept in the text for this).
#[test]
fn gemma4_thought_channel_is_reasoning() {
    let dir = gemma4_tools_fixture("thought");
    let server = Server::start_model(&dir, &[]);
    // The random model would not think: a grammar holds it to a thought and an answer.
    let grammar = "start: \"<|channel>thought\\nadd them<channel|>It is 4.\"";
    let mut body = json!({"model": "tiny", "max_tokens": 60, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": true}, "grammar": grammar,
        "messages": [{"role": "user", "content": "2+2?"}]});
    let reply = server.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let message = &reply.json()["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "\nadd them", "{message}");
    assert_eq!(message["content"], "It is 4.");
    body["stream"] = json!(true);
    let reply = server.post("/v1/chat/completions", &body);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for event in reply.events().iter().filter(|e| e.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(event).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or_default();
        content += delta["content"].as_str().unwrap_or_default();
    }
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("\nadd them", "It is 4.")
    );
    let _ = std::fs::remove_dir_all(dir);
}
