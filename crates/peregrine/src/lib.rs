//! Peregrine: a native Rust LLM inference engine. Load a GGUF file or a checkpoint folder (HF
//! safetensors, MLX-quantized safetensors) and stream a completion:
//!
//! ```
//! use peregrine::{Engine, EngineConfig, Event, FinishReason, Prompt, Request};
//!
//! # let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/hf");
//! # /*
//! let model = std::path::Path::new("SmolLM2-135M-Instruct-Q4_1.gguf");
//! # */
//! let engine = Engine::load(&model, EngineConfig::default())?;
//! let mut request = Request::new(Prompt::Text("The capital of France is".into()));
//! request.max_tokens = Some(8);
//! request.sampling.temperature = 0.0; // greedy: the same text every run
//! let mut generated = 0;
//! for event in engine.submit(request)? {
//!     match event {
//!         Event::Delta { text, tokens, .. } => {
//!             print!("{text}");
//!             generated += tokens.len();
//!         }
//!         Event::Done { finish, usage, .. } => {
//!             assert!(matches!(finish, FinishReason::Length | FinishReason::Stop));
//!             assert!(generated <= usage.completion_tokens && usage.completion_tokens <= 8);
//!         }
//!         _ => {}
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! (Above, the repository's tiny random-weight fixture stands in for the GGUF file, so the
//! example runs as a test: its text is noise.)
//!
//! This facade re-exports the engine crates so that applications depend on one crate:
//! [`engine`] (the `Engine` API, tokenizers, chat templates), [`models`] (architectures and
//! checkpoint loading), [`kv`] (KV caches), [`moe`] (expert routing and stores), [`sampling`]
//! and [`tensor`] (candle, `QLinear`, fused ops). See `docs/ARCHITECTURE.md` for how they fit
//! together, and the repository's `examples/` for a chat, scoring text and a web service.
//!
//! # Features
//!
//! - `metal`: candle's Metal backend, chosen with the device option
//!   (`tensor::device::parse_device("metal")` into `EngineConfig::device`). **Untested**: it
//!   cannot be built on the Linux machines this project is tested on; only the CPU is.
//! - CUDA is not a feature yet; naming `cuda` as the device is an error in this build.
#![warn(missing_docs)]

pub use peregrine_engine as engine;
pub use peregrine_kv as kv;
pub use peregrine_models as models;
pub use peregrine_moe as moe;
pub use peregrine_sampling as sampling;
pub use peregrine_tensor as tensor;

pub use peregrine_engine::{
    Engine, EngineConfig, EngineError, Event, FinishReason, Prompt, Request,
};

// The README's example compiles as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
