//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

use hyper::StatusCode;
use peregrine_engine::EngineError;
use serde_json::{Value, json};

/// An error answer: the status and the fields of OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// Human-readable reason.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, when one is (`messages[1].role`, `temperature`).
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 `invalid_request_error` that concerns no single field (malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            param: None,
            ..Self::invalid("", message)
        }
    }

    /// Any status with `invalid_request_error` and no param.
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            ..Self::bad_request(message)
        }
    }

    /// A 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// Sets the status.
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Sets the code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The same error about a field of the object at `prefix` (`prefix.param`).
    pub fn within(mut self, prefix: &str) -> Self {
        self.param = Some(match self.param.take() {
            Some(p) if p.is_empty() => prefix.to_string(),
            Some(p) if p.starts_with('[') => format!("{prefix}{p}"),
            Some(p) => format!("{prefix}.{p}"),
            None => prefix.to_string(),
        });
        self
    }

    /// Maps an engine error; `prompt_param` names the field holding the prompt.
    pub fn from_engine(e: &EngineError, prompt_param: &str) -> Self {
        match e {
            EngineError::ContextLengthExceeded { .. } => {
                Self::invalid(prompt_param, e.to_string()).code("context_length_exceeded")
            }
            // The message names the field between backticks (the decoder checks ranges first).
            EngineError::Sampling(_) => {
                let text = e.to_string();
                let field = text.split('`').nth(1).unwrap_or(prompt_param).to_string();
                Self::invalid(field, text)
            }
            EngineError::Unsupported { param, .. } => Self::invalid(*param, e.to_string()),
            EngineError::QueueFull(_) => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                ..Self::internal(e.to_string())
            }
            .code("queue_full"),
            EngineError::ShutDown => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                ..Self::internal(e.to_string())
            },
            e if e.is_client_error() => Self::invalid(prompt_param, e.to_string()),
            e => Self::internal(e.to_string()),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}
