//! The SigLIP vision transformer (`siglip_vision_model`), Gemma 3's vision tower:
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/siglip/modeling_siglip.py>
//!
//! Non-overlapping patches embedded by a strided convolution (run here as one matmul over the
//! flattened patches) plus learned absolute positions, pre-norm encoder layers (LayerNorm with
//! bias, bidirectional multi-head attention with biased projections, a GELU-tanh MLP) and a final
//! LayerNorm. No pooling head: the VLMs read the last hidden state.

use peregrine_tensor::{D, DType, QLinear, Tensor};

use crate::Result;
use crate::config::Fields;
use crate::weights::Weights;

/// The tower's shape, from a `vision_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct SiglipConfig {
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Side of the square input image in pixels.
    pub image_size: usize,
    /// Side of a patch in pixels.
    pub patch_size: usize,
    /// LayerNorm epsilon.
    pub eps: f64,
}

impl SiglipConfig {
    /// Reads a `vision_config` (HF's `SiglipVisionConfig` defaults where a key is absent).
    pub fn from_fields(f: &Fields) -> Result<Self> {
        let act = f.opt_str("hidden_act")?.unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(f.err(format!(
                "field `vision_config.hidden_act` `{act}` is not supported (only `gelu_pytorch_tanh`)"
            )));
        }
        if f.opt_usize("num_channels")?.is_some_and(|c| c != 3) {
            return Err(
                f.err("field `vision_config.num_channels`: only 3 (RGB) is supported".into())
            );
        }
        let c = Self {
            hidden_size: f.opt_usize("hidden_size")?.unwrap_or(768),
            intermediate_size: f.opt_usize("intermediate_size")?.unwrap_or(3072),
            layers: f.opt_usize("num_hidden_layers")?.unwrap_or(12),
            heads: f.opt_usize("num_attention_heads")?.unwrap_or(12),
            image_size: f.opt_usize("image_size")?.unwrap_or(224),
            patch_size: f.opt_usize("patch_size")?.unwrap_or(16),
            eps: f.opt_f64("layer_norm_eps")?.unwrap_or(1e-6),
        };
        let bad = |what: &str| Err(f.err(format!("vision_config: {what}")));
        if c.patch_size == 0 || !c.image_size.is_multiple_of(c.patch_size) {
            return bad("`image_size` must be a multiple of `patch_size`");
        }
        if c.heads == 0 || !c.hidden_size.is_multiple_of(c.heads) {
            return bad("`hidden_size` must be a multiple of `num_attention_heads`");
        }
        Ok(c)
    }

    /// Patches along one side of the image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// A LayerNorm with weight and bias.
pub(crate) struct LayerNorm {
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub(crate) fn load(w: &Weights, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            w: w.tensor(&format!("{prefix}.weight"), &[dim])?,
            b: w.tensor(&format!("{prefix}.bias"), &[dim])?,
            eps,
        })
    }

    /// Normalises the last dimension in f32 (as torch's LayerNorm accumulates) and returns
    /// `x`'s dtype.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let w = self.w.to_dtype(DType::F32)?;
        let b = self.b.to_dtype(DType::F32)?;
        Ok(normed
            .broadcast_mul(&w)?
            .broadcast_add(&b)?
            .to_dtype(dtype)?)
    }
}

/// Where a pre-norm encoder layer keeps its tensors and which GELU its MLP takes: SigLIP's
/// layers and Whisper's (Qwen2-Audio's tower) differ only in these.
pub(crate) struct LayerStyle {
    /// The norms before attention and before the MLP, and the MLP's two linears.
    pub names: [&'static str; 4],
    /// The key projection has a bias.
    pub key_bias: bool,
    /// The exact (erf) GELU rather than the tanh approximation.
    pub exact_gelu: bool,
    /// LayerNorm epsilon.
    pub eps: f64,
}

/// SigLIP's tensor names (its key projection has a bias, its GELU is the tanh one).
const SIGLIP: [&str; 4] = ["layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"];

/// A pre-norm transformer encoder layer: LayerNorm, bidirectional multi-head attention with
/// biased projections, LayerNorm, a two-layer GELU MLP, each added to the residual.
pub(crate) struct EncoderLayer {
    norm1: LayerNorm,
    q: QLinear,
    k: QLinear,
    v: QLinear,
    out: QLinear,
    norm2: LayerNorm,
    fc1: QLinear,
    fc2: QLinear,
    exact_gelu: bool,
}

impl EncoderLayer {
    /// The layer `p` of width `h` and MLP width `i`, named and computed as `style` says.
    pub(crate) fn load(
        w: &Weights,
        p: &str,
        (h, i): (usize, usize),
        style: &LayerStyle,
    ) -> Result<Self> {
        let lin = |name: &str, out, inp, bias| w.linear(&format!("{p}.{name}"), out, inp, bias);
        let [norm1, norm2, fc1, fc2] = style.names;
        Ok(Self {
            norm1: LayerNorm::load(w, &format!("{p}.{norm1}"), h, style.eps)?,
            q: lin("self_attn.q_proj", h, h, true)?,
            k: lin("self_attn.k_proj", h, h, style.key_bias)?,
            v: lin("self_attn.v_proj", h, h, true)?,
            out: lin("self_attn.out_proj", h, h, true)?,
            norm2: LayerNorm::load(w, &format!("{p}.{norm2}"), h, style.eps)?,
            fc1: lin(fc1, i, h, true)?,
            fc2: lin(fc2, h, i, true)?,
            exact_gelu: style.exact_gelu,
        })
    }

    /// `x: [positions, hidden]`, every position attending to every other.
    pub(crate) fn forward(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let h = x.dim(1)?;
        let hd = h / heads;
        let y = self.norm1.forward(x)?;
        let split = |t: Tensor| super::heads_first(&t, heads);
        let (q, k, v) = (
            split(self.q.forward(&y)?)?,
            split(self.k.forward(&y)?)?,
            split(self.v.forward(&y)?)?,
        );
        let attn = super::attend_all(&q, &k, &v, (hd as f64).powf(-0.5))?;
        let x = (x + self.out.forward(&attn)?)?;
        let y = self.fc1.forward(&self.norm2.forward(&x)?)?;
        let y = if self.exact_gelu {
            y.gelu_erf()?
        } else {
            y.gelu()?
        };
        Ok((x + self.fc2.forward(&y)?)?)
    }
}

/// The SigLIP vision transformer.
pub struct SiglipVision {
    config: SiglipConfig,
    /// The patch convolution as a matrix `[hidden, 3 · patch²]` (input order: channel, row,
    /// column, as the kernel is stored).
    patch: QLinear,
    positions: Tensor,
    layers: Vec<EncoderLayer>,
    post_norm: LayerNorm,
}

impl SiglipVision {
    /// Loads the tower whose tensors are `{prefix}.embeddings…`, `{prefix}.encoder…` and
    /// `{prefix}.post_layernorm…` (HF: `vision_tower.vision_model`).
    pub fn load(config: SiglipConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, p) = (config.hidden_size, config.patch_size);
        let conv = format!("{prefix}.embeddings.patch_embedding");
        let kernel = w.tensor(&format!("{conv}.weight"), &[h, 3, p, p])?;
        let bias = w.tensor(&format!("{conv}.bias"), &[h])?;
        let patch = QLinear::Dense {
            w: kernel.reshape((h, 3 * p * p))?,
            b: Some(bias),
        };
        let n = config.patches_per_side().pow(2);
        let positions = w.tensor(
            &format!("{prefix}.embeddings.position_embedding.weight"),
            &[n, h],
        )?;
        let style = LayerStyle {
            names: SIGLIP,
            key_bias: true,
            exact_gelu: false,
            eps: config.eps,
        };
        let widths = (h, config.intermediate_size);
        let layers = (0..config.layers)
            .map(|i| EncoderLayer::load(w, &format!("{prefix}.encoder.layers.{i}"), widths, &style))
            .collect::<Result<_>>()?;
        let post_norm = LayerNorm::load(w, &format!("{prefix}.post_layernorm"), h, config.eps)?;
        Ok(Self {
            config,
            patch,
            positions,
            layers,
            post_norm,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &SiglipConfig {
        &self.config
    }

    /// `pixels: [3, image_size, image_size]` (f32) → the last hidden state `[patches, hidden]`,
    /// patches in row-major order.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let (s, p) = (self.config.image_size, self.config.patch_size);
        let side = s / p;
        let dtype = self.positions.dtype();
        // [3, side·p, side·p] → [side, side, 3, p, p] → one row of 3·p² values per patch.
        let patches = (pixels.reshape((3, side, p, side, p))?)
            .permute((1, 3, 0, 2, 4))?
            .reshape((side * side, 3 * p * p))?
            .to_dtype(dtype)?;
        let mut x = (self.patch.forward(&patches)? + &self.positions)?;
        for layer in &self.layers {
            x = layer.forward(&x, self.config.heads)?;
        }
        self.post_norm.forward(&x)
    }
}
