//! Real models against llama.cpp on the same GGUF files (reference data recorded by
//! `scripts/record_llamacpp_reference.py` with llama-cpp-python; see tests/data/llamacpp/).

use peregrine::engine::tensor::{D, DType};
use peregrine::engine::{ChatMessage, KvOptions};
use peregrine::{Engine, EngineConfig, Event, FinishReason, Prompt, Request};

use crate::common::{data_json, ids, real_model};

fn load(file: &str) -> Engine {
    Engine::load(&real_model(file), EngineConfig::default()).expect("model loads")
}

/// Keys and values stored in f16, as llama.cpp stores them by default, so comparisons differ only
/// in summation order and activation rounding (measured on SmolLM2 over 8 prompts: 504/512 top-1;
/// every miss is a near-tie, within 0.3 logits in llama.cpp's own top-5).
fn load_like_llama_cpp(file: &str) -> Engine {
    let kv = KvOptions {
        dtype: Some(DType::F16),
    };
    Engine::load(
        &real_model(file),
        EngineConfig {
            kv,
            ..Default::default()
        },
    )
    .expect("model loads")
}

/// Teacher forcing: feed llama.cpp's prompt + greedy continuation and compare our argmax at every
/// continuation position with llama.cpp's. Both quantize activations differently (llama.cpp
/// to Q8 blocks for its dot products), so near-ties may flip: the issue asks ≥ 0.98 agreement.
fn teacher_forced_agreement(data: &str, file: &str) -> f64 {
    let reference = data_json(data);
    let engine = load_like_llama_cpp(file);
    let (mut agree, mut total) = (0usize, 0usize);
    for case in reference["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let continuation = ids(&case["continuation_ids"]);
        let top1 = ids(&case["top1"]);
        let all: Vec<u32> = prompt.iter().chain(&continuation).copied().collect();
        let logits = engine.logits(&all, 0..all.len()).unwrap();
        let ours = logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
        for pos in prompt.len() - 1..all.len() - 1 {
            total += 1;
            agree += usize::from(ours[pos] == top1[pos]);
        }
    }
    let rate = agree as f64 / total as f64;
    eprintln!("{file}: teacher-forced top-1 agreement {agree}/{total} = {rate:.4}");
    rate
}

#[test]
fn smollm2_teacher_forced_top1_matches_llama_cpp() {
    let rate = teacher_forced_agreement("llamacpp/smollm2.json", "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(rate >= 0.98, "agreement {rate} < 0.98");
}

#[test]
fn smollm2_prompt_tokens_match_llama_cpp() {
    let reference = data_json("llamacpp/smollm2.json");
    let engine = load("SmolLM2-135M-Instruct.Q4_1.gguf");
    for case in reference["cases"].as_array().unwrap() {
        let text = case["prompt"].as_str().unwrap().to_string();
        assert_eq!(
            engine.prompt_ids(&Prompt::Text(text)).unwrap(),
            ids(&case["prompt_ids"])
        );
    }
}

/// Greedy text of `prompt`, at most `max_tokens` tokens.
fn greedy_text(engine: &Engine, prompt: Prompt, max_tokens: usize) -> (String, FinishReason) {
    let mut request = Request::new(prompt);
    request.sampling.temperature = 0.0;
    request.max_tokens = Some(max_tokens);
    let (mut text, mut finish) = (String::new(), None);
    for event in engine.submit(request).unwrap() {
        match event {
            Event::Delta { text: t, .. } => text.push_str(&t),
            Event::Done { finish: f, .. } => finish = Some(f),
            Event::Error(e) => panic!("{e}"),
        }
    }
    (text, finish.expect("a Done event"))
}

/// The GGUF's own chat template (which injects SmolLM's default system prompt) through our
/// template engine gives llama.cpp's prompt and the same greedy answers. One answer may end
/// earlier: after "...capital of France." `<|im_end|>` and " It" are a near-tie (14.093 vs 14.079
/// in llama.cpp's own batched logits, which pick `<|im_end|>` like we do, while its incremental
/// decode picked " It"), so the check is that one answer is a prefix of the other.
#[test]
fn smollm2_chat_answers_match_llama_cpp() {
    let reference = data_json("llamacpp/smollm2_chat.json");
    let engine = load_like_llama_cpp("SmolLM2-135M-Instruct.Q4_1.gguf");
    for case in reference["cases"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let max_tokens = case["max_tokens"].as_u64().unwrap() as usize;
        let prompt = Prompt::Chat {
            messages,
            template_kwargs: Default::default(),
        };
        assert_eq!(
            engine.prompt_ids(&prompt).unwrap().len() as u64,
            case["usage"]["prompt_tokens"].as_u64().unwrap(),
            "prompt tokens"
        );
        let (text, _) = greedy_text(&engine, prompt, max_tokens);
        let theirs = case["text"].as_str().unwrap();
        assert!(text.len() >= 16, "answer too short: {text:?}");
        assert!(
            theirs.starts_with(&text) || text.starts_with(theirs),
            "ours {text:?}\nllama.cpp {theirs:?}"
        );
    }
}

/// Without the template's default system prompt the model knows the answer (as in llama.cpp).
#[test]
fn smollm2_answers_paris() {
    let engine = load("SmolLM2-135M-Instruct.Q4_1.gguf");
    let prompt =
        "<|im_start|>user\nWhich city is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let (text, _) = greedy_text(&engine, Prompt::Text(prompt.into()), 32);
    assert!(
        text.starts_with("The capital of France is Paris."),
        "answer: {text:?}"
    );
}
