//! `peregrine quantize`: MLX and GGUF checkpoints it writes load back close to the reference.

mod cli_support;

use std::path::Path;
use std::process::Output;

use cli_support::*;
use peregrine_engine::tensor::RopeScaling;
use peregrine_engine::tensor::ops::max_abs_diff;

/// `peregrine quantize` writes an MLX checkpoint that loads back; at 8 bits its logits stay as near
/// the f32 model's as mlx-lm's own 8-bit quantization of this fixture does (0.155 max abs, see
/// tests/fixtures/qwen3/mlx-q8-g64); a packing or scale bug moves them by more than 1. Read with
/// f32 activations, as mlx-lm computes (the default 8-bit activations add their own rounding,
/// bounded in golden_mlx.rs).
#[test]
fn quantize_writes_a_checkpoint_that_loads_back() {
    let dir = scratch("quantize");
    let out = dir.join("q8");
    let run = peregrine(&[
        "quantize",
        "--model",
        fixture("qwen3").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--bits",
        "8",
        "--group-size",
        "32",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (ids, expected) = reference("qwen3");
    let f32_activations = ["--mlx-activations", "f32"];
    let logits = cli_logits(&out, &ids, &f32_activations, "quantize-logits");
    let max = max_abs_diff(&logits, &expected).unwrap();
    assert!(max < 0.2, "8-bit logits moved by {max}");
    assert!(max > 0.0, "the checkpoint was not quantized at all");
}

/// Runs `peregrine quantize --format gguf --type <ty>` on `model` into `out`.
fn quantize_gguf(model: &Path, out: &Path, ty: &str) -> Output {
    peregrine(&[
        "quantize",
        "--format",
        "gguf",
        "--type",
        ty,
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

/// `peregrine quantize --format gguf --type q8_0` writes a file the GGUF loader reads back
/// (metadata, tensor names, the tokenizer transcribed from tokenizer.json) whose logits stay
/// close to transformers' f32 logits.
///
/// Tolerance 0.3 max abs: measured 0.142-0.147 on these fixtures (logits std ~1, |max| ~4). Q8_0
/// rounds weights to 1/127 of each 32-block's largest magnitude and candle's Q8_0 matmul rounds
/// the activations the same way, hence more than MLX 8-bit/g128's 0.025 (README-mlx.md). Q4_0 of
/// the same files moves them by 1.6-2.2, a dropped or misnamed tensor or wrong head count by
/// more, so 0.3 separates "8-bit rounding" from "wrong file". The llama q/k permutation is
/// checked separately below.
#[test]
fn gguf_export_loads_back_close_to_transformers() {
    let dir = scratch("gguf-export");
    for arch in ["qwen2", "qwen3", "mistral"] {
        let out = dir.join(format!("{arch}.gguf"));
        let run = quantize_gguf(&fixture(arch), &out, "q8_0");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let (ids, expected) = reference(arch);
        let ours = cli_logits(&out, &ids, &[], &format!("gguf-{arch}"));
        let max = max_abs_diff(&ours, &expected).unwrap();
        assert!(max < 0.3, "{arch} q8_0: max abs diff {max}");
        assert!(max > 0.0, "{arch}: the weights were not quantized");
    }
}

/// The export of `arch`'s fixture is refused with a message containing `refusal`; once
/// `edit` makes its config expressible in GGUF metadata, the exported Q8_0 file's logits match
/// Peregrine's on the edited HF folder within the Q8_0 tolerance above.
fn check_gguf_export_of_edited_fixture(
    arch: &str,
    refusal: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let dir = scratch(&format!("gguf-{arch}"));
    let refused = quantize_gguf(&fixture(arch), &dir.join("refused.gguf"), "q8_0");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains(refusal),
        "{stderr}"
    );
    check_gguf_export_of_edited_fixture_in(&dir, arch, edit);
}

/// Copies `arch`'s fixture into `dir/hf`, applies `edit` to its config, exports it as Q8_0 and
/// compares the file's logits with Peregrine's on the edited HF folder.
fn check_gguf_export_of_edited_fixture_in(
    dir: &Path,
    arch: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let hf = edited_fixture(&dir.join("hf"), arch, edit);
    let out = dir.join(format!("{arch}.gguf"));
    let run = quantize_gguf(&hf, &out, "q8_0");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (ids, _) = reference(arch);
    let want = cli_logits(&hf, &ids, &[], &format!("gguf-{arch}-hf"));
    let got = cli_logits(&out, &ids, &[], &format!("gguf-{arch}-q8"));
    let max = max_abs_diff(&got, &want).unwrap();
    assert!(
        max < 0.3,
        "{arch} q8_0 vs the same HF folder: max abs diff {max}"
    );
}

/// A copy of `arch`'s fixture in `hf` with `edit` applied to its config.
fn edited_fixture(
    hf: &Path,
    arch: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> std::path::PathBuf {
    std::fs::create_dir_all(hf).unwrap();
    copy_fixture(arch, hf);
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    std::fs::write(&config_path, config.to_string()).unwrap();
    hf.to_path_buf()
}

/// MoE checkpoints export with their experts stacked per layer and projection (`ffn_*_exps`)
/// and the expert counts in the metadata. The exported file of the fixture as it is must read
/// back with the same routing settings; its logits are compared with every expert routed
/// (`num_experts_per_tok` raised to `num_experts` in a copy), because Q8_0's rounding flips
/// near-tied top-k choices of these untrained routers at some positions (measured 0.36 on
/// qwen3_moe with top-2), while with every expert chosen only the rounding remains and the
/// Q8_0 bound above applies. A mis-stacked expert or a wrong projection moves logits by more
/// than 1.
#[test]
fn gguf_export_writes_moe_experts_stacked() {
    use peregrine_models::weights::{GgufFile, config_from_gguf};
    for (arch, gguf_arch) in [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")] {
        let dir = scratch(&format!("gguf-moe-{arch}"));
        let out = dir.join("top-k.gguf");
        let run = quantize_gguf(&fixture(arch), &out, "q8_0");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let config = config_from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
        let moe = config.moe.expect("MoE metadata");
        assert_eq!(config.model_type, gguf_arch);
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.normalize),
            (4, 2, true),
            "{arch}"
        );
        check_gguf_export_of_edited_fixture_in(&dir, arch, |config| {
            let experts = config
                .get("num_experts")
                .or(config.get("num_local_experts"))
                .cloned()
                .unwrap();
            config.insert("num_experts_per_tok".into(), experts);
        });
    }
}

/// `llama` GGUF files hold q/k permuted for interleaved RoPE (llama.cpp's converter; the loader
/// rotates them interleaved): a missing permutation would move the logits by more than 1.
#[test]
fn gguf_export_permutes_llama_attention() {
    check_gguf_export_of_edited_fixture_in(&scratch("gguf-llama"), "llama", |_| {});
}

/// Llama 3.1's RoPE scaling exports as llama.cpp's converter writes it, a `rope_freqs` tensor
/// of one divisor per rotated pair, and reads back as those divisors (real Llama 3.1/3.2 GGUF
/// files carry it so). The llama fixture (factor 8 over an original context of 64) exported in
/// f32 gives transformers' logits within 1e-4 (measured 2.7e-6, as the HF folder does); the
/// same weights exported without the scaling miss them by 1.85, so a file whose factors were
/// dropped or inverted fails.
#[test]
fn gguf_export_writes_llama3_rope_scaling_as_rope_freqs() {
    use peregrine_models::weights::{GgufFile, config_from_gguf};
    let dir = scratch("gguf-llama3");
    let (ids, want) = reference("llama");
    let plain = edited_fixture(&dir.join("plain"), "llama", |config| {
        config.remove("rope_scaling");
        config.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": 500000.0, "rope_type": "default"}),
        );
    });
    let mut diffs = vec![];
    for (name, model) in [("scaled", fixture("llama")), ("plain", plain)] {
        let out = dir.join(format!("{name}.gguf"));
        let run = quantize_gguf(&model, &out, "f32");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let config = config_from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
        let factors = matches!(config.rope_scaling, RopeScaling::Factors(ref f) if f.len() == 8);
        assert_eq!(
            factors,
            name == "scaled",
            "{name}: {:?}",
            config.rope_scaling
        );
        let got = cli_logits(&out, &ids, &[], &format!("gguf-llama3-{name}"));
        diffs.push(max_abs_diff(&got, &want).unwrap());
    }
    eprintln!(
        "max abs diff from transformers: with rope_freqs {}, without {}",
        diffs[0], diffs[1]
    );
    assert!(diffs[0] < 1e-4 && diffs[1] > 0.5, "{diffs:?}");
}

/// Gemma 3 GGUF files store norm weights as `1 + w` and leave the layer pattern (every sixth
/// layer global) and attention scale (`head_dim^-0.5`) to the reader. The fixture's pattern of 4
/// cannot be written, so the export refuses it; with llama.cpp's pattern and scale, dropping the
/// `+ 1` would move the logits by more than 1.
#[test]
fn gguf_export_writes_gemma3() {
    check_gguf_export_of_edited_fixture("gemma3", "layer_types", |config| {
        for key in ["layer_types", "_sliding_window_pattern"] {
            config.remove(key);
        }
        config.insert("sliding_window_pattern".into(), 6.into());
        config.insert("query_pre_attn_scalar".into(), 16.into());
    });
}

/// Gemma 4 exports as llama.cpp's own converter writes it: against the converter's Q8_0 file
/// of the same fixture (tests/fixtures/<arch>/gguf, scripts/fixtures/convert_gguf.py), the
/// same tensors (names, shapes, types, `rope_freqs` included), the same `gemma4.*` metadata
/// (ours adds `vocab_size`), read back as the same configuration, and the same logits: measured
/// identical (candle's Q8_0 blocks of these weights equal gguf-py's), so 1e-4 leaves room only
/// for a rounding tie broken the other way, while a misplaced tensor moves logits by 1 or more.
#[test]
fn gguf_export_writes_gemma4_as_llama_cpp_does() {
    use peregrine_engine::tensor::candle::quantized::gguf_file::Content;
    use peregrine_models::weights::{GgufFile, config_from_gguf};
    let dir = scratch("gguf-gemma4");
    for arch in ["gemma4_text", "gemma4_text_moe"] {
        let ours = dir.join(format!("{arch}.gguf"));
        let run = quantize_gguf(&fixture(arch), &ours, "q8_0");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let theirs = fixture(arch).join("../gguf/model-q8_0.gguf");
        let read = |path: &Path| {
            let mut f = std::fs::File::open(path).unwrap();
            Content::read(&mut f).unwrap()
        };
        let (a, b) = (read(&ours), read(&theirs));
        let tensors = |c: &Content| -> std::collections::BTreeMap<String, String> {
            (c.tensor_infos.iter())
                .map(|(n, i)| {
                    (
                        n.clone(),
                        format!("{:?} {:?}", i.ggml_dtype, i.shape.dims()),
                    )
                })
                .collect()
        };
        assert_eq!(tensors(&a), tensors(&b), "{arch}: tensors");
        let keys = |c: &Content| -> std::collections::BTreeMap<String, String> {
            (c.metadata.iter())
                .filter(|(k, _)| k.starts_with("gemma4.") && *k != "gemma4.vocab_size")
                .map(|(k, v)| (k.clone(), format!("{v:?}")))
                .collect()
        };
        assert_eq!(keys(&a), keys(&b), "{arch}: metadata");
        let config = |p: &Path| config_from_gguf(&GgufFile::open(p).unwrap()).unwrap();
        assert_eq!(config(&ours), config(&theirs), "{arch}: configuration");
        let (ids, _) = reference(arch);
        let got = cli_logits(&ours, &ids, &[], &format!("gguf-{arch}-ours"));
        let want = cli_logits(&theirs, &ids, &[], &format!("gguf-{arch}-llama-cpp"));
        let max = max_abs_diff(&got, &want).unwrap();
        eprintln!("{arch}: our Q8_0 export vs llama.cpp's converter: max abs diff {max}");
        assert!(max < 1e-4, "{arch}: logits differ by {max}");
    }
}

/// Gemma 2 GGUF files store norm weights as `1 + w` and the two soft caps; the layer pattern
/// (even layers slide) and attention scale (`head_dim^-0.5`) are llama.cpp's, which the fixture
/// follows, so it exports as it is. The file reads back as the same configuration (a cap lost
/// on the way would fall back to llama.cpp's 50 / 30, which moves these logits by ~0.25, inside
/// the Q8_0 tolerance, hence the metadata check), and its logits match the HF folder's. A
/// checkpoint whose cap is off (`null`) cannot be written: llama.cpp always caps.
#[test]
fn gguf_export_writes_gemma2() {
    use peregrine_models::weights::{GgufFile, config_from_gguf};
    let dir = scratch("gguf-gemma2");
    let out = dir.join("gemma2.gguf");
    let run = quantize_gguf(&fixture("gemma2"), &out, "q8_0");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let config = config_from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
    assert_eq!(config.model_type, "gemma2");
    let caps = (
        config.attn_logit_softcapping,
        config.final_logit_softcapping,
    );
    assert_eq!(caps, (Some(5.0), Some(10.0)));
    assert_eq!(config.sliding_window, Some(8));
    assert_eq!(config.sliding_layers, Some(vec![true, false]));
    assert_eq!(config.query_pre_attn_scalar, Some(16.0));

    let (ids, _) = reference("gemma2");
    let want = cli_logits(&fixture("gemma2"), &ids, &[], "gguf-gemma2-hf");
    let got = cli_logits(&out, &ids, &[], "gguf-gemma2-q8");
    let max = max_abs_diff(&got, &want).unwrap();
    assert!(
        max < 0.3,
        "gemma2 q8_0 vs the HF folder: max abs diff {max}"
    );
    assert!(max > 0.0, "gemma2: the weights were not quantized");
    eprintln!("gemma2 q8_0 vs the HF folder: max abs diff {max:.3}");

    let hf = dir.join("uncapped");
    std::fs::create_dir_all(&hf).unwrap();
    copy_fixture("gemma2", &hf);
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["final_logit_softcapping"] = serde_json::Value::Null;
    std::fs::write(&config_path, config.to_string()).unwrap();
    let refused = quantize_gguf(&hf, &dir.join("refused.gguf"), "q8_0");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("final_logit_softcapping"),
        "{stderr}"
    );
}
