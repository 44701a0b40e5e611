//! Pick the device the model runs on by name: `cpu` (the default), `cuda`, `cuda:N` or `metal`.
//! `metal` needs a build with the `metal` feature (candle's Metal backend; untested, it cannot
//! be built on the Linux machines Peregrine is tested on); CUDA is not a feature yet. Naming a
//! backend this build lacks is a clear error, not a silent fall back to the CPU.
//!
//! `cargo run --release --example device -- cpu [MODEL]`

mod common;

use peregrine::tensor::device::parse_device;
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let device = parse_device(&args.next().unwrap_or_else(|| "cpu".into()))?;
    let config = EngineConfig {
        device: device.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::load(&common::model_path(args.next()), config)?;
    let mut request = Request::new(Prompt::Text("Hello".into()));
    request.max_tokens = Some(8);
    let generated: usize = (engine.submit(request)?)
        .map(|e| match e {
            Event::Delta { tokens, .. } => tokens.len(),
            _ => 0,
        })
        .sum();
    println!("{device:?}: generated {generated} tokens");
    Ok(())
}
