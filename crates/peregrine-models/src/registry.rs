//! Maps a checkpoint (GGUF file or HF folder) to its architecture and loads it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use peregrine_moe::ReadPool;
use peregrine_tensor::Device;
use peregrine_tensor::device::compute_dtype;

use crate::arch::gemma4::model::GemmaLm;
use crate::arch::qwen3_next::HybridMixer;
use crate::config::{Fields, read_json_object};
use crate::layers::attention::Attention;
use crate::layers::decoder::DecoderLm;
use crate::layers::mla::Mla;
use crate::weights::{
    GgufFile, LoadProgress, MlxActivations, MlxQuantization, SafetensorsFiles, Source, Weights,
    config_from_gguf,
};
use crate::{CausalLm, ModelConfig, ModelError, Result, arch};

type Configure = fn(&Fields, &mut ModelConfig) -> Result<()>;
type Build = fn(ModelConfig, &Weights, usize) -> Result<Arc<dyn CausalLm>>;

/// The llama-family decoder with multi-head latent attention (DeepSeek-V3).
fn deepseek_v3(c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(DecoderLm::<Mla>::load(c, w, max_context)?))
}

fn decoder(c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(DecoderLm::<Attention>::load(c, w, max_context)?))
}

/// The Gemma decoder (Gemma 2, 3 and 4).
fn gemma(c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(GemmaLm::load(c, w, max_context)?))
}

/// Qwen3-Next and Qwen3.5: delta-net and full-attention layers in one decoder.
fn hybrid(mut c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    arch::qwen3_next::adjust_for_mlx_lm(&mut c, w)?;
    Ok(Arc::new(DecoderLm::<HybridMixer>::load(c, w, max_context)?))
}

/// Falcon-H1: a Mamba 2 mixer beside attention in every layer.
fn falcon_h1(mut c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    arch::falcon_h1::adjust_for_mlx_lm(&mut c, w)?;
    Ok(Arc::new(arch::falcon_h1::FalconH1Lm::load(
        c,
        w,
        max_context,
    )?))
}

/// Jamba: Mamba layers with some attention layers and experts.
fn jamba(c: ModelConfig, w: &Weights, max_context: usize) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(arch::jamba::JambaLm::load(c, w, max_context)?))
}

/// Mamba 2: an attention-free model.
fn mamba2(c: ModelConfig, w: &Weights, _max_context: usize) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(arch::mamba2::Mamba2Lm::load(c, w)?))
}

/// Registered architectures: name (HF `model_type`, also GGUF `general.architecture`), its
/// config adjustments and the model it builds (the llama-family decoder unless it differs).
const ARCHITECTURES: &[(&str, Configure, Build)] = &[
    ("deepseek_v3", arch::deepseek_v3::configure, deepseek_v3),
    ("falcon_h1", arch::falcon_h1::configure, falcon_h1),
    ("gemma2", arch::gemma2::configure, gemma),
    ("gemma3", arch::gemma3::configure, gemma),
    ("gemma4_text", arch::gemma4::configure, gemma),
    ("jamba", arch::jamba::configure, jamba),
    ("llama", arch::llama::configure, decoder),
    ("mamba2", arch::mamba2::configure, mamba2),
    ("mistral", arch::mistral::configure, decoder),
    ("mixtral", arch::mixtral::configure, decoder),
    ("phi3", arch::phi3::configure, decoder),
    ("qwen2", arch::qwen2::configure, decoder),
    ("qwen3", arch::qwen3::configure, decoder),
    ("qwen3_moe", arch::qwen3_moe::configure, decoder),
    ("qwen3_next", arch::qwen3_next::configure, hybrid),
];

/// Names registered under another one: Gemma 3's text-only HF checkpoints are `gemma3_text`
/// (its GGUF architecture is `gemma3`); llama.cpp calls Qwen3-MoE `qwen3moe`, Qwen2(.5)-VL's text
/// model `qwen2vl`, Qwen3-VL's `qwen3vl` / `qwen3vlmoe`, and DeepSeek-V2/V3
/// `deepseek2`; Qwen3.5 (dense and MoE) is Qwen3-Next's decoder with its projections apart;
/// multimodal `gemma4` and `qwen3_5` checkpoints load their text model ([`TEXT_MODELS`]), and
/// SmolVLM's `idefics3` and SmolVLM 2's `smolvlm` their llama, Qwen2-VL, Qwen2.5-VL and
/// Qwen2-Audio their Qwen2, Qwen3-VL its Qwen3, Mistral 3 its Mistral.
const ALIASES: &[(&str, &str)] = &[
    ("deepseek2", "deepseek_v3"),
    ("falcon-h1", "falcon_h1"),
    ("gemma3_text", "gemma3"),
    ("gemma4", "gemma4_text"),
    ("idefics3", "llama"),
    ("mistral3", "mistral"),
    ("qwen2_5_vl", "qwen2"),
    ("qwen2_5_vl_text", "qwen2"),
    ("qwen2_audio", "qwen2"),
    ("qwen2_vl", "qwen2"),
    ("qwen2_vl_text", "qwen2"),
    ("qwen2vl", "qwen2"),
    ("qwen3_5", "qwen3_next"),
    ("qwen3_5_moe", "qwen3_next"),
    ("qwen3_5_moe_text", "qwen3_next"),
    ("qwen3_5_text", "qwen3_next"),
    ("qwen3_vl", "qwen3"),
    ("qwen3_vl_text", "qwen3"),
    ("qwen35", "qwen3_next"),
    ("qwen35moe", "qwen3_next"),
    ("qwen3next", "qwen3_next"),
    ("qwen3moe", "qwen3_moe"),
    ("qwen3vl", "qwen3"),
    ("qwen3vlmoe", "qwen3_moe"),
    ("smolvlm", "llama"),
];

/// Multimodal checkpoints whose text model loads on its own: the `text_config` is read and the
/// language model's tensors are found under these prefixes (HF's, then MLX's) as `model.…`;
/// the vision and audio towers are skipped.
const TEXT_MODELS: &[(&str, &[(&str, &str)])] = &[
    ("gemma3", LANGUAGE_MODEL),
    ("gemma4", LANGUAGE_MODEL),
    ("idefics3", TEXT_MODEL),
    ("mistral3", LANGUAGE_MODEL),
    ("qwen2_5_vl", LANGUAGE_MODEL),
    ("qwen2_audio", LANGUAGE_MODEL),
    ("qwen2_vl", LANGUAGE_MODEL),
    ("qwen3_5", LANGUAGE_MODEL),
    ("qwen3_5_moe", LANGUAGE_MODEL),
    ("qwen3_vl", LANGUAGE_MODEL),
    ("smolvlm", TEXT_MODEL),
];

/// Where Idefics3 (SmolVLM, SmolVLM 2) keeps its language model (HF's, then mlx-vlm's).
const TEXT_MODEL: &[(&str, &str)] = &[
    ("model.text_model.", "model."),
    ("language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// Where HF and MLX keep a multimodal checkpoint's language model.
const LANGUAGE_MODEL: &[(&str, &str)] = &[
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// The architecture names this build can load (GGUF `general.architecture`, HF `model_type`;
/// HF `gemma3_text` loads as `gemma3`).
pub fn supported_architectures() -> Vec<&'static str> {
    ARCHITECTURES.iter().map(|(name, ..)| *name).collect()
}

fn find_architecture(name: &str) -> Option<&'static (&'static str, Configure, Build)> {
    let name = ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map_or(name, |(_, target)| target);
    ARCHITECTURES.iter().find(|(n, ..)| *n == name)
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where the weights go.
    pub device: Device,
    /// Longest context to prepare for (RoPE tables); defaults to the model's trained length.
    pub max_context: Option<usize>,
    /// How MLX 4-bit matrices are multiplied (8-bit activations unless asked otherwise).
    pub mlx_activations: MlxActivations,
    /// Mixture-of-experts settings: streaming from disk, the routed top-k.
    pub experts: ExpertOptions,
    /// Where the bytes read are counted, for a progress display.
    pub progress: Option<Arc<LoadProgress>>,
    /// Also load the multi-token-prediction layers the checkpoint carries
    /// ([`ModelConfig::mtp_layers`]), which speculative decoding drafts with; off, they are
    /// not read (they can be large: DeepSeek-V3's is a whole MoE layer).
    pub mtp: bool,
}

/// How a mixture-of-experts model's experts are held and routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertOptions {
    /// Read the experts from the files on each use instead of loading them (models larger
    /// than memory); refused for a model without experts.
    pub stream: bool,
    /// Expert reads in flight at most when streaming.
    pub queue_depth: usize,
    /// When streaming, also start reading each MoE layer's experts on a guess made one layer
    /// earlier (its router applied to that layer's input).
    pub speculate: bool,
    /// When streaming, bytes of recently used experts kept in memory (the resident hot set),
    /// shared equally by the MoE layers; 0 keeps none.
    pub cache_bytes: usize,
    /// When streaming, bytes of recently used experts kept mapped where they multiply the
    /// file's pages in place (GGUF Q4_0/Q4_1/Q8_0/Q4_K on x86): no copy, the page cache's own
    /// pages, counted in the process's resident set; 0 maps each in and out on every use.
    pub mapped_bytes: usize,
    /// Experts each token is routed to, instead of the model's own `top_k` (fewer is faster
    /// and reads less when streaming, at a cost in quality); refused for a model without
    /// experts or above its expert count.
    pub top_k: Option<usize>,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        Self {
            stream: false,
            queue_depth: 24,
            speculate: false,
            cache_bytes: 0,
            mapped_bytes: 256 << 20,
            top_k: None,
        }
    }
}

impl ExpertOptions {
    /// Applies the top-k to `config` and, when streaming, makes the pool the experts are read
    /// on; refuses settings that `config` (read from `path`) cannot take.
    fn apply(&self, config: &mut ModelConfig, path: &Path) -> Result<Option<Arc<ReadPool>>> {
        let no_experts = |asked: String| {
            let why = format!(
                "{asked}, but this `{}` model has no expert layers (its config names no \
                 `num_experts`, `num_local_experts` or `n_routed_experts`, its GGUF no \
                 `expert_count`)",
                config.model_type
            );
            ModelError::config(path, why)
        };
        if let Some(k) = self.top_k {
            let Some(moe) = config.moe.as_mut() else {
                return Err(no_experts(format!("a top-k of {k} experts was asked for")));
            };
            if k == 0 || k > moe.num_experts {
                let why = format!(
                    "a top-k of {k} experts was asked for; this model has {} (routes to {})",
                    moe.num_experts, moe.top_k
                );
                return Err(ModelError::config(path, why));
            }
            moe.top_k = k;
        }
        if !self.stream {
            return Ok(None);
        }
        if config.moe.is_none() {
            return Err(no_experts("streamed experts were asked for".into()));
        }
        let pool = ReadPool::configured(
            self.queue_depth,
            self.speculate,
            self.cache_bytes,
            self.mapped_bytes,
        );
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        Ok(Some(pool.map_err(io)?))
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            max_context: None,
            mlx_activations: MlxActivations::default(),
            experts: ExpertOptions::default(),
            progress: None,
            mtp: false,
        }
    }
}

/// A loaded model and what else its checkpoint carries.
pub struct LoadedModel {
    /// The model.
    pub model: Arc<dyn CausalLm>,
    /// The GGUF file or checkpoint folder it came from.
    pub path: PathBuf,
    /// The GGUF file (metadata carries the tokenizer and chat template), if loaded from GGUF
    /// and the model does not keep it open (streamed experts read from it).
    pub gguf: Option<GgufFile>,
    /// Context length the model was prepared for.
    pub max_context: usize,
    /// Where its MoE layers read their experts, when they stream them (what was read, and
    /// the expert bytes left on disk).
    pub expert_reads: Option<Arc<ReadPool>>,
}

fn unsupported(file: &Path, arch: &str) -> ModelError {
    ModelError::UnsupportedArchitecture {
        file: file.to_path_buf(),
        arch: arch.to_string(),
        supported: supported_architectures().join(", "),
    }
}

fn find_gguf(dir: &Path) -> Option<PathBuf> {
    let mut ggufs = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"));
    let first = ggufs.next()?;
    ggufs.next().is_none().then_some(first)
}

/// Loads a GGUF file, or an HF checkpoint folder (`config.json` + safetensors).
pub fn load_model(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    open_model(path, opts)?.load()
}

/// A checkpoint whose config is read and whose files are open, weights not loaded yet.
pub struct OpenModel {
    config: ModelConfig,
    weights: Weights,
    build: Build,
    path: PathBuf,
    max_context: usize,
}

impl OpenModel {
    /// The GGUF file, when the checkpoint is one (its metadata carries the tokenizer).
    pub fn gguf(&self) -> Option<&GgufFile> {
        match self.weights.source() {
            Source::Gguf(file) => Some(file),
            Source::Safetensors(_) => None,
        }
    }

    /// Whether the model has mixture-of-experts layers (whose experts can be streamed).
    pub fn has_experts(&self) -> bool {
        self.config.moe.is_some()
    }

    /// Bytes of the checkpoint's weight files: at least what a resident load holds.
    pub fn file_bytes(&self) -> u64 {
        self.weights.file_bytes()
    }

    /// Loads the weights and builds the model.
    pub fn load(self) -> Result<LoadedModel> {
        let model = (self.build)(self.config, &self.weights, self.max_context)?;
        let expert_reads = self.weights.expert_reads().cloned();
        let gguf = match Arc::try_unwrap(self.weights.into_source()) {
            Ok(Source::Gguf(file)) => Some(file),
            _ => None,
        };
        Ok(LoadedModel {
            model,
            path: self.path,
            gguf,
            max_context: self.max_context,
            expert_reads,
        })
    }
}

/// Opens a GGUF file or HF checkpoint folder: config and file headers read, weights not yet
/// (so a caller can build the tokenizer first, while little memory is in use).
pub fn open_model(path: &Path, opts: &LoadOptions) -> Result<OpenModel> {
    let meta = std::fs::metadata(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let dtype = compute_dtype(&opts.device);
    if meta.is_dir() && !path.join("config.json").exists() {
        match find_gguf(path) {
            Some(gguf) => return open_model(&gguf, opts),
            None => {
                let source = std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no config.json (nor a single .gguf file) in this folder",
                );
                return Err(ModelError::Io {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    let (config, weights, build) = if meta.is_dir() {
        let config_path = path.join("config.json");
        let mut map = read_json_object(&config_path)?;
        let model_type = Fields::new(&config_path, &map)
            .opt_str("model_type")?
            .ok_or_else(|| ModelError::config(&config_path, "missing required field `model_type`"))?
            .to_string();
        if model_type == "mamba2" {
            map = arch::mamba2::shared_keys(&map);
        }
        let fields = Fields::new(&config_path, &map);
        let model_type = model_type.as_str();
        let (_, configure, build) =
            find_architecture(model_type).ok_or_else(|| unsupported(&config_path, model_type))?;
        let text_model = TEXT_MODELS.iter().find(|(name, _)| *name == model_type);
        let text = match text_model {
            Some(_) => fields.object("text_config")?,
            None => None,
        };
        // transformers 5 keeps a multimodal model's `tie_word_embeddings` at the top level.
        let top_tie = fields.opt_bool("tie_word_embeddings")?;
        let (fields, prefixes) = match (text, text_model) {
            (Some(text), Some((_, prefixes))) => {
                tracing::info!(
                    "{model_type}: loading the text model from `text_config`; the vision and \
                     audio towers are skipped"
                );
                (text, *prefixes)
            }
            // A flat config under the multimodal type (mlx-lm's Qwen3.5 conversions): the
            // language model's tensors are still under its prefixes.
            (None, Some((_, prefixes))) => (fields, *prefixes),
            _ => (fields, &[][..]),
        };
        if fields.get("text_config").is_some() {
            return Err(ModelError::config(
                &config_path,
                format!(
                    "field `text_config`: `{model_type}` checkpoints with a vision tower are not \
                     supported yet; load the text-only model (e.g. `gemma3_text`) or a GGUF file"
                ),
            ));
        }
        let mut config = ModelConfig::from_hf(&fields)?;
        if let Some(tie) = top_tie.filter(|_| fields.get("tie_word_embeddings").is_none()) {
            config.tie_word_embeddings = tie;
        }
        configure(&fields, &mut config)?;
        let mut files = SafetensorsFiles::open_dir(path)?;
        for (from, to) in prefixes {
            files.alias_prefix(from, to);
        }
        if let Some(progress) = &opts.progress {
            files.count_reads_in(progress.clone());
        }
        // MLX checkpoints: quantized modules are found per tensor by their `.scales`.
        let mut mlx = MlxQuantization::from_config(&config_path, &map)?;
        for (from, to) in prefixes {
            mlx.iter_mut().for_each(|q| q.alias_prefix(from, to));
        }
        let weights = Weights::new(Source::Safetensors(files), opts.device.clone(), dtype);
        (config, weights.with_mlx(mlx, opts.mlx_activations), *build)
    } else {
        let mut file = GgufFile::open(path)?;
        if let Some(progress) = &opts.progress {
            file.count_reads_in(progress.clone());
        }
        let config = config_from_gguf(&file)?;
        let (_, _, build) = find_architecture(&config.model_type)
            .ok_or_else(|| unsupported(path, &config.model_type))?;
        let weights = Weights::new(Source::Gguf(file), opts.device.clone(), dtype);
        (config, weights, *build)
    };
    let mut config = config;
    if !opts.mtp {
        config.mtp_layers = 0;
    }
    let pool = opts.experts.apply(&mut config, path)?;
    let weights = weights.with_streamed_experts(pool);
    Ok(OpenModel {
        max_context: opts.max_context.unwrap_or(config.max_position_embeddings),
        config,
        weights,
        build,
        path: path.to_path_buf(),
    })
}
