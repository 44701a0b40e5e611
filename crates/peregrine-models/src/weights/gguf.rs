//! GGUF checkpoints: HF tensor names mapped to GGUF names in one place, and GGUF metadata
//! mapped onto [`ModelConfig`].

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use peregrine_tensor::candle::quantized::gguf_file::{Content, TensorInfo, Value};
use peregrine_tensor::candle::quantized::{GgmlDType, GgmlType, QStorage, QTensor, k_quants};
use peregrine_tensor::quant::Format;
use peregrine_tensor::{Device, GgufMatrix, RopeScaling, RopeStyle};

use crate::config::Activation;
use crate::{ModelConfig, ModelError, Result};

/// An open GGUF file: metadata and tensor directory in memory, tensor data read on demand.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    file: Mutex<File>,
}

/// The GGUF name of an HF tensor name (llama.cpp's naming) in a file of architecture `arch`, or
/// `None` if it has no counterpart. Gemma 2 and 3's sandwich norms differ: its `post_attention_layernorm`
/// follows attention, and `pre_feedforward_layernorm` is llama's `ffn_norm`. Phi-3 keeps HF's fused
/// projections: `attn_qkv` is `qkv_proj` and its `ffn_up` is `gate_up_proj` (gate rows, then up
/// rows; llama.cpp's SwiGLU halves), so it has no separate `gate_proj` / `up_proj`.
pub fn gguf_name(hf: &str, arch: &str) -> Option<String> {
    let global = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = global {
        return Some(name.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let mapped = match (module, arch) {
        ("post_attention_layernorm", "gemma2" | "gemma3") => "post_attention_norm",
        ("pre_feedforward_layernorm", "gemma2" | "gemma3") => "ffn_norm",
        ("post_feedforward_layernorm", "gemma2" | "gemma3") => "post_ffw_norm",
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
            file: Mutex::new(file),
        })
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

    /// Reads `out.len()` bytes of tensor `name` from byte `skip` of its data.
    fn read_at(&self, name: &str, info: &TensorInfo, skip: u64, out: &mut [u8]) -> Result<()> {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let at = self.content.tensor_data_offset + info.offset + skip;
        (file.seek(SeekFrom::Start(at)))
            .and_then(|_| file.read_exact(out))
            .map_err(|e| ModelError::Checkpoint {
                file: self.path.clone(),
                message: format!("tensor `{name}`: {e}"),
            })
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
            let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
            return self.content.tensor(&mut *file, &name, device).map_err(err);
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
                let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
                return self.content.tensor(&mut *file, &name, device).map_err(err);
            }
        };
        QTensor::new(storage, dims).map_err(err)
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
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let t = (self.content.tensor(&mut *file, name, &Device::Cpu))
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
    /// The stacked experts `hf` (`[n, out, in]`, llama.cpp's `ffn_*_exps`) as `n` matrices
    /// `[out, in]`, each read from its own slice of the tensor (experts are contiguous).
    pub fn expert_matrices(&self, hf: &str, n: usize, device: &Device) -> Result<Vec<GgufMatrix>> {
        let (name, info) = self.info(hf)?;
        let &[_, rows, cols] = info.shape.dims() else {
            return Err(ModelError::Checkpoint {
                file: self.path.clone(),
                message: format!(
                    "tensor `{name}`: expected 3 dimensions, got {:?}",
                    info.shape
                ),
            });
        };
        let parts: Vec<(usize, usize)> = (0..n).map(|e| (e * rows, rows)).collect();
        self.matrices_of_rows(&name, info, &parts, cols, device)
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
        self.matrices_of_rows(&name, info, &super::row_ranges(parts), cols, device)
    }

    /// Matrices of `cols` columns read from the rows `(first, count)` of tensor `name`, whose
    /// data is rows of `cols` values one after another.
    fn matrices_of_rows(
        &self,
        name: &str,
        info: &TensorInfo,
        parts: &[(usize, usize)],
        cols: usize,
        device: &Device,
    ) -> Result<Vec<GgufMatrix>> {
        let dtype = info.ggml_dtype;
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let err = |e: peregrine_tensor::candle::Error| ModelError::Checkpoint {
            file: self.path.clone(),
            message: format!("tensor `{name}`: {}", peregrine_tensor::error_message(&e)),
        };
        (parts.iter())
            .map(|&(first, rows)| {
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

/// The `partial_rotary_factor` whose `rotary_dim()` is exactly `rotary` of `head_dim` (the
/// smallest such f64 at or above `rotary / head_dim`, since `rotary_dim` truncates).
fn partial_rotary_factor(rotary: usize, head_dim: usize) -> f64 {
    let mut f = rotary as f64 / head_dim as f64;
    while ((head_dim as f64 * f) as usize) < rotary {
        f = f64::from_bits(f.to_bits() + 1);
    }
    f
}

/// A typed view of GGUF metadata with errors naming the key.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: String,
}

impl Meta<'_> {
    fn value(&self, key: &str) -> Option<&Value> {
        self.file.metadata().get(&format!("{}.{key}", self.arch))
    }

    fn err(&self, key: &str, what: &str) -> ModelError {
        ModelError::config(
            &self.file.path,
            format!("metadata `{}.{key}` {what}", self.arch),
        )
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .to_u64()
                .map(|n| Some(n as usize))
                .map_err(|_| self.err(key, "must be an integer")),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => v
                .to_u64()
                .map(|n| Some(n as f64))
                .map_err(|_| self.err(key, "must be a number")),
        }
    }
}

/// Maps GGUF metadata to a [`ModelConfig`] (llama.cpp's keys, `{arch}.block_count` etc.).
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let md = file.metadata();
    let arch = match md.get("general.architecture").map(|v| v.to_string()) {
        Some(Ok(a)) => a.clone(),
        _ => {
            return Err(ModelError::config(
                &file.path,
                "metadata `general.architecture` is missing",
            ));
        }
    };
    let meta = Meta {
        file,
        arch: arch.clone(),
    };
    let hidden_size = meta.usize("embedding_length")?;
    let heads = meta.usize("attention.head_count")?;
    let vocab_size = match md.get("tokenizer.ggml.tokens").map(|v| v.to_vec()) {
        Some(Ok(tokens)) => tokens.len(),
        _ => meta.usize("vocab_size")?,
    };
    let token_id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    let rope_scaling = match md
        .get(&format!("{arch}.rope.scaling.type"))
        .map(|v| v.to_string())
    {
        Some(Ok(kind)) if kind == "linear" => RopeScaling::Linear {
            factor: meta
                .opt_f64("rope.scaling.factor")?
                .ok_or_else(|| meta.err("rope.scaling.factor", "is missing"))?,
        },
        Some(Ok(kind)) if kind != "none" => {
            return Err(meta.err("rope.scaling.type", &format!("`{kind}` is not supported")));
        }
        _ => RopeScaling::None,
    };
    if file.content.tensor_infos.contains_key("rope_freqs.weight") {
        return Err(ModelError::config(
            &file.path,
            "per-frequency RoPE factors (`rope_freqs.weight`) are not supported yet",
        ));
    }
    let mut config = ModelConfig {
        model_type: arch.clone(),
        vocab_size,
        hidden_size,
        intermediate_size: meta.usize("feed_forward_length")?,
        num_hidden_layers: meta.usize("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: meta.opt_usize("attention.head_count_kv")?.unwrap_or(heads),
        head_dim: meta
            .opt_usize("attention.key_length")?
            .unwrap_or(hidden_size / heads),
        rms_norm_eps: meta
            .opt_f64("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5),
        rope_theta: meta.opt_f64("rope.freq_base")?.unwrap_or(10_000.0),
        rope_scaling,
        partial_rotary_factor: 1.0,
        // llama.cpp's converter permutes llama q/k weights for GPT-J-style rotation.
        rope_style: if arch == "llama" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        max_position_embeddings: meta.opt_usize("context_length")?.unwrap_or(4096),
        tie_word_embeddings: !file.content.tensor_infos.contains_key("output.weight"),
        sliding_window: meta.opt_usize("attention.sliding_window")?,
        attention_bias: file.content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        qk_norm: file
            .content
            .tensor_infos
            .contains_key("blk.0.attn_q_norm.weight"),
        norm_weight_offset: 0.0,
        activation: Activation::Silu,
        query_pre_attn_scalar: None,
        sliding_layers: None,
        rope_local_theta: None,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token_id("tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        moe: None,
        mla: None,
        v_norm: false,
        per_layer_input: None,
        layer_specs: vec![],
    };
    if let Some(experts) = meta.opt_usize("expert_count")? {
        // llama.cpp makes every layer of these families sparse and renormalises the chosen
        // experts' weights unless `expert_weights_norm` says otherwise.
        config.moe = Some(crate::config::MoeConfig {
            num_experts: experts,
            top_k: meta.usize("expert_used_count")?,
            intermediate_size: meta
                .opt_usize("expert_feed_forward_length")?
                .unwrap_or(config.intermediate_size),
            normalize: !matches!(meta.value("expert_weights_norm"), Some(Value::Bool(false))),
            sparse_layers: vec![true; config.num_hidden_layers],
            naming: crate::config::ExpertNaming::Qwen,
            sigmoid: None,
            shared_intermediate_size: None,
        });
    }
    if arch == "gemma3" {
        crate::arch::gemma3::configure_gguf(&mut config, meta.opt_f64("rope.freq_base_swa")?);
    }
    if let Some(rotary) = meta.opt_usize("rope.dimension_count")? {
        config.partial_rotary_factor = partial_rotary_factor(rotary, config.head_dim);
    }
    if arch == "phi3" {
        let factors = (
            file.f32_values("rope_factors_short.weight")?,
            file.f32_values("rope_factors_long.weight")?,
        );
        let scaling = (
            meta.opt_usize("rope.scaling.original_context_length")?,
            meta.opt_f64("rope.scaling.attn_factor")?,
        );
        crate::arch::phi3::configure_gguf(&mut config, &file.path, factors, scaling)?;
    }
    if arch == "gemma2" {
        let caps = (
            meta.opt_f64("attn_logit_softcapping")?,
            meta.opt_f64("final_logit_softcapping")?,
        );
        crate::arch::gemma2::configure_gguf(&mut config, caps);
    }
    config.validate(&file.path)?;
    Ok(config)
}
