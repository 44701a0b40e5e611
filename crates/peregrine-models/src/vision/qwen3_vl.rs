//! Qwen3-VL's vision tower (`Qwen3VLVisionModel`), also Qwen3.5's (`Qwen3_5VisionModel`: the
//! same without DeepStack):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_vl/modeling_qwen3_vl.py>
//! with the position helpers of transformers' `vision_utils.py`.
//!
//! Qwen2-VL's tower (blocks of LayerNorms and full attention over the picture, the axial
//! rope) with a biased Conv3d patch embedding, a learned square table of position embeddings
//! resampled bilinearly (corners aligned) to each picture's patch grid and added after the patch
//! embedding, a tanh-GELU MLP, and DeepStack: after each block named in
//! `deepstack_visual_indexes` a merger of its own (LayerNorm over the merged `merge²` rows, then
//! Linear → exact GELU → Linear) gives rows that the text model adds to the picture's hidden
//! states after its layer of the same rank. The final merger normalises each patch before the
//! merge. [`Qwen3VisionTower::forward`] returns the merged rows with the DeepStack rows beside
//! them (`[n, (1 + k) · out_hidden]`), the layout [`Media`](crate::Media) carries.

use peregrine_tensor::{DType, Device, QLinear, Tensor};

use super::mmproj::patch_kernel;
use super::qwen2_5_vl::{
    Block, Qwen25VisionConfig, QwenVisionKind, axial_theta, check_input, grid_points, indices,
    rope_tables,
};
use super::siglip::LayerNorm;
use crate::Result;
use crate::config::Fields;
use crate::weights::Weights;

/// The tower's shape: Qwen2-VL's fields and Qwen3-VL's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3VisionConfig {
    /// The fields the blocks share with the Qwen2 towers (`kind` [`QwenVisionKind::Qwen3`]).
    pub base: Qwen25VisionConfig,
    /// Entries of the learned position table, a square (`num_position_embeddings`).
    pub num_position_embeddings: usize,
    /// The blocks after which a DeepStack merger reads the hidden states.
    pub deepstack_visual_indexes: Vec<usize>,
}

impl Qwen3VisionConfig {
    /// Reads a `vision_config` (transformers' `Qwen3VLVisionConfig` defaults where a key is
    /// absent; `deepstack` stands for an absent `deepstack_visual_indexes`: Qwen3-VL's
    /// `[8, 16, 24]`, none for Qwen3.5's tower, which has no DeepStack).
    pub fn from_fields(f: &Fields, deepstack: &[usize]) -> Result<Self> {
        check_input(f, "gelu_pytorch_tanh")?;
        let depth = f.opt_usize("depth")?.unwrap_or(27);
        let base = Qwen25VisionConfig {
            kind: QwenVisionKind::Qwen3,
            depth,
            hidden_size: f.opt_usize("hidden_size")?.unwrap_or(1152),
            num_heads: f.opt_usize("num_heads")?.unwrap_or(16),
            intermediate_size: f.opt_usize("intermediate_size")?.unwrap_or(4304),
            patch_size: f.opt_usize("patch_size")?.unwrap_or(16),
            temporal_patch_size: f.opt_usize("temporal_patch_size")?.unwrap_or(2),
            spatial_merge_size: f.opt_usize("spatial_merge_size")?.unwrap_or(2),
            window_size: 0,
            fullatt_block_indexes: (0..depth).collect(),
            out_hidden_size: f.opt_usize("out_hidden_size")?.unwrap_or(3584),
            rope_theta: axial_theta(f)?,
        };
        base.check_heads(f)?;
        let deepstack = match f.contains("deepstack_visual_indexes") {
            true => f.usize_list("deepstack_visual_indexes")?,
            false => deepstack.to_vec(),
        };
        let positions = f.opt_usize("num_position_embeddings")?.unwrap_or(2304);
        let side = (positions as f64).sqrt() as usize;
        if side * side != positions {
            return Err(f.err(format!(
                "vision_config: `num_position_embeddings` ({positions}) must be a square"
            )));
        }
        if deepstack.iter().any(|&i| i >= depth) {
            return Err(
                f.err("vision_config: `deepstack_visual_indexes` must be below `depth`".into())
            );
        }
        Ok(Self {
            base,
            num_position_embeddings: positions,
            deepstack_visual_indexes: deepstack,
        })
    }

    /// Side of the square position table.
    fn side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt() as usize
    }
}

/// A patch merger: `merge²` rows of a block concatenated, LayerNorm (per patch before the merge,
/// or over the merged row after it: DeepStack's), Linear → exact GELU → Linear.
struct Merger {
    norm: LayerNorm,
    post_shuffle: bool,
    fc1: QLinear,
    fc2: QLinear,
}

impl Merger {
    fn load(w: &Weights, p: &str, c: &Qwen3VisionConfig, post_shuffle: bool) -> Result<Self> {
        let h = c.base.hidden_size;
        let merged = h * c.base.merge_unit();
        let norm_width = if post_shuffle { merged } else { h };
        let lin = |name: &str, out, inp| w.linear(&format!("{p}.{name}"), out, inp, true);
        Ok(Self {
            norm: LayerNorm::load(w, &format!("{p}.norm"), norm_width, 1e-6)?,
            post_shuffle,
            fc1: lin("linear_fc1", merged, merged)?,
            fc2: lin("linear_fc2", c.base.out_hidden_size, merged)?,
        })
    }

    /// `x: [n, hidden]` in block-major order → `[n / merge², out_hidden]`.
    fn forward(&self, x: &Tensor, merged: usize) -> Result<Tensor> {
        let n = x.dim(0)? * x.dim(1)? / merged;
        let y = match self.post_shuffle {
            true => self.norm.forward(&x.reshape((n, merged))?)?,
            false => self.norm.forward(x)?.reshape((n, merged))?,
        };
        Ok(self.fc2.forward(&self.fc1.forward(&y)?.gelu_erf()?)?)
    }
}

/// Qwen3-VL's vision tower with its mergers.
pub struct Qwen3VisionTower {
    config: Qwen3VisionConfig,
    /// The Conv3d as a biased matrix `[hidden, 3 · temporal · patch²]`.
    patch: QLinear,
    /// The learned position table `[side², hidden]`.
    pos_embed: Tensor,
    blocks: Vec<Block>,
    merger: Merger,
    deepstack: Vec<Merger>,
    dtype: DType,
    device: Device,
}

impl Qwen3VisionTower {
    /// Loads the tower whose tensors are `{prefix}.patch_embed…`, `{prefix}.pos_embed…`,
    /// `{prefix}.blocks…`, `{prefix}.merger…` and `{prefix}.deepstack_merger_list…`.
    pub fn load(config: &Qwen3VisionConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let c = &config.base;
        let (h, p, tp) = (c.hidden_size, c.patch_size, c.temporal_patch_size);
        let kernel = patch_kernel(w, prefix, [h, 3, tp, p, p])?;
        let (dtype, device) = (kernel.dtype(), kernel.device().clone());
        let patch = QLinear::Dense {
            w: kernel.reshape((h, c.patch_values()))?,
            b: Some(w.tensor(&format!("{prefix}.patch_embed.proj.bias"), &[h])?),
        };
        let pos_embed = w.tensor(
            &format!("{prefix}.pos_embed.weight"),
            &[config.num_position_embeddings, h],
        )?;
        let blocks = (0..c.depth)
            .map(|i| Block::load(w, &format!("{prefix}.blocks.{i}"), c))
            .collect::<Result<_>>()?;
        // HF lists the DeepStack mergers; llama.cpp's projector files name each by its block.
        let listed = w.contains(&format!("{prefix}.deepstack_merger_list.0.norm.weight"));
        let deepstack = (config.deepstack_visual_indexes.iter().enumerate())
            .map(|(i, block)| {
                let name = match listed {
                    true => format!("{prefix}.deepstack_merger_list.{i}"),
                    false => format!("{prefix}.deepstack.{block}"),
                };
                Merger::load(w, &name, config, true)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            merger: Merger::load(w, &format!("{prefix}.merger"), config, false)?,
            config: config.clone(),
            patch,
            pos_embed,
            blocks,
            deepstack,
            dtype,
            device,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &Qwen3VisionConfig {
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
    /// with patch grid `(t, h, w)` → `[t · h · w / merge², (1 + k) · out_hidden]`: the merged
    /// rows in the processor's order, then the `k` DeepStack mergers' rows beside them.
    pub fn forward(&self, patches: &Tensor, grid: (usize, usize, usize)) -> Result<Tensor> {
        let c = &self.config.base;
        let (t, h, w) = grid;
        let m = c.spatial_merge_size;
        let n = t * h * w;
        let bad = |why: String| -> Result<Tensor> {
            Err(peregrine_tensor::candle::Error::Msg(format!("Qwen3-VL vision: {why}")).into())
        };
        if n == 0 || !h.is_multiple_of(m) || !w.is_multiple_of(m) {
            return bad(format!("grid {grid:?} is not whole {m}×{m} merge blocks"));
        }
        if patches.dims() != [n, c.patch_values()] {
            let dims = patches.dims();
            return bad(format!(
                "patches {dims:?} for grid {grid:?} (expected [{n}, {}])",
                c.patch_values()
            ));
        }
        let device = patches.device();
        let x = self.patch.forward(&patches.to_dtype(self.dtype)?)?;
        let mut x = (x + self.positions(grid)?.to_dtype(self.dtype)?)?;
        let (cos, sin) = rope_tables(c, grid)?;
        let (cos, sin) = (cos.to_device(device)?, sin.to_device(device)?);
        let frames: Vec<usize> = (0..=t).map(|f| f * h * w).collect();
        let merged = c.hidden_size * c.merge_unit();
        let mut deep = Vec::with_capacity(self.deepstack.len());
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, c.num_heads, (&cos, &sin), &frames)?;
            if let Some(j) = self
                .config
                .deepstack_visual_indexes
                .iter()
                .position(|&d| d == i)
            {
                deep.push(self.deepstack[j].forward(&x, merged)?);
            }
        }
        let mut rows = vec![self.merger.forward(&x, merged)?];
        rows.extend(deep);
        Ok(Tensor::cat(&rows, 1)?)
    }

    /// The position table resampled to the patch grid, one row per patch in the processor's
    /// (block-major) order: bilinear with corners aligned, as `F.interpolate` and transformers'
    /// `get_vision_interpolation_indices_and_weights` compute it (f32 taps and weights).
    fn positions(&self, (t, h, w): (usize, usize, usize)) -> Result<Tensor> {
        let side = self.config.side();
        let m = self.config.base.spatial_merge_size;
        // Two taps along one axis of `size` positions: (table index, weight) each.
        let taps = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / size.saturating_sub(1).max(1) as f32;
            let floor = src.floor();
            [0, 1].map(|off| {
                let tap = (floor as usize + off).min(side - 1);
                let weight = (1.0 - (src - floor - off as f32).abs()).max(0.0);
                (tap, weight)
            })
        };
        let (mut index, mut weight) = (Vec::new(), Vec::new());
        for (_, by, bx, y, x) in grid_points([t, h / m, w / m, m, m]) {
            let (row, col) = (taps(by * m + y, h), taps(bx * m + x, w));
            for (r, wr) in row {
                for (c, wc) in col {
                    index.push(r * side + c);
                    weight.push(wr * wc);
                }
            }
        }
        let table = self.pos_embed.to_dtype(DType::F32)?;
        let n = t * h * w;
        let rows = table.index_select(&indices(&index, table.device())?, 0)?;
        let weight = Tensor::from_vec(weight, (n, 4, 1), table.device())?;
        let hidden = table.dim(1)?;
        Ok(rows
            .reshape((n, 4, hidden))?
            .broadcast_mul(&weight)?
            .sum(1)?)
    }
}
