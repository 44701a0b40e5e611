//! Image input: decoding, the HF image processors' resampling, and vision towers with their
//! projectors. A VLM checkpoint loads twice: its language model through the registry (as a
//! text model), its vision tower here ([`load_vision`]); the engine splices the tower's rows
//! into the prompt where the image tokens stand.
//!
//! [`decode_image`] turns PNG, JPEG or WebP bytes into 8-bit RGB as
//! transformers' `convert_to_rgb` does with PIL (transparency composited onto white);
//! [`resize`](resize::resize) is PIL's `Image.resize`, and
//! [`to_chw_normalized`](resize::to_chw_normalized) the processors' rescale and normalise: together
//! they give the pixel values of an HF image processor run with the PIL backend.

pub mod gemma3;
pub mod gemma4;
pub mod idefics3;
pub mod image;
pub mod mistral3;
pub mod mmproj;
pub mod processor;
pub mod qwen2_5_vl;
pub mod qwen2_vl;
pub mod qwen3_vl;
pub mod resize;
pub mod siglip;
pub mod smolvlm;

use std::path::Path;
use std::sync::Arc;

use peregrine_tensor::device::compute_dtype;
use peregrine_tensor::nn::ops::softmax_last_dim;
use peregrine_tensor::{DType, Device, Tensor};

use crate::config::{Fields, read_json_object};
use crate::weights::{MlxActivations, MlxQuantization, SafetensorsFiles, Source, Weights};
use crate::{ModelError, Result};
pub use image::{ImageLimits, MediaError, RgbImage, decode_image};
pub use mmproj::load_mmproj;

/// How a prompt stands for images.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePrompt {
    /// What the chat template writes for an image part (Gemma 3: `<start_of_image>`, SmolVLM:
    /// `<image>`), which [`ImageEncoder::expansion`] replaces.
    pub marker: String,
    /// The token that stands for each of an image's rows.
    pub image_token: String,
    /// Image tokens in a row of them: one run per tile (Gemma 3: one run of 256 per picture);
    /// 0 where the run's length depends on the picture ([`ImageEncoder::runs`]).
    pub run: usize,
    /// Whether a run's tokens attend to each other both ways (Gemma 3) or causally.
    pub both_ways: bool,
}

/// One picture as its tower takes it: the processor's pixel values tile by tile, and the grid
/// the picture was split into (`(0, 0)` when it was not).
#[derive(Debug, Clone)]
pub struct ImageInput {
    /// `[tiles, 3, side, side]` f32 on the CPU; Qwen2-VL's patch rows `[patches, values]`.
    pub tiles: Tensor,
    /// Rows and columns of split tiles (SmolVLM), before its whole-picture tile; Qwen2-VL's
    /// rows and columns of patches.
    pub grid: (usize, usize),
}

/// One run of image tokens that stands for (part of) a picture in the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageRun {
    /// Tokens in the run.
    pub len: usize,
    /// M-RoPE models: the run's rows and columns, which position its tokens.
    pub grid: Option<(usize, usize)>,
}

/// A vision tower with its projector and its processor's settings: pictures in, rows of the
/// text model's input embeddings out.
pub trait ImageEncoder: Send + Sync {
    /// The family's HF image processor on one decoded picture.
    fn preprocess(&self, image: &RgbImage) -> Result<ImageInput>;
    /// The rows (`[tiles · run, text hidden]`, the text model's dtype and device) that replace
    /// the picture's image tokens in the prompt, run by run in prompt order.
    fn encode(&self, input: &ImageInput) -> Result<Tensor>;
    /// Width of the rows [`encode`](Self::encode) gives: the text model's hidden size.
    fn width(&self) -> usize;
    /// How the prompt stands for images.
    fn prompt(&self) -> &ImagePrompt;
    /// What the processor writes in place of the picture's marker: one run of
    /// [`ImagePrompt::run`] image tokens per tile, with the family's tokens around them.
    fn expansion(&self, input: &ImageInput) -> String;
    /// The runs of image tokens that stand for the picture, in prompt order, which
    /// [`encode`](Self::encode)'s rows fill in turn: by default one run of [`ImagePrompt::run`]
    /// per tile.
    fn runs(&self, input: &ImageInput) -> Vec<ImageRun> {
        let tiles = input.tiles.dim(0).unwrap_or(0);
        let run = ImageRun {
            len: self.prompt().run,
            grid: None,
        };
        vec![run; tiles]
    }
}

/// Rows `[n, heads · hd]` as `[heads, n, hd]`, each head's rows together.
pub(crate) fn heads_first(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (n, width) = t.dims2()?;
    Ok(t.reshape((n, heads, width / heads))?
        .transpose(0, 1)?
        .contiguous()?)
}

/// Every query over every key, as the towers attend: `q`, `k`, `v` `[heads, n, hd]`, the
/// scores times `scale`, their softmax in f32 → `[n, heads · hd]`. One GEMM for the scores
/// (the fused kernel, built for a cache's rows, is slower at thousands of queries).
pub(crate) fn attend_all(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (heads, n, hd) = q.dims3()?;
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    let probs = softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(v)?.transpose(0, 1)?.reshape((n, heads * hd))?)
}

/// A vision-language config's `vision_config` and `text_config`, both required.
pub(crate) fn sections<'a>(fields: &Fields<'a>) -> Result<(Fields<'a>, Fields<'a>)> {
    let section = |key: &str| -> Result<Fields<'a>> {
        (fields.object(key)?).ok_or_else(|| fields.err(format!("missing `{key}`")))
    };
    Ok((section("vision_config")?, section("text_config")?))
}

/// The special tokens `tokenizer_config.json` names under `keys` (Gemma 4's image and audio
/// tokens), each required for `what`.
pub(crate) fn token_names<const N: usize>(
    dir: &Path,
    keys: [&str; N],
    what: &str,
) -> Result<[String; N]> {
    let path = dir.join("tokenizer_config.json");
    let map = read_json_object(&path)?;
    let f = Fields::new(&path, &map);
    let mut out: [String; N] = std::array::from_fn(|_| String::new());
    for (name, key) in out.iter_mut().zip(keys) {
        *name = (f.opt_str(key)?.map(str::to_owned))
            .ok_or_else(|| f.err(format!("field `{key}` is needed for {what}")))?;
    }
    Ok(out)
}

/// Where mlx-vlm's conversions keep the towers and projectors, and where the loaders look for
/// them (HF's names): Qwen's `visual`, Pixtral's `vision_tower`, Idefics3's `model.vision_model`
/// and `model.connector`, Gemma 4's `model.vision_tower` and `model.embed_vision`. The convolution kernels mlx-vlm stores channels-last are turned back
/// as they are read ([`Weights::tensor`]).
const MLX_VLM_NAMES: [(&str, &str); 6] = [
    ("vision_tower.", "visual."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_model.", "model.vision_model."),
    ("connector.", "model.connector."),
    ("vision_tower.", "model.vision_tower."),
    ("embed_vision.", "model.embed_vision."),
];

/// The vision tower of the HF checkpoint folder `dir`, when its `config.json` has a
/// `vision_config`; `None` for text models, GGUF files and other paths.
pub fn load_vision(dir: &Path, device: &Device) -> Result<Option<Arc<dyn ImageEncoder>>> {
    let config_path = dir.join("config.json");
    if !dir.is_dir() || !config_path.is_file() {
        return Ok(None);
    }
    let map = read_json_object(&config_path)?;
    let fields = Fields::new(&config_path, &map);
    let Some(vision) = fields.object("vision_config")? else {
        return Ok(None);
    };
    let model_type = fields.opt_str("model_type")?.unwrap_or_default();
    let tower = vision.opt_str("model_type")?.unwrap_or_default();
    let towers: &[&str] = match model_type {
        "gemma3" => &["siglip_vision_model"],
        "idefics3" => &["idefics3_vision"],
        "smolvlm" => &["smolvlm_vision"],
        "qwen2_5_vl" => &["qwen2_5_vl_vision", "qwen2_5_vl", ""],
        "qwen2_vl" => &["qwen2_vl_vision", "qwen2_vl", ""],
        "qwen3_vl" => &["qwen3_vl_vision", "qwen3_vl"],
        "qwen3_5" => &["qwen3_5_vision", "qwen3_5"],
        "qwen3_5_moe" => &["qwen3_5_moe_vision", "qwen3_5_moe"],
        "mistral3" => &["pixtral"],
        "gemma4" => &["gemma4_vision"],
        _ => {
            return Err(ModelError::config(
                &config_path,
                format!(
                    "`{model_type}` vision-language checkpoints are not supported yet (Gemma 3, \
                     SmolVLM's `idefics3` and `smolvlm`, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, \
                     Mistral 3 and Gemma 4 are)"
                ),
            ));
        }
    };
    if !towers.contains(&tower) {
        return Err(ModelError::config(
            &config_path,
            format!(
                "vision_config: tower `{tower}` is not supported for `{model_type}` (expected \
                 `{}`)",
                towers.join("` or `")
            ),
        ));
    }
    let mut files = SafetensorsFiles::open_dir(dir)?;
    let mut mlx = MlxQuantization::from_config(&config_path, &map)?;
    for (from, to) in MLX_VLM_NAMES {
        files.alias_prefix(from, to);
        mlx.iter_mut().for_each(|q| q.alias_prefix(from, to));
    }
    // A quantized projector (mlx-vlm quantizes SmolVLM's connector) runs on dequantized weights.
    let weights = Weights::new(
        Source::Safetensors(files),
        device.clone(),
        compute_dtype(device),
    )
    .with_mlx(mlx, MlxActivations::F32);
    let encoder: Arc<dyn ImageEncoder> = match model_type {
        "gemma3" => Arc::new(gemma3::Gemma3Vision::load(dir, &fields, &weights)?),
        "qwen2_5_vl" | "qwen2_vl" | "qwen3_vl" | "qwen3_5" | "qwen3_5_moe" => {
            Arc::new(qwen2_vl::QwenVlVision::load(dir, &fields, &weights)?)
        }
        "mistral3" => Arc::new(mistral3::Mistral3Vision::load(dir, &fields, &weights)?),
        "gemma4" => Arc::new(gemma4::Gemma4Vision::load(dir, &fields, &weights)?),
        _ => Arc::new(smolvlm::SmolVlmVision::load(dir, &fields, &weights)?),
    };
    Ok(Some(encoder))
}
