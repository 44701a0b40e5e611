//! Building blocks shared by the architectures.

pub mod attention;
pub mod decoder;
pub mod mlp;
