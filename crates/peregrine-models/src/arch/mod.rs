//! One file per HF `model_type`: what the architecture changes in the shared config and layers.

pub mod deepseek_v3;
pub mod falcon_h1;
pub mod gemma2;
pub mod gemma3;
pub mod gemma4;
pub mod jamba;
pub mod llama;
pub mod mamba2;
pub mod mistral;
pub mod mixtral;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_moe;
pub mod qwen3_next;
