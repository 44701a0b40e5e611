//! What the examples share: which model to load.

use std::path::PathBuf;

/// The model named by the first argument (a GGUF file or a checkpoint folder), or the
/// repository's tiny random-weight llama fixture (its text is noise, but every step runs).
pub fn model_path(arg: Option<String>) -> PathBuf {
    arg.map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/hf")
    })
}
