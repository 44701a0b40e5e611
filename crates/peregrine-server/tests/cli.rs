//! The `peregrine` binary as a user runs it: parity through `peregrine logits`, and one clear
//! error (naming the file, tensor or field) with a non-zero exit and no panic for each kind of
//! broken checkpoint. Checkpoint export (`quantize`) is in cli_export.rs.

mod cli_support;

use std::path::Path;

use cli_support::*;
use peregrine_engine::tensor::Device;
use peregrine_engine::tensor::candle::safetensors::load;
use peregrine_engine::tensor::ops::max_abs_diff;

#[test]
fn logits_command_matches_transformers() {
    for arch in ["gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3"] {
        let (ids, expected) = reference(arch);
        // A small prefill size makes the command cross chunk boundaries.
        let ours = cli_logits(
            &fixture(arch),
            &ids,
            &["--prefill-size", "7"],
            &format!("logits-{arch}"),
        );
        let max = max_abs_diff(&ours, &expected).unwrap();
        // f32 weights and compute on both sides: only summation order differs (see golden.rs).
        assert!(max < 1e-3, "{arch}: max abs diff {max}");
    }
}

#[test]
fn logits_command_selects_positions() {
    let dir = scratch("positions");
    let out_file = dir.join("l.safetensors");
    let out = peregrine(&[
        "logits",
        "--model",
        fixture("llama").to_str().unwrap(),
        "--input-ids",
        "5,6,7,8",
        "--positions",
        "1..3",
        "--out",
        out_file.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        load(&out_file, &Device::Cpu).unwrap()["logits"].dims(),
        &[2, 512]
    );
}

#[test]
fn missing_model_file_is_one_clear_error() {
    let stderr = expect_failure(Path::new("/nonexistent/model.gguf"));
    assert!(stderr.contains("/nonexistent/model.gguf"), "{stderr}");
}

/// `--mmproj` files that cannot serve the model stop the start with one error naming why: a
/// text model's GGUF is no projector file, and Gemma 3's projector does not fit Llama (no
/// image token in its tokenizer).
#[test]
fn a_projector_file_that_does_not_fit_is_one_clear_error() {
    let vlm = repo().join("tests/fixtures/vlm/gemma3");
    let cases = [
        (
            vlm.join("hf"),
            vlm.join("gguf/model-bf16.gguf"),
            "not a multimodal projector",
        ),
        (
            fixture("llama"),
            vlm.join("gguf/mmproj-f32.gguf"),
            "no image token",
        ),
    ];
    for (model, mmproj, says) in cases {
        let out = peregrine(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--mmproj",
            mmproj.to_str().unwrap(),
            "--prompt",
            "hi",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = scratch("truncated-st");
    copy_fixture("llama", &dir);
    let weights = dir.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let stderr = expect_failure(&dir);
    assert!(stderr.contains("model.safetensors"), "{stderr}");
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = scratch("unknown-arch");
    copy_fixture("llama", &dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"model_type\": \"llama\"", "\"model_type\": \"llama9000\""),
    )
    .unwrap();
    let stderr = expect_failure(&dir);
    assert!(
        stderr.contains("llama9000") && stderr.contains("qwen3") && stderr.contains("config.json"),
        "{stderr}"
    );
}

#[test]
fn config_missing_a_field_names_it() {
    let dir = scratch("missing-field");
    copy_fixture("qwen2", &dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let without: String = config
        .lines()
        .filter(|l| !l.contains("\"hidden_size\""))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.join("config.json"), without).unwrap();
    let stderr = expect_failure(&dir);
    assert!(
        stderr.contains("hidden_size") && stderr.contains("config.json"),
        "{stderr}"
    );
}

#[test]
fn wrong_tensor_shape_names_tensor_and_shapes() {
    let dir = scratch("wrong-shape");
    copy_fixture("llama", &dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let stderr = expect_failure(&dir);
    assert!(
        stderr.contains("gate_proj.weight") && stderr.contains("[96, 64]"),
        "{stderr}"
    );
}

/// A GGUF cut short, in its header and in its tensor data. Built from SmolLM2 (fetched by
/// `scripts/fetch-models.sh`; the test fails, rather than skips, when it is absent).
#[test]
fn truncated_gguf_names_the_file_and_tensor() {
    let source = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&source).unwrap();
    let dir = scratch("truncated-gguf");
    for (name, len) in [("header.gguf", 4096), ("data.gguf", bytes.len() / 2)] {
        let path = dir.join(name);
        std::fs::write(&path, &bytes[..len]).unwrap();
        let stderr = expect_failure(&path);
        assert!(stderr.contains(name), "{stderr}");
        if name == "data.gguf" {
            assert!(
                stderr.contains("tensor `") && stderr.contains("truncated"),
                "{stderr}"
            );
        }
    }
}

/// `bench`, `generate` and `serve` keep the KV cache in f16 unless `--cache-type` says
/// otherwise: `bench`'s `kv_bytes` (the cache's allocations) by default is half of f32's, the
/// same as `--cache-type f16`'s.
#[test]
fn the_kv_cache_is_f16_by_default() {
    let kv_bytes = |extra: &[&str]| -> u64 {
        let out = bench_json(
            &fixture("llama"),
            &[&["--prompt-tokens", "16", "--gen-tokens", "4"], extra].concat(),
        );
        out["kv_bytes"].as_u64().expect("kv_bytes")
    };
    let (default, f16, f32) = (
        kv_bytes(&[]),
        kv_bytes(&["--cache-type", "f16"]),
        kv_bytes(&["--cache-type", "f32"]),
    );
    assert!(
        default > 0 && default == f16 && 2 * default == f32,
        "{default} {f16} {f32}"
    );
}

/// Loading says what it read, once, when stderr is not a terminal (a log gets one line, no
/// redraws); a device this build lacks is one clear error naming the flag.
#[test]
fn loading_logs_one_line_and_a_missing_backend_is_named() {
    let model = fixture("llama");
    let model = model.to_str().unwrap();
    let run = peregrine(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let loaded: Vec<&str> = stderr.lines().filter(|l| l.contains("loaded")).collect();
    assert_eq!(loaded.len(), 1, "{stderr}");
    assert!(
        loaded[0].starts_with("peregrine: loaded ") && loaded[0].contains(model),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\r') && !stderr.contains("loading ["),
        "{stderr}"
    );

    let run = peregrine(&[
        "generate", "--model", model, "--prompt", "Hi", "--device", "metal",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("--device metal") && stderr.contains("metal"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A CPU-only build names the feature a GPU needs.
    if !cfg!(feature = "cuda") {
        let run = peregrine(&[
            "generate", "--model", model, "--prompt", "Hi", "--device", "cuda:1",
        ]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success());
        assert!(stderr.contains("--features cuda"), "{stderr}");
    }
}

/// KV storage the model's layers cannot use is refused at load, by name, not at the first
/// request or silently.
#[test]
fn kv_options_the_model_cannot_use_are_refused_at_load() {
    let cases: [(&str, &[&str], &str); 2] = [
        (
            "llama",
            &["--kv-bits", "8", "--kv-group-size", "32"],
            "head_dim 16",
        ),
        ("deepseek_v3", &["--turbo-kv"], "latent-attention"),
    ];
    for (arch, flags, want) in cases {
        let model = fixture(arch);
        let mut args = vec!["generate", "-m", model.to_str().unwrap(), "--prompt", "hi"];
        args.extend_from_slice(flags);
        let out = peregrine(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{arch} {flags:?} ran");
        assert!(
            stderr.contains(want) && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}

/// A mixture-of-experts checkpoint whose files are larger than the memory available is refused
/// before loading, with a message that suggests `--stream-experts`; with the flag the same file
/// loads and generates. (The GGUF fixture, padded by a sparse hole past its tensors to a size
/// above `MemAvailable`: no disk space is used.)
#[test]
fn a_moe_larger_than_memory_suggests_streaming_its_experts() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let Some(available) = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    else {
        eprintln!("no /proc/meminfo: skipped");
        return;
    };
    let dir = scratch("moe-larger-than-memory");
    let file = dir.join("model.gguf");
    std::fs::copy(
        repo().join("tests/fixtures/qwen3_moe/gguf/model-q8_0.gguf"),
        &file,
    )
    .unwrap();
    let big = available * 1024 + (1 << 30);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(big)
        .unwrap();
    let model = file.to_str().unwrap();
    let stderr = expect_failure(&file);
    assert!(
        stderr.contains("--stream-experts") && stderr.contains(model),
        "{stderr}"
    );
    let out = peregrine(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
        "--stream-experts",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(&file).unwrap();
}

/// `bench --json` with `--stream-experts` reports the streaming: every use of an expert counted,
/// the budgets of kept experts as the flags set them, and uses served by the kept set only
/// when there is one (the fixture's Q8_0 experts are multiplied where they lie in the file's
/// mapping: `--expert-map-mb` keeps them mapped).
#[test]
fn bench_reports_expert_streaming() {
    let model = repo().join("tests/fixtures/qwen3_moe/gguf/model-q8_0.gguf");
    let streaming = |map_mb: &str| -> serde_json::Value {
        let args = ["--stream-experts", "--expert-map-mb", map_mb];
        bench_json(
            &model,
            &[&["--prompt-tokens", "8", "--gen-tokens", "8"], &args[..]].concat(),
        )["expert_streaming"]
            .clone()
    };
    let (none, kept) = (streaming("0"), streaming("3"));
    for r in [&none, &kept] {
        let reads = r["expert_reads"].as_u64().unwrap();
        assert!(reads > 0, "{r}");
        assert!(r["prefetched_reads"].as_u64().unwrap() <= reads, "{r}");
        assert!(r["expert_bytes_on_disk"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["expert_cache_bytes"].as_u64(), Some(0), "{r}");
    }
    assert_eq!(none["expert_map_bytes"].as_u64(), Some(0), "{none}");
    assert_eq!(none["expert_cache_hit_rate"].as_f64(), Some(0.0), "{none}");
    assert_eq!(kept["expert_map_bytes"].as_u64(), Some(3 << 20), "{kept}");
    assert!(
        kept["expert_cache_hit_rate"].as_f64().unwrap() > 0.5,
        "{kept}"
    );
}

/// `peregrine bench --model MODEL ARGS --repeat 1 --json`'s report; the run must succeed.
fn bench_json(model: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec![
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--repeat",
        "1",
        "--json",
    ];
    all.extend(args);
    peregrine_json(&all)
}
