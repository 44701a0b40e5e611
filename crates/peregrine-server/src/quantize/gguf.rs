//! `peregrine quantize --format gguf`: one GGUF file of an HF checkpoint's weights, with the
//! llama-family metadata and llama.cpp tensor names that Peregrine's GGUF loader reads back, and
//! the tokenizer transcribed as `tokenizer.ggml.*` (byte-level BPE only; the loader takes the
//! tokenizer from the file, not from a folder).
//!
//! As llama.cpp's converter does, `llama` q/k projections are permuted for GPT-J-style rotation
//! (the loader rotates `llama` GGUF files interleaved) and Gemma 2 and 3's norm weights store
//! `1 + w`; Gemma 2's soft caps go into `gemma2.{attn,final}_logit_softcapping`. Gemma 4 is
//! written as llama.cpp's converter writes it (per-layer arrays, the sliding pattern, the
//! proportional RoPE as a `rope_freqs` tensor).
//! Rope scalings other than linear cannot be expressed in the metadata the loader reads, so such
//! checkpoints are refused.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use peregrine_engine::tensor::candle::D;
use peregrine_engine::tensor::candle::quantized::gguf_file::{self, Value};

use super::gguf_write::write;
use peregrine_engine::tensor::candle::quantized::{GgmlDType, QTensor};
use peregrine_engine::tensor::candle::safetensors::MmapedSafetensors;
use peregrine_engine::tensor::{DType, Device, RopeScaling, Tensor};
use peregrine_models::ModelConfig;
use peregrine_models::config::{Fields, read_json_object};
use peregrine_models::weights::gguf_name;

/// `--type` values: llama.cpp's 32-element block types that candle quantizes on the CPU, and
/// plain f16 / f32.
pub const TYPES: [&str; 7] = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "f32"];

fn ggml_type(name: &str) -> Result<(GgmlDType, u32)> {
    // The second value is llama.cpp's `general.file_type` (LLAMA_FTYPE_MOSTLY_*).
    Ok(match name {
        "q4_0" => (GgmlDType::Q4_0, 2),
        "q4_1" => (GgmlDType::Q4_1, 3),
        "q8_0" => (GgmlDType::Q8_0, 7),
        "q5_0" => (GgmlDType::Q5_0, 8),
        "q5_1" => (GgmlDType::Q5_1, 9),
        "f32" => (GgmlDType::F32, 0),
        "f16" => (GgmlDType::F16, 1),
        other => bail!("--type {other}: supported are {}", TYPES.join(", ")),
    })
}

/// The HF config as Peregrine reads it (shared fields plus the architecture's adjustments).
fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let map = read_json_object(&path)?;
    if map.contains_key("quantization") || map.contains_key("quantization_config") {
        bail!("{}: the checkpoint is already quantized", path.display());
    }
    let fields = Fields::new(&path, &map);
    let mut config = ModelConfig::from_hf(&fields)?;
    use peregrine_models::arch;
    match config.model_type.as_str() {
        "llama" => arch::llama::configure(&fields, &mut config)?,
        "mistral" => arch::mistral::configure(&fields, &mut config)?,
        "qwen2" => arch::qwen2::configure(&fields, &mut config)?,
        "qwen3" => arch::qwen3::configure(&fields, &mut config)?,
        "qwen3_moe" => {
            arch::qwen3_moe::configure(&fields, &mut config)?;
            moe_expressible(&config).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
            config.model_type = "qwen3moe".into();
        }
        // llama.cpp writes Mixtral as `llama` with experts.
        "mixtral" => {
            arch::mixtral::configure(&fields, &mut config)?;
            moe_expressible(&config).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
            config.model_type = "llama".into();
        }
        "gemma2" => {
            arch::gemma2::configure(&fields, &mut config)?;
            gemma_expressible(&config)
                .map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
        }
        "gemma3_text" => {
            arch::gemma3::configure(&fields, &mut config)?;
            config.model_type = "gemma3".into();
            gemma_expressible(&config)
                .map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
        }
        "gemma4_text" => {
            arch::gemma4::configure(&fields, &mut config)?;
            config.model_type = "gemma4".into();
        }
        other => bail!(
            "{}: model_type `{other}` cannot be written as GGUF (supported: llama, mistral, \
             mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, gemma4_text)",
            path.display()
        ),
    }
    Ok(config)
}

/// GGUF MoE files make every layer sparse (llama.cpp has no `mlp_only_layers` for these
/// families).
fn moe_expressible(c: &ModelConfig) -> std::result::Result<(), String> {
    match &c.moe {
        Some(moe) if moe.sparse_layers.iter().any(|s| !s) => Err(
            "GGUF MoE files route every layer; this checkpoint keeps dense layers \
             (`mlp_only_layers` / `decoder_sparse_step`)"
                .into(),
        ),
        _ => Ok(()),
    }
}

/// `(layer, projection)` of a per-expert HF tensor
/// (`model.layers.L.{mlp,block_sparse_moe}.experts.E.{gate_proj|w1,up_proj|w3,down_proj|w2}.weight`),
/// the projection named as in a stacked `switch_mlp`.
fn expert_tensor(name: &str) -> Option<(usize, &'static str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest
        .strip_prefix("mlp.experts.")
        .or_else(|| rest.strip_prefix("block_sparse_moe.experts."))?;
    let (_, proj) = rest.split_once('.')?;
    let proj = match proj {
        "gate_proj.weight" | "w1.weight" => "gate_proj",
        "up_proj.weight" | "w3.weight" => "up_proj",
        "down_proj.weight" | "w2.weight" => "down_proj",
        _ => return None,
    };
    Some((layer.parse().ok()?, proj))
}

/// One projection of layer `layer`'s experts stacked `[experts, out, in]`, with its HF name in
/// the stacked form GGUF names map from.
fn stacked_experts(
    files: &MmapedSafetensors,
    names: &[String],
    layer: usize,
    proj: &str,
) -> Result<(String, Tensor)> {
    let mut each: Vec<(usize, Tensor)> = Vec::new();
    for name in names {
        if expert_tensor(name) != Some((layer, proj)) {
            continue;
        }
        let e: usize = name
            .split(".experts.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|e| e.parse().ok())
            .with_context(|| format!("tensor `{name}`: no expert index"))?;
        each.push((e, files.load(name, &Device::Cpu)?.to_dtype(DType::F32)?));
    }
    each.sort_by_key(|(e, _)| *e);
    if each.iter().enumerate().any(|(i, (e, _))| i != *e) {
        bail!("layer {layer}: the experts' `{proj}` tensors are not numbered 0..n");
    }
    let stacked = Tensor::stack(&each.into_iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?;
    Ok((
        format!("model.layers.{layer}.mlp.switch_mlp.{proj}.weight"),
        stacked,
    ))
}

/// GGUF `gemma2` / `gemma3` files (`c.model_type`) carry no layer pattern or attention scale,
/// `gemma3` no soft caps and `gemma2` no way to turn its caps off: llama.cpp (and our loader,
/// `configure_gguf`) fix them, so a checkpoint that differs cannot be written faithfully.
fn gemma_expressible(c: &ModelConfig) -> std::result::Result<(), String> {
    use peregrine_models::arch::{gemma2, gemma3};
    let arch = c.model_type.as_str();
    let caps = (c.attn_logit_softcapping, c.final_logit_softcapping);
    let mut read_back = c.clone();
    let layers = match arch {
        "gemma2" => {
            gemma2::configure_gguf(&mut read_back, caps);
            "the even layers"
        }
        _ => {
            gemma3::configure_gguf(&mut read_back, c.rope_local_theta);
            // The loader reads no caps for `gemma3` (llama.cpp has none).
            read_back.attn_logit_softcapping = None;
            read_back.final_logit_softcapping = None;
            "every layer but each sixth"
        }
    };
    if c.sliding_layers != read_back.sliding_layers {
        return Err(format!(
            "GGUF {arch} files slide {layers}; this checkpoint's `layer_types` differ"
        ));
    }
    if c.query_pre_attn_scalar != read_back.query_pre_attn_scalar {
        return Err(format!(
            "GGUF {arch} files scale attention by {:?}^-0.5 (llama.cpp's rule); \
             `query_pre_attn_scalar` is {:?}",
            read_back.query_pre_attn_scalar, c.query_pre_attn_scalar
        ));
    }
    if caps
        != (
            read_back.attn_logit_softcapping,
            read_back.final_logit_softcapping,
        )
    {
        return Err(format!(
            "GGUF {arch} files cannot hold this checkpoint's soft caps \
             (`attn_logit_softcapping`, `final_logit_softcapping`: {caps:?})"
        ));
    }
    Ok(())
}

/// `{arch}.*` metadata, as llama.cpp writes it and `config_from_gguf` reads it.
fn model_metadata(c: &ModelConfig, file_type: u32) -> Result<Vec<(String, Value)>> {
    let arch = &c.model_type;
    let u = |n: usize| Value::U32(n as u32);
    let mut md = vec![
        ("general.architecture".into(), Value::String(arch.clone())),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
        (
            format!("{arch}.context_length"),
            u(c.max_position_embeddings),
        ),
        (format!("{arch}.embedding_length"), u(c.hidden_size)),
        (format!("{arch}.block_count"), u(c.num_hidden_layers)),
        (
            format!("{arch}.feed_forward_length"),
            u(c.intermediate_size),
        ),
        (
            format!("{arch}.attention.head_count"),
            u(c.num_attention_heads),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            u(c.num_key_value_heads),
        ),
        (format!("{arch}.attention.key_length"), u(c.head_dim)),
        (format!("{arch}.attention.value_length"), u(c.head_dim)),
        (format!("{arch}.rope.dimension_count"), u(c.rotary_dim())),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (
            format!("{arch}.rope.freq_base"),
            Value::F32(c.rope_theta as f32),
        ),
        (format!("{arch}.vocab_size"), u(c.vocab_size)),
    ];
    if arch == "gemma4" {
        gemma4_metadata(c, &mut md)?;
        return Ok(md);
    }
    match c.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            md.push((
                format!("{arch}.rope.scaling.type"),
                Value::String("linear".into()),
            ));
            md.push((
                format!("{arch}.rope.scaling.factor"),
                Value::F32(factor as f32),
            ));
        }
        RopeScaling::Yarn { .. } => bail!("yarn rope scaling is not written to GGUF yet"),
        RopeScaling::LongRope { .. } => bail!(
            "longrope scaling is not written to GGUF yet (llama.cpp stores its factors as \
             `rope_factors_long` / `rope_factors_short` tensors)"
        ),
        RopeScaling::Proportional { .. } => {
            bail!("proportional rope (Gemma 4) is not written to GGUF yet")
        }
        // A divisor per rotated pair in the `rope_freqs` tensor ([`rope_freqs`]), as llama.cpp's
        // converter writes it; no metadata key.
        RopeScaling::Llama3 { .. } | RopeScaling::Factors(_) => {}
    }
    common_metadata(c, &mut md);
    Ok(md)
}

/// Keys written the same way for every family: the window, the experts, the sliding layers'
/// RoPE base and the soft caps.
fn common_metadata(c: &ModelConfig, md: &mut Vec<(String, Value)>) {
    let (arch, u) = (&c.model_type, |n: usize| Value::U32(n as u32));
    if let Some(w) = c.sliding_window {
        md.push((format!("{arch}.attention.sliding_window"), u(w)));
    }
    if let Some(moe) = &c.moe {
        md.push((format!("{arch}.expert_count"), u(moe.num_experts)));
        md.push((format!("{arch}.expert_used_count"), u(moe.top_k)));
        md.push((
            format!("{arch}.expert_feed_forward_length"),
            u(moe.intermediate_size),
        ));
        // Gemma 4's routing always renormalises; its converter writes no such key.
        if arch != "gemma4" {
            let norm = Value::Bool(moe.normalize);
            md.push((format!("{arch}.expert_weights_norm"), norm));
        }
    }
    if let Some(theta) = c.rope_local_theta {
        md.push((
            format!("{arch}.rope.freq_base_swa"),
            Value::F32(theta as f32),
        ));
    }
    let caps = [
        ("attn_logit_softcapping", c.attn_logit_softcapping),
        ("final_logit_softcapping", c.final_logit_softcapping),
    ];
    for (key, cap) in caps {
        if let Some(cap) = cap {
            md.push((format!("{arch}.{key}"), Value::F32(cap as f32)));
        }
    }
}

/// Gemma 4's keys as llama.cpp's converter writes them (`Gemma4Model.set_gguf_parameters`;
/// the loader's reading is `arch/gemma4/gguf.rs`): `key_length` is the full layers' head width
/// and `key_length_swa` the sliding ones', widths and KV heads become per-layer arrays where
/// layers differ, the pattern is one boolean per layer. Its proportional RoPE is the
/// `rope_freqs` tensor ([`gemma4_rope_freqs`]).
fn gemma4_metadata(c: &ModelConfig, md: &mut Vec<(String, Value)>) -> Result<()> {
    let (arch, u) = (&c.model_type, |n: usize| Value::U32(n as u32));
    let sliding = c
        .sliding_layers
        .clone()
        .context("gemma4: no layer pattern")?;
    let specs = &c.layer_specs;
    if specs.len() != c.num_hidden_layers || c.partial_rotary_factor != 1.0 {
        bail!(
            "gemma4: per-layer shapes or a partial rotary on the sliding layers cannot be written"
        );
    }
    let full = gemma4_full_head_dim(c);
    for (i, s) in specs.iter().enumerate() {
        if s.head_dim != if sliding[i] { c.head_dim } else { full } {
            bail!(
                "gemma4: layer {i}'s head width {} is neither kind's",
                s.head_dim
            );
        }
    }
    // Arrays of i32, as gguf-py writes Python lists.
    let per_layer = |values: Vec<usize>| match values.iter().all(|&v| v == values[0]) {
        true => u(values[0]),
        false => Value::Array(values.into_iter().map(|v| Value::I32(v as i32)).collect()),
    };
    let set = |md: &mut Vec<(String, Value)>, key: &str, value: Value| {
        let key = format!("{arch}.{key}");
        md.retain(|(k, _)| *k != key);
        md.push((key, value));
    };
    set(
        md,
        "feed_forward_length",
        per_layer(specs.iter().map(|s| s.intermediate_size).collect()),
    );
    set(
        md,
        "attention.head_count_kv",
        per_layer(specs.iter().map(|s| s.num_key_value_heads).collect()),
    );
    for key in [
        "attention.key_length",
        "attention.value_length",
        "rope.dimension_count",
    ] {
        set(md, key, u(full));
    }
    for key in [
        "attention.key_length_swa",
        "attention.value_length_swa",
        "rope.dimension_count_swa",
    ] {
        set(md, key, u(c.head_dim));
    }
    let shared = specs.iter().filter(|s| s.kv_source.is_some()).count();
    set(md, "attention.shared_kv_layers", u(shared));
    let pattern = sliding.iter().map(|&s| Value::Bool(s)).collect();
    set(
        md,
        "attention.sliding_window_pattern",
        Value::Array(pattern),
    );
    let per_layer_input = c.per_layer_input.map_or(0, |p| p.hidden);
    set(md, "embedding_length_per_layer_input", u(per_layer_input));
    gemma4_rope_freqs(c)?;
    common_metadata(c, md);
    Ok(())
}

/// The full (global) layers' head width: the first full layer's (the sliding one's if none).
fn gemma4_full_head_dim(c: &ModelConfig) -> usize {
    let sliding = c.sliding_layers.as_deref().unwrap_or_default();
    let full = (0..sliding.len()).find(|&i| !sliding[i]);
    full.map_or(c.head_dim, |i| c.layer_specs[i].head_dim)
}

/// The `rope_freqs` tensor the model needs, if any: Gemma 4's ([`gemma4_rope_freqs`]), or each
/// rotated pair's divisor of its frequency for Llama 3.1's scaling (llama.cpp's
/// `LlamaModel.generate_extra_tensors`: the plain frequency over the scaled one).
fn rope_freqs(c: &ModelConfig) -> Result<Option<Tensor>> {
    use peregrine_engine::tensor::rope::inv_freqs;
    if c.model_type == "gemma4" {
        return gemma4_rope_freqs(c).map(Some);
    }
    let (rotary, theta) = (c.rotary_dim(), c.rope_theta);
    let scaled = match c.rope_scaling {
        ref s @ (RopeScaling::Llama3 { .. } | RopeScaling::Factors(_)) => {
            inv_freqs(rotary, theta, s)
        }
        _ => return Ok(None),
    };
    let plain = inv_freqs(rotary, theta, &RopeScaling::None);
    let factors: Vec<f32> = (plain.iter().zip(&scaled))
        .map(|(p, s)| (p / s) as f32)
        .collect();
    Ok(Some(Tensor::new(factors, &Device::Cpu)?))
}

/// The `rope_freqs` tensor that stands for Gemma 4's proportional RoPE over the full layers'
/// heads (llama.cpp's converter's `generate_extra_tensors`): 1 for the pairs that turn, 1e30
/// (frequency 0) for the rest.
fn gemma4_rope_freqs(c: &ModelConfig) -> Result<Tensor> {
    let head_dim = gemma4_full_head_dim(c);
    let turning = match c.rope_scaling {
        RopeScaling::Proportional {
            factor: 1.0,
            partial_rotary_factor,
        } => (partial_rotary_factor * head_dim as f64 / 2.0).floor() as usize,
        RopeScaling::None => head_dim / 2,
        ref other => bail!("gemma4: RoPE {other:?} cannot be written as `rope_freqs`"),
    };
    let values: Vec<f32> = (0..head_dim / 2)
        .map(|i| if i < turning { 1.0 } else { 1e30 })
        .collect();
    Ok(Tensor::new(values, &Device::Cpu)?)
}

/// llama.cpp's `LlamaModel.permute`: within each head, rows `[0, d/2)` and `[d/2, d)` (the
/// halves HF rotates together) become interleaved pairs.
fn permute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims[0];
    let mut shape = vec![heads, 2, rows / heads / 2];
    shape.extend_from_slice(&dims[1..]);
    Ok(w.reshape(shape)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// Runs `peregrine quantize --format gguf --type <type>`.
pub fn run(model: &Path, out: &Path, type_name: &str) -> Result<()> {
    let (qtype, file_type) = ggml_type(type_name)?;
    if out.exists() {
        bail!("{}: already exists", out.display());
    }
    if model.is_file() {
        return convert(model, out, qtype, file_type, type_name);
    }
    let config = read_config(model)?;
    let mut metadata = model_metadata(&config, file_type)?;
    metadata.extend(super::gguf_tokenizer::tokenizer_metadata(
        model,
        config.vocab_size,
    )?);

    let files = super::open_safetensors(model)?;
    let mut tensors: BTreeMap<String, QTensor> = BTreeMap::new();
    let (mut quantized, mut kept) = (0, 0);
    let names: Vec<String> = files.tensors().into_iter().map(|(n, _)| n).collect();
    // Experts are written stacked, one tensor per layer and projection, each stack built when
    // its turn comes (all of them at once in f32 would hold the model twice over).
    let inputs = (names.iter()).filter_map(|name| match expert_tensor(name) {
        Some((layer, proj)) => name
            .contains(".experts.0.")
            .then_some((name, Some((layer, proj)))),
        None => Some((name, None)),
    });
    for (name, expert) in inputs {
        let (name, loaded) = match expert {
            Some((layer, proj)) => {
                let (stacked, t) = stacked_experts(&files, &names, layer, proj)?;
                (stacked, Some(t))
            }
            None => (name.clone(), None),
        };
        if name == "lm_head.weight" && config.tie_word_embeddings {
            continue;
        }
        let Some(gname) = gguf_name(&name, &config.model_type) else {
            bail!(
                "{}: tensor `{name}` has no GGUF name in the llama family",
                model.display()
            );
        };
        let mut t = match loaded {
            Some(t) => t,
            None => files.load(&name, &Device::Cpu)?.to_dtype(DType::F32)?,
        };
        // GGUF norm weights hold Gemma's `1 + w` (llama.cpp's converter adds the offset).
        if config.norm_weight_offset != 0.0 && name.ends_with("norm.weight") {
            t = (t + config.norm_weight_offset)?;
        }
        if config.model_type == "llama" {
            if name.contains("self_attn.q_proj.") {
                t = permute_qk(&t, config.num_attention_heads)?;
            } else if name.contains("self_attn.k_proj.") {
                t = permute_qk(&t, config.num_key_value_heads)?;
            }
        }
        let block = qtype.block_size();
        // Routers stay f32, as llama.cpp keeps `ffn_gate_inp`.
        let router = name.ends_with(".gate.weight") || name.ends_with(".router.proj.weight");
        let q = if (2..=3).contains(&t.rank()) && !router && t.dim(D::Minus1)?.is_multiple_of(block)
        {
            quantized += 1;
            QTensor::quantize(&t, qtype)
        } else {
            kept += 1;
            QTensor::quantize(&t, GgmlDType::F32)
        };
        tensors.insert(gname, q.with_context(|| format!("tensor `{name}`"))?);
    }
    if let Some(freqs) = rope_freqs(&config)? {
        let freqs = QTensor::quantize(&freqs, GgmlDType::F32)?;
        tensors.insert("rope_freqs.weight".into(), freqs);
        kept += 1;
    }
    write(out, &metadata, &tensors)?;
    eprintln!(
        "wrote {}: {quantized} tensors as {type_name}, {kept} as f32",
        out.display()
    );
    Ok(())
}

/// Rewrites the GGUF file `model` with its matrices as `qtype` (dequantized first), the rest
/// and every metadata key as they are: an f32 or f16 copy of a quantized file, for example.
fn convert(
    model: &Path,
    out: &Path,
    qtype: GgmlDType,
    file_type: u32,
    type_name: &str,
) -> Result<()> {
    let mut file =
        std::fs::File::open(model).with_context(|| format!("{}: cannot open", model.display()))?;
    let content = gguf_file::Content::read(&mut file)
        .with_context(|| format!("{}: not a GGUF file", model.display()))?;
    let mut metadata: Vec<(String, Value)> = (content.metadata.iter())
        .filter(|(k, _)| k.as_str() != "general.file_type")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.push(("general.file_type".into(), Value::U32(file_type)));
    let (mut converted, mut kept) = (0, 0);
    let mut tensors = BTreeMap::new();
    for name in content.tensor_infos.keys() {
        let t = (content.tensor(&mut file, name, &Device::Cpu))
            .with_context(|| format!("{}: tensor `{name}`", model.display()))?;
        let dims = t.shape().dims().to_vec();
        let fits = dims.last().is_some_and(|d| d % qtype.block_size() == 0);
        let q = match dims.len() >= 2 && fits && t.dtype() != qtype {
            true => {
                converted += 1;
                QTensor::quantize(&t.dequantize(&Device::Cpu)?, qtype)
                    .with_context(|| format!("tensor `{name}`"))?
            }
            false => {
                kept += 1;
                t
            }
        };
        tensors.insert(name.clone(), q);
    }
    write(out, &metadata, &tensors)?;
    eprintln!(
        "wrote {}: {converted} tensors as {type_name}, {kept} as they were",
        out.display()
    );
    Ok(())
}
