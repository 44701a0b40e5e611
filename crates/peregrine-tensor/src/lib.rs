//! Peregrine's tensor layer: device choice, dtype rules, [`QLinear`] (the one place where weight
//! formats meet matmul) and fused ops, each with a plain candle-op reference (`*_ref`) that tests
//! compare against on every compiled device.
#![warn(missing_docs)]

pub use candle_core as candle;
pub use candle_nn as nn;

pub mod attention;
mod attention_cpu;
#[cfg(feature = "cuda")]
mod attention_cuda;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda_op;
pub mod dense;
#[cfg(feature = "cuda")]
mod dense_cuda;
pub mod device;
#[cfg(feature = "cuda")]
mod fused_cuda;
#[cfg(feature = "cuda")]
mod gguf_cuda;
#[cfg(feature = "cuda")]
mod kv_append_cuda;
pub mod linear;
pub mod mlx;
pub mod moe;
#[cfg(feature = "cuda")]
mod moe_cuda;
pub mod ops;
pub mod quant;
pub mod rope;

pub use candle_core::{D, DType, Device, Result, Tensor};
pub use linear::{Embedding, QLinear};
pub use mlx::MlxQuantized;
pub use quant::GgufMatrix;
pub use rope::{RopeScaling, RopeStyle, RotaryEmbedding};

/// A candle error's message for users: without the backtrace candle attaches when
/// `RUST_BACKTRACE` is set, and without its `path:` prefix (our errors name the file already).
pub fn error_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::WithPath { inner, .. } => error_message(inner),
        other => other.to_string(),
    }
}

// The README's examples compile and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
