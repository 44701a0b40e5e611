//! Command-line interface: `generate`, `chat`, `logits`, `bench`, `info`, `serve`, `quantize`.

use std::io::Write;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use peregrine_engine::tensor::device::parse_device;
use peregrine_engine::tensor::{DType, error_message};
use peregrine_engine::{
    ChatMessage, Engine, EngineConfig, Event, ExpertOptions, KvOptions, KvQuant, LoadOptions,
    LoadProgress, MlxActivations, Prompt, Request, SamplingParams, SpeculativeConfig, TurboKeys,
    TurboOptions,
};

use peregrine_engine::speculative::{
    AssistantDraft, DraftModel, DraftSource, MtpDraft, PromptLookup,
};
use peregrine_models::Gemma4Assistant;

use crate::hub::resolve_model;

/// Peregrine: a native LLM inference engine and OpenAI-compatible server.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Cli {
    /// CPU threads for compute (default: the physical cores).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a completion and print it.
    Generate(GenerateArgs),
    /// Chat with the model in the terminal: streamed replies, history, slash commands.
    Chat(crate::chat::ChatArgs),
    /// Write the model's logits for given tokens to a safetensors file (a parity tool).
    Logits(LogitsArgs),
    /// Measure prefill and decode speed; prints one JSON object.
    Bench(crate::bench::BenchArgs),
    /// Print the model's weight bytes and the KV cache and recurrent state one sequence holds
    /// at the context length (`--ctx-size`), per kind of layer.
    Info(crate::info::InfoArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(crate::server::ServeArgs),
    /// Write an MLX affine-quantized checkpoint (mlx-lm loads it) or a GGUF file (`--format gguf`)
    /// from an HF safetensors folder.
    Quantize(crate::quantize::QuantizeArgs),
}

/// Options every command that loads a model shares.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A GGUF file, an HF/MLX checkpoint folder, or a hub id (`owner/name`, `owner/name:file.gguf`).
    #[arg(long, short)]
    pub model: String,
    /// Where the model runs: `auto` (the first CUDA GPU in a build with the `cuda` feature when
    /// one is present, else the CPU), `cpu`, `cuda`, `cuda:N`, or `metal` in a build with the
    /// `metal` feature (untested: it cannot be built on the Linux machines Peregrine is tested
    /// on).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Context length (default: the model's).
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// Prompt tokens per forward pass during prefill.
    #[arg(long, default_value_t = 512)]
    pub prefill_size: usize,
    /// KV cache storage: f16 (the default, as llama.cpp's, vLLM's and mlx-lm's), f32 (exact,
    /// twice the memory; `logits`' default, the parity tool's) or bf16.
    #[arg(long, value_parser = ["f32", "f16", "bf16"])]
    pub cache_type: Option<String>,
    /// Quantize cached keys and values to 4 or 8 bits as they are written (mlx-lm's
    /// `kv_bits`): an f16 scale and bias per `--kv-group-size` values; replaces `--cache-type`.
    #[arg(long, value_parser = PossibleValuesParser::new(["4", "8"])
        .map(|s| s.parse::<u8>().expect("a listed value")))]
    pub kv_bits: Option<u8>,
    /// Values per scale and bias of `--kv-bits` (it must divide the model's head dimension).
    #[arg(long, default_value_t = 64, value_parser = PossibleValuesParser::new(["32", "64", "128"])
        .map(|s| s.parse::<usize>().expect("a listed value")))]
    pub kv_group_size: usize,
    /// TurboQuant KV: once a sequence passes `--turbo-threshold` tokens, keys and values older
    /// than `--turbo-hot-window` are kept at ~4.9 / ~3.125 bits per value (head_dim 128) and
    /// attended without decompressing; replaces `--cache-type` and `--kv-bits`.
    #[arg(long)]
    pub turbo_kv: bool,
    /// Most recent tokens TurboQuant keeps uncompressed (f16).
    #[arg(long, default_value_t = 256)]
    pub turbo_hot_window: usize,
    /// Tokens a sequence holds before TurboQuant compresses anything.
    #[arg(long, default_value_t = 2048)]
    pub turbo_threshold: usize,
    /// How TurboQuant codes keys: `mse`, 4-bit Lloyd–Max codes (the lower score error), or
    /// `qjl`, the paper's 3-bit codes with a 1-bit QJL sketch of their residual (same size).
    #[arg(long, default_value = "mse", value_parser = ["mse", "qjl"])]
    pub turbo_keys: String,
    /// Positions a recurrent layer (Mamba 2, gated delta-net) can roll back exactly: each keeps a copy of the
    /// layer's state, so memory is `(1 + N) ×` the state.
    #[arg(long, default_value_t = peregrine_models::DEFAULT_RECURRENT_ROLLBACK)]
    pub recurrent_rollback: usize,
    /// MLX 4- and 8-bit weights: q8 rounds activations to 8 bits per 32 values and runs the
    /// integer kernels (as llama.cpp does for its block formats); f32 computes as mlx-lm does
    /// (slower).
    #[arg(long, default_value = "q8", value_parser = ["q8", "f32"])]
    pub mlx_activations: String,
    /// Finished sequences whose KV caches are kept, so that a prompt sharing a prefix with
    /// one prefills only the rest (0 turns the prompt cache off).
    #[arg(long, default_value_t = 4)]
    pub prompt_cache_entries: usize,
    /// Megabytes of KV the prompt cache may hold.
    #[arg(long, default_value_t = 1024)]
    pub prompt_cache_mb: usize,
    /// Mixture-of-experts models: keep only the non-expert weights in memory and read each
    /// routed expert from the checkpoint's files when it is used (for models larger than
    /// memory; the OS page cache keeps what fits). A model without experts is refused.
    #[arg(long)]
    pub stream_experts: bool,
    /// Refuse to start when a vision-language checkpoint's vision tower cannot load (by
    /// default its text model is served alone, with a warning).
    #[arg(long)]
    pub vision: bool,
    /// A llama.cpp multimodal projector file (GGUF, `convert_hf_to_gguf.py --mmproj`) holding
    /// the vision tower for a GGUF text model (Gemma 3's); a file that does not load or fit
    /// the model is an error.
    #[arg(long, value_name = "FILE")]
    pub mmproj: Option<std::path::PathBuf>,
    /// Expert reads in flight at most with `--stream-experts` (each layer's routed experts
    /// are read ahead of their use, at most this many at once and waiting in memory); 0 reads
    /// each expert only when it is used, with no prefetch.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u16).range(0..=256)
        .map(usize::from))]
    pub stream_queue_depth: usize,
    /// With `--stream-experts`, also start reading each MoE layer's experts one layer early, on
    /// a guess (the layer's router applied to the previous layer's input). Wrong guesses cost
    /// reads: worth it where reads wait on the disk, not where copying them keeps the cores
    /// busy (docs/benchmarks.md); the hit rate is in `/metrics` and `bench --json`.
    #[arg(long, requires = "stream_experts")]
    pub stream_speculate: bool,
    /// With `--stream-experts`, megabytes of recently used experts to keep in memory, shared
    /// by the MoE layers (0: none, the default: on the CPU the page cache already keeps what
    /// fits; meant for devices where each read is also a copy to the device). Experts that are
    /// multiplied from the file's own pages keep theirs by `--expert-map-mb` instead.
    #[arg(long, default_value_t = 0, requires = "stream_experts")]
    pub expert_cache_mb: usize,
    /// With `--stream-experts`, megabytes of recently used experts kept mapped where they are
    /// multiplied from the file's own pages (GGUF Q4_0, Q4_1, Q8_0, Q4_K and Q6_K on x86): not a
    /// copy, the page cache's pages, but counted in the resident set; keeping them saves
    /// mapping their pages in and out on every use (0: map each expert only while it is used).
    #[arg(long, default_value_t = 256, requires = "stream_experts")]
    pub expert_map_mb: usize,
    /// Mixture-of-experts models: route each token to this many experts instead of the
    /// model's own number. Fewer is faster (and reads less with `--stream-experts`) but moves
    /// the output away from the model's: a quality trade, measured in docs/benchmarks.md.
    #[arg(long)]
    pub moe_top_k: Option<usize>,
    /// Speculative decoding with this draft model (a GGUF file or checkpoint folder sharing
    /// the model's tokenizer, or a Gemma 4 assistant checkpoint for a Gemma 4 model): it
    /// drafts `--num-draft-tokens` tokens, the model verifies them in one pass; output is
    /// distributed exactly as without it (identical when greedy).
    #[arg(long, conflicts_with = "spec_ngram")]
    pub draft_model: Option<String>,
    /// Speculative decoding by prompt lookup: drafts what followed an earlier occurrence of
    /// the context's last tokens (no second model; pays off where output repeats the input,
    /// as edits and code do).
    #[arg(long, conflicts_with = "spec_mtp")]
    pub spec_ngram: bool,
    /// Speculative decoding with the model's own multi-token-prediction layer (DeepSeek-V3,
    /// Qwen3-Next, Qwen3.5 checkpoints that carry it), loaded for the purpose and chained for
    /// drafts longer than one token.
    #[arg(long, conflicts_with = "draft_model")]
    pub spec_mtp: bool,
    /// Most tokens drafted per pass; fewer (or none) while the measured acceptance and cost
    /// say drafting loses, unless `--draft-fixed`.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(1..=16)
        .map(usize::from))]
    pub num_draft_tokens: usize,
    /// Always draft `--num-draft-tokens` (no adaptation; for measurements).
    #[arg(long)]
    pub draft_fixed: bool,
}

impl ModelArgs {
    /// The engine settings the arguments describe (one request at a time, default queue).
    pub fn engine_config(&self) -> EngineConfig {
        let dtype = match self.cache_type.as_deref().unwrap_or("f16") {
            "f32" => None,
            "bf16" => Some(DType::BF16),
            _ => Some(DType::F16),
        };
        EngineConfig {
            max_context: self.ctx_size,
            prefill_size: self.prefill_size,
            kv: KvOptions {
                dtype,
                quant: self.kv_bits.map(|bits| KvQuant {
                    bits,
                    group_size: self.kv_group_size,
                }),
                turbo: self.turbo_kv.then_some(TurboOptions {
                    hot_window: self.turbo_hot_window,
                    threshold: self.turbo_threshold,
                    keys: match self.turbo_keys.as_str() {
                        "qjl" => TurboKeys::Qjl,
                        _ => TurboKeys::Mse,
                    },
                }),
                recurrent_rollback: Some(self.recurrent_rollback),
            },
            mlx_activations: match self.mlx_activations.as_str() {
                "f32" => MlxActivations::F32,
                _ => MlxActivations::Q8,
            },
            prompt_cache_entries: self.prompt_cache_entries,
            prompt_cache_bytes: self.prompt_cache_mb << 20,
            experts: ExpertOptions {
                stream: self.stream_experts,
                queue_depth: self.stream_queue_depth,
                speculate: self.stream_speculate,
                cache_bytes: self.expert_cache_mb << 20,
                mapped_bytes: self.expert_map_mb << 20,
                top_k: self.moe_top_k,
            },
            require_vision: self.vision,
            mmproj: self.mmproj.clone(),
            ..Default::default()
        }
    }

    /// Loads the engine `config` describes from the `--model` path or hub id.
    pub fn load_with(&self, config: EngineConfig) -> Result<Engine> {
        let path = resolve_model(&self.model)?;
        let device = parse_device(&self.device)
            .map_err(|e| anyhow::anyhow!("--device {}: {}", self.device, error_message(&e)))?;
        let progress = std::sync::Arc::new(LoadProgress::default());
        let speculative = self.speculative(&device, &config)?;
        let config = EngineConfig {
            device,
            load_progress: Some(progress.clone()),
            speculative,
            ..config
        };
        crate::progress::show(&path, progress, || Engine::load(&path, config)).map_err(Into::into)
    }

    /// The drafter the speculative flags ask for, a draft model loaded on `device`.
    fn speculative(
        &self,
        device: &peregrine_engine::tensor::Device,
        config: &EngineConfig,
    ) -> Result<Option<SpeculativeConfig>> {
        let source: Arc<dyn DraftSource> = match (&self.draft_model, self.spec_ngram) {
            (Some(draft), _) => {
                let path = resolve_model(draft)?;
                let opts = LoadOptions {
                    device: device.clone(),
                    max_context: config.max_context,
                    mlx_activations: config.mlx_activations,
                    experts: ExpertOptions::default(),
                    progress: None,
                    mtp: false,
                };
                tracing::info!("drafting with {}", path.display());
                let failed =
                    |e: &dyn std::fmt::Display| anyhow::anyhow!("--draft-model {draft}: {e}");
                if Gemma4Assistant::is_assistant(&path) {
                    let assistant = Gemma4Assistant::load(&path, &opts).map_err(|e| failed(&e))?;
                    Arc::new(AssistantDraft(Arc::new(assistant)))
                } else {
                    Arc::new(
                        DraftModel::load(&path, &opts, config.prefill_size)
                            .map_err(|e| failed(&e))?,
                    )
                }
            }
            (None, true) => Arc::new(PromptLookup::default()),
            (None, false) if self.spec_mtp => Arc::new(MtpDraft),
            (None, false) => return Ok(None),
        };
        Ok(Some(SpeculativeConfig {
            source,
            max_draft: self.num_draft_tokens,
            adaptive: !self.draft_fixed,
        }))
    }

    /// The drafter the speculative flags name, if any.
    pub fn drafter_name(&self) -> Option<&'static str> {
        match (&self.draft_model, self.spec_ngram, self.spec_mtp) {
            (Some(d), _, _) if Gemma4Assistant::is_assistant(std::path::Path::new(d)) => {
                Some("gemma4-assistant")
            }
            (Some(_), _, _) => Some("draft-model"),
            (None, true, _) => Some("prompt-lookup"),
            (None, false, true) => Some("mtp"),
            (None, false, false) => None,
        }
    }

    /// Loads the engine the arguments describe.
    pub fn load(&self) -> Result<Engine> {
        self.load_with(self.engine_config())
    }
}

#[derive(Debug, Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Raw prompt text.
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// A user message, wrapped by the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// An optional system message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// Sampling flags `generate` and `chat` share.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens per reply.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

impl SamplingArgs {
    /// A request for `prompt` with these flags.
    pub fn request(&self, prompt: Prompt) -> Request {
        let sampling = SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        };
        Request {
            sampling,
            stop: self.stop.clone(),
            max_tokens: Some(self.max_tokens),
            ..Request::new(prompt)
        }
    }
}

#[derive(Debug, Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    input_ids: Option<String>,
    /// A text file, tokenized with the model's special tokens (BOS where the model adds one).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Positions to write, `A..B` (default: all).
    #[arg(long)]
    positions: Option<String>,
    /// Output file (`logits`: f32 [positions, vocab]; `input_ids`: u32).
    #[arg(long)]
    out: PathBuf,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate(args),
        Command::Chat(args) => crate::chat::run(args),
        Command::Logits(args) => logits(args),
        Command::Bench(args) => crate::bench::run(args, cli.threads),
        Command::Info(args) => crate::info::run(args),
        Command::Serve(args) => crate::server::run(args),
        Command::Quantize(args) => crate::quantize::run(args),
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let engine = args.model.load()?;
    let prompt = match (&args.prompt, &args.chat) {
        (Some(text), _) => Prompt::Text(text.clone()),
        (None, Some(chat)) => {
            let mut messages: Vec<ChatMessage> = args
                .system
                .iter()
                .map(|s| ChatMessage::text("system", s.clone()))
                .collect();
            messages.push(ChatMessage::text("user", chat.clone()));
            Prompt::Chat {
                messages,
                template_kwargs: Default::default(),
            }
        }
        (None, None) => bail!("give --prompt or --chat"),
    };
    let request = args.sampling.request(prompt);
    let mut out = std::io::stdout().lock();
    for event in engine.submit(request)? {
        match event {
            Event::Delta { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Event::Done { usage, timings, .. } => {
                writeln!(out)?;
                eprintln!(
                    "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode]",
                    usage.prompt_tokens,
                    timings.prefill_tps(usage.prompt_tokens),
                    usage.completion_tokens,
                    timings.decode_tps()
                );
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn parse_positions(spec: &str) -> Result<Range<usize>> {
    let (a, b) = spec
        .split_once("..")
        .context("--positions must look like A..B")?;
    let a: usize = a.trim().parse().context("--positions: bad start")?;
    let b: usize = b.trim().parse().context("--positions: bad end")?;
    if a >= b {
        bail!("--positions {spec}: the range is empty");
    }
    Ok(a..b)
}

fn logits(mut args: LogitsArgs) -> Result<()> {
    // The parity tool compares with f32 references: its cache is exact unless asked otherwise.
    args.model.cache_type.get_or_insert_with(|| "f32".into());
    let engine = args.model.load()?;
    let ids: Vec<u32> = match (&args.input_ids, &args.prompt_file) {
        (Some(list), _) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .with_context(|| format!("--input-ids: `{s}` is not a token id"))
            })
            .collect::<Result<_>>()?,
        (None, Some(file)) => {
            let text =
                std::fs::read_to_string(file).with_context(|| format!("{}", file.display()))?;
            engine.prompt_ids(&Prompt::Text(text))?
        }
        (None, None) => bail!("give --input-ids or --prompt-file"),
    };
    let positions = match &args.positions {
        Some(spec) => parse_positions(spec)?,
        None => 0..ids.len(),
    };
    if positions.end > ids.len() {
        bail!(
            "--positions {positions:?} is past the {} input tokens",
            ids.len()
        );
    }
    engine.prompt_ids(&Prompt::Tokens(ids.clone()))?; // range-checks the ids
    let logits = engine.logits(&ids, positions)?;
    let device = logits.device().clone();
    let ids = peregrine_engine::tensor::Tensor::new(ids.as_slice(), &device)?;
    let tensors = std::collections::HashMap::from([
        ("logits".to_string(), logits),
        ("input_ids".to_string(), ids),
    ]);
    peregrine_engine::tensor::candle::safetensors::save(&tensors, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
