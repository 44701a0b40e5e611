//! Tokenizers (in progress)
