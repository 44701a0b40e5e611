//! `peregrine quantize`: writes an MLX affine-quantized checkpoint (config, tokenizer files,
//! `model.safetensors` with `format: mlx`) from an HF safetensors folder, so users can make MLX
//! checkpoints without Python (mlx-lm loads the result), or a GGUF file of the same weights
//! (`--format gguf`, [`gguf`]) for comparisons with llama.cpp-style block quantization.

mod gguf;
mod gguf_tokenizer;
mod gguf_write;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use peregrine_engine::tensor::candle::safetensors::MmapedSafetensors;
use peregrine_engine::tensor::mlx::SUPPORTED_BITS;
use peregrine_engine::tensor::{DType, Device, MlxQuantized, Tensor};
use serde_json::{Value, json};

/// Files copied unchanged beside the weights (those that exist).
const COPIED: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// Arguments of `peregrine quantize`.
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// HF checkpoint folder (config.json + safetensors), or a GGUF file to convert to
    /// another `--type` (`--format gguf`; an f32 copy of a quantized file, say).
    #[arg(long, short)]
    pub model: PathBuf,
    /// Output folder for MLX (created; must not hold a config.json already), output file for
    /// GGUF (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// Output format: `mlx` (affine, `--bits`/`--group-size`) or `gguf` (`--type`).
    #[arg(long, default_value = "mlx", value_parser = ["mlx", "gguf"])]
    pub format: String,
    /// MLX: bits per weight: 2, 3, 4, 5, 6 or 8.
    #[arg(long, default_value_t = 4)]
    pub bits: usize,
    /// MLX: weights sharing one scale and bias: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
    /// GGUF: block type of the 2-D weights (1-D tensors stay f32); f16 and f32 leave them
    /// unquantized.
    #[arg(long = "type", default_value = "q4_0", value_parser = gguf::TYPES)]
    pub gguf_type: String,
}

/// Runs `peregrine quantize`.
pub fn run(args: QuantizeArgs) -> Result<()> {
    if args.format == "gguf" {
        return gguf::run(&args.model, &args.out, &args.gguf_type);
    }
    if !SUPPORTED_BITS.contains(&args.bits) {
        bail!("--bits {}: supported are 2, 3, 4, 5, 6, 8", args.bits);
    }
    if !matches!(args.group_size, 32 | 64 | 128) {
        bail!(
            "--group-size {}: supported are 32, 64, 128",
            args.group_size
        );
    }
    let config_path = args.model.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("{}: cannot read", config_path.display()))?;
    let mut config: serde_json::Map<String, Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid JSON", config_path.display()))?;
    if config.contains_key("quantization") || config.contains_key("quantization_config") {
        bail!(
            "{}: the checkpoint is already quantized",
            config_path.display()
        );
    }
    if args.out.join("config.json").exists() {
        bail!("{}: already holds a checkpoint", args.out.display());
    }
    let q = json!({"group_size": args.group_size, "bits": args.bits, "mode": "affine"});
    config.insert("quantization".into(), q.clone());
    config.insert("quantization_config".into(), q);

    let files = open_safetensors(&args.model)?;
    let mut tensors = BTreeMap::new();
    let (mut quantized, mut kept) = (0, 0);
    for (name, _) in files.tensors() {
        let t = files.load(&name, &Device::Cpu)?;
        match quantizable(&name, &t, args.group_size) {
            true => {
                let base = name
                    .strip_suffix(".weight")
                    .expect("checked by quantizable");
                let q = MlxQuantized::quantize(&t, args.bits, args.group_size)
                    .with_context(|| format!("tensor `{name}`"))?;
                let (packed, scales, biases) = q.parts();
                // Scales and biases are bf16 values already: the cast is exact.
                tensors.insert(name.clone(), packed.clone());
                tensors.insert(format!("{base}.scales"), scales.to_dtype(DType::BF16)?);
                tensors.insert(format!("{base}.biases"), biases.to_dtype(DType::BF16)?);
                quantized += 1;
            }
            false => {
                tensors.insert(name, t);
                kept += 1;
            }
        }
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("{}: cannot create", args.out.display()))?;
    write_safetensors(&args.out.join("model.safetensors"), &tensors)?;
    let config_out = args.out.join("config.json");
    std::fs::write(&config_out, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("{}: cannot write", config_out.display()))?;
    for f in COPIED {
        let src = args.model.join(f);
        if src.exists() {
            std::fs::copy(&src, args.out.join(f))
                .with_context(|| format!("{}: cannot copy", src.display()))?;
        }
    }
    eprintln!(
        "wrote {}: {quantized} tensors quantized to {} bits (group {}), {kept} kept",
        args.out.display(),
        args.bits,
        args.group_size
    );
    Ok(())
}

/// MLX quantizes Linear and Embedding weights whose input dimension divides by the group size;
/// in HF checkpoints those are exactly the float 2-D `.weight` tensors.
fn quantizable(name: &str, t: &Tensor, group_size: usize) -> bool {
    name.ends_with(".weight")
        && t.rank() == 2
        && t.dtype().is_float()
        && t.dim(1).is_ok_and(|d| d.is_multiple_of(group_size))
}

pub(crate) fn open_safetensors(dir: &Path) -> Result<MmapedSafetensors> {
    let index = dir.join("model.safetensors.index.json");
    let paths: Vec<PathBuf> = if index.exists() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{}: invalid JSON", index.display()))?;
        let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
            bail!("{}: missing object field `weight_map`", index.display());
        };
        let names: std::collections::BTreeSet<&str> =
            map.values().filter_map(Value::as_str).collect();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    // SAFETY: mapped read-only; like every mmap reader we rely on the files not being truncated.
    unsafe { MmapedSafetensors::multi(&paths) }
        .with_context(|| format!("{}: cannot read safetensors", dir.display()))
}

/// Writes safetensors by hand so the header carries `format: mlx` (MLX's own files do).
fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut offset = 0usize;
    let mut blobs = vec![];
    for (name, t) in tensors {
        let (dtype, bytes) = tensor_bytes(t)?;
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": t.dims(), "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
        blobs.push(bytes);
    }
    let mut head = serde_json::to_string(&header)?.into_bytes();
    // The data must start 8-byte aligned; the format pads the header with spaces.
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path)
            .with_context(|| format!("{}: cannot create", path.display()))?,
    );
    f.write_all(&(head.len() as u64).to_le_bytes())?;
    f.write_all(&head)?;
    for b in blobs {
        f.write_all(&b)?;
    }
    f.flush()
        .with_context(|| format!("{}: cannot write", path.display()))
}

/// The safetensors dtype name and little-endian bytes of a tensor.
fn tensor_bytes(t: &Tensor) -> Result<(&'static str, Vec<u8>)> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U32 => {
            let v = flat.to_vec1::<u32>()?;
            ("U32", v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        // bf16 → f32 is exact, and the top half of that f32 is the bf16 bit pattern.
        DType::BF16 => {
            let v = flat.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let bits = v.iter().map(|x| (x.to_bits() >> 16) as u16);
            ("BF16", bits.flat_map(|x| x.to_le_bytes()).collect())
        }
        // f16 (rare in HF checkpoints) is widened to f32, exactly: this crate has no f16 type.
        DType::F16 | DType::F32 => {
            let v = flat.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            ("F32", v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        other => bail!("cannot write a {other:?} tensor"),
    })
}
