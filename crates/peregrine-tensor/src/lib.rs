//! Peregrine's tensor layer: device choice, dtype rules, `QLinear` (the one place where weight
//! formats meet matmul) and fused ops, each with a plain candle-op reference (`*_ref`).

pub use candle_core as candle;
pub use candle_nn as nn;
