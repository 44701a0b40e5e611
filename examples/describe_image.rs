//! Ask a vision-language model about a picture: image input through the library.
//!
//! `cargo run --release --example describe_image -- [MODEL_DIR] [IMAGE] [QUESTION]`
//! (a Gemma 3, SmolVLM or Qwen2.5-VL checkpoint folder and a PNG, JPEG or WebP file; by
//! default the repository's tiny random Gemma 3 fixture and its photo, which only show that it
//! runs).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use peregrine::engine::ChatMessage;
use peregrine::models::vision::decode_image;
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vlm/gemma3");
    let mut args = std::env::args().skip(1);
    let model = args.next().map_or(fixture.join("hf"), PathBuf::from);
    let image = args.next().map_or(fixture.join("image.png"), PathBuf::from);
    let question = args
        .next()
        .unwrap_or_else(|| "Describe this image in one sentence.".into());
    let engine = Engine::load(&model, EngineConfig::default())?;
    if !engine.accepts_images() {
        return Err(format!("{}: this model has no vision tower", model.display()).into());
    }
    // Decoded (and size-checked) here; the engine preprocesses it as the model's processor does.
    let picture = decode_image(&std::fs::read(&image)?, &Default::default())?;
    // The image part stands where the chat template puts the picture.
    let parts = serde_json::json!([{"type": "image"}, {"type": "text", "text": question}]);
    let message = ChatMessage {
        content: parts,
        ..ChatMessage::text("user", "")
    };
    let mut request = Request::new(Prompt::Chat {
        messages: vec![message],
        template_kwargs: Default::default(),
    });
    request.images = vec![Arc::new(picture)];
    request.max_tokens = Some(32);
    request.sampling.temperature = 0.0;
    for event in engine.submit(request)? {
        match event {
            Event::Delta { text, .. } => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            Event::Done { usage, .. } => eprintln!(
                "\n[{} prompt tokens, {} generated]",
                usage.prompt_tokens, usage.completion_tokens
            ),
            Event::Error(e) => return Err(e.into()),
        }
    }
    Ok(())
}
