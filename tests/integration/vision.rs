//! Images through the engine on the tiny Gemma 3 VLM fixture (and Qwen2.5-VL's for M-RoPE
//! positions after a cached picture): the prompt cache hands a
//! picture's keys and values only to a request about the same picture (image tokens are keyed
//! by the picture's digest) and the tower's rows are reused for it, several images in one prompt
//! go in as separate runs, and a request whose images do not match the template's markers is
//! refused.

use std::sync::Arc;

use peregrine::engine::ChatMessage;
use peregrine::models::vision::{RgbImage, decode_image};
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

use crate::common::repo_root;

fn photo(rel: &str) -> Arc<RgbImage> {
    photo_of("gemma3", rel)
}

fn photo_of(family: &str, rel: &str) -> Arc<RgbImage> {
    let dir = repo_root().join("tests/fixtures/vlm").join(family);
    let bytes = std::fs::read(dir.join(rel)).unwrap();
    Arc::new(decode_image(&bytes, &Default::default()).unwrap())
}

/// A user turn with `images` image parts, then the question.
fn ask(images: &[Arc<RgbImage>]) -> Request {
    ask_about(images, "Describe this image.")
}

/// [`ask`] with the question `text`.
fn ask_about(images: &[Arc<RgbImage>], text: &str) -> Request {
    let mut parts: Vec<serde_json::Value> = (images.iter())
        .map(|_| serde_json::json!({"type": "image"}))
        .collect();
    parts.push(serde_json::json!({"type": "text", "text": text}));
    let message = ChatMessage {
        content: serde_json::Value::Array(parts),
        ..ChatMessage::text("user", "")
    };
    let mut request = Request::new(Prompt::Chat {
        messages: vec![message],
        template_kwargs: Default::default(),
    });
    request.images = images.to_vec();
    request.sampling.temperature = 0.0;
    request.max_tokens = Some(1);
    request.logprobs = Some(4);
    request
}

/// The first token's top log-probabilities, and the prompt tokens the cache supplied.
fn first_token(engine: &Engine, request: Request) -> (Vec<(u32, f32)>, usize) {
    let mut top = None;
    for event in engine.submit(request).unwrap() {
        match event {
            Event::Delta { logprobs, .. } => top = top.or(logprobs.first().map(|l| l.top.clone())),
            Event::Done { usage, .. } => return (top.expect("a token"), usage.cached_tokens),
            Event::Error(e) => panic!("{e}"),
        }
    }
    panic!("no Done event")
}

fn engine() -> Engine {
    engine_of("gemma3")
}

fn engine_of(family: &str) -> Engine {
    let dir = repo_root()
        .join("tests/fixtures/vlm")
        .join(family)
        .join("hf");
    Engine::load(&dir, EngineConfig::default()).expect("the VLM fixture loads")
}

fn ids(top: &[(u32, f32)]) -> Vec<u32> {
    top.iter().map(|t| t.0).collect()
}

/// Follow-up turns about the same picture (Qwen2.5-VL): the cached prefix holds the image,
/// whose M-RoPE run left the positions after it shifted; the new tokens must continue from
/// the shifted positions, both where the cache entry is taken whole and where a copy of it is
/// trimmed back to the shared prefix, so the answers equal a fresh engine's.
#[test]
fn follow_up_turns_continue_from_the_pictures_shifted_positions() {
    let picture = photo_of("qwen2_5_vl", "image.png");
    let turn = |answer: &str| {
        let mut request = ask(std::slice::from_ref(&picture));
        if let Prompt::Chat { messages, .. } = &mut request.prompt {
            messages.push(ChatMessage::text("assistant", answer));
            messages.push(ChatMessage::text("user", "What else is in it?"));
        }
        request
    };
    let shared = engine_of("qwen2_5_vl");
    first_token(&shared, ask(std::slice::from_ref(&picture)));
    for answer in ["A photo.", "A cat on a mat."] {
        let (fresh, _) = first_token(&engine_of("qwen2_5_vl"), turn(answer));
        let (again, cached) = first_token(&shared, turn(answer));
        assert!(
            cached > 30,
            "{answer}: the image came from the cache ({cached} tokens did)"
        );
        // Equal to 1e-4: a pass of many rows rounds its matmuls unlike a short one (a few
        // 1e-6 here); positions that ignored the shift move the fixture's logits by ~2.
        assert_eq!(ids(&again), ids(&fresh), "{answer}");
        for ((_, a), (_, b)) in again.iter().zip(&fresh) {
            assert!((a - b).abs() < 1e-4, "{answer}: {again:?} vs {fresh:?}");
        }
    }
    assert_eq!(shared.image_stats(), (1, 2));
}

/// A GGUF text model with llama.cpp's projector file (`EngineConfig::mmproj`): the first
/// answer token's log-probabilities equal the same GGUF model's logits with the HF
/// checkpoint's tower rows spliced in by hand (the projector file's rows are the tower's, bit
/// for bit: crates/peregrine-models/tests/vision_gemma3.rs), to 1e-4 (pass sizes differ).
#[test]
fn a_gguf_model_with_its_projector_file_answers_with_the_towers_rows() {
    use peregrine::models::vision::load_vision;
    use peregrine::models::{BatchSeq, Logits, Media, SequenceCache, load_model};
    use peregrine::tensor::{D, DType, Device, nn::ops::log_softmax};

    let vlm = repo_root().join("tests/fixtures/vlm/gemma3");
    let gguf = vlm.join("gguf/model-bf16.gguf");
    let config = EngineConfig {
        mmproj: Some(vlm.join("gguf/mmproj-f32.gguf")),
        ..EngineConfig::default()
    };
    let engine = Engine::load(&gguf, config).expect("the GGUF model and its projector load");
    // The fixture's prompt, whose ids the reference holds.
    let question = "Describe this image in one sentence.";
    let (top, _) = first_token(&engine, ask_about(&[photo("image.png")], question));

    let r = peregrine::tensor::candle::safetensors::load(
        vlm.join("hf/reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let u32s = |name: &str| {
        r[name]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    let (ids, types) = (u32s("input_ids"), u32s("token_type_ids"));
    let first = types.iter().position(|&t| t == 1).unwrap();
    let model = load_model(&gguf, &Default::default()).unwrap().model;
    let vision = load_vision(&vlm.join("hf"), &Device::Cpu).unwrap().unwrap();
    let image = photo("image.png");
    let rows = vision.encode(&vision.preprocess(&image).unwrap()).unwrap();
    let mut cache = SequenceCache::new(&model.cache_spec(), &Default::default());
    let media = Media {
        offset: first,
        rows: &rows,
        both_ways: true,
        grid: None,
    };
    let mut batch = [BatchSeq {
        tokens: &ids,
        cache: &mut cache,
        logits: Logits::Last,
        media: Some(media),
    }];
    let logits = model.forward_batch(&mut batch).unwrap();
    let logp = log_softmax(&logits, D::Minus1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (id, got) in &top {
        let want = logp[*id as usize];
        assert!((got - want).abs() < 1e-4, "token {id}: {got} vs {want}");
    }
}

#[test]
fn the_prompt_cache_reuses_a_picture_only_for_the_same_picture() {
    let (astronaut, coffee) = (photo("image.png"), photo("images/small.png"));
    let fresh = |image: &Arc<RgbImage>| first_token(&engine(), ask(std::slice::from_ref(image)));
    let ((alone_a, _), (alone_c, _)) = (fresh(&astronaut), fresh(&coffee));
    // The comparison can fail: the two pictures give different distributions.
    assert_ne!(alone_a, alone_c);
    let shared = engine();
    let (a, _) = first_token(&shared, ask(std::slice::from_ref(&astronaut)));
    let (c, cached_c) = first_token(&shared, ask(std::slice::from_ref(&coffee)));
    let (a2, cached_a2) = first_token(&shared, ask(&[astronaut]));
    assert_eq!((a, c, a2), (alone_a.clone(), alone_c, alone_a));
    // Another picture reuses at most what precedes its image tokens (8 here); the same one
    // reuses the whole prompt but its last token (its 16 image tokens among them).
    assert!(cached_c <= 8, "{cached_c} cached tokens");
    assert!(cached_a2 > 8 + 16, "{cached_a2} cached tokens");
    // And the tower ran once per picture.
    assert_eq!(shared.image_stats(), (2, 1));
}

#[test]
fn two_images_go_in_as_two_runs_and_a_missing_marker_is_refused() {
    let engine = engine();
    let two = [photo("image.png"), photo("images/wide.png")];
    let (both, _) = first_token(&engine, ask(&two));
    let (one, _) = first_token(&engine, ask(&two[..1]));
    assert_ne!(both, one, "the second picture changes the answer");
    // Two pictures, one marker: refused, not silently dropped.
    let mut request = ask(&two[..1]);
    request.images = two.to_vec();
    let err = engine.submit(request).err().expect("refused").to_string();
    assert!(
        err.contains("2 image(s)") && err.contains("1 image marker"),
        "{err}"
    );
}

/// The fixture's output head has 512 rows for a tokenizer of 503 ids (real checkpoints pad
/// theirs too: Gemma 3's 262,208 rows for 262,144 tokens): sampling never draws a padding id,
/// which no text stands for (it used to end such a request with an error).
#[test]
fn sampling_never_draws_the_heads_padding_ids() {
    let engine = engine();
    for seed in 0..4 {
        let mut request = ask(&[photo("image.png")]);
        request.sampling.temperature = 1.5;
        request.sampling.seed = Some(seed);
        request.max_tokens = Some(200);
        request.ignore_eos = true;
        for event in engine.submit(request).unwrap() {
            if let Event::Delta { tokens, .. } = &event {
                assert!(tokens.iter().all(|&t| t < 503), "{tokens:?}");
            }
            assert!(!matches!(event, Event::Error(_)), "{event:?}");
        }
    }
}
