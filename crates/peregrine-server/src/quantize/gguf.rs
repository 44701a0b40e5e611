//! `peregrine quantize --format gguf`: one GGUF file of an HF checkpoint's weights, with the
//! llama-family metadata and llama.cpp tensor names that Peregrine's GGUF loader reads back, and
//! the tokenizer transcribed as `tokenizer.ggml.*` (byte-level BPE only; the loader takes the
//! tokenizer from the file, not from a folder).
//!
//! As llama.cpp's converter does, `llama` q/k projections are permuted for GPT-J-style rotation
//! (the loader rotates `llama` GGUF files interleaved) and Gemma 2 and 3's norm weights store
//! `1 + w`; Gemma 2's soft caps go into `gemma2.{attn,final}_logit_softcapping`.
//! Rope scalings other than linear cannot be expressed in the metadata the loader reads, so such
//! checkpoints are refused.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use peregrine_engine::tensor::candle::D;
use peregrine_engine::tensor::candle::quantized::gguf_file::{self, Value};
use peregrine_engine::tensor::candle::quantized::{GgmlDType, QTensor};
use peregrine_engine::tensor::candle::safetensors::MmapedSafetensors;
use peregrine_engine::tensor::{DType, Device, RopeScaling, Tensor};
use peregrine_models::ModelConfig;
use peregrine_models::config::{Fields, read_json_object};
use peregrine_models::weights::gguf_name;
use serde_json::Value as Json;

/// `--type` values: llama.cpp's 32-element block types that candle quantizes on the CPU.
pub const TYPES: [&str; 5] = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"];

fn ggml_type(name: &str) -> Result<(GgmlDType, u32)> {
    // The second value is llama.cpp's `general.file_type` (LLAMA_FTYPE_MOSTLY_*).
    Ok(match name {
        "q4_0" => (GgmlDType::Q4_0, 2),
        "q4_1" => (GgmlDType::Q4_1, 3),
        "q8_0" => (GgmlDType::Q8_0, 7),
        "q5_0" => (GgmlDType::Q5_0, 8),
        "q5_1" => (GgmlDType::Q5_1, 9),
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
        other => bail!(
            "{}: model_type `{other}` cannot be written as GGUF \
             (supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text)",
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
        RopeScaling::Llama3 { .. } => bail!(
            "llama3 rope scaling cannot be written as GGUF metadata that Peregrine's GGUF loader \
             reads (llama.cpp stores it as a `rope_freqs` tensor, which the loader refuses)"
        ),
    }
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
        md.push((
            format!("{arch}.expert_weights_norm"),
            Value::Bool(moe.normalize),
        ));
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
    Ok(md)
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
    let config = read_config(model)?;
    let mut metadata = model_metadata(&config, file_type)?;
    metadata.extend(tokenizer_metadata(model, config.vocab_size)?);

    let files = super::open_safetensors(model)?;
    let mut tensors: BTreeMap<String, QTensor> = BTreeMap::new();
    let (mut quantized, mut kept) = (0, 0);
    let names: Vec<String> = files.tensors().into_iter().map(|(n, _)| n).collect();
    let mut inputs: Vec<(String, Option<Tensor>)> = Vec::new();
    for name in &names {
        match expert_tensor(name) {
            // Experts are written stacked, one tensor per layer and projection.
            Some((layer, proj)) => {
                if name.contains(".experts.0.") {
                    let (stacked, t) = stacked_experts(&files, &names, layer, proj)?;
                    inputs.push((stacked, Some(t)));
                }
            }
            None => inputs.push((name.clone(), None)),
        }
    }
    for (name, loaded) in inputs {
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
        let router = name.ends_with(".gate.weight");
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
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("{}: cannot create", out.display()))?,
    );
    gguf_file::write(&mut f, &md, &ts)
        .and_then(|()| std::io::Write::flush(&mut f).map_err(Into::into))
        .with_context(|| format!("{}: cannot write", out.display()))?;
    eprintln!(
        "wrote {}: {quantized} tensors as {type_name}, {kept} as f32",
        out.display()
    );
    Ok(())
}

/// The pre-tokenizer regexes llama.cpp knows by name (`tokenizer.ggml.pre`), as tokenizer.json
/// spells them.
const PRE_NAMES: &[(&str, &str)] = &[
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
];

/// `tokenizer.ggml.*` from tokenizer.json (+ tokenizer_config.json for BOS/EOS and the chat
/// template). Only byte-level BPE is transcribed: SentencePiece models would need scores and
/// token types that tokenizer.json does not carry in the same form.
fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Value)>> {
    let path = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: cannot read (the GGUF loader takes the tokenizer from the file)",
            path.display()
        )
    })?;
    let tok: Json =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let unsupported = |why: &str| {
        anyhow::anyhow!(
            "{}: {why}; only byte-level BPE tokenizers can be written into GGUF",
            path.display()
        )
    };
    let model = &tok["model"];
    if model["type"] != "BPE" {
        return Err(unsupported("the model is not BPE"));
    }
    let pre =
        pre_name(&tok["pre_tokenizer"]).ok_or_else(|| unsupported("unknown pre-tokenizer"))?;

    // Token texts by id: the BPE vocabulary, then added tokens; holes and the rows past the
    // tokenizer (embedding tables are often padded) get llama.cpp's `[PAD{id}]` names.
    let mut texts: BTreeMap<usize, (String, i32)> = BTreeMap::new();
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| unsupported("`model.vocab` is not an object"))?;
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| unsupported("a vocabulary id is not an integer"))?;
        texts.insert(id as usize, (text.clone(), 1)); // 1: normal
    }
    for added in tok["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(unsupported("an added token lacks `id` or `content`"));
        };
        // 3: control (special), 4: user-defined.
        let kind = if added["special"].as_bool().unwrap_or(false) {
            3
        } else {
            4
        };
        texts.insert(id as usize, (text.to_string(), kind));
    }
    let n = texts.keys().next_back().map_or(0, |&last| last + 1);
    if n > vocab_size {
        bail!(
            "{}: {n} token ids but the model has {vocab_size} embedding rows",
            path.display()
        );
    }
    let (mut tokens, mut types) = (Vec::with_capacity(vocab_size), vec![]);
    for id in 0..vocab_size {
        let (text, kind) = texts
            .remove(&id)
            .unwrap_or_else(|| (format!("[PAD{id}]"), 5)); // 5: unused
        tokens.push(Value::String(text));
        types.push(Value::I32(kind));
    }
    let merges: Vec<Value> = model["merges"]
        .as_array()
        .ok_or_else(|| unsupported("`model.merges` is not an array"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(pair) if pair.len() == 2 => Ok(Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap_or_default(),
                pair[1].as_str().unwrap_or_default()
            ))),
            _ => Err(unsupported("a merge is neither `a b` nor [a, b]")),
        })
        .collect::<Result<_>>()?;

    let mut md = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];
    // BOS/EOS/PAD and add_bos from tokenizer_config.json (token texts resolved to ids).
    let config: Json = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Json::Null);
    let id_of = |key: &str| -> Option<u32> {
        let text = match &config[key] {
            Json::String(s) => s.as_str(),
            Json::Object(o) => o.get("content")?.as_str()?,
            _ => return None,
        };
        let id = vocab.get(text).and_then(Json::as_u64).or_else(|| {
            tok["added_tokens"]
                .as_array()?
                .iter()
                .find(|a| a["content"] == text)?["id"]
                .as_u64()
        })?;
        Some(id as u32)
    };
    for (key, gguf_key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = id_of(key) {
            md.push((gguf_key.into(), Value::U32(id)));
        }
    }
    md.push((
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(config["add_bos_token"].as_bool().unwrap_or(false)),
    ));
    let template = std::fs::read_to_string(dir.join("chat_template.jinja"))
        .ok()
        .or_else(|| config["chat_template"].as_str().map(str::to_owned));
    if let Some(t) = template {
        md.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(md)
}

/// `tokenizer.ggml.pre` for a tokenizer.json `pre_tokenizer`: GPT-2's byte-level regex, or a
/// `Split` by one of [`PRE_NAMES`] followed by a regex-free `ByteLevel`.
fn pre_name(pre: &Json) -> Option<&'static str> {
    match pre["type"].as_str()? {
        "ByteLevel" if pre["use_regex"].as_bool().unwrap_or(true) => Some("gpt-2"),
        "Sequence" => {
            let steps = pre["pretokenizers"].as_array()?;
            let [split, byte_level] = steps.as_slice() else {
                return None;
            };
            if split["type"] != "Split"
                || byte_level["type"] != "ByteLevel"
                || byte_level["use_regex"].as_bool() != Some(false)
            {
                return None;
            }
            let regex = split["pattern"]["Regex"].as_str()?;
            PRE_NAMES
                .iter()
                .find(|(r, _)| *r == regex)
                .map(|(_, name)| *name)
        }
        _ => None,
    }
}
