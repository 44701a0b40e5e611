//! Engine errors, with a classification the server maps to HTTP statuses.

use peregrine_models::ModelError;
use peregrine_sampling::SamplingError;

use crate::chat_template::TemplateError;
use crate::tokenizer::TokenizerError;

/// Why a request or the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer could not be built or failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The chat template failed (a `raise_exception` from the template is the client's fault).
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The prompt does not fit the context.
    #[error(
        "the prompt has {prompt_tokens} tokens but the context holds {max_context} (leave room for at least one generated token)"
    )]
    ContextLengthExceeded {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// The context length.
        max_context: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A request field this model or engine cannot honour: KV storage the model's rows cannot
    /// use, a request the KV budget cannot hold, `moe_top_k` on a dense model.
    #[error("{message}")]
    Unsupported {
        /// The request field at fault.
        param: &'static str,
        /// Why.
        message: String,
    },
    /// A grammar or JSON schema for constrained output does not compile.
    #[error("the grammar does not compile: {0}")]
    Grammar(String),
    /// Too many requests are waiting.
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    /// A bug: generation panicked, or failed in a way no request can cause.
    #[error("internal error: {0}")]
    Internal(String),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShutDown,
}

impl EngineError {
    /// True when the request itself is at fault (HTTP 400), not the server.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            Self::Template(TemplateError::Raised(_))
                | Self::Sampling(_)
                | Self::ContextLengthExceeded { .. }
                | Self::EmptyPrompt
                | Self::TokenOutOfRange { .. }
                | Self::Unsupported { .. }
                | Self::Grammar(_)
        )
    }
}
