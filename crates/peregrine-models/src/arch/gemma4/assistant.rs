//! Gemma 4's assistant (`gemma4_assistant`), the drafter Google ships beside Gemma 4 models:
//! a small Gemma 4 text decoder whose layers project only queries and read the target's keys
//! and values (its last sliding and last full-attention layers'), always at the position of
//! the token after the target's last. Each step joins the target's input embedding of the
//! last token with a hidden state (the target's final one, then the assistant's own projected
//! back, `post_projection`), projects the pair in (`pre_projection`) and runs the layers; the
//! logits come from the tied head, or, with `use_ordered_embeddings`, only for the tokens of
//! the `centroid_intermediate_top_k` best of `num_centroids` token clusters (the rest just
//! below the smallest of those). As transformers' `Gemma4AssistantForCausalLM` and its
//! drafting loop (`SinglePositionMultiTokenCandidateGenerator`) run it:
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/gemma4_assistant/modeling_gemma4_assistant.py>

use std::path::{Path, PathBuf};

use serde_json::Value;

use peregrine_kv::SequenceCache;
use peregrine_tensor::device::compute_dtype;
use peregrine_tensor::{DType, QLinear, Tensor};

use super::model::GemmaLm;
use crate::config::{Fields, read_json_object};
use crate::weights::{SafetensorsFiles, Source, Weights};
use crate::{CausalLm, LoadOptions, ModelConfig, ModelError, Result};

/// The clusters of the ordered-embeddings head: logits only for the tokens of the best few.
struct ClusterHead {
    centroids: QLinear,
    /// Token ids, cluster after cluster (`token_ordering`).
    ordering: Vec<u32>,
    top_k: usize,
}

/// A loaded Gemma 4 assistant.
pub struct Gemma4Assistant {
    lm: GemmaLm,
    pre_projection: QLinear,
    post_projection: QLinear,
    clusters: Option<ClusterHead>,
    backbone: usize,
    path: PathBuf,
}

impl Gemma4Assistant {
    /// Whether `path` is a Gemma 4 assistant checkpoint (its `config.json` says so).
    pub fn is_assistant(path: &Path) -> bool {
        let config = read_json_object(&path.join("config.json"));
        config.is_ok_and(|c| c.get("model_type") == Some(&Value::from("gemma4_assistant")))
    }

    /// Loads the assistant checkpoint at `path` (a folder) on `opts.device`.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        let config_path = path.join("config.json");
        let map = read_json_object(&config_path)?;
        let fields = Fields::new(&config_path, &map);
        let text = fields.object("text_config")?.ok_or_else(|| {
            ModelError::config(&config_path, "missing `text_config` (a gemma4_text config)")
        })?;
        // Every layer reads the target's keys and values; the decoder loads them as its own
        // query-only layers (`load_with(.., shared)`), so none is marked shared here.
        let mut text_map = text.map().clone();
        text_map.insert("num_kv_shared_layers".into(), Value::from(0));
        let text = Fields::new(&config_path, &text_map);
        let mut config = ModelConfig::from_hf(&text)?;
        super::configure(&text, &mut config)?;
        if config.per_layer_input.is_some() || config.moe.is_some() {
            return Err(ModelError::config(
                &config_path,
                "an assistant's `text_config` has no per-layer inputs and no MoE block",
            ));
        }
        let backbone = fields.usize("backbone_hidden_size")?;
        let dtype = compute_dtype(&opts.device);
        let files = SafetensorsFiles::open_dir(path)?;
        let w = Weights::new(Source::Safetensors(files), opts.device.clone(), dtype);
        let max_context = opts.max_context.unwrap_or(config.max_position_embeddings);
        let (h, vocab) = (config.hidden_size, config.vocab_size);
        let clusters = match fields.opt_bool("use_ordered_embeddings")?.unwrap_or(false) {
            true => Some(ClusterHead::load(&fields, &w, h, vocab)?),
            false => None,
        };
        Ok(Self {
            pre_projection: w.linear("pre_projection", h, 2 * backbone, false)?,
            post_projection: w.linear("post_projection", backbone, h, false)?,
            lm: GemmaLm::load_with(config, &w, max_context, true)?,
            clusters,
            backbone,
            path: path.to_path_buf(),
        })
    }

    /// Fails unless the assistant can draft for `target`: a Gemma 4 model of its backbone
    /// width and vocabulary whose keys and values have the assistant's head shapes.
    pub fn check(&self, target: &dyn CausalLm) -> Result<()> {
        let (a, t) = (self.lm.config(), target.config());
        let why = if target.shared_kv().is_none() || !t.model_type.starts_with("gemma4") {
            format!(
                "a Gemma 4 assistant drafts for Gemma 4 models, not {}",
                t.model_type
            )
        } else if t.hidden_size != self.backbone || t.vocab_size != a.vocab_size {
            format!(
                "the assistant was made for a model of width {} and {} tokens; this one has \
                 {} and {}",
                self.backbone, a.vocab_size, t.hidden_size, t.vocab_size
            )
        } else if (t.num_key_value_heads, t.head_dim) != (a.num_key_value_heads, a.head_dim) {
            format!(
                "the assistant reads {} key/value heads of {}; this model has {} of {}",
                a.num_key_value_heads, a.head_dim, t.num_key_value_heads, t.head_dim
            )
        } else {
            return Ok(());
        };
        Err(ModelError::config(&self.path, why))
    }

    /// One drafting step for the sequence in `cache` (`target`'s): joins `hidden` with
    /// `token`'s input embedding at the position after the cache's last, writes the next
    /// token's f32 logits and the hidden state the next step joins.
    pub fn step(
        &self,
        target: &dyn CausalLm,
        cache: &mut SequenceCache,
        (hidden, token): (&[f32], u32),
        (logits, out): (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        let kv = target.shared_kv().ok_or_else(|| {
            ModelError::config(&self.path, "the target model shares no keys and values")
        })?;
        let embedded = target.input_embedding(token)?;
        let h = Tensor::from_slice(hidden, (1, 1, hidden.len()), embedded.device())?;
        let joined = Tensor::cat(&[&embedded, &h.to_dtype(embedded.dtype())?], 2)?;
        let x = self.pre_projection.forward(&joined)?;
        let pos = cache.len();
        let y = self.lm.run_shared(&x, cache, pos, kv)?;
        let f32_row = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        };
        *out = f32_row(&self.post_projection.forward(&y)?)?;
        *logits = f32_row(&self.lm.lm_head().forward(&y)?)?;
        if let Some(clusters) = &self.clusters {
            clusters.mask(&y, logits)?;
        }
        Ok(())
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        let projections = self.pre_projection.weight_bytes() + self.post_projection.weight_bytes();
        let clusters = self
            .clusters
            .as_ref()
            .map_or(0, |c| c.centroids.weight_bytes());
        self.lm.weight_bytes() + projections + clusters
    }
}

impl ClusterHead {
    fn load(fields: &Fields, w: &Weights, hidden: usize, vocab: usize) -> Result<Self> {
        let n = fields.usize("num_centroids")?;
        let top_k = fields.usize("centroid_intermediate_top_k")?;
        if n == 0 || !vocab.is_multiple_of(n) || top_k == 0 || top_k > n {
            return Err(fields.err(format!(
                "`num_centroids` {n} must divide the {vocab} tokens and hold \
                 `centroid_intermediate_top_k` {top_k}"
            )));
        }
        let name = "masked_embedding.token_ordering";
        let ordering = w.tensor(name, &[vocab])?.to_dtype(DType::F32)?;
        let ordering: Vec<u32> = (ordering.to_vec1::<f32>()?.iter())
            .map(|&t| t as u32)
            .collect();
        if ordering.iter().any(|&t| t as usize >= vocab) {
            return Err(fields.err(format!("`{name}` holds ids outside the vocabulary")));
        }
        Ok(Self {
            centroids: w.linear("masked_embedding.centroids", n, hidden, false)?,
            ordering,
            top_k,
        })
    }

    /// Keeps `logits` of the tokens in the `top_k` clusters whose centroids score best for
    /// `y`; every other token gets the smallest kept logit less 1.
    fn mask(&self, y: &Tensor, logits: &mut [f32]) -> Result<()> {
        let scores = self
            .centroids
            .forward(y)?
            .flatten_all()?
            .to_dtype(DType::F32)?;
        let scores = scores.to_vec1::<f32>()?;
        let mut best: Vec<usize> = (0..scores.len()).collect();
        best.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let per = self.ordering.len() / scores.len();
        let kept: Vec<u32> = (best[..self.top_k].iter())
            .flat_map(|&c| self.ordering[c * per..(c + 1) * per].iter().copied())
            .collect();
        let floor = kept
            .iter()
            .map(|&t| logits[t as usize])
            .fold(f32::INFINITY, f32::min)
            - 1.0;
        let values: Vec<f32> = kept.iter().map(|&t| logits[t as usize]).collect();
        logits.iter_mut().for_each(|l| *l = floor);
        kept.iter()
            .zip(values)
            .for_each(|(&t, v)| logits[t as usize] = v);
        Ok(())
    }
}
