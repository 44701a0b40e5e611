//! Mamba 2 (`mamba2`): a pure state-space model, no attention.
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/mamba2/modeling_mamba2.py>
//!
//! Each block is `x + mixer(rms_norm(x))` with the [`Mamba2Mixer`] (gate, then norm). Tensors
//! are under `backbone.`; the embedding is tied unless `lm_head.weight` exists.

use serde_json::{Map, Value};

use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Device, Embedding, QLinear, Tensor};

use crate::config::Fields;
use crate::layers::batch::{BatchSeq, Segment, batch_logits, check_batch, run_layers, stacked_ids};
use crate::layers::ssm::{Mamba2Mixer, SsmConfig};
use crate::weights::Weights;
use crate::weights::gguf_config::GgufMeta;
use crate::{CausalLm, LayerKind, Logits, ModelConfig, ModelError, Result, SequenceCache};

/// `config.json` of a Mamba 2 checkpoint with the llama-family keys the shared parser wants:
/// its SSM heads as `num_attention_heads` (they have no attention), `expand · hidden` as
/// `intermediate_size`, `layer_norm_epsilon` as `rms_norm_eps`.
pub fn shared_keys(map: &Map<String, Value>) -> Map<String, Value> {
    let mut map = map.clone();
    let hidden = map.get("hidden_size").and_then(Value::as_u64).unwrap_or(0);
    let expand = map.get("expand").and_then(Value::as_u64).unwrap_or(2);
    let rename = [
        ("num_heads", "num_attention_heads"),
        ("layer_norm_epsilon", "rms_norm_eps"),
    ];
    for (from, to) in rename {
        if let Some(v) = map.get(from).cloned() {
            map.entry(to).or_insert(v);
        }
    }
    map.entry("intermediate_size")
        .or_insert((expand * hidden).into());
    map
}

/// Reads the SSM fields.
pub fn configure(fields: &Fields, config: &mut ModelConfig) -> Result<()> {
    if let Some(act) = fields.opt_str("hidden_act")?.filter(|a| *a != "silu") {
        return Err(fields.err(format!("mamba2 with `hidden_act` `{act}`: only `silu`")));
    }
    let ssm = SsmConfig {
        heads: fields.usize("num_heads")?,
        head_dim: fields.usize("head_dim")?,
        state_size: fields.usize("state_size")?,
        groups: fields.opt_usize("n_groups")?.unwrap_or(1),
        conv_kernel: fields.opt_usize("conv_kernel")?.unwrap_or(4),
        bias: fields.opt_bool("use_bias")?.unwrap_or(false),
        out_bias: fields.opt_bool("use_bias")?.unwrap_or(false),
        conv_bias: fields.opt_bool("use_conv_bias")?.unwrap_or(true),
        gated_norm: true,
        norm_before_gate: false,
        multipliers: [1.0; 5],
    };
    if ssm.inner() != config.intermediate_size {
        return Err(fields.err(format!(
            "`num_heads` {} × `head_dim` {} must equal `expand` × `hidden_size` ({})",
            ssm.heads, ssm.head_dim, config.intermediate_size
        )));
    }
    if ssm.groups == 0 || !ssm.heads.is_multiple_of(ssm.groups) || ssm.conv_kernel < 2 {
        return Err(fields.err(format!(
            "`n_groups` {} must divide `num_heads` {}, and `conv_kernel` {} be at least 2",
            ssm.groups, ssm.heads, ssm.conv_kernel
        )));
    }
    config.ssm = Some(ssm);
    Ok(())
}

/// A `mamba2` (or `falcon-h1`) GGUF file's SSM sizes (llama.cpp's converter writes `ssm.*`;
/// heads are `ssm.time_step_rank`, the norm groups `ssm.group_count`; the norm, when the file
/// has one, follows the gate, as llama.cpp runs it).
pub(crate) fn configure_gguf(meta: &GgufMeta, config: &mut ModelConfig) -> Result<()> {
    let (inner, heads) = (
        meta.usize("ssm.inner_size")?,
        meta.usize("ssm.time_step_rank")?,
    );
    let groups = meta.opt_usize("ssm.group_count")?.unwrap_or(1);
    if heads == 0 || !inner.is_multiple_of(heads) || groups == 0 || !heads.is_multiple_of(groups) {
        let what = "must divide ssm.inner_size, and ssm.group_count divide it";
        return Err(meta.err("ssm.time_step_rank", what));
    }
    let file = meta.file;
    if meta.usize("ssm.conv_kernel")? < 2 {
        return Err(meta.err("ssm.conv_kernel", "must be at least 2"));
    }
    config.ssm = Some(SsmConfig {
        heads,
        head_dim: inner / heads,
        state_size: meta.usize("ssm.state_size")?,
        groups,
        conv_kernel: meta.usize("ssm.conv_kernel")?,
        bias: file.has_tensor("blk.0.ssm_in.bias"),
        out_bias: file.has_tensor("blk.0.ssm_out.bias"),
        conv_bias: file.has_tensor("blk.0.ssm_conv1d.bias"),
        gated_norm: file.has_tensor("blk.0.ssm_norm.weight"),
        norm_before_gate: false,
        multipliers: [1.0; 5],
    });
    if config.model_type == "mamba2" {
        config.intermediate_size = inner;
    }
    Ok(())
}

/// One block: its input norm and mixer.
struct Block {
    norm: Tensor,
    mixer: Mamba2Mixer,
}

/// The Mamba 2 language model.
pub struct Mamba2Lm {
    config: ModelConfig,
    ssm: SsmConfig,
    embed: Embedding,
    layers: Vec<Block>,
    norm_f: Tensor,
    lm_head: QLinear,
    untied_head: bool,
    device: Device,
    dtype: DType,
}

impl Mamba2Lm {
    /// Loads `backbone.*` (and `lm_head` when untied).
    pub fn load(config: ModelConfig, w: &Weights) -> Result<Self> {
        let ssm = config.ssm.ok_or_else(|| {
            ModelError::config(w.path(), "mamba2 without its SSM fields".to_string())
        })?;
        let (h, eps) = (config.hidden_size, config.rms_norm_eps as f32);
        let layers = (0..config.num_hidden_layers)
            .map(|i| -> Result<Block> {
                let p = format!("backbone.layers.{i}");
                Ok(Block {
                    norm: w.tensor(&format!("{p}.norm.weight"), &[h])?,
                    mixer: Mamba2Mixer::load(ssm, w, &format!("{p}.mixer"), h, eps)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = w.embedding("backbone.embeddings.weight", config.vocab_size, h)?;
        let untied_head = w.contains("lm_head.weight");
        let lm_head = match untied_head {
            true => w.linear("lm_head", config.vocab_size, h, false)?,
            false => embed.as_linear()?,
        };
        Ok(Self {
            norm_f: w.tensor("backbone.norm_f.weight", &[h])?,
            ssm,
            embed,
            layers,
            lm_head,
            untied_head,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
        })
    }

    /// The last block's output `[1, rows, hidden]` for the stacked new tokens of `batch`.
    fn hidden(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        check_batch(batch, usize::MAX)?;
        let ids = Tensor::new(stacked_ids(batch), &self.device)?.unsqueeze(0)?;
        let x = self.embed.forward(&ids, self.dtype)?;
        run_layers(
            batch,
            x,
            self.layers.len(),
            |i| i,
            |i, x, segments| self.block(&self.layers[i], x, segments),
        )
    }

    fn block(&self, b: &Block, x: &Tensor, segments: &mut [Segment]) -> Result<Tensor> {
        let normed = rms_norm(x, &b.norm, self.config.rms_norm_eps as f32)?;
        Ok((x + b.mixer.forward(&normed, segments)?)?)
    }
}

impl CausalLm for Mamba2Lm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        let state = self.ssm.state_len();
        vec![LayerKind::Recurrent { state }; self.layers.len()]
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(&mut [BatchSeq::last(tokens, cache)])?;
        crate::layers::output_logits(&x, want, &self.norm_f, eps, &self.lm_head)
    }

    fn forward_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps as f32;
        let x = self.hidden(batch)?;
        batch_logits(&x, batch, &self.norm_f, eps, &self.lm_head)
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let linears = self.layers.iter().map(|b| b.mixer.weight_bytes());
        // A tied head is the embedding table, already counted.
        let head = match self.untied_head {
            true => self.lm_head.weight_bytes(),
            false => 0,
        };
        linears.sum::<usize>() + self.embed.weight_bytes() + head
    }
}
