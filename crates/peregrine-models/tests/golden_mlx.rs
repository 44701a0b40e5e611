//! Golden logits for MLX checkpoints (`tests/fixtures/<arch>/mlx-*`, made by
//! `scripts/fixtures/make_mlx.py` with mlx-lm from the HF fixtures): bf16 and affine-quantized
//! (4-bit g64, 8-bit g64, 4-bit g32; 3-bit g32 and 6-bit g128, whose codes straddle u32 words
//! and whose g128 leaves the 64-wide embedding unquantized), loaded through `load_model`.
//!
//! The reference is transformers in f32 on the weights dequantized by an independent numpy
//! decoder; mlx-lm's own f32 logits are stored too and agree with it to ~4e-6 (see
//! tests/fixtures/README-mlx.md), so we check both. Tolerance 1e-3 max abs: the dequantized
//! weights are the same f32 numbers on both sides and we compute in f32, so only summation order
//! differs (observed ~1e-5); one misdecoded code or a wrong group moves logits by 1e-2 or more.
//! Those checks load with `MlxActivations::F32`, the mode that computes as mlx-lm does.
//!
//! The default mode regroups 4-bit weights into Q4_1 blocks and 8-bit ones into MLX8G64 blocks
//! (bit-exact, tests/mlx.rs in peregrine-tensor) and rounds activations to 8 bits per 32
//! values, as llama.cpp does. That rounding is the only difference, and it is not small on
//! these fixtures: about 0.5 % of each matmul input's magnitude, compounded over the 7 matmuls
//! of 2 untrained layers, measured 0.019-0.021 RMS (max 0.09-0.13) on logits of standard
//! deviation ~1, 4-bit and 8-bit weights alike. The checks there:
//! RMS ≤ [`Q8_RMS`] (2× measured; a wrong nibble order or scale moves it to ~1), max ≤
//! [`Q8_MAX`], and the same top-1 token wherever the reference's lead over its runner-up is
//! more than 2 × [`Q8_MAX`] (near-ties may flip, as they do between llama.cpp and transformers).

mod common;

use std::path::PathBuf;

use peregrine_models::weights::{MlxActivations, MlxQuantization};
use peregrine_models::{CausalLm, LoadOptions, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

use common::max_abs_diff;

const TOLERANCE: f32 = 1e-3;
/// RMS logit difference allowed with 8-bit activations (module docs: 2× the measured 0.02).
const Q8_RMS: f32 = 0.04;
/// Largest logit difference allowed with 8-bit activations (2× the measured 0.13).
const Q8_MAX: f32 = 0.25;

/// The mlx-lm-exact mode every check but the Q8 ones uses.
fn exact() -> LoadOptions {
    LoadOptions {
        mlx_activations: MlxActivations::F32,
        ..LoadOptions::default()
    }
}

/// Quantized weights may take this much more memory than the file: scales and biases are kept
/// in f32 (bf16 in the file) so the kernels need no conversion; dequantized copies would be 8×.
const MAX_MEMORY_OVER_FILE: f64 = 1.3;

fn fixture(arch: &str, variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(arch)
        .join(variant)
}

struct Reference {
    ids: Vec<u32>,
    logits: Tensor,
    logits_mlx: Tensor,
    greedy: Vec<u32>,
}

fn reference(arch: &str, variant: &str) -> Reference {
    let dir = fixture(arch, variant);
    let common::Reference {
        ids,
        logits,
        greedy,
    } = common::reference_in(&dir);
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).expect("reference.safetensors");
    Reference {
        ids,
        logits,
        logits_mlx: r["logits_mlx"].clone(),
        greedy,
    }
}

/// Logits for `r.ids` fed `chunk` tokens per forward pass.
fn logits_in_chunks(model: &dyn CausalLm, r: &Reference, chunk: usize) -> Tensor {
    common::run_in_chunks(model, &r.ids, chunk)
}

fn check_logits(arch: &str, variant: &str) {
    let model = load_model(&fixture(arch, variant), &exact())
        .expect("fixture loads")
        .model;
    let r = reference(arch, variant);
    // The whole prompt (tiled batch kernel), chunks of 5, and token by token (decode kernel).
    for chunk in [1024, 5, 1] {
        let ours = logits_in_chunks(model.as_ref(), &r, chunk);
        assert_eq!(
            ours.dims(),
            r.logits.dims(),
            "{arch}/{variant}: logits shape"
        );
        // mlx-lm 0.32.2 disagrees with transformers on its own conversions of two fixtures,
        // where ours matches transformers (1e-5): Jamba (1.4 max abs, not investigated) and
        // Mamba 2 (2.2: its gated norm runs over the whole width, transformers' per group, and
        // the fixture has 2 groups). Those are checked against transformers alone.
        let references = match arch {
            "jamba" | "mamba2" => &[("transformers", &r.logits)][..],
            _ => &[("transformers", &r.logits), ("mlx-lm", &r.logits_mlx)][..],
        };
        for &(what, want) in references {
            let diff = max_abs_diff(&ours, want);
            eprintln!("{arch}/{variant} (chunk {chunk}) vs {what}: max abs diff {diff:.1e}");
            assert!(
                diff < TOLERANCE,
                "{arch}/{variant} (chunk {chunk}) vs {what}: max abs diff {diff} ≥ {TOLERANCE}"
            );
        }
    }
}

/// The default (8-bit activation) mode on a 4- or 8-bit fixture, against the module docs' bounds.
fn check_q8_logits(arch: &str, variant: &str) {
    let load = |opts| load_model(&fixture(arch, variant), &opts).unwrap().model;
    let (model, exact_model) = (load(LoadOptions::default()), load(exact()));
    let r = reference(arch, variant);
    let exact_logits = logits_in_chunks(exact_model.as_ref(), &r, 1024);
    // mlx-lm runs phi3 with LongRoPE's long factors on this short prompt (see `phi3` below).
    let reference = match arch {
        "phi3" => &r.logits,
        _ => &r.logits_mlx,
    };
    let want = reference.to_vec2::<f32>().unwrap();
    for chunk in [1024, 5, 1] {
        let ours = logits_in_chunks(model.as_ref(), &r, chunk);
        let what = format!("{arch}/{variant} (chunk {chunk}, 8-bit activations)");
        // Otherwise this would check the f32 path a second time.
        assert!(
            max_abs_diff(&ours, &exact_logits) > 1e-4,
            "{what}: integer kernels not used"
        );
        let max = max_abs_diff(&ours, reference);
        let rms = (&ours - reference)
            .and_then(|d| d.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>())
            .unwrap();
        assert!(
            rms <= Q8_RMS && max <= Q8_MAX,
            "{what}: rms {rms}, max {max}"
        );
        for (pos, (got, want)) in ours.to_vec2::<f32>().unwrap().iter().zip(&want).enumerate() {
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let (top, lead) = (argmax(want), sorted[0] - sorted[1]);
            if lead > 2.0 * Q8_MAX {
                assert_eq!(argmax(got), top, "{what}: top-1 at {pos} (lead {lead})");
            }
        }
    }
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .unwrap_or(0)
}

fn check_greedy(arch: &str, variant: &str) {
    let model = load_model(&fixture(arch, variant), &exact()).unwrap().model;
    let r = reference(arch, variant);
    let out = common::greedy_ids(model.as_ref(), &r.ids, r.greedy.len());
    assert_eq!(out, r.greedy, "{arch}/{variant}: greedy continuation");
}

fn check_memory(arch: &str, variant: &str) {
    let dir = fixture(arch, variant);
    let model = load_model(&dir, &LoadOptions::default()).unwrap().model;
    let file = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len() as f64;
    let held = model.weight_bytes() as f64;
    assert!(
        held <= file * MAX_MEMORY_OVER_FILE,
        "{arch}/{variant}: weights hold {held} bytes for a {file}-byte file"
    );
}

macro_rules! golden_mlx {
    ($($arch:ident: $($variant:ident = $dir:literal),*;)*) => {$(
        mod $arch {$(
            mod $variant {
                #[test]
                fn logits_match_transformers_and_mlx_lm() {
                    super::super::check_logits(stringify!($arch), $dir);
                }
                #[test]
                fn greedy_ids_match_transformers() {
                    super::super::check_greedy(stringify!($arch), $dir);
                }
            }
        )*}
    )*};
}

golden_mlx! {
    llama: bf16 = "mlx-bf16", q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64", q4_g32 = "mlx-q4-g32",
        q3_g32 = "mlx-q3-g32", q6_g128 = "mlx-q6-g128";
    qwen3: bf16 = "mlx-bf16", q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64", q4_g32 = "mlx-q4-g32",
        q3_g32 = "mlx-q3-g32", q6_g128 = "mlx-q6-g128";
    qwen3_moe: bf16 = "mlx-bf16", q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64",
        q4_g32 = "mlx-q4-g32", q3_g32 = "mlx-q3-g32", q6_g128 = "mlx-q6-g128";
    mixtral: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    gemma4_text: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64", q4_g32 = "mlx-q4-g32";
    gemma4_text_moe: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64", q4_g32 = "mlx-q4-g32";
    qwen3_next: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    qwen3_5: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    qwen3_5_moe: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    falcon_h1: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    jamba: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
    mamba2: q4_g64 = "mlx-q4-g64", q8_g64 = "mlx-q8-g64";
}

/// Phi-3 in MLX form (fused `qkv_proj` / `gate_up_proj` quantized as one matrix each, split by
/// rows at load). mlx-lm always rotates with LongRoPE's long factors, transformers with the short
/// ones until a forward passes `original_max_position_embeddings` (32): on the 24-token prompt
/// the check is against transformers on the dequantized weights (whole, chunks of 5, token by
/// token); on the 49-token prompt both use the long factors and both references are checked.
#[test]
fn phi3_matches_transformers_and_mlx_lm_in_its_longrope_regimes() {
    for variant in [
        "mlx-bf16",
        "mlx-q4-g64",
        "mlx-q8-g64",
        "mlx-q4-g32",
        "mlx-q3-g32",
        "mlx-q6-g128",
    ] {
        let model = load_model(&fixture("phi3", variant), &exact())
            .unwrap()
            .model;
        let r = reference("phi3", variant);
        let mut worst = 0f32;
        for chunk in [1024, 5, 1] {
            let diff = max_abs_diff(&logits_in_chunks(model.as_ref(), &r, chunk), &r.logits);
            assert!(diff < TOLERANCE, "phi3/{variant} (chunk {chunk}): {diff}");
            worst = worst.max(diff);
        }
        let extra = load(
            fixture("phi3", variant).join("reference.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let long = Reference {
            ids: extra["long_input_ids"]
                .to_dtype(DType::U32)
                .unwrap()
                .to_vec1::<u32>()
                .unwrap(),
            logits: extra["long_logits"].clone(),
            logits_mlx: extra["long_logits_mlx"].clone(),
            greedy: vec![],
        };
        let ours = logits_in_chunks(model.as_ref(), &long, 1024);
        for (what, want) in [("transformers", &long.logits), ("mlx-lm", &long.logits_mlx)] {
            let diff = max_abs_diff(&ours, want);
            assert!(
                diff < TOLERANCE,
                "phi3/{variant} long prompt vs {what}: {diff}"
            );
            worst = worst.max(diff);
        }
        eprintln!("phi3/{variant}: max abs diff {worst:.2e}");
        check_greedy("phi3", variant);
    }
    for variant in ["mlx-q4-g64", "mlx-q4-g32", "mlx-q8-g64"] {
        check_q8_logits("phi3", variant);
    }
}

#[test]
fn eight_bit_activations_stay_within_their_rounding() {
    for arch in ["llama", "qwen3"] {
        for variant in ["mlx-q4-g64", "mlx-q4-g32", "mlx-q8-g64"] {
            check_q8_logits(arch, variant);
        }
    }
}

/// The MoE fixtures in the 8-bit-activation mode, against the same checkpoint in the exact
/// mode, with every expert routed (`num_experts_per_tok` raised to `num_experts` in a copy):
/// top-k routing is discrete, and on these untrained routers the activation rounding flips a
/// near-tied choice at some positions (measured: mixtral q4-g64 position 15 moves by 1.53 with
/// top-2, by 0.03 with all 4 experts; qwen3_moe q4-g32 by 0.61), as it would in llama.cpp.
/// With every expert chosen only the rounding remains, and the dense bounds apply.
#[test]
fn eight_bit_activations_on_moe_with_every_expert_routed() {
    for (arch, variant) in [
        ("qwen3_moe", "mlx-q4-g64"),
        ("qwen3_moe", "mlx-q4-g32"),
        ("qwen3_moe", "mlx-q8-g64"),
        ("mixtral", "mlx-q4-g64"),
        ("mixtral", "mlx-q8-g64"),
    ] {
        let dir = std::env::temp_dir().join(format!(
            "peregrine-moe-{}-{arch}-{variant}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(fixture(arch, variant)).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let experts = config
            .get("num_experts")
            .or(config.get("num_local_experts"))
            .cloned()
            .unwrap();
        config["num_experts_per_tok"] = experts;
        std::fs::write(&path, config.to_string()).unwrap();
        let load = |opts| load_model(&dir, &opts).unwrap().model;
        let (q8, exact_model) = (load(LoadOptions::default()), load(exact()));
        let r = reference(arch, variant);
        let want = logits_in_chunks(exact_model.as_ref(), &r, 1024);
        for chunk in [1024, 5, 1] {
            let ours = logits_in_chunks(q8.as_ref(), &r, chunk);
            let what = format!("{arch}/{variant} (every expert, chunk {chunk})");
            let max = max_abs_diff(&ours, &want);
            let rms = (&ours - &want)
                .and_then(|d| d.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>())
                .unwrap();
            assert!(max > 1e-4, "{what}: integer kernels not used");
            assert!(
                rms <= Q8_RMS && max <= Q8_MAX,
                "{what}: rms {rms}, max {max}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn quantized_checkpoints_stay_about_their_file_size() {
    for arch in ["llama", "qwen3", "qwen3_moe", "phi3"] {
        for variant in ["mlx-q4-g64", "mlx-q8-g64", "mlx-q4-g32", "mlx-q3-g32"] {
            check_memory(arch, variant);
        }
    }
}

fn parse(json: &str) -> peregrine_models::Result<Option<MlxQuantization>> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    MlxQuantization::from_config(&PathBuf::from("config.json"), v.as_object().unwrap())
}

#[test]
fn config_quantization_defaults_and_overrides() {
    let q = parse(
        r#"{"quantization_config": {"group_size": 64, "bits": 4,
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "lm_head": {"bits": 6}, "model.embed_tokens": false}}"#,
    )
    .unwrap()
    .expect("MLX quantization");
    let p = |m: &str| q.params(m).map(|p| (p.bits, p.group_size));
    assert_eq!(p("model.layers.0.self_attn.q_proj"), Some((4, 64)));
    assert_eq!(p("model.layers.0.mlp.gate"), Some((8, 64)));
    assert_eq!(p("lm_head"), Some((6, 64)));
    assert_eq!(p("model.embed_tokens"), None);
}

/// A multimodal checkpoint's overrides (mlx-lm keeps Qwen3.5's 8-bit routers under
/// `language_model.`) apply to the text model's names its tensors are read under.
#[test]
fn overrides_follow_the_language_models_prefix() {
    let mut q = parse(
        r#"{"quantization": {"group_size": 64, "bits": 4,
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.lm_head": false}}"#,
    )
    .unwrap()
    .expect("MLX quantization");
    q.alias_prefix("language_model.model.", "model.");
    q.alias_prefix("language_model.lm_head.", "lm_head.");
    let p = |m: &str| q.params(m).map(|p| (p.bits, p.group_size));
    assert_eq!(p("model.layers.0.mlp.gate"), Some((8, 64)));
    assert_eq!(p("language_model.model.layers.0.mlp.gate"), Some((8, 64)));
    assert_eq!(p("lm_head"), None);
    assert_eq!(p("model.layers.1.mlp.gate"), Some((4, 64)));
}

#[test]
fn config_without_mlx_quantization_is_plain() {
    assert!(parse(r#"{"model_type": "llama"}"#).unwrap().is_none());
    let gptq = r#"{"quantization_config": {"quant_method": "gptq", "bits": 4}}"#;
    assert!(parse(gptq).unwrap().is_none());
}

#[test]
fn config_errors_name_the_field() {
    let e = parse(r#"{"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}"#);
    assert!(
        e.unwrap_err()
            .to_string()
            .contains("unsupported MLX mode `mxfp4`")
    );
    let e = parse(r#"{"quantization": {"group_size": 48, "bits": 4}}"#);
    assert!(
        e.unwrap_err()
            .to_string()
            .contains("unsupported group_size 48")
    );
    let e = parse(r#"{"quantization": {"group_size": 64, "bits": 4, "lm_head": {"bits": 7}}}"#);
    assert!(
        e.unwrap_err()
            .to_string()
            .contains("`lm_head`: unsupported bits 7")
    );
}
