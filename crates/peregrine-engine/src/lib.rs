//! Peregrine's generation engine: tokenizers, chat templates, incremental detokenization, stop
//! strings, the generation loop and the request/event API that the server uses.
//!
//! ```no_run
//! use peregrine_engine::{Engine, EngineConfig, Event, Prompt, Request};
//! let engine = Engine::load("model.gguf".as_ref(), EngineConfig::default())?;
//! let mut request = Request::new(Prompt::Text("The capital of France is".into()));
//! request.max_tokens = Some(16);
//! for event in engine.submit(request)? {
//!     if let Event::Delta { text, .. } = event { print!("{text}"); }
//! }
//! # Ok::<(), peregrine_engine::EngineError>(())
//! ```
#![warn(missing_docs)]

mod allocator;
pub mod api;
mod audio;
pub mod chat_template;
mod config;
pub mod constraint;
pub mod detok;
mod engine;
mod error;
mod kv_budget;
mod media;
mod pacing;
mod prompt_cache;
mod scheduler;
mod sequence;
pub mod speculative;
pub mod stop;
mod stream;
pub mod tokenizer;

pub use api::{Event, FinishReason, KvRequest, Prompt, Request, Timings, Usage};
pub use chat_template::{ChatMessage, ChatTemplate};
pub use constraint::{Constraint, Grammar};
pub use engine::{Engine, EngineConfig, EventStream};
pub use error::EngineError;
pub use kv_budget::{LayerMemory, cache_memory};
pub use peregrine_models::weights::MlxActivations;
pub use peregrine_models::{
    CausalLm, ExpertOptions, KvOptions, KvQuant, LoadOptions, LoadProgress, SequenceCache,
    TurboKeys, TurboOptions,
};
/// The samplers, for callers that handle distributions (speculative drafters).
pub use peregrine_sampling as sampling;
pub use peregrine_sampling::{SamplingParams, TokenLogprob};
/// The tensor layer, for callers that handle logits.
pub use peregrine_tensor as tensor;
pub use prompt_cache::PromptCacheStats;
pub use speculative::{SpeculationStats, SpeculativeConfig};
pub use tokenizer::Tokenizer;

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
