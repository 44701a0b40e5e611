//! MLX affine-quantized safetensors (`mlx-community/*-4bit` and `mlx_lm.convert -q` output).
//!
//! A quantized module `W` stores `W.weight` (u32 `[out, in * bits / 32]`), `W.scales` and
//! `W.biases` (`[out, in / group_size]`). config.json's `quantization` (or
//! `quantization_config`) gives the default `bits`/`group_size` and per-module overrides keyed by
//! module path. Whether a module is quantized is decided per tensor by whether `W.scales` exists,
//! because MLX leaves modules whose input does not divide by the group size in float.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use peregrine_tensor::{Device, GgufMatrix, MlxQuantized, Tensor};
use safetensors::tensor::Dtype;
use serde_json::{Map, Value};

use super::SafetensorsFiles;
use crate::{ModelError, Result};

/// How MLX 4- and 8-bit matrices are multiplied on CPU (other widths always use f32
/// activations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MlxActivations {
    /// Weights regrouped at load into blocks (GGUF Q4_1, or our
    /// [`Format::MLX8G64`](peregrine_tensor::quant::Format::MLX8G64); the same numbers) and
    /// multiplied by the integer kernels against activations rounded to 8 bits per 32 values, as
    /// llama.cpp multiplies its block formats: prefill 2-3× faster. Logits move by about 1e-2
    /// against mlx-lm's.
    #[default]
    Q8,
    /// The codes as stored against f32 activations, as mlx-lm computes: logits within ~1e-5 of
    /// mlx-lm's.
    F32,
}

/// Bits and group size of one quantized module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlxParams {
    /// Bits per code (2, 3, 4, 5, 6 or 8).
    pub bits: usize,
    /// Inputs sharing one scale/bias pair (32, 64 or 128).
    pub group_size: usize,
}

/// An MLX checkpoint's quantization settings from config.json.
#[derive(Debug, Clone)]
pub struct MlxQuantization {
    file: PathBuf,
    default: MlxParams,
    /// Per-module settings; `None` marks a module MLX was told to leave unquantized.
    overrides: HashMap<String, Option<MlxParams>>,
}

impl MlxQuantization {
    /// Reads `quantization` (or `quantization_config`) from a parsed config.json. `Ok(None)` when
    /// there is none or it is another library's (`quant_method`: GPTQ, AWQ, ...).
    pub fn from_config(file: &Path, config: &Map<String, Value>) -> Result<Option<Self>> {
        let key = ["quantization", "quantization_config"]
            .into_iter()
            .find(|k| config.get(*k).is_some_and(Value::is_object));
        let Some(key) = key else { return Ok(None) };
        let q = config[key].as_object().expect("checked to be an object");
        if q.contains_key("quant_method") {
            return Ok(None);
        }
        let err = |m: String| ModelError::config(file, format!("`{key}`: {m}"));
        match q.get("mode").and_then(Value::as_str).unwrap_or("affine") {
            "affine" => {}
            mode => {
                return Err(err(format!(
                    "unsupported MLX mode `{mode}` (supported: affine)"
                )));
            }
        }
        let default = params(q, None).map_err(|m| err(m.to_string()))?;
        let mut overrides = HashMap::new();
        for (module, v) in q {
            match v {
                Value::Object(o) => {
                    let p =
                        params(o, Some(default)).map_err(|m| err(format!("`{module}`: {m}")))?;
                    overrides.insert(module.clone(), Some(p));
                }
                Value::Bool(false) => {
                    overrides.insert(module.clone(), None);
                }
                _ => {}
            }
        }
        Ok(Some(Self {
            file: file.to_path_buf(),
            default,
            overrides,
        }))
    }

    /// Makes the overrides of modules stored as `{from}…` apply to them as `{to}…` too, as
    /// [`SafetensorsFiles::alias_prefix`] does for their tensors (`from` and `to` end in `.`).
    pub fn alias_prefix(&mut self, from: &str, to: &str) {
        let aliased: Vec<(String, Option<MlxParams>)> = (self.overrides.iter())
            .filter_map(|(module, &p)| {
                let rest = format!("{module}.").strip_prefix(from)?.to_string();
                Some((format!("{to}{rest}").trim_end_matches('.').to_string(), p))
            })
            .collect();
        self.overrides.extend(aliased);
    }

    /// The settings for module `prefix` (`model.layers.0.mlp.gate_proj`).
    pub fn params(&self, prefix: &str) -> Option<MlxParams> {
        match self.overrides.get(prefix) {
            Some(p) => *p,
            None => Some(self.default),
        }
    }
}

/// `bits` and `group_size` of one JSON object, falling back to `default` (module overrides).
fn params(
    o: &Map<String, Value>,
    default: Option<MlxParams>,
) -> std::result::Result<MlxParams, String> {
    let get = |k: &str, d: Option<usize>| match o.get(k).map(Value::as_u64) {
        Some(Some(n)) => Ok(n as usize),
        Some(None) => Err(format!("field `{k}` must be a positive integer")),
        None => d.ok_or_else(|| format!("missing field `{k}`")),
    };
    let p = MlxParams {
        bits: get("bits", default.map(|d| d.bits))?,
        group_size: get("group_size", default.map(|d| d.group_size))?,
    };
    if !peregrine_tensor::mlx::SUPPORTED_BITS.contains(&p.bits) {
        return Err(format!(
            "unsupported bits {} (supported: 2, 3, 4, 5, 6, 8)",
            p.bits
        ));
    }
    if !matches!(p.group_size, 32 | 64 | 128) {
        return Err(format!(
            "unsupported group_size {} (supported: 32, 64, 128)",
            p.group_size
        ));
    }
    Ok(p)
}

/// The quantized matrix `{prefix}.weight` `[out, in]`, or `None` when the module is stored in
/// float (no `{prefix}.scales`). Without a config entry the settings are read off the shapes.
/// With `regroup`, 4- and 8-bit matrices come back as blocks for the integer kernels when every
/// value survives (`Ok`), regrouped straight from the mapped file so that the codes and the
/// blocks are never both in memory; otherwise as stored (`Err`).
pub fn load_quantized(
    files: &SafetensorsFiles,
    quant: Option<&MlxQuantization>,
    prefix: &str,
    (out_dim, in_dim): (usize, usize),
    device: &Device,
    regroup: bool,
) -> Result<Option<std::result::Result<GgufMatrix, MlxQuantized>>> {
    let Some(QuantizedParts {
        w_name,
        scales,
        biases,
        params: p,
        ..
    }) = quantized_parts(files, quant, prefix, None, (out_dim, in_dim), device)?
    else {
        return Ok(None);
    };
    let params = (p.bits, p.group_size);
    if regroup && device.is_cpu() {
        let mapped = files.with_bytes(&w_name, Dtype::U32, |packed, done| {
            MlxQuantized::regroup_mapped(packed, &scales, &biases, params, done)
        })??;
        if let Some(blocks) = mapped {
            return Ok(Some(Ok(blocks)));
        }
    }
    let packed = files.load(&w_name, device)?;
    let q = MlxQuantized::new(packed, scales, biases, p.bits, p.group_size)?;
    Ok(Some(match regroup {
        true => q.into_gguf_matrix()?,
        false => Err(q),
    }))
}

/// A quantized module's tensors, read and checked: the scales and biases of rows
/// `first_row..` (all of them, or one stacked expert's).
struct QuantizedParts {
    w_name: String,
    scales: Tensor,
    biases: Tensor,
    first_row: usize,
    params: MlxParams,
}

/// `{prefix}.scales` and `.biases` (of every row, or with `expert: Some((n, e))` of expert `e`
/// of the `n` stacked ones alone), checked with `{prefix}.weight`'s shape against `[out, in]`
/// (behind `[n]` stacked experts), or `None` when the module is not quantized.
fn quantized_parts(
    files: &SafetensorsFiles,
    quant: Option<&MlxQuantization>,
    prefix: &str,
    expert: Option<(usize, usize)>,
    (out_dim, in_dim): (usize, usize),
    device: &Device,
) -> Result<Option<QuantizedParts>> {
    let scales_name = format!("{prefix}.scales");
    if !files.contains(&scales_name) {
        return Ok(None);
    }
    let (w_name, biases_name) = (format!("{prefix}.weight"), format!("{prefix}.biases"));
    let packed_dims = files.dims(&w_name)?.to_vec();
    let p = match quant.and_then(|q| q.params(prefix)) {
        Some(p) => p,
        None => inferred(&packed_dims, files.dims(&scales_name)?, in_dim),
    };
    let shape_err = |tensor: &str, got: &[usize], expected: Vec<usize>| ModelError::Shape {
        file: quant.map_or_else(|| files.path().to_path_buf(), |q| q.file.clone()),
        tensor: format!("{tensor} (MLX {} bits, group {})", p.bits, p.group_size),
        expected,
        got: got.to_vec(),
    };
    let lead: Vec<usize> = expert.map(|(n, _)| n).into_iter().collect();
    let words = [&lead[..], &[out_dim, in_dim * p.bits / 32]].concat();
    if packed_dims != words || !(in_dim * p.bits).is_multiple_of(32) {
        return Err(shape_err(&w_name, &packed_dims, words));
    }
    let groups = [&lead[..], &[out_dim, in_dim / p.group_size]].concat();
    for name in [&scales_name, &biases_name] {
        let got = files.dims(name)?;
        if got != groups || !in_dim.is_multiple_of(p.group_size) {
            return Err(shape_err(name, got, groups.clone()));
        }
    }
    let (scales, biases, first_row) = match expert {
        Some((_, e)) => (
            files.load_rows(&scales_name, e * out_dim, out_dim, device)?,
            files.load_rows(&biases_name, e * out_dim, out_dim, device)?,
            e * out_dim,
        ),
        None => (
            files.load(&scales_name, device)?,
            files.load(&biases_name, device)?,
            0,
        ),
    };
    Ok(Some(QuantizedParts {
        w_name,
        scales,
        biases,
        first_row,
        params: p,
    }))
}

/// Settings implied by the shapes (checkpoints whose config lost its `quantization`).
fn inferred(packed: &[usize], scales: &[usize], in_dim: usize) -> MlxParams {
    let last = |dims: &[usize]| dims.last().copied().unwrap_or(0).max(1);
    MlxParams {
        bits: last(packed) * 32 / in_dim.max(1),
        group_size: in_dim / last(scales),
    }
}

/// Expert `e` of one MoE layer's `n` stacked experts `{prefix}.weight` (u32
/// `[n, out, in * bits / 32]`, MLX's `switch_mlp`) as a matrix `[out, in]`, or `None` when the
/// stack is not quantized: that expert's codes, scales and biases alone are read, so a
/// streamed store reads what a resident one loads, and they are equal.
pub fn load_quantized_expert(
    files: &SafetensorsFiles,
    quant: Option<&MlxQuantization>,
    prefix: &str,
    (n, e): (usize, usize),
    (out_dim, in_dim): (usize, usize),
    device: &Device,
    regroup: bool,
) -> Result<Option<std::result::Result<GgufMatrix, MlxQuantized>>> {
    let dims = (out_dim, in_dim);
    let Some(module) = quantized_parts(files, quant, prefix, Some((n, e)), dims, device)? else {
        return Ok(None);
    };
    let mut mats = row_parts(files, module, &[(e * out_dim, out_dim)], device, regroup)?;
    Ok(mats.pop())
}

/// The quantized matrix `{prefix}.weight` `[sum(parts), in]` split by output rows into
/// consecutive matrices of `parts[i]` rows (Phi-3's fused `qkv_proj` and `gate_up_proj`), or
/// `None` when the module is stored in float. A row's codes, scales and biases belong to that
/// row alone, so each part is the same rows of all three.
pub fn load_quantized_rows(
    files: &SafetensorsFiles,
    quant: Option<&MlxQuantization>,
    prefix: &str,
    parts: &[usize],
    in_dim: usize,
    device: &Device,
    regroup: bool,
) -> Result<Option<Vec<std::result::Result<GgufMatrix, MlxQuantized>>>> {
    let out_dim: usize = parts.iter().sum();
    let Some(module) = quantized_parts(files, quant, prefix, None, (out_dim, in_dim), device)?
    else {
        return Ok(None);
    };
    let ranges = super::row_ranges(parts);
    row_parts(files, module, &ranges, device, regroup).map(Some)
}

/// Row ranges `(first, rows)` of a quantized module (a stack's experts counted as consecutive
/// rows) as matrices `[rows, in]`: each range's codes (read by position, that range alone),
/// scales and biases are the same rows of each. With `regroup`, regrouped into blocks when
/// every range regroups (as [`load_quantized`] does for one matrix), else kept as stored.
fn row_parts(
    files: &SafetensorsFiles,
    module: QuantizedParts,
    ranges: &[(usize, usize)],
    device: &Device,
    regroup: bool,
) -> Result<Vec<std::result::Result<GgufMatrix, MlxQuantized>>> {
    let QuantizedParts {
        w_name,
        scales,
        biases,
        first_row,
        params: p,
    } = module;
    let rows_of = |t: &Tensor| -> Result<Tensor> {
        let last = t.dims().last().copied().unwrap_or(1);
        Ok(t.reshape(((), last))?)
    };
    let (scales, biases) = (rows_of(&scales)?, rows_of(&biases)?);
    let rows = |t: &Tensor, (at, n): (usize, usize)| -> Result<Tensor> {
        Ok(t.narrow(0, at - first_row, n)?.contiguous()?)
    };
    let params = (p.bits, p.group_size);
    if regroup && device.is_cpu() {
        let regrouped = (ranges.iter())
            .map(|&(at, n)| {
                let (s, b) = (rows(&scales, (at, n))?, rows(&biases, (at, n))?);
                let (codes, _) = files.read_rows(&w_name, at, n)?;
                Ok(MlxQuantized::regroup_mapped(
                    &codes,
                    &s,
                    &b,
                    params,
                    &mut |_| {},
                )?)
            })
            .collect::<Result<Option<Vec<GgufMatrix>>>>()?;
        if let Some(blocks) = regrouped {
            return Ok(blocks.into_iter().map(Ok).collect());
        }
    }
    (ranges.iter())
        .map(|&(at, n)| {
            let w = files.load_rows(&w_name, at, n, device)?;
            let (s, b) = (rows(&scales, (at, n))?, rows(&biases, (at, n))?);
            let q = MlxQuantized::new(w, s, b, p.bits, p.group_size)?;
            Ok(match regroup {
                true => q.into_gguf_matrix()?,
                false => Err(q),
            })
        })
        .collect()
}
