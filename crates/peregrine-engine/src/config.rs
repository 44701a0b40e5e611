//! [`EngineConfig`]: how an engine runs (device, context, batching, KV storage, prompt cache,
//! speculative decoding), with defaults for a single-user CPU server.

use peregrine_models::weights::MlxActivations;
use peregrine_models::{ExpertOptions, KvOptions, LoadProgress};
use peregrine_tensor::Device;
use std::sync::Arc;

use crate::speculative::SpeculativeConfig;

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Device for weights and compute.
    pub device: Device,
    /// Context length; defaults to the model's trained length.
    pub max_context: Option<usize>,
    /// Prompt tokens per forward pass during prefill.
    pub prefill_size: usize,
    /// Sequences generating at once: their steps share one forward pass (continuous
    /// batching).
    pub parallel: usize,
    /// Tokens one forward pass may take: each decoding sequence's next token, then prompt
    /// chunks (at most `prefill_size` each) in arrival order.
    pub batch_tokens: usize,
    /// Prompt tokens one pass may take while other sequences decode (at most `batch_tokens`):
    /// small values keep the decodes' inter-token gap close to its unloaded value while a long
    /// prompt is prefilled, at the cost of that prompt's time to first token.
    pub prefill_while_decoding: usize,
    /// How much longer than a step of decodes alone the mean step may be while prompts longer
    /// than one chunk are prefilled beside decodes: the scheduler measures both and gives such
    /// prompts as many tokens as fit (a fraction of a token per step where one costs more; at
    /// most `prefill_while_decoding`). 1 or less turns pacing off.
    pub decode_stretch: f64,
    /// Requests that may wait for a free slot before `submit` refuses more.
    pub queue_size: usize,
    /// Bytes of KV cache all running requests together may grow to; `None`: half the memory
    /// available when the engine starts. A request waits until what its prompt and token
    /// budget can take fits beside the running ones'.
    pub kv_budget: Option<usize>,
    /// KV cache storage.
    pub kv: KvOptions,
    /// How MLX 4-bit weights are multiplied (8-bit activations by default).
    pub mlx_activations: MlxActivations,
    /// Mixture-of-experts settings: experts streamed from disk (a model larger than memory),
    /// the routed top-k.
    pub experts: ExpertOptions,
    /// Finished sequences whose caches are kept for reuse by prompt prefix (0: no prompt cache).
    pub prompt_cache_entries: usize,
    /// Bytes of KV the prompt cache may hold.
    pub prompt_cache_bytes: usize,
    /// Speculative decoding: where drafts come from and how many a pass verifies (`None`:
    /// off). Requests opt out with [`Request::speculative`](crate::Request::speculative).
    pub speculative: Option<SpeculativeConfig>,
    /// Where [`Engine::load`](crate::Engine::load) counts the checkpoint bytes it reads, for a progress display.
    pub load_progress: Option<Arc<LoadProgress>>,
    /// Test hook (fault injection): a generation whose prompt text contains this string panics
    /// after its first token, so tests can see the scheduler survive a bug.
    #[doc(hidden)]
    pub panic_marker: Option<String>,
    /// Fail to load a vision-language checkpoint whose vision tower cannot load, instead of
    /// serving its text model alone with a warning.
    pub require_vision: bool,
    /// A llama.cpp multimodal projector file (`--mmproj`) to take the vision tower from,
    /// instead of the checkpoint's own.
    pub mmproj: Option<std::path::PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            max_context: None,
            prefill_size: 512,
            parallel: 1,
            batch_tokens: 512,
            prefill_while_decoding: 512,
            decode_stretch: 1.5,
            queue_size: 64,
            kv_budget: None,
            kv: KvOptions::default(),
            mlx_activations: MlxActivations::default(),
            experts: ExpertOptions::default(),
            prompt_cache_entries: 4,
            prompt_cache_bytes: 1 << 30,
            speculative: None,
            load_progress: None,
            panic_marker: None,
            require_vision: false,
            mmproj: None,
        }
    }
}
