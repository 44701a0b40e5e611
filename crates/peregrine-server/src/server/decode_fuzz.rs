//! Property test of the request decoders (chat, completions, and the Anthropic Messages and
//! Responses translations onto chat): random structural mutations of valid bodies and random
//! byte edits of their text never panic; every accepted body yields requests the engine's own
//! validation accepts, and every rejection is a 400 `invalid_request_error` naming a field or
//! none. The case count is fixed (`CASES` per endpoint) and the generator is seeded, so a failure
//! reproduces.

use serde_json::{Map, Value, json};

use super::complete::decode_body;
use super::openai::{Endpoint, MAX_N};
use super::responses::Store;
use peregrine_engine::{Prompt, SamplingParams};

/// Mutated bodies decoded per endpoint (structural and byte-level, half each).
const CASES: usize = 20_000;

/// Field names the mutator draws from: every field the decoder reads, plus some it ignores.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "seed",
    "n",
    "logprobs",
    "top_logprobs",
    "response_format",
    "type",
    "chat_template_kwargs",
    "enable_thinking",
    "user",
    "echo",
    "suffix",
    "role",
    "content",
    "text",
    "ignore_eos",
    "speculative",
    "tools",
    "name",
    "unknown",
    "system",
    "stop_sequences",
    "tool_choice",
    "input_schema",
    "tool_use_id",
    "id",
    "input",
    "thinking",
    "disable_parallel_tool_use",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "call_id",
    "arguments",
    "output",
    "parameters",
    "format",
    "store",
];

/// xorshift64*: small, seeded, good enough to drive mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    let scalars = [
        json!(null),
        json!(true),
        json!(false),
        json!(0),
        json!(1),
        json!(-1),
        json!(2),
        json!(17),
        json!(i64::MIN),
        json!(u64::MAX),
        json!(0.5),
        json!(-0.0),
        json!(1e308),
        json!(-2.5),
        json!(""),
        json!("user"),
        json!("assistant"),
        json!("text"),
        json!("json_schema"),
        json!("héllo 🌍"),
        json!("tiny"),
        json!("tool_use"),
        json!("tool_result"),
        json!("function_call"),
        json!("function_call_output"),
        json!("message"),
        json!("input_text"),
        json!("any"),
        json!("auto"),
        json!("required"),
    ];
    match rng.below(if depth > 2 { 1 } else { 4 }) {
        0 => scalars[rng.below(scalars.len())].clone(),
        1 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        2 => json!({"role": random_value(rng, depth + 1), "content": random_value(rng, depth + 1)}),
        _ => {
            let mut map = Map::new();
            for _ in 0..rng.below(4) {
                map.insert(
                    KEYS[rng.below(KEYS.len())].into(),
                    random_value(rng, depth + 1),
                );
            }
            Value::Object(map)
        }
    }
}

fn mutate(rng: &mut Rng, v: &mut Value, depth: usize) {
    match v {
        Value::Object(map) if depth < 4 && !map.is_empty() && rng.below(3) == 0 => {
            let key = map.keys().nth(rng.below(map.len())).cloned().unwrap();
            mutate(rng, map.get_mut(&key).unwrap(), depth + 1);
        }
        Value::Object(map) => match rng.below(3) {
            0 if !map.is_empty() => {
                let key = map.keys().nth(rng.below(map.len())).cloned().unwrap();
                map.remove(&key);
            }
            _ => {
                map.insert(KEYS[rng.below(KEYS.len())].into(), random_value(rng, depth));
            }
        },
        Value::Array(items) if !items.is_empty() && rng.below(2) == 0 => {
            let i = rng.below(items.len());
            mutate(rng, &mut items[i], depth + 1);
        }
        Value::Array(items) => items.push(random_value(rng, depth)),
        other => *other = random_value(rng, depth),
    }
}

fn seed_body(endpoint: Endpoint) -> Value {
    let tool = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    match endpoint {
        Endpoint::Messages => {
            return json!({
                "model": "tiny", "max_tokens": 16, "system": [{"type": "text", "text": "brief"}],
                "temperature": 0.5, "top_k": 5, "stop_sequences": ["END"], "stream": true,
                "messages": [
                    {"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}]},
                ],
                "tools": [{"name": "w", "description": "weather", "input_schema": tool}],
                "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
            });
        }
        Endpoint::Responses => {
            return json!({
                "model": "tiny", "instructions": "brief", "max_output_tokens": 16, "top_p": 0.9,
                "input": [
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                    {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                ],
                "tools": [{"type": "function", "name": "w", "parameters": tool}],
                "tool_choice": "auto", "text": {"format": {"type": "json_object"}}, "store": false,
            });
        }
        _ => {}
    }
    let common = json!({
        "model": "tiny", "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "stop": ["\n", "END"], "seed": 7, "n": 2, "user": "u",
    });
    let mut body = common.as_object().unwrap().clone();
    let extra = match endpoint {
        Endpoint::Completions => json!({"prompt": ["a", "b"], "echo": true, "logprobs": 3}),
        _ => json!({
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": true, "top_logprobs": 2, "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"enable_thinking": false},
        }),
    };
    body.extend(extra.as_object().unwrap().clone());
    Value::Object(body)
}

fn check(bytes: &[u8], endpoint: Endpoint, store: &Store) -> bool {
    let defaults = SamplingParams::default();
    let decode = || decode_body(endpoint, bytes, false, (64, &defaults, None), store);
    let (result, again) = (decode(), decode());
    assert_eq!(result.is_ok(), again.is_ok(), "decoding is deterministic");
    match result {
        Ok((d, _)) => {
            assert!(!d.requests.is_empty());
            assert!((1..=MAX_N as usize).contains(&d.n));
            for r in &d.requests {
                assert!(r.sampling.validate().is_ok(), "{:?}", r.sampling);
                assert!(r.max_tokens.is_some_and(|m| m >= 1));
                assert!(r.stop.iter().all(|s| !s.is_empty()));
                if let Prompt::Chat { messages, .. } = &r.prompt {
                    assert!(!messages.is_empty());
                }
            }
            true
        }
        // The one 404 a body can cause: a `previous_response_id` the store does not hold.
        Err(e) if e.status.as_u16() == 404 => {
            assert_eq!(e.param.as_deref(), Some("previous_response_id"), "{e}");
            false
        }
        Err(e) => {
            assert_eq!(e.status.as_u16(), 400, "{e}");
            assert_eq!(e.kind, "invalid_request_error");
            assert!(!e.message.is_empty());
            assert!(e.param.as_deref().is_none_or(|p| !p.is_empty()));
            false
        }
    }
}

#[test]
fn decoder_survives_random_mutations() {
    let store = Store::new(4);
    let endpoints = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Messages,
        Endpoint::Responses,
    ];
    for endpoint in endpoints {
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        let seed = seed_body(endpoint);
        assert!(
            check(seed.to_string().as_bytes(), endpoint, &store),
            "the seed body is valid"
        );
        let (mut accepted, mut rejected) = (0, 0);
        for case in 0..CASES {
            let mut body = seed.clone();
            for _ in 0..1 + rng.below(3) {
                mutate(&mut rng, &mut body, 0);
            }
            let mut bytes = body.to_string().into_bytes();
            if case % 2 == 1 {
                // Byte-level edits: overwrite, truncate or duplicate a span.
                let i = rng.below(bytes.len());
                match rng.below(3) {
                    0 => bytes[i] = rng.next() as u8,
                    1 => bytes.truncate(i),
                    _ => {
                        let span = bytes[i..].to_vec();
                        bytes.extend_from_slice(&span);
                    }
                }
            }
            if check(&bytes, endpoint, &store) {
                accepted += 1;
            } else {
                rejected += 1;
            }
        }
        assert_eq!(accepted + rejected, CASES);
        eprintln!("{endpoint:?}: {CASES} cases, {accepted} accepted, {rejected} rejected");
        // Both outcomes must be exercised for the test to mean anything.
        assert!(
            accepted > CASES / 20 && rejected > CASES / 20,
            "{accepted} / {rejected}"
        );
    }
}
