//! Score text: the perplexity of a file under a model, from the logits of every position
//! (teacher forcing, the same chunked prefill generation runs).
//!
//! `cargo run --release --example score -- [MODEL] [FILE]` (FILE defaults to a short text)

mod common;

use peregrine::{Engine, EngineConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let engine = Engine::load(&common::model_path(args.next()), EngineConfig::default())?;
    let text = match args.next() {
        Some(file) => std::fs::read_to_string(file)?,
        None => "The quick brown fox jumps over the lazy dog. ".repeat(4),
    };
    let ids = engine.tokenizer().encode(&text, true)?;
    let logits = engine.logits(&ids, 0..ids.len())?.to_vec2::<f32>()?;
    // Position i's logits predict token i + 1.
    let mut nll = 0.0f64;
    for (row, &next) in logits.iter().zip(&ids[1..]) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let log_sum = row
            .iter()
            .map(|&x| ((x - max) as f64).exp())
            .sum::<f64>()
            .ln();
        nll += log_sum - (row[next as usize] - max) as f64;
    }
    let scored = ids.len() - 1;
    println!(
        "{{\"tokens\": {scored}, \"mean_nll\": {:.6}, \"perplexity\": {:.4}}}",
        nll / scored as f64,
        (nll / scored as f64).exp()
    );
    Ok(())
}
