//! Peregrine: a native Rust LLM inference engine.
//!
//! This facade re-exports the engine crates so that applications depend on one crate:
//! [`engine`] (the `Engine` API, tokenizers, chat templates), [`models`] (architectures and
//! checkpoint loading), [`kv`] (KV caches), [`moe`] (expert routing and stores), [`sampling`] and [`tensor`] (candle, `QLinear`,
//! fused ops). See `docs/ARCHITECTURE.md` for how they fit together.
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
