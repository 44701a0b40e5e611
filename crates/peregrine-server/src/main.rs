//! `peregrine`: run open-weight LLMs from GGUF, safetensors or MLX checkpoints.

mod bench;
mod chat;
mod cli;
mod hub;
mod info;
mod progress;
mod quantize;
mod server;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // Our kernels (rayon) and candle's size their pools from this; set before any pool starts.
    // An explicit RAYON_NUM_THREADS is kept when --threads is absent.
    let threads = cli.threads.or_else(|| {
        std::env::var_os("RAYON_NUM_THREADS")
            .is_none()
            .then(peregrine_engine::tensor::device::physical_cores)
    });
    if let Some(threads) = threads {
        // SAFETY: no other thread exists yet.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
