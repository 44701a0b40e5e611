//! Load a model and stream a completion to stdout.
//!
//! `cargo run --release --example stream -- [MODEL] [PROMPT]`

mod common;

use std::io::Write;

use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let engine = Engine::load(&common::model_path(args.next()), EngineConfig::default())?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    let mut request = Request::new(Prompt::Text(prompt));
    request.max_tokens = Some(32);
    request.sampling.temperature = 0.0; // greedy: the same text every run
    // The stream yields events as tokens are generated; dropping it cancels the request.
    for event in engine.submit(request)? {
        match event {
            Event::Delta { text, .. } => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            Event::Done {
                finish,
                usage,
                timings,
                ..
            } => eprintln!(
                "\n[{finish:?}: {} prompt tokens, {} generated, {:.1} tok/s]",
                usage.prompt_tokens,
                usage.completion_tokens,
                timings.decode_tps()
            ),
            Event::Error(e) => return Err(e.into()),
        }
    }
    Ok(())
}
