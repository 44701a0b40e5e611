//! The request/event types of the engine's public API.

use std::sync::Arc;
use std::time::Duration;

use peregrine_models::audio::AudioClip;
use peregrine_models::vision::RgbImage;
use peregrine_models::{KvOptions, KvQuant};
use peregrine_sampling::{SamplingParams, TokenLogprob};
use serde_json::{Map, Value};

use crate::chat_template::ChatMessage;
use crate::constraint::Constraint;
use crate::error::EngineError;

/// What to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized with the tokenizer's special tokens (BOS where the model wants it).
    Text(String),
    /// A conversation rendered by the model's chat template.
    Chat {
        /// The messages.
        messages: Vec<ChatMessage>,
        /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
        template_kwargs: Map<String, Value>,
    },
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Whether any text of the prompt contains `needle`.
    pub fn mentions(&self, needle: &str) -> bool {
        match self {
            Self::Text(text) => text.contains(needle),
            Self::Chat { messages, .. } => messages
                .iter()
                .any(|m| m.content.to_string().contains(needle)),
            Self::Tokens(_) => false,
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// The prompt.
    pub prompt: Prompt,
    /// How tokens are drawn.
    pub sampling: SamplingParams,
    /// Generation ends when the text contains any of these (they are not returned).
    pub stop: Vec<String>,
    /// Most tokens to generate; `None` runs to the end of the context.
    pub max_tokens: Option<usize>,
    /// Return log-probabilities of each chosen token and of this many alternatives.
    pub logprobs: Option<usize>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// How this request's KV cache is stored, where it differs from the engine's default.
    pub kv: KvRequest,
    /// Hold the output to this grammar ([`Engine::compile`](crate::Engine::compile) makes one).
    pub constraint: Option<Constraint>,
    /// Route each token to this many experts in every mixture-of-experts layer instead of the
    /// model's number (at most that; fewer is faster and moves the output away from the
    /// model's). Refused for a model without experts.
    pub moe_top_k: Option<usize>,
    /// Keep control tokens in the text (some families' tool-call markers, such as Mistral's
    /// `[TOOL_CALLS]`, are control tokens that plain decoding drops).
    pub special_tokens: bool,
    /// Decode speculatively when the engine has a drafter (default); `false` opts out. Output
    /// is distributed the same either way; constrained requests never speculate.
    pub speculative: bool,
    /// Pictures for the chat's image parts, in order (the template marks where each goes).
    /// Only an engine with a vision tower takes them ([`Engine::accepts_images`](crate::Engine::accepts_images)).
    pub images: Vec<Arc<RgbImage>>,
    /// Clips for the chat's audio parts, in order. Only an engine with an audio tower takes
    /// them ([`Engine::accepts_audio`](crate::Engine::accepts_audio)).
    pub audio: Vec<Arc<AudioClip>>,
}

/// A request's KV storage choices (the API's `kv_bits`, `kv_group_size`, `turbo_kv`); what it
/// leaves out comes from the engine's options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvRequest {
    /// Quantize KV to 4 or 8 bits (and no TurboQuant).
    pub kv_bits: Option<u8>,
    /// Values per scale and bias of the quantized KV.
    pub kv_group_size: Option<usize>,
    /// TurboQuant on (`true`, with the engine's or the default window and threshold) or off.
    pub turbo_kv: Option<bool>,
}

impl KvRequest {
    /// The options these choices make of the engine's `default`.
    pub fn resolve(&self, default: &KvOptions) -> KvOptions {
        let mut kv = *default;
        if let Some(bits) = self.kv_bits {
            let group_size = (self.kv_group_size)
                .or(default.quant.map(|q| q.group_size))
                .unwrap_or(64);
            kv.quant = Some(KvQuant { bits, group_size });
            kv.turbo = None;
        } else if let (Some(group_size), Some(quant)) = (self.kv_group_size, &mut kv.quant) {
            quant.group_size = group_size;
        }
        match self.turbo_kv {
            Some(true) => kv.turbo = Some(default.turbo.unwrap_or_default()),
            Some(false) => kv.turbo = None,
            None => {}
        }
        kv
    }
}

impl Request {
    /// A request with default sampling and no limits but the context.
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::default(),
            stop: vec![],
            max_tokens: None,
            logprobs: None,
            ignore_eos: false,
            kv: KvRequest::default(),
            constraint: None,
            special_tokens: false,
            moe_top_k: None,
            speculative: true,
            images: Vec::new(),
            audio: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
    /// The caller dropped the stream.
    Cancelled,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (an end-of-sequence token counts).
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prompt cache (not prefilled).
    pub cached_tokens: usize,
}

/// Where the time went, and what memory the sequence held.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Time spent waiting in the queue.
    pub queued: Duration,
    /// Time of the prompt's forward passes.
    pub prefill: Duration,
    /// From the start of processing to the first generated token.
    pub time_to_first_token: Duration,
    /// Time of the forward passes after the first token.
    pub decode: Duration,
    /// Tokens produced by those decode passes.
    pub decode_tokens: usize,
    /// Bytes held by the sequence's KV cache at the end.
    pub kv_bytes: usize,
}

impl Timings {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tps(&self, prompt_tokens: usize) -> f64 {
        prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tps(&self) -> f64 {
        self.decode_tokens as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// What a request's stream yields.
#[derive(Debug)]
pub enum Event {
    /// Newly generated tokens and the text they completed (possibly empty while a multi-byte
    /// character or a possible stop string is held back).
    Delta {
        /// Text to append.
        text: String,
        /// The token ids generated in this step.
        tokens: Vec<u32>,
        /// Their log-probabilities, when the request asked.
        logprobs: Vec<TokenLogprob>,
    },
    /// The request finished; always the last event unless an error came.
    Done {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
        /// Timings.
        timings: Timings,
        /// The stop string that ended generation, if one did (not part of the text).
        stop_string: Option<String>,
    },
    /// The request failed; the last event.
    Error(EngineError),
}
