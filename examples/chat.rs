//! A multi-turn chat through the model's own chat template: each line of stdin is a user turn;
//! the conversation so far is sent every turn (the prompt cache reuses its prefix).
//!
//! `cargo run --release --example chat -- [MODEL]`, then type; end with Ctrl-D.

mod common;

use std::io::{BufRead, Write};

use peregrine::engine::ChatMessage;
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = Engine::load(
        &common::model_path(std::env::args().nth(1)),
        EngineConfig::default(),
    )?;
    let mut history = vec![ChatMessage::text("system", "You are a concise assistant.")];
    for line in std::io::stdin().lock().lines() {
        history.push(ChatMessage::text("user", line?));
        let mut request = Request::new(Prompt::Chat {
            messages: history.clone(),
            template_kwargs: Default::default(),
        });
        request.max_tokens = Some(64);
        request.sampling.temperature = 0.0;
        let mut reply = String::new();
        print!("> ");
        for event in engine.submit(request)? {
            match event {
                Event::Delta { text, .. } => {
                    print!("{text}");
                    std::io::stdout().flush()?;
                    reply.push_str(&text);
                }
                Event::Done { .. } => println!(),
                Event::Error(e) => return Err(e.into()),
            }
        }
        history.push(ChatMessage::text("assistant", reply));
    }
    Ok(())
}
