//! Errors from loading and running models; each names the file, tensor, field or shape at fault.

use std::path::PathBuf;

/// Result type of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Why a model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A config file or GGUF metadata is missing a field or holds a bad value.
    #[error("{file}: {message}")]
    Config {
        /// The config file (or GGUF file) at fault.
        file: PathBuf,
        /// What is wrong, naming the field.
        message: String,
    },
    /// The checkpoint names an architecture this build does not implement.
    #[error("{file}: unsupported architecture `{arch}` (supported: {supported})")]
    UnsupportedArchitecture {
        /// Where the architecture was read.
        file: PathBuf,
        /// The architecture named there.
        arch: String,
        /// Comma-separated list of supported architectures.
        supported: String,
    },
    /// A weight file is malformed or truncated.
    #[error("{file}: {message}")]
    Checkpoint {
        /// The weight file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("{file}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The checkpoint (file or folder).
        file: PathBuf,
        /// The tensor's name (HF naming, and the GGUF name where it differs).
        tensor: String,
    },
    /// A tensor has the wrong shape for the config.
    #[error("{file}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The checkpoint.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape found in the file.
        got: Vec<usize>,
    },
    /// A picture the image processor cannot take (the request's fault).
    #[error("{0}")]
    Media(#[from] crate::vision::MediaError),
    /// A tensor operation failed.
    #[error("{}", peregrine_tensor::error_message(.0))]
    Tensor(#[from] peregrine_tensor::candle::Error),
}

impl ModelError {
    /// A config error for `file` naming what is wrong.
    pub fn config(file: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Config {
            file: file.into(),
            message: message.into(),
        }
    }
}
