//! GGUF checkpoints: HF tensor names mapped to GGUF names in one place, tensors read on
//! demand. The metadata's mapping onto `ModelConfig` is in `gguf_config.rs`.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use memmap2::Mmap;

use peregrine_tensor::candle::Result as CandleResult;
use peregrine_tensor::candle::quantized::gguf_file::{Content, TensorInfo, Value};
use peregrine_tensor::candle::quantized::{GgmlDType, GgmlType, QStorage, QTensor, k_quants};
use peregrine_tensor::quant::Format;
use peregrine_tensor::{Device, GgufMatrix};

use super::LoadProgress;
use super::mapped::{MappedFile, MappedRange, check_length};
use super::sigbus::Guard;
use crate::{ModelError, Result};

/// An open GGUF file: metadata and tensor directory in memory, tensor data read on demand.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    /// For candle's readers, which seek.
    file: Mutex<File>,
    /// For positioned reads, many at once (streamed experts).
    reader: File,
    /// The file mapped read-only, when first asked for (streamed experts multiplied in place),
    /// and its SIGBUS guard (dropped first); `None` if it could not be mapped.
    map: OnceLock<Option<(Option<Guard>, Arc<MappedFile>)>>,
    /// Counts the bytes of every tensor read.
    progress: Arc<LoadProgress>,
    /// The file's length when opened.
    len: u64,
}

/// The GGUF name of an HF tensor name (llama.cpp's naming) in a file of architecture `arch`, or
/// `None` if it has no counterpart. Gemma 2 and 3's sandwich norms differ: its `post_attention_layernorm`
/// follows attention, and `pre_feedforward_layernorm` is llama's `ffn_norm`. Phi-3 keeps HF's fused
/// projections: `attn_qkv` is `qkv_proj` and its `ffn_up` is `gate_up_proj` (gate rows, then up
/// rows; llama.cpp's SwiGLU halves), so it has no separate `gate_proj` / `up_proj`. Gemma 4's
/// tensors without a `.weight` suffix in HF (`layer_scalar`, `router.scale`, the stacked
/// `experts.*`) have one in GGUF, and its per-expert scale is `ffn_down_exps.scale`. DeepSeek's
/// `kv_b_proj` is split by llama.cpp's converter into `attn_k_b` (transposed) and `attn_v_b`,
/// HF-named here `k_b_proj` / `v_b_proj`. Qwen3-Next's `in_proj_qkvz` is split by the converter
/// into `attn_qkv` and `attn_gate` (HF-named as Qwen3.5's `in_proj_qkv` / `in_proj_z`); its
/// feed-forward norm is `post_attention_norm` (Qwen3.5's too); Qwen3.5's `in_proj_b` / `in_proj_a`
/// are `ssm_beta` / `ssm_alpha`. Falcon-H1's `mamba.*` are `ssm_*` as Mamba 2's mixer's, its
/// `feed_forward` is `ffn_*` and its `pre_ff_layernorm` the suffix-less `ffn_norm` (Jamba's has
/// the suffix; its Mamba v1 mixer adds `ssm_x`, `ssm_dt` and the `ssm_{dt,b,c}_norm`s).
pub fn gguf_name(hf: &str, arch: &str) -> Option<String> {
    if arch == "clip" {
        return super::gguf_clip::clip_name(hf);
    }
    let global = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" | "model.final_layernorm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        "model.embed_tokens_per_layer.weight" => Some("per_layer_token_embd.weight"),
        "model.per_layer_model_projection.weight" => Some("per_layer_model_proj.weight"),
        "model.per_layer_projection_norm.weight" => Some("per_layer_proj_norm.weight"),
        _ => None,
    };
    if let Some(name) = global {
        return Some(name.to_string());
    }
    if let Some(rest) = hf.strip_prefix("backbone.") {
        return mamba2_name(rest);
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let whole = match rest {
        "layer_scalar" => Some("layer_output_scale.weight"),
        "router.scale" => Some("ffn_gate_inp.scale"),
        "router.per_expert_scale" => Some("ffn_down_exps.scale"),
        "experts.gate_up_proj" => Some("ffn_gate_up_exps.weight"),
        "experts.down_proj" => Some("ffn_down_exps.weight"),
        "mlp.gate.e_score_correction_bias" => Some("exp_probs_b.bias"),
        "linear_attn.A_log" | "mamba.A_log" => Some("ssm_a"),
        "linear_attn.dt_bias" | "mamba.dt_bias" => Some("ssm_dt.bias"),
        "mamba.D" => Some("ssm_d"),
        "pre_ff_layernorm.weight" if arch == "falcon-h1" => Some("ffn_norm"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(format!("blk.{layer}.{name}"));
    }
    let (module, kind) = rest.rsplit_once('.')?;
    let gemma = matches!(arch, "gemma2" | "gemma3" | "gemma4");
    let mapped = match (module, arch) {
        ("post_attention_layernorm", _) if gemma => "post_attention_norm",
        ("pre_feedforward_layernorm", _) if gemma => "ffn_norm",
        ("post_feedforward_layernorm", _) if gemma => "post_ffw_norm",
        ("post_attention_layernorm", "qwen3next" | "qwen35" | "qwen35moe") => "post_attention_norm",
        ("linear_attn.in_proj_qkv", _) => "attn_qkv",
        ("linear_attn.in_proj_z", _) => "attn_gate",
        ("linear_attn.in_proj_ba", _) => "ssm_ba",
        ("linear_attn.in_proj_b", _) => "ssm_beta",
        ("linear_attn.in_proj_a", _) => "ssm_alpha",
        ("linear_attn.conv1d", _) => "ssm_conv1d",
        ("linear_attn.norm", _) => "ssm_norm",
        ("linear_attn.out_proj", _) => "ssm_out",
        ("pre_ff_layernorm", _) => "ffn_norm",
        ("feed_forward.router", _) => "ffn_gate_inp",
        ("feed_forward.switch_mlp.gate_proj", _) => "ffn_gate_exps",
        ("feed_forward.switch_mlp.up_proj", _) => "ffn_up_exps",
        ("feed_forward.switch_mlp.down_proj", _) => "ffn_down_exps",
        ("mamba.x_proj", _) => "ssm_x",
        ("mamba.dt_proj", _) => "ssm_dt",
        ("mamba.dt_layernorm", _) => "ssm_dt_norm",
        ("mamba.b_layernorm", _) => "ssm_b_norm",
        ("mamba.c_layernorm", _) => "ssm_c_norm",
        ("mamba.in_proj", _) => "ssm_in",
        ("mamba.conv1d", _) => "ssm_conv1d",
        ("mamba.norm", _) => "ssm_norm",
        ("mamba.out_proj", _) => "ssm_out",
        ("feed_forward.gate_proj", _) => "ffn_gate",
        ("feed_forward.up_proj", _) => "ffn_up",
        ("feed_forward.down_proj", _) => "ffn_down",
        ("mlp.shared_expert.gate_proj", _) => "ffn_gate_shexp",
        ("mlp.shared_expert.up_proj", _) => "ffn_up_shexp",
        ("mlp.shared_expert.down_proj", _) => "ffn_down_shexp",
        ("mlp.shared_expert_gate", _) => "ffn_gate_inp_shexp",
        ("pre_feedforward_layernorm_2", _) => "pre_ffw_norm_2",
        ("post_feedforward_layernorm_1", _) => "post_ffw_norm_1",
        ("post_feedforward_layernorm_2", _) => "post_ffw_norm_2",
        ("per_layer_input_gate", _) => "inp_gate",
        ("per_layer_projection", _) => "proj",
        ("post_per_layer_input_norm", _) => "post_norm",
        ("router.proj", _) => "ffn_gate_inp",
        ("self_attn.q_a_proj", _) => "attn_q_a",
        ("self_attn.q_a_layernorm", _) => "attn_q_a_norm",
        ("self_attn.q_b_proj", _) => "attn_q_b",
        ("self_attn.kv_a_proj_with_mqa", _) => "attn_kv_a_mqa",
        ("self_attn.kv_a_layernorm", _) => "attn_kv_a_norm",
        ("self_attn.kv_b_proj", _) => "attn_kv_b",
        ("self_attn.k_b_proj", _) => "attn_k_b",
        ("self_attn.v_b_proj", _) => "attn_v_b",
        ("mlp.shared_experts.gate_proj", _) => "ffn_gate_shexp",
        ("mlp.shared_experts.up_proj", _) => "ffn_up_shexp",
        ("mlp.shared_experts.down_proj", _) => "ffn_down_shexp",
        ("experts.switch_glu.gate_proj", _) => "ffn_gate_exps",
        ("experts.switch_glu.up_proj", _) => "ffn_up_exps",
        ("experts.switch_glu.down_proj", _) => "ffn_down_exps",
        ("mlp.gate_up_proj", "phi3") => "ffn_up",
        ("mlp.gate_proj" | "mlp.up_proj", "phi3") => return None,
        ("self_attn.qkv_proj", _) => "attn_qkv",
        ("input_layernorm", _) => "attn_norm",
        ("post_attention_layernorm", _) => "ffn_norm",
        ("self_attn.q_proj", _) => "attn_q",
        ("self_attn.k_proj", _) => "attn_k",
        ("self_attn.v_proj", _) => "attn_v",
        ("self_attn.o_proj", _) => "attn_output",
        ("self_attn.q_norm", _) => "attn_q_norm",
        ("self_attn.k_norm", _) => "attn_k_norm",
        ("mlp.gate_proj", _) => "ffn_gate",
        ("mlp.up_proj", _) => "ffn_up",
        ("mlp.down_proj", _) => "ffn_down",
        ("mlp.gate" | "block_sparse_moe.gate", _) => "ffn_gate_inp",
        ("mlp.switch_mlp.gate_proj" | "block_sparse_moe.switch_mlp.gate_proj", _) => {
            "ffn_gate_exps"
        }
        ("mlp.switch_mlp.up_proj" | "block_sparse_moe.switch_mlp.up_proj", _) => "ffn_up_exps",
        ("mlp.switch_mlp.down_proj" | "block_sparse_moe.switch_mlp.down_proj", _) => {
            "ffn_down_exps"
        }
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}.{kind}"))
}

/// Mamba 2's names (HF `backbone.*`) as llama.cpp's converter writes them.
fn mamba2_name(rest: &str) -> Option<String> {
    match rest {
        "embeddings.weight" => return Some("token_embd.weight".into()),
        "norm_f.weight" => return Some("output_norm.weight".into()),
        _ => {}
    }
    let (layer, rest) = rest.strip_prefix("layers.")?.split_once('.')?;
    let name = match rest {
        "norm.weight" => "attn_norm.weight",
        "mixer.A_log" => "ssm_a",
        "mixer.D" => "ssm_d",
        "mixer.dt_bias" => "ssm_dt.bias",
        "mixer.in_proj.weight" => "ssm_in.weight",
        "mixer.in_proj.bias" => "ssm_in.bias",
        "mixer.conv1d.weight" => "ssm_conv1d.weight",
        "mixer.conv1d.bias" => "ssm_conv1d.bias",
        "mixer.norm.weight" => "ssm_norm.weight",
        "mixer.out_proj.weight" => "ssm_out.weight",
        "mixer.out_proj.bias" => "ssm_out.bias",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}"))
}

impl GgufFile {
    /// Opens `path` and checks that every tensor's data lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let io_err = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        // Buffered: the header is hundreds of thousands of small fields (a 262K-token vocabulary).
        let content =
            Content::read(&mut BufReader::new(&mut file)).map_err(|e| ModelError::Checkpoint {
                file: path.to_path_buf(),
                message: format!(
                    "not a valid GGUF file: {}",
                    peregrine_tensor::error_message(&e)
                ),
            })?;
        for (name, info) in &content.tensor_infos {
            let dtype = info.ggml_dtype;
            let bytes = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
            let end = content.tensor_data_offset + info.offset + bytes as u64;
            if end > len {
                return Err(ModelError::Checkpoint {
                    file: path.to_path_buf(),
                    message: format!(
                        "tensor `{name}` ({dtype:?} {:?}) ends at byte {end} but the file has {len} bytes \
                         (truncated download?)",
                        info.shape.dims()
                    ),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader: file.try_clone().map_err(io_err)?,
            file: Mutex::new(file),
            map: OnceLock::new(),
            len,
            progress: Default::default(),
        })
    }

    /// Counts the bytes of every tensor read into `progress`.
    pub fn count_reads_in(&mut self, progress: Arc<LoadProgress>) {
        self.progress = progress;
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All key/value metadata (architecture, tokenizer, chat template).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// `general.architecture` (empty when missing; `config_from_gguf` reports that).
    fn arch(&self) -> &str {
        match self.content.metadata.get("general.architecture") {
            Some(Value::String(a)) => a,
            _ => "",
        }
    }

    fn name_for(&self, hf: &str) -> Option<String> {
        gguf_name(hf, self.arch()).filter(|n| self.content.tensor_infos.contains_key(n))
    }

    /// Whether the file has a tensor named `name` (GGUF naming).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The shape of the tensor named `name` (GGUF naming, `[out, in]` for a matrix), if present.
    pub fn tensor_dims(&self, name: &str) -> Option<Vec<usize>> {
        (self.content.tensor_infos.get(name)).map(|info| info.shape.dims().to_vec())
    }

    /// Whether the tensor with HF name `hf` is present.
    pub fn contains(&self, hf: &str) -> bool {
        self.name_for(hf).is_some()
    }

    /// The GGUF name and directory entry of the tensor with HF name `hf`.
    fn info(&self, hf: &str) -> Result<(String, &TensorInfo)> {
        match self.name_for(hf) {
            Some(name) => Ok((name.clone(), &self.content.tensor_infos[&name])),
            None => Err(ModelError::MissingTensor {
                file: self.path.clone(),
                tensor: match gguf_name(hf, self.arch()) {
                    Some(g) => format!("{g}` (HF `{hf}`)"),
                    None => hf.to_string(),
                },
            }),
        }
    }

    /// The shape of the tensor with HF name `hf`, `[out, in]` for a matrix.
    pub fn dims(&self, hf: &str) -> Result<Vec<usize>> {
        Ok(self.info(hf)?.1.shape.dims().to_vec())
    }

    /// Reads tensor `name`'s bytes into `out` (which holds exactly them).
    fn read_into(&self, name: &str, info: &TensorInfo, out: &mut [u8]) -> Result<()> {
        self.read_at(name, info, 0, out)
    }

    /// Reads `out.len()` bytes of tensor `name` from byte `skip` of its data (a positioned
    /// read: any number of them run at once). A file cut short since it was opened is an error
    /// naming it, never a crash.
    fn read_at(&self, name: &str, info: &TensorInfo, skip: u64, out: &mut [u8]) -> Result<()> {
        let at = self.content.tensor_data_offset + info.offset + skip;
        self.progress.add(out.len());
        super::read_exact_at(&self.reader, out, at).map_err(|e| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {e}"),
        })
    }

    /// The file mapped read-only, made on first use; `None` where it cannot be mapped (then
    /// its experts are read instead).
    fn mapping(&self) -> Option<&Arc<MappedFile>> {
        let map = self.map.get_or_init(|| {
            // SAFETY: mapped read-only. A file cut short under the mapping faults when its
            // lost pages are touched: every range is checked against the file's length when
            // made and before each use (`still_whole`), and paged in when made; a fault in
            // between reads zeros and fails the use (the guard, `unharmed`).
            let map = unsafe { Mmap::map(&self.reader) }.ok()?;
            Some((
                Guard::new(map.as_ptr(), map.len()),
                Arc::new(MappedFile::new(map)),
            ))
        });
        map.as_ref().map(|(_, map)| map)
    }

    /// The mapping's SIGBUS guard, if the file is mapped and guarded.
    fn guard(&self) -> Option<&Guard> {
        self.map.get()?.as_ref()?.0.as_ref()
    }

    /// `len` bytes of `map` from `at` (within tensor `name`), paged in.
    fn mapped_range(
        &self,
        map: &Arc<MappedFile>,
        name: &str,
        at: usize,
        len: usize,
    ) -> Result<Arc<MappedRange>> {
        let err = |message: String| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {message}"),
        };
        let range = MappedRange::new(map, &self.reader, &self.path, at, len);
        self.progress.add(len);
        Ok(Arc::new(range.map_err(|e| err(e.to_string()))?))
    }

    /// An error naming the file unless it is still as long as when it was opened (a range
    /// mapped before it was cut short must not be touched).
    /// Once whole again after a cut that damaged the mapping, its pages are mapped afresh.
    pub fn still_whole(&self) -> Result<()> {
        let err = |e: std::io::Error| ModelError::Checkpoint {
            file: self.path.clone(),
            message: e.to_string(),
        };
        check_length(&self.reader, &self.path, self.len).map_err(err)?;
        match self.guard() {
            Some(guard) if guard.damaged().is_some() => guard.repair(&self.reader).map_err(err),
            _ => Ok(()),
        }
    }

    /// An error naming the file if it was cut short while mapped bytes were being read (they
    /// read as zeros): what was computed from them since the last check must not be used.
    pub fn unharmed(&self) -> Result<()> {
        match self.guard().and_then(Guard::damaged) {
            Some(bytes) => Err(ModelError::Checkpoint {
                file: self.path.clone(),
                message: format!(
                    "cut short while in use: bytes {}..{} were gone when read",
                    bytes.start, bytes.end
                ),
            }),
            None => Ok(()),
        }
    }

    /// Reads the tensor with HF name `hf` (GGUF shapes are reported as `[out, in]`). On the CPU
    /// the bytes go straight into the tensor's storage: a large table is never held twice.
    pub fn qtensor(&self, hf: &str, device: &Device) -> Result<QTensor> {
        let (name, info) = self.info(hf)?;
        let err = |e: peregrine_tensor::candle::Error| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {}", peregrine_tensor::error_message(&e)),
        };
        if !matches!(device, Device::Cpu) {
            return self.candle_read(&name, info, device).map_err(err);
        }
        let dims = info.shape.dims().to_vec();
        let blocks = info.shape.elem_count() / info.ggml_dtype.block_size();
        let read = |out: &mut [u8]| self.read_into(&name, info, out);
        let storage = match info.ggml_dtype {
            GgmlDType::F32 => read_blocks::<f32>(blocks, read)?,
            GgmlDType::F16 => read_blocks::<half::f16>(blocks, read)?,
            GgmlDType::BF16 => read_blocks::<half::bf16>(blocks, read)?,
            GgmlDType::Q4_0 => read_blocks::<k_quants::BlockQ4_0>(blocks, read)?,
            GgmlDType::Q4_1 => read_blocks::<k_quants::BlockQ4_1>(blocks, read)?,
            GgmlDType::Q5_0 => read_blocks::<k_quants::BlockQ5_0>(blocks, read)?,
            GgmlDType::Q5_1 => read_blocks::<k_quants::BlockQ5_1>(blocks, read)?,
            GgmlDType::Q8_0 => read_blocks::<k_quants::BlockQ8_0>(blocks, read)?,
            GgmlDType::Q2K => read_blocks::<k_quants::BlockQ2K>(blocks, read)?,
            GgmlDType::Q3K => read_blocks::<k_quants::BlockQ3K>(blocks, read)?,
            GgmlDType::Q4K => read_blocks::<k_quants::BlockQ4K>(blocks, read)?,
            GgmlDType::Q5K => read_blocks::<k_quants::BlockQ5K>(blocks, read)?,
            GgmlDType::Q6K => read_blocks::<k_quants::BlockQ6K>(blocks, read)?,
            _ => {
                // Types Peregrine does not read itself: candle's reader (or its error).
                return self.candle_read(&name, info, device).map_err(err);
            }
        };
        QTensor::new(storage, dims).map_err(err)
    }

    /// Tensor `name` read by candle's reader onto `device`, its bytes counted as read.
    fn candle_read(&self, name: &str, info: &TensorInfo, dev: &Device) -> CandleResult<QTensor> {
        let blocks = info.shape.elem_count() / info.ggml_dtype.block_size();
        self.progress.add(blocks * info.ggml_dtype.type_size());
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        self.content.tensor(&mut *file, name, dev)
    }

    /// The values of the tensor named `name` in the file (GGUF naming: tensors with no HF
    /// counterpart, as Phi-3's `rope_factors_long.weight`), or `None` when it is absent.
    pub fn f32_values(&self, name: &str) -> Result<Option<Vec<f32>>> {
        if !self.content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        let err = |e: peregrine_tensor::candle::Error| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {}", peregrine_tensor::error_message(&e)),
        };
        let info = &self.content.tensor_infos[name];
        let t = (self.candle_read(name, info, &Device::Cpu))
            .and_then(|q| q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>());
        t.map(Some).map_err(err)
    }

    /// The tensor with HF name `hf` as a matrix for the CPU kernels (`[out, in]`). Formats that
    /// interleave are read as bytes and moved into that layout in place.
    pub fn matrix(&self, hf: &str, device: &Device) -> Result<GgufMatrix> {
        let (name, info) = self.info(hf)?;
        let dims = info.shape.dims();
        let format = Format::of(info.ggml_dtype);
        match (device, format, dims) {
            (Device::Cpu, Some(f), &[rows, cols]) if GgufMatrix::interleaves(f, rows, cols) => {
                let mut bytes = vec![0u8; rows * cols / f.block_len() * f.block_bytes()];
                self.read_into(&name, info, &mut bytes)?;
                Ok(GgufMatrix::from_blocks(f, bytes, (rows, cols))?)
            }
            _ => Ok(GgufMatrix::new(Arc::new(self.qtensor(hf, device)?))?),
        }
    }
}

impl GgufFile {
    /// Expert `e` of the stacked experts `hf` `[n, sum(parts), in]` (llama.cpp's `ffn_*_exps`;
    /// Gemma 4's `ffn_gate_up_exps` holds gate, then up) as consecutive matrices of `parts[i]`
    /// rows, read from that expert's bytes alone (experts are contiguous), none dequantized.
    pub fn expert_row_matrices(
        &self,
        hf: &str,
        (n, e): (usize, usize),
        parts: &[usize],
        device: &Device,
        in_place: bool,
    ) -> Result<Vec<GgufMatrix>> {
        let (name, info) = self.info(hf)?;
        let total: usize = parts.iter().sum();
        let &[experts, rows, cols] = info.shape.dims() else {
            return Err(ModelError::Checkpoint {
                file: self.path.clone(),
                message: format!(
                    "tensor `{name}`: expected 3 dimensions, got {:?}",
                    info.shape
                ),
            });
        };
        if (experts, rows) != (n, total) {
            return Err(ModelError::Shape {
                file: self.path.clone(),
                tensor: name,
                expected: vec![n, total, cols],
                got: vec![experts, rows, cols],
            });
        }
        let ranges: Vec<(usize, usize)> = (super::row_ranges(parts).iter())
            .map(|&(at, k)| (e * rows + at, k))
            .collect();
        self.matrices_of_rows(&name, info, &ranges, cols, device, in_place)
    }

    /// The matrix `hf` `[sum(parts), in]` split by output rows into consecutive matrices of
    /// `parts[i]` rows (Phi-3's fused `attn_qkv` and gate+up `ffn_up`), each read from its own
    /// bytes: a GGUF row is whole blocks that belong to it alone.
    pub fn row_matrices(
        &self,
        hf: &str,
        parts: &[usize],
        device: &Device,
    ) -> Result<Vec<GgufMatrix>> {
        let (name, info) = self.info(hf)?;
        let &[rows, cols] = info.shape.dims() else {
            return Err(ModelError::Checkpoint {
                file: self.path.clone(),
                message: format!(
                    "tensor `{name}`: expected 2 dimensions, got {:?}",
                    info.shape
                ),
            });
        };
        let total: usize = parts.iter().sum();
        if total != rows {
            return Err(ModelError::Shape {
                file: self.path.clone(),
                tensor: name,
                expected: vec![total, cols],
                got: vec![rows, cols],
            });
        }
        self.matrices_of_rows(&name, info, &super::row_ranges(parts), cols, device, false)
    }

    /// Matrices of `cols` columns read from the rows `(first, count)` of tensor `name`, whose
    /// data is rows of `cols` values one after another. `in_place`: where the CPU kernels
    /// multiply the format as the file lays it out, the rows are mapped instead of read
    /// ([`MappedRange`]: no copy, no repacking; for streamed experts, used once).
    fn matrices_of_rows(
        &self,
        name: &str,
        info: &TensorInfo,
        parts: &[(usize, usize)],
        cols: usize,
        device: &Device,
        in_place: bool,
    ) -> Result<Vec<GgufMatrix>> {
        let dtype = info.ggml_dtype;
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let err = |e: peregrine_tensor::candle::Error| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {}", peregrine_tensor::error_message(&e)),
        };
        (parts.iter())
            .map(|&(first, rows)| {
                if let (true, Device::Cpu, Some(f)) = (in_place, device, Format::of(dtype))
                    && GgufMatrix::multiplies_in_place(f, rows, cols)
                    && let Some(map) = self.mapping()
                {
                    let at = self.content.tensor_data_offset + info.offset;
                    let at = at as usize + first * row_bytes;
                    let range = self.mapped_range(map, name, at, rows * row_bytes)?;
                    return Ok(GgufMatrix::from_shared(f, range, (rows, cols))?);
                }
                let mut data = vec![0u8; rows * row_bytes];
                self.read_at(name, info, (first * row_bytes) as u64, &mut data)?;
                let format = Format::of(dtype);
                if let (Device::Cpu, Some(f)) = (device, format)
                    && GgufMatrix::interleaves(f, rows, cols)
                {
                    return Ok(GgufMatrix::from_blocks(f, data, (rows, cols))?);
                }
                let storage = QStorage::from_data(data.into(), device, dtype).map_err(err)?;
                let q = QTensor::new(storage, (rows, cols)).map_err(err)?;
                Ok(GgufMatrix::new(Arc::new(q))?)
            })
            .collect()
    }
}

/// `n` blocks of `T` filled by `read` with their bytes, as candle's CPU storage.
fn read_blocks<T: GgmlType + Send + Sync + 'static>(
    n: usize,
    read: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<QStorage> {
    let bytes = n * std::mem::size_of::<T>();
    debug_assert_eq!(
        bytes,
        n * T::DTYPE.type_size(),
        "{:?} blocks are padded",
        T::DTYPE
    );
    let mut blocks = vec![T::zeros(); n];
    // SAFETY: GGUF block types are plain data (floats, f16s and byte arrays, no padding or
    // invalid bit patterns), laid out as the file stores them, so any bytes are valid blocks.
    let out = unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), bytes) };
    read(out)?;
    Ok(QStorage::Cpu(Box::new(blocks)))
}
