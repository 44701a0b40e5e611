//! The `Engine`: a loaded model, its tokenizer and chat template, and the scheduler thread
//! that runs requests ([`crate::scheduler`]). `submit` returns a stream of events; dropping the stream cancels the request.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::Instant;

use peregrine_models::audio::{AudioClip, AudioEncoder};
use peregrine_models::vision::{ImageEncoder, ImageInput};
use peregrine_models::{
    CausalLm, KvOptions, LoadOptions, Logits, ReadPool, SequenceCache, open_model,
};
use peregrine_tensor::Tensor;
use tokio::sync::mpsc::unbounded_channel;

use crate::api::{KvRequest, Prompt, Request};
use crate::chat_template::{ChatTemplate, fallback_template};
pub use crate::config::EngineConfig;
use crate::constraint::{Compiler, Constraint, Grammar};
use crate::error::EngineError;
use crate::kv_budget::{default_kv_budget, kv_bytes};
use crate::media::{EncodedImages, ImageSpan};
use crate::prompt_cache::{PromptCache, PromptCacheStats};
use crate::sequence::prefill;
use crate::speculative::{SpeculationCounters, SpeculationStats, SpeculativeConfig};
use crate::stream::ChoiceSink;
pub use crate::stream::EventStream;
use crate::tokenizer::Tokenizer;

pub(crate) struct Job {
    pub request: Request,
    /// The request's KV options, resolved against the engine's.
    pub kv: KvOptions,
    pub ids: Vec<u32>,
    pub submitted: Instant,
    pub choices: Vec<ChoiceSink>,
    /// KV bytes its choices can grow to, and the positions that bound holds.
    pub reserve: usize,
    pub positions: usize,
    /// The prompt's images, encoded, at their runs of image tokens.
    pub images: Vec<ImageSpan>,
    /// `ids` as the prompt cache keys them, image tokens named by their pictures (empty
    /// without images: the ids key the prompt).
    pub cache_key: Vec<u32>,
}

/// What the scheduler thread and the engine's handle share.
pub(crate) struct Shared {
    pub model: Arc<dyn CausalLm>,
    /// The vision tower of a VLM checkpoint.
    pub vision: Option<Arc<dyn ImageEncoder>>,
    /// Pictures encoded lately, by content.
    pub encoded: EncodedImages,
    /// The audio tower of an audio-language checkpoint.
    pub audio: Option<Arc<AudioEncoder>>,
    pub tokenizer: Tokenizer,
    template: ChatTemplate,
    pub prefill_size: usize,
    pub max_context: usize,
    kv: KvOptions,
    /// KV bytes held by every running sequence together.
    pub live_kv: Arc<AtomicUsize>,
    /// KV bytes the running requests may grow to together, and the most they may.
    pub kv_reserved: Arc<AtomicUsize>,
    pub kv_budget: usize,
    pub prompt_cache: PromptCache,
    /// Prefills run, for `/metrics` (the `n` choices of a request share one).
    pub prefills: AtomicU64,
    /// Sequences running (prefilling or decoding) after the last step's admissions.
    pub running: AtomicUsize,
    /// Batched forward passes run, and the sequences they carried.
    pub steps: AtomicU64,
    pub step_rows: AtomicU64,
    pub speculative: Option<SpeculativeConfig>,
    pub spec_counters: SpeculationCounters,
    panic_marker: Option<String>,
    grammars: Compiler,
}

impl Shared {
    /// The speculative settings `request` decodes with: the engine's, unless it opts out or
    /// its output is constrained.
    pub fn speculation_for(&self, request: &Request) -> Option<&SpeculativeConfig> {
        (self.speculative.as_ref()).filter(|_| request.speculative && request.constraint.is_none())
    }

    /// Panics where the test hook says to, standing in for a bug in a forward pass.
    pub fn fault_point(&self, req: &Request, generated: usize) {
        if generated == 1
            && let Some(marker) = self.panic_marker.as_deref()
            && req.prompt.mentions(marker)
        {
            panic!("injected fault: the prompt mentions the panic marker `{marker}`");
        }
    }
}

/// A loaded model ready to serve requests.
pub struct Engine {
    shared: Arc<Shared>,
    jobs: SyncSender<Job>,
    queue_size: usize,
    expert_reads: Option<Arc<ReadPool>>,
}

impl Engine {
    /// Loads a GGUF file or HF checkpoint folder with its tokenizer and chat template.
    pub fn load(path: &Path, config: EngineConfig) -> Result<Self, EngineError> {
        let opts = LoadOptions {
            device: config.device.clone(),
            max_context: config.max_context,
            mlx_activations: config.mlx_activations,
            experts: config.experts,
            progress: config.load_progress.clone(),
            mtp: (config.speculative.as_ref()).is_some_and(|s| s.source.loads_mtp()),
        };
        crate::allocator::tune(opts.experts.stream);
        // The tokenizer first: building a large vocabulary's takes memory for a moment, and
        // that moment should not come on top of the weights.
        let open = open_model(path, &opts)?;
        let available = crate::kv_budget::available_memory().unwrap_or(usize::MAX);
        if open.has_experts() && !opts.experts.stream && open.file_bytes() > available as u64 {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let why = format!(
                "this mixture-of-experts model's files hold {:.1} GiB of weights, more than the \
                 {:.1} GiB of memory available: stream its experts from disk instead \
                 (--stream-experts) to keep only the other weights in memory",
                gib(open.file_bytes()),
                gib(available as u64)
            );
            return Err(peregrine_models::ModelError::config(path, why).into());
        }
        let tokenizer = match open.gguf() {
            Some(gguf) => Tokenizer::from_gguf(gguf.metadata())?,
            None => Tokenizer::from_dir(path)?,
        };
        let loaded = open.load()?;
        let (model, max_context) = (loaded.model, loaded.max_context);
        drop(loaded.gguf);
        crate::allocator::release_freed();
        let vision = crate::media::load_tower(path, &opts.device, (&*model, &tokenizer), &config)?;
        let audio = crate::audio::load(path, &opts.device, (&*model, &tokenizer));
        let mut engine = Self::build(model, (vision, audio), tokenizer, max_context, config)?;
        engine.expert_reads = loaded.expert_reads;
        Ok(engine)
    }

    /// Builds an engine from parts and starts its scheduler thread.
    pub fn new(
        model: Arc<dyn CausalLm>,
        tokenizer: Tokenizer,
        max_context: usize,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::build(model, (None, None), tokenizer, max_context, config)
    }

    fn build(
        model: Arc<dyn CausalLm>,
        (vision, audio): (Option<Arc<dyn ImageEncoder>>, Option<Arc<AudioEncoder>>),
        tokenizer: Tokenizer,
        max_context: usize,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let source = tokenizer.chat_template().unwrap_or_else(|| {
            let (name, source) = fallback_template(&model.config().model_type);
            tracing::warn!("the model has no chat template; using {name}");
            source
        });
        if let Err(message) = config
            .kv
            .check(model.config().head_dim, &model.cache_spec())
        {
            return Err(EngineError::Unsupported {
                param: "kv",
                message,
            });
        }
        let speculative = match config.speculative {
            Some(spec) => Some(crate::speculative::checked(
                spec,
                model.as_ref(),
                &tokenizer,
                (&config.kv, config.experts.stream),
            )?),
            None => None,
        };
        let template = ChatTemplate::new(
            source,
            tokenizer.bos_token().map(str::to_owned),
            tokenizer.eos_token().map(str::to_owned),
        )?;
        let shared = Arc::new(Shared {
            model,
            vision,
            encoded: EncodedImages::default(),
            audio,
            tokenizer,
            template,
            prefill_size: config.prefill_size.max(1),
            max_context,
            kv: config.kv,
            live_kv: Arc::new(AtomicUsize::new(0)),
            kv_reserved: Arc::new(AtomicUsize::new(0)),
            kv_budget: config.kv_budget.unwrap_or_else(default_kv_budget),
            prompt_cache: PromptCache::new(config.prompt_cache_entries, config.prompt_cache_bytes),
            prefills: AtomicU64::new(0),
            running: AtomicUsize::new(0),
            steps: AtomicU64::new(0),
            step_rows: AtomicU64::new(0),
            speculative,
            spec_counters: SpeculationCounters::default(),
            panic_marker: config.panic_marker,
            grammars: Compiler::default(),
        });
        let (jobs, queue) = sync_channel::<Job>(config.queue_size);
        let budget = crate::scheduler::Budget {
            parallel: config.parallel.max(1),
            batch_tokens: config.batch_tokens.max(1),
            prefill_while_decoding: config.prefill_while_decoding.max(1),
            decode_stretch: config.decode_stretch,
        };
        let scheduler = shared.clone();
        std::thread::Builder::new()
            .name("peregrine-scheduler".into())
            .spawn(move || crate::scheduler::run(&scheduler, queue, budget))
            .map_err(|e| EngineError::Model(peregrine_models::ModelError::Tensor(e.into())))?;
        Ok(Self {
            shared,
            jobs,
            queue_size: config.queue_size,
            expert_reads: None,
        })
    }

    /// The reads of streamed experts (`--stream-experts`): what was read, how much of it was
    /// prefetched, and the expert bytes left on disk; `None` when experts are resident.
    pub fn expert_reads(&self) -> Option<&ReadPool> {
        self.expert_reads.as_deref()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.shared.tokenizer
    }

    /// The model.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.shared.model
    }

    /// Compiles `grammar` for [`Request::constraint`]; a grammar or schema that does not
    /// compile is [`EngineError::Grammar`]. The first call builds the token trie.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, EngineError> {
        let s = &self.shared;
        s.grammars.compile(&s.tokenizer, grammar)
    }

    /// The context length in tokens.
    pub fn max_context(&self) -> usize {
        self.shared.max_context
    }

    /// KV bytes the running requests may grow to together (their reservations), and the
    /// budget they share.
    pub fn kv_reserved(&self) -> (usize, usize) {
        let s = &self.shared;
        (s.kv_reserved.load(Ordering::Relaxed), s.kv_budget)
    }

    /// KV-cache bytes held by all running sequences now (0 when idle).
    pub fn kv_bytes_in_use(&self) -> usize {
        self.shared.live_kv.load(Ordering::Relaxed)
    }

    /// Prefills run since the engine started (the choices of one request share one).
    pub fn prefills(&self) -> u64 {
        self.shared.prefills.load(Ordering::Relaxed)
    }

    /// Sequences running now (prefilling or decoding).
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// Batched forward passes run, and the sequences they carried (a lone decode step is
    /// not counted: it runs the allocation-free single-sequence step).
    pub fn batch_steps(&self) -> (u64, u64) {
        let s = &self.shared;
        (
            s.steps.load(Ordering::Relaxed),
            s.step_rows.load(Ordering::Relaxed),
        )
    }

    /// Speculative decoding's counters since the engine started (all 0 when it is off).
    pub fn speculation_stats(&self) -> SpeculationStats {
        self.shared.spec_counters.stats()
    }

    /// The prompt cache's counters and size.
    pub fn prompt_cache_stats(&self) -> PromptCacheStats {
        self.shared.prompt_cache.stats()
    }

    /// Whether requests may carry images (the model loaded with a vision tower).
    pub fn accepts_images(&self) -> bool {
        self.shared.vision.is_some()
    }

    /// Whether requests may carry audio (the model loaded with an audio tower).
    pub fn accepts_audio(&self) -> bool {
        self.shared.audio.is_some()
    }

    /// Pictures run through the vision tower, and pictures whose rows were reused from an
    /// earlier request, since the engine started.
    pub fn image_stats(&self) -> (u64, u64) {
        let e = &self.shared.encoded;
        (
            e.encoded.load(Ordering::Relaxed),
            e.reused.load(Ordering::Relaxed),
        )
    }

    /// Renders and tokenizes a prompt exactly as `submit` will (without images).
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        self.prompt_ids_with(prompt, (&[], &[]))
    }

    /// The prompt ids `submit` runs for `request`: its prompt's, each image's marker
    /// expanded into the image's tokens.
    pub fn request_ids(&self, request: &Request) -> Result<Vec<u32>, EngineError> {
        let images = self.image_inputs(request)?;
        self.prompt_ids_with(&request.prompt, (&images, &request.audio))
    }

    /// `request`'s pictures as the vision tower takes them (none without pictures); refused
    /// without a tower or a chat.
    fn image_inputs(&self, request: &Request) -> Result<Vec<ImageInput>, EngineError> {
        if request.images.is_empty() {
            return Ok(Vec::new());
        }
        match (&self.shared.vision, &request.prompt) {
            (Some(vision), Prompt::Chat { .. }) => {
                crate::media::preprocess(&request.images, vision.as_ref())
            }
            _ => Err(EngineError::Unsupported {
                param: "messages",
                message: "this model takes no image input (it has no vision tower)".into(),
            }),
        }
    }

    /// [`prompt_ids`](Self::prompt_ids) of a chat with `images` and audio `clips`, each
    /// image's marker and clip's token the template writes expanded into its run of tokens.
    fn prompt_ids_with(
        &self,
        prompt: &Prompt,
        (images, clips): (&[ImageInput], &[Arc<AudioClip>]),
    ) -> Result<Vec<u32>, EngineError> {
        let tok = &self.shared.tokenizer;
        let vision = self.shared.vision.as_deref();
        let ids = match prompt {
            Prompt::Text(text) => tok.encode(text, true)?,
            Prompt::Chat {
                messages,
                template_kwargs,
            } => {
                let mut text = self
                    .shared
                    .template
                    .render(messages, true, template_kwargs)?;
                if let (Some(vision), false) = (vision, images.is_empty()) {
                    text = crate::media::expand_markers(&text, images, vision)?;
                }
                text = crate::audio::expand(&text, clips, self.shared.audio.as_deref())?;
                // Templates write BOS themselves, as with HF's apply_chat_template.
                tok.encode(&text, false)?
            }
            Prompt::Tokens(ids) => ids.clone(),
        };
        let vocab_size = self.shared.model.config().vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfRange { id, vocab_size });
        }
        Ok(ids)
    }

    /// A request's `moe_top_k`: at least 1 and at most the experts the model routes to.
    fn check_moe_top_k(&self, k: Option<usize>) -> Result<(), EngineError> {
        let Some(k) = k else {
            return Ok(());
        };
        let refuse = |message: String| EngineError::Unsupported {
            param: "moe_top_k",
            message,
        };
        match &self.shared.model.config().moe {
            None => Err(refuse(
                "this model has no experts to route (moe_top_k)".into(),
            )),
            Some(moe) if !(1..=moe.top_k).contains(&k) => Err(refuse(format!(
                "moe_top_k must be between 1 and the {} experts this model routes each token \
                 to (start the server with --moe-top-k to change that number); got {k}",
                moe.top_k
            ))),
            Some(_) => Ok(()),
        }
    }

    /// The KV options a request's choices make, checked against the model.
    fn request_kv(&self, choices: &KvRequest) -> Result<KvOptions, EngineError> {
        let kv = choices.resolve(&self.shared.kv);
        if kv == self.shared.kv {
            return Ok(kv);
        }
        let param = match (kv.turbo, choices.kv_group_size) {
            (Some(_), _) => "turbo_kv",
            (None, Some(_)) => "kv_group_size",
            (None, None) => "kv_bits",
        };
        let model = &self.shared.model;
        match kv.check(model.config().head_dim, &model.cache_spec()) {
            Ok(()) => Ok(kv),
            Err(message) => Err(EngineError::Unsupported { param, message }),
        }
    }

    /// The KV bytes `choices` choices of `request` (a prompt of `prompt` tokens) can grow to,
    /// and to how many positions. Without `max_tokens`, a request whose context would not fit
    /// the budget gets the positions that do (it ends with `length` there); with it, or when
    /// not even the prompt fits, an error naming the budget. A speculating request's draft
    /// caches count too.
    fn kv_reservation(
        &self,
        request: &Request,
        prompt: usize,
        kv: &KvOptions,
        choices: usize,
    ) -> Result<(usize, usize), EngineError> {
        let s = &self.shared;
        let (config, spec) = (s.model.config(), s.model.cache_spec());
        // A speculating request's draft model keeps a cache per choice too.
        let drafter = s.speculation_for(request);
        let target = s.model.as_ref();
        let draft = |positions| drafter.map_or(0, |d| d.source.kv_bytes(target, kv, positions));
        let bytes =
            |positions| (kv_bytes(config, &spec, kv, positions) + draft(positions)) * choices;
        let wanted = request.max_tokens.map_or(s.max_context, |m| {
            prompt.saturating_add(m).min(s.max_context)
        });
        if bytes(wanted) <= s.kv_budget {
            return Ok((bytes(wanted), wanted));
        }
        let floor = prompt + 1;
        if request.max_tokens.is_some() || bytes(floor) > s.kv_budget {
            let mib = |b: usize| b.div_ceil(1 << 20);
            let (param, need) = match request.max_tokens.is_some() {
                true => ("max_tokens", wanted),
                false => ("prompt", floor),
            };
            let message = format!(
                "{choices} choice(s) of {need} positions ({prompt} prompt tokens) need up to \
                 {} MiB of KV cache; the server's KV budget is {} MiB (--kv-budget-mb)",
                mib(bytes(need)),
                mib(s.kv_budget)
            );
            return Err(EngineError::Unsupported { param, message });
        }
        // The most positions that fit: bytes grow with positions.
        let (mut fits, mut over) = (floor, wanted);
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            match bytes(mid) <= s.kv_budget {
                true => fits = mid,
                false => over = mid,
            }
        }
        Ok((bytes(fits), fits))
    }

    /// Validates and queues a request. Errors found before generation (bad parameters, a
    /// prompt that does not fit, a full queue) are returned here; later ones arrive as events.
    pub fn submit(&self, request: Request) -> Result<EventStream, EngineError> {
        let mut streams = self.submit_choices(request, 1)?;
        Ok(streams.remove(0))
    }

    /// Queues `n` choices of one request (OpenAI's `n`): the prompt is prefilled once, then
    /// each choice samples its own continuation (seeded choices use seed, seed + 1, ...).
    /// Dropping a choice's stream cancels that choice.
    pub fn submit_choices(
        &self,
        request: Request,
        n: usize,
    ) -> Result<Vec<EventStream>, EngineError> {
        request.sampling.validate()?;
        let inputs = self.image_inputs(&request)?;
        let ids = self.prompt_ids_with(&request.prompt, (&inputs, &request.audio))?;
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if ids.len() >= self.shared.max_context {
            return Err(EngineError::ContextLengthExceeded {
                prompt_tokens: ids.len(),
                max_context: self.shared.max_context,
            });
        }
        let kv = self.request_kv(&request.kv)?;
        self.check_moe_top_k(request.moe_top_k)?;
        let (reserve, positions) = self.kv_reservation(&request, ids.len(), &kv, n.max(1))?;
        let mut images = match (&self.shared.vision, request.images.is_empty()) {
            (Some(vision), false) => crate::media::encode(
                &ids,
                (&request.images, &inputs),
                (vision.as_ref(), &self.shared.encoded),
                &self.shared.tokenizer,
            )?,
            _ => Vec::new(),
        };
        let audio = self.shared.audio.as_deref();
        images.extend(crate::audio::encode(
            &ids,
            &request.audio,
            audio,
            &self.shared.tokenizer,
        )?);
        images.sort_by_key(|span| span.start);
        let (choices, streams) = (0..n.max(1))
            .map(|_| {
                let (tx, rx) = unbounded_channel();
                let cancel = Arc::new(AtomicBool::new(false));
                let stream = EventStream {
                    events: rx,
                    cancel: cancel.clone(),
                };
                (ChoiceSink { events: tx, cancel }, stream)
            })
            .unzip();
        let cache_key = crate::media::cache_key(&ids, &images);
        let job = Job {
            kv,
            request,
            ids,
            submitted: Instant::now(),
            choices,
            reserve,
            positions,
            cache_key,
            images,
        };
        match self.jobs.try_send(job) {
            Ok(()) => Ok(streams),
            Err(TrySendError::Full(_)) => Err(EngineError::QueueFull(self.queue_size)),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::ShutDown),
        }
    }

    /// f32 logits `[positions, vocab]` for `positions` of `ids`, computed through the same
    /// chunked prefill as generation (a parity tool).
    pub fn logits(&self, ids: &[u32], positions: Range<usize>) -> Result<Tensor, EngineError> {
        let s = &self.shared;
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if ids.len() > s.max_context {
            return Err(EngineError::ContextLengthExceeded {
                prompt_tokens: ids.len(),
                max_context: s.max_context,
            });
        }
        let mut cache = SequenceCache::new(&s.model.cache_spec(), &s.kv);
        let all = prefill(
            s.model.as_ref(),
            ids,
            &mut cache,
            s.prefill_size,
            Logits::All,
        )?;
        let len = positions.end.min(ids.len()).saturating_sub(positions.start);
        Ok(all
            .narrow(0, positions.start.min(ids.len()), len)
            .map_err(peregrine_models::ModelError::from)?)
    }
}
