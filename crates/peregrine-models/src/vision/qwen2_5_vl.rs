//! Qwen2.5-VL's vision tower (`Qwen2_5_VisionTransformerPretrainedModel`):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py>
//! with the window and position helpers of transformers' `vision_utils.py`, and Qwen2-VL's
//! (`Qwen2VisionTransformerPretrainedModel`, `models/qwen2_vl/modeling_qwen2_vl.py`), which is
//! the same tower with LayerNorms, a biased `fc1` → quick-GELU → `fc2` MLP and no windows
//! (every block attends over the whole frame).
//!
//! The processor's patch rows ([`Qwen2VlPixels`](super::qwen2_vl::Qwen2VlPixels), each
//! `3 · temporal · patch²` values, laid out block-major over the `merge × merge` blocks) are
//! embedded by the Conv3d (run as one matmul), reordered window by window (windows of
//! `window_size` pixels, in units of merge blocks), rotated by an axial 2D rope (row and column
//! of each patch), and run through pre-norm blocks (RMSNorm, bidirectional attention with a fused
//! biased `qkv` inside each window, or over the whole frame in the `fullatt_block_indexes`
//! blocks, a SwiGLU MLP with biases). The patch merger (RMSNorm, the `merge²` rows of a block
//! concatenated, Linear → exact GELU → Linear) gives one row per merge block, put back in the
//! processor's order.
//!
//! [`QwenVlVision`](super::qwen2_vl::QwenVlVision) is the family's
//! [`ImageEncoder`](super::ImageEncoder): in the prompt each
//! `<|vision_start|><|image_pad|><|vision_end|>` gets one `<|image_pad|>` per merged row, and
//! the text model gives those tokens M-RoPE positions from the merged grid.

use peregrine_tensor::nn::ops::sigmoid;
use peregrine_tensor::{D, DType, Device, QLinear, Tensor};

use super::mmproj::{fused_qkv, patch_kernel};
use super::siglip::LayerNorm;
use crate::Result;
use crate::config::Fields;
use crate::weights::Weights;

/// RMSNorm epsilon of the blocks and the merger (fixed in transformers).
const EPS: f64 = 1e-6;

/// Which of the two towers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QwenVisionKind {
    /// Qwen2-VL: LayerNorms, quick-GELU MLP, full attention in every block.
    Qwen2,
    /// Qwen2.5-VL: RMSNorms, SwiGLU MLP, window attention but in `fullatt_block_indexes`.
    Qwen25,
    /// Qwen3-VL: LayerNorms, tanh-GELU MLP (`linear_fc1`, `linear_fc2`), full attention
    /// ([`Qwen3VisionTower`](super::qwen3_vl::Qwen3VisionTower) adds the rest).
    Qwen3,
}

/// The tower's shape, from a `vision_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen25VisionConfig {
    /// Which tower.
    pub kind: QwenVisionKind,
    /// Blocks (`depth`).
    pub depth: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Attention heads (`num_heads`).
    pub num_heads: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Side of a patch in pixels.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Side of the block of patches the merger turns into one row.
    pub spatial_merge_size: usize,
    /// Side of an attention window in pixels.
    pub window_size: usize,
    /// The blocks that attend over the whole frame instead of within windows.
    pub fullatt_block_indexes: Vec<usize>,
    /// Width of the merged rows (the text model's hidden size).
    pub out_hidden_size: usize,
    /// Base of the axial rope.
    pub rope_theta: f64,
}

impl Qwen25VisionConfig {
    /// Reads a `vision_config` (transformers' `Qwen2_5_VLVisionConfig` defaults where a key is
    /// absent).
    pub fn from_fields(f: &Fields) -> Result<Self> {
        check_input(f, "silu")?;
        let rope_theta = axial_theta(f)?;
        let fullatt = match f.contains("fullatt_block_indexes") {
            true => f.usize_list("fullatt_block_indexes")?,
            false => vec![7, 15, 23, 31],
        };
        let c = Self {
            kind: QwenVisionKind::Qwen25,
            depth: f.opt_usize("depth")?.unwrap_or(32),
            hidden_size: f.opt_usize("hidden_size")?.unwrap_or(3584),
            num_heads: f.opt_usize("num_heads")?.unwrap_or(16),
            intermediate_size: f.opt_usize("intermediate_size")?.unwrap_or(3420),
            patch_size: f.opt_usize("patch_size")?.unwrap_or(14),
            temporal_patch_size: f.opt_usize("temporal_patch_size")?.unwrap_or(2),
            spatial_merge_size: f.opt_usize("spatial_merge_size")?.unwrap_or(2),
            window_size: f.opt_usize("window_size")?.unwrap_or(112),
            fullatt_block_indexes: fullatt,
            out_hidden_size: f.opt_usize("out_hidden_size")?.unwrap_or(3584),
            rope_theta,
        };
        let bad = |what: &str| Err(f.err(format!("vision_config: {what}")));
        c.check_heads(f)?;
        if c.window_size < c.spatial_merge_size * c.patch_size {
            return bad("`window_size` must be at least `spatial_merge_size` · `patch_size`");
        }
        if c.fullatt_block_indexes.iter().any(|&i| i >= c.depth) {
            return bad("`fullatt_block_indexes` must be below `depth`");
        }
        Ok(c)
    }

    /// Reads a Qwen2-VL `vision_config` (`Qwen2VLVisionConfig` defaults where a key is absent):
    /// its `embed_dim` is the tower's width and `hidden_size` the merged rows'.
    pub fn from_qwen2_fields(f: &Fields) -> Result<Self> {
        check_input(f, "quick_gelu")?;
        let width = f.opt_usize("embed_dim")?.unwrap_or(1280);
        let depth = f.opt_usize("depth")?.unwrap_or(32);
        let ratio = f.opt_f64("mlp_ratio")?.unwrap_or(4.0);
        let c = Self {
            kind: QwenVisionKind::Qwen2,
            depth,
            hidden_size: width,
            num_heads: f.opt_usize("num_heads")?.unwrap_or(16),
            intermediate_size: (width as f64 * ratio) as usize,
            patch_size: f.opt_usize("patch_size")?.unwrap_or(14),
            temporal_patch_size: f.opt_usize("temporal_patch_size")?.unwrap_or(2),
            spatial_merge_size: f.opt_usize("spatial_merge_size")?.unwrap_or(2),
            window_size: 0,
            fullatt_block_indexes: (0..depth).collect(),
            out_hidden_size: f.opt_usize("hidden_size")?.unwrap_or(3584),
            rope_theta: 10000.0,
        };
        c.check_heads(f)?;
        Ok(c)
    }

    /// The axial rope takes a quarter of each head's width per axis.
    pub(super) fn check_heads(&self, f: &Fields) -> Result<()> {
        let (h, n) = (self.hidden_size, self.num_heads);
        if n == 0 || !h.is_multiple_of(n) || !(h / n).is_multiple_of(4) {
            return Err(f.err(
                "vision_config: the tower's width / `num_heads` must be a multiple of 4 (axial \
                 rope)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Values in one patch row: `3 · temporal_patch_size · patch_size²`.
    pub fn patch_values(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size.pow(2)
    }

    /// Patches per merged row: `spatial_merge_size²`.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size.pow(2)
    }
}

/// The axial rope's base (`rope_parameters.rope_theta`, 10000 by default); another rope type is
/// refused by name.
pub(super) fn axial_theta(f: &Fields) -> Result<f64> {
    let Some(rope) = f.object("rope_parameters")? else {
        return Ok(10000.0);
    };
    let kind = rope.opt_str("rope_type")?.unwrap_or("axial");
    if kind != "axial" {
        return Err(f.err(format!(
            "field `vision_config.rope_parameters.rope_type` `{kind}` is not supported (only \
             `axial`)"
        )));
    }
    Ok(rope.opt_f64("rope_theta")?.unwrap_or(10000.0))
}

/// The tower's activation and its 3 input channels, refused by name otherwise.
pub(super) fn check_input(f: &Fields, act: &str) -> Result<()> {
    let found = f.opt_str("hidden_act")?.unwrap_or(act);
    if found != act {
        return Err(f.err(format!(
            "field `vision_config.hidden_act` `{found}` is not supported (only `{act}`)"
        )));
    }
    for key in ["in_channels", "in_chans"] {
        if f.opt_usize(key)?.is_some_and(|c| c != 3) {
            return Err(f.err(format!(
                "field `vision_config.{key}`: only 3 (RGB) is supported"
            )));
        }
    }
    Ok(())
}

/// The blocks' and the merger's norm: LayerNorm (Qwen2-VL, Qwen3-VL) or RMSNorm (Qwen2.5-VL),
/// eps 1e-6.
enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    fn load(w: &Weights, prefix: &str, dim: usize, kind: QwenVisionKind) -> Result<Self> {
        Ok(match kind {
            QwenVisionKind::Qwen2 | QwenVisionKind::Qwen3 => {
                Norm::Layer(LayerNorm::load(w, prefix, dim, EPS)?)
            }
            QwenVisionKind::Qwen25 => {
                Norm::Rms(RmsNorm(w.tensor(&format!("{prefix}.weight"), &[dim])?))
            }
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(n) => n.forward(x),
            Norm::Layer(n) => n.forward(x),
        }
    }
}

/// The blocks' MLP: SwiGLU (Qwen2.5-VL), `fc2(quick_gelu(fc1 x))` (Qwen2-VL) or
/// `fc2(gelu_tanh(fc1 x))` (Qwen3-VL), with biases.
enum Mlp {
    SwiGlu {
        gate: QLinear,
        up: QLinear,
        down: QLinear,
    },
    QuickGelu {
        fc1: QLinear,
        fc2: QLinear,
    },
    GeluTanh {
        fc1: QLinear,
        fc2: QLinear,
    },
}

impl Mlp {
    fn forward(&self, y: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Mlp::SwiGlu { gate, up, down } => {
                down.forward(&(gate.forward(y)?.silu()? * up.forward(y)?)?)?
            }
            Mlp::QuickGelu { fc1, fc2 } => {
                // transformers' QuickGELUActivation: x · sigmoid(1.702 x).
                let x = fc1.forward(y)?;
                fc2.forward(&(&x * sigmoid(&(&x * 1.702)?)?)?)?
            }
            Mlp::GeluTanh { fc1, fc2 } => fc2.forward(&fc1.forward(y)?.gelu()?)?,
        })
    }
}

/// An RMSNorm with a weight, computed in f32 as transformers does.
struct RmsNorm(Tensor);

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let ms = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_div(&(ms + EPS)?.sqrt()?)?.to_dtype(dtype)?;
        Ok(normed.broadcast_mul(&self.0)?)
    }
}

/// The second half of the last dimension negated, then the first: `cat(-x2, x1)`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

/// A pre-norm block: bidirectional attention with a fused biased `qkv` and the axial rope,
/// then the MLP.
pub(super) struct Block {
    norm1: Norm,
    qkv: QLinear,
    proj: QLinear,
    norm2: Norm,
    mlp: Mlp,
}

impl Block {
    pub(super) fn load(w: &Weights, p: &str, c: &Qwen25VisionConfig) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let lin = |name: &str, out, inp| w.linear(&format!("{p}.{name}"), out, inp, true);
        let mlp = match c.kind {
            QwenVisionKind::Qwen2 => Mlp::QuickGelu {
                fc1: lin("mlp.fc1", i, h)?,
                fc2: lin("mlp.fc2", h, i)?,
            },
            QwenVisionKind::Qwen25 => Mlp::SwiGlu {
                gate: lin("mlp.gate_proj", i, h)?,
                up: lin("mlp.up_proj", i, h)?,
                down: lin("mlp.down_proj", h, i)?,
            },
            QwenVisionKind::Qwen3 => Mlp::GeluTanh {
                fc1: lin("mlp.linear_fc1", i, h)?,
                fc2: lin("mlp.linear_fc2", h, i)?,
            },
        };
        Ok(Self {
            norm1: Norm::load(w, &format!("{p}.norm1"), h, c.kind)?,
            qkv: fused_qkv(w, p, h)?,
            proj: lin("attn.proj", h, h)?,
            norm2: Norm::load(w, &format!("{p}.norm2"), h, c.kind)?,
            mlp,
        })
    }

    /// `x: [n, hidden]` in window order; `cos`, `sin`: `[n, 1, head_dim]` f32; `bounds`: the
    /// cumulative row counts of the segments that attend within themselves.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        heads: usize,
        (cos, sin): (&Tensor, &Tensor),
        bounds: &[usize],
    ) -> Result<Tensor> {
        let (n, h) = x.dims2()?;
        let hd = h / heads;
        let dtype = x.dtype();
        let qkv = self.qkv.forward(&self.norm1.forward(x)?)?;
        let qkv = qkv.reshape((n, 3, heads, hd))?;
        // The rope in f32, then back to the compute dtype.
        let rope = |t: Tensor| -> Result<Tensor> {
            let t = t.to_dtype(DType::F32)?;
            let r = (t.broadcast_mul(cos)? + rotate_half(&t)?.broadcast_mul(sin)?)?;
            Ok(r.to_dtype(dtype)?)
        };
        let q = rope(qkv.narrow(1, 0, 1)?.squeeze(1)?)?;
        let k = rope(qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (hd as f64).powf(-0.5);
        let mut parts = Vec::with_capacity(bounds.len().saturating_sub(1));
        for seg in bounds.windows(2) {
            let (a, len) = (seg[0], seg[1] - seg[0]);
            // [len, heads, hd] → [heads, len, hd]
            let part = |t: &Tensor| -> Result<Tensor> {
                Ok(t.narrow(0, a, len)?.transpose(0, 1)?.contiguous()?)
            };
            let (q, k, v) = (part(&q)?, part(&k)?, part(&v)?);
            parts.push(super::attend_all(&q, &k, &v, scale)?);
        }
        let attn = Tensor::cat(&parts, 0)?;
        let x = (x + self.proj.forward(&attn)?)?;
        Ok((&x + self.mlp.forward(&self.norm2.forward(&x)?)?)?)
    }
}

/// The order in which the window blocks see the merge blocks, and the windows' cumulative
/// patch counts (`get_vision_window_index` for one grid; empty windows dropped as its
/// `unique_consecutive` does).
fn window_index(
    c: &Qwen25VisionConfig,
    (t, h, w): (usize, usize, usize),
) -> (Vec<usize>, Vec<usize>) {
    let m = c.spatial_merge_size;
    let (lh, lw) = (h / m, w / m);
    if c.kind != QwenVisionKind::Qwen25 {
        // No windows: the processor's order, one segment per frame.
        return (
            (0..t * lh * lw).collect(),
            (0..=t).map(|f| f * h * w).collect(),
        );
    }
    let vw = c.window_size / m / c.patch_size;
    let (nh, nw) = ((lh + vw - lh % vw) / vw, (lw + vw - lw % vw) / vw);
    let (mut index, mut bounds) = (Vec::with_capacity(t * lh * lw), vec![0]);
    for f in 0..t {
        for wy in 0..nh {
            for wx in 0..nw {
                let before = index.len();
                for y in (wy * vw..(wy + 1) * vw).filter(|&y| y < lh) {
                    for x in (wx * vw..(wx + 1) * vw).filter(|&x| x < lw) {
                        index.push(f * lh * lw + y * lw + x);
                    }
                }
                if index.len() > before {
                    bounds.push(index.len() * c.merge_unit());
                }
            }
        }
    }
    (index, bounds)
}

/// The rope's cos and sin `[n, 1, head_dim]` (f32) for the patches in the processor's order:
/// each patch's row then column angles, the pair repeated (`Qwen2_5_VLVisionRotaryEmbedding`).
pub(super) fn rope_tables(
    c: &Qwen25VisionConfig,
    (t, h, w): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let hd = c.hidden_size / c.num_heads;
    let spatial = hd / 2;
    let inv_freq: Vec<f32> = (0..spatial)
        .step_by(2)
        .map(|i| (1.0 / c.rope_theta.powf(i as f64 / spatial as f64)) as f32)
        .collect();
    let (m, n) = (c.spatial_merge_size, t * h * w);
    let (mut cos, mut sin) = (Vec::with_capacity(n * hd), Vec::with_capacity(n * hd));
    // Block-major, as `get_vision_position_ids`: merge blocks row-major, the patches of a block
    // row-major inside it; the same for every frame.
    for (_, by, bx, y, x) in grid_points([t, h / m, w / m, m, m]) {
        let (row, col) = ((by * m + y) as f32, (bx * m + x) as f32);
        let angles: Vec<f32> = (inv_freq.iter().map(|f| row * f))
            .chain(inv_freq.iter().map(|f| col * f))
            .collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, 1, hd), &Device::Cpu)?,
        Tensor::from_vec(sin, (n, 1, hd), &Device::Cpu)?,
    ))
}

/// Every `(a, b, c, d, e)` below `dims`, row-major.
pub(super) fn grid_points(
    dims: [usize; 5],
) -> impl Iterator<Item = (usize, usize, usize, usize, usize)> {
    let total: usize = dims.iter().product();
    (0..total).map(move |mut k| {
        let mut at = [0; 5];
        for (i, &d) in dims.iter().enumerate().rev() {
            at[i] = k % d;
            k /= d;
        }
        (at[0], at[1], at[2], at[3], at[4])
    })
}

/// Indices as a `u32` tensor on `device`.
pub(super) fn indices(v: &[usize], device: &Device) -> Result<Tensor> {
    let v: Vec<u32> = v.iter().map(|&i| i as u32).collect();
    let n = v.len();
    Ok(Tensor::from_vec(v, n, device)?)
}

/// Qwen2.5-VL's vision tower with its patch merger.
pub struct Qwen25VisionTower {
    config: Qwen25VisionConfig,
    /// The Conv3d as a matrix `[hidden, 3 · temporal · patch²]` (input order: channel, frame,
    /// row, column, as the processor lays out a patch row and the kernel is stored).
    patch: QLinear,
    blocks: Vec<Block>,
    ln_q: Norm,
    fc1: QLinear,
    fc2: QLinear,
    /// The weights' dtype and device, which the tower computes in and on.
    dtype: DType,
    device: Device,
}

impl Qwen25VisionTower {
    /// Loads the tower whose tensors are `{prefix}.patch_embed…`, `{prefix}.blocks…` and
    /// `{prefix}.merger…` (`visual` in hub checkpoints, `model.visual` in transformers 5's
    /// module tree).
    pub fn load(config: &Qwen25VisionConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let c = config;
        let (h, p, tp) = (c.hidden_size, c.patch_size, c.temporal_patch_size);
        let kernel = patch_kernel(w, prefix, [h, 3, tp, p, p])?;
        let (dtype, device) = (kernel.dtype(), kernel.device().clone());
        let patch = QLinear::Dense {
            w: kernel.reshape((h, c.patch_values()))?,
            b: None,
        };
        let blocks = (0..c.depth)
            .map(|i| Block::load(w, &format!("{prefix}.blocks.{i}"), c))
            .collect::<Result<_>>()?;
        let merged = h * c.merge_unit();
        let m = format!("{prefix}.merger");
        Ok(Self {
            config: c.clone(),
            patch,
            blocks,
            ln_q: Norm::load(w, &format!("{m}.ln_q"), h, c.kind)?,
            fc1: w.linear(&format!("{m}.mlp.0"), merged, merged, true)?,
            fc2: w.linear(&format!("{m}.mlp.2"), c.out_hidden_size, merged, true)?,
            dtype,
            device,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &Qwen25VisionConfig {
        &self.config
    }

    /// Where its weights are.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype it computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `patches: [t · h · w, 3 · temporal · patch²]` (the processor's rows, f32) of one picture
    /// or video with patch grid `(t, h, w)` → its merged rows `[t · h · w / merge², out_hidden]`
    /// in the processor's order (the rows that replace its `<|image_pad|>` tokens).
    pub fn forward(&self, patches: &Tensor, grid: (usize, usize, usize)) -> Result<Tensor> {
        let c = &self.config;
        let (t, h, w) = grid;
        let (m, unit) = (c.spatial_merge_size, c.merge_unit());
        let n = t * h * w;
        if n == 0 || !h.is_multiple_of(m) || !w.is_multiple_of(m) {
            return Err(peregrine_tensor::candle::Error::Msg(format!(
                "Qwen2.5-VL vision: grid {grid:?} is not whole {m}×{m} merge blocks"
            ))
            .into());
        }
        if patches.dims() != [n, c.patch_values()] {
            return Err(peregrine_tensor::candle::Error::Msg(format!(
                "Qwen2.5-VL vision: patches {:?} for grid {grid:?} (expected [{n}, {}])",
                patches.dims(),
                c.patch_values()
            ))
            .into());
        }
        let device = patches.device();
        let dtype = self.dtype;
        let (window, window_bounds) = window_index(c, grid);
        // Patch order: whole merge blocks, window by window.
        let order: Vec<usize> = (window.iter())
            .flat_map(|&b| (0..unit).map(move |j| b * unit + j))
            .collect();
        let order = indices(&order, device)?;
        let x = self.patch.forward(&patches.to_dtype(dtype)?)?;
        let mut x = x.index_select(&order, 0)?;
        let (cos, sin) = rope_tables(c, grid)?;
        let cos = cos.to_device(device)?.index_select(&order, 0)?;
        let sin = sin.to_device(device)?.index_select(&order, 0)?;
        // Full attention: each frame on its own (frames stay contiguous in window order).
        let frame_bounds: Vec<usize> = (0..=t).map(|f| f * h * w).collect();
        for (i, block) in self.blocks.iter().enumerate() {
            let bounds = match c.fullatt_block_indexes.contains(&i) {
                true => &frame_bounds,
                false => &window_bounds,
            };
            x = block.forward(&x, c.num_heads, (&cos, &sin), bounds)?;
        }
        let y = self
            .ln_q
            .forward(&x)?
            .reshape((n / unit, c.hidden_size * unit))?;
        let y = self.fc2.forward(&self.fc1.forward(&y)?.gelu_erf()?)?;
        // Back to the processor's order: row `window[i]` is row `i` of `y`.
        let mut reverse = vec![0; window.len()];
        for (i, &b) in window.iter().enumerate() {
            reverse[b] = i;
        }
        Ok(y.index_select(&indices(&reverse, device)?, 0)?)
    }
}
