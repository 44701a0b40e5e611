//! Integration tests over the public API with real models (fetched by `scripts/fetch-models.sh`).

mod batching;
mod common;
mod engine_state;
mod examples;
mod numerics;
mod prompt_cache;
mod real_models;
mod vision;
