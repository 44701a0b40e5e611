//! Qwen2-Audio's audio tower (Whisper's encoder) and projector:
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_audio/modeling_qwen2_audio.py>
//!
//! Two GELU convolutions over the log-mel frames (the second of stride 2), learned positions,
//! pre-norm encoder layers (LayerNorm, bidirectional attention whose key projection has no
//! bias, a GELU MLP), pairs of positions averaged, a LayerNorm, and a linear projector into
//! the text model's width. transformers runs the whole 30-second window and masks the keys past
//! the clip; the positions before the mask see nothing past it, so only they are computed here.

use peregrine_tensor::{Device, QLinear, Tensor};

use crate::Result;
use crate::config::Fields;
use crate::vision::siglip::{EncoderLayer, LayerNorm, LayerStyle};
use crate::weights::Weights;

/// The tower's shape, from an `audio_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioTowerConfig {
    /// Mel bins of the input.
    pub mels: usize,
    /// Width of the hidden states (`d_model`).
    pub width: usize,
    /// Width of the MLP (`encoder_ffn_dim`).
    pub ffn: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Positions after the strided convolution: half a window's frames.
    pub positions: usize,
}

impl AudioTowerConfig {
    /// Reads an `audio_config` (Qwen2-Audio's defaults where a key is absent).
    pub fn from_fields(f: &Fields) -> Result<Self> {
        let act = f.opt_str("activation_function")?.unwrap_or("gelu");
        if act != "gelu" || f.opt_bool("scale_embedding")? == Some(true) {
            return Err(f.err(format!(
                "audio_config: `activation_function` `{act}` or `scale_embedding` is not \
                 supported (only `gelu`, unscaled)"
            )));
        }
        let c = Self {
            mels: f.opt_usize("num_mel_bins")?.unwrap_or(128),
            width: f.opt_usize("d_model")?.unwrap_or(1280),
            ffn: f.opt_usize("encoder_ffn_dim")?.unwrap_or(5120),
            layers: f.opt_usize("encoder_layers")?.unwrap_or(32),
            heads: f.opt_usize("encoder_attention_heads")?.unwrap_or(20),
            positions: f.opt_usize("max_source_positions")?.unwrap_or(1500),
        };
        if c.heads == 0 || !c.width.is_multiple_of(c.heads) {
            return Err(f.err("audio_config: `d_model` must be a multiple of the heads".into()));
        }
        Ok(c)
    }
}

/// Whisper's layer names, its key projection without a bias, and the exact GELU.
const WHISPER: LayerStyle = LayerStyle {
    names: ["self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"],
    key_bias: false,
    exact_gelu: true,
    eps: 1e-5,
};

/// Qwen2-Audio's tower and projector: log-mel frames in, rows of the text model's input
/// embeddings out.
pub struct Qwen2AudioTower {
    config: AudioTowerConfig,
    conv1: (Tensor, Tensor),
    conv2: (Tensor, Tensor),
    positions: Tensor,
    layers: Vec<EncoderLayer>,
    norm: LayerNorm,
    projector: QLinear,
    text_width: usize,
}

impl Qwen2AudioTower {
    /// Loads `audio_tower.*` and `multi_modal_projector.linear` (into `text_width` values).
    pub fn load(config: AudioTowerConfig, w: &Weights, text_width: usize) -> Result<Self> {
        let (m, h) = (config.mels, config.width);
        let conv = |name: &str, inp: usize| -> Result<(Tensor, Tensor)> {
            let p = format!("audio_tower.{name}");
            Ok((
                w.tensor(&format!("{p}.weight"), &[h, inp, 3])?,
                w.tensor(&format!("{p}.bias"), &[h])?.reshape((1, h, 1))?,
            ))
        };
        let layers = (0..config.layers)
            .map(|i| {
                let p = format!("audio_tower.layers.{i}");
                EncoderLayer::load(w, &p, (config.width, config.ffn), &WHISPER)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            conv1: conv("conv1", m)?,
            conv2: conv("conv2", h)?,
            positions: w.tensor("audio_tower.embed_positions.weight", &[config.positions, h])?,
            layers,
            norm: LayerNorm::load(w, "audio_tower.layer_norm", h, 1e-5)?,
            projector: w.linear("multi_modal_projector.linear", text_width, h, true)?,
            text_width,
            config,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &AudioTowerConfig {
        &self.config
    }

    /// Width of the rows [`encode`](Self::encode) gives.
    pub fn width(&self) -> usize {
        self.text_width
    }

    /// Audio tokens for a clip of `valid` feature frames (the processor's count): half the
    /// positions the strided convolution gives.
    pub fn tokens(valid: usize) -> usize {
        (valid.saturating_sub(1) / 2).div_ceil(2)
    }

    /// `features: [mels][frames]` of one window (row-major, f32, as
    /// [`MelSettings::features`](super::MelSettings::features) gives), of which `valid`
    /// frames hold the clip → `[tokens(valid), text width]`.
    pub fn encode(&self, features: &[f32], valid: usize, device: &Device) -> Result<Tensor> {
        let (m, frames) = (self.config.mels, features.len() / self.config.mels.max(1));
        let positions = (valid.saturating_sub(1) / 2 + 1).min(self.config.positions);
        let tokens = positions / 2;
        if tokens == 0 || features.len() != m * frames {
            return Err(crate::ModelError::Media(crate::vision::MediaError(
                format!(
                    "the clip is too short ({valid} feature frames) or its features are not {m} bins"
                ),
            )));
        }
        // Frames up to 2·positions feed the kept positions (both kernels reach a frame past
        // their centre); the outputs past them, wrong where the window is cut, are dropped.
        let used = (2 * positions + 2).min(frames);
        let x = Tensor::from_vec(features.to_vec(), (m, frames), &Device::Cpu)?
            .narrow(1, 0, used)?
            .to_device(device)?
            .to_dtype(self.positions.dtype())?
            .unsqueeze(0)?;
        let conv = |x: &Tensor, (w, b): &(Tensor, Tensor), stride| -> Result<Tensor> {
            Ok(x.conv1d(w, 1, stride, 1, 1)?.broadcast_add(b)?.gelu_erf()?)
        };
        let x = conv(&x, &self.conv1, 1)?;
        let x = conv(&x, &self.conv2, 2)?;
        let x = x.squeeze(0)?.t()?.narrow(0, 0, positions)?;
        let mut x = (x + self.positions.narrow(0, 0, positions)?)?;
        for layer in &self.layers {
            x = layer.forward(&x, self.config.heads)?;
        }
        let pairs = x
            .narrow(0, 0, 2 * tokens)?
            .reshape((tokens, 2, self.config.width))?;
        let pooled = (pairs.sum(1)? * 0.5)?;
        Ok(self.projector.forward(&self.norm.forward(&pooled)?)?)
    }
}
