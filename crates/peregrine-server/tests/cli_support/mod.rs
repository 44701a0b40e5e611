//! Helpers shared by the CLI tests: the binary, the fixtures, scratch folders, reference logits.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use peregrine_engine::tensor::candle::safetensors::load;
use peregrine_engine::tensor::{DType, Device, Tensor};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(arch: &str) -> PathBuf {
    repo().join("tests/fixtures").join(arch).join("hf")
}

pub fn peregrine(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_peregrine"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// [`peregrine`] that must succeed (its stderr is the failure's message).
pub fn peregrine_ok(args: &[&str]) -> Output {
    let out = peregrine(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The JSON a successful [`peregrine`] run prints.
pub fn peregrine_json(args: &[&str]) -> serde_json::Value {
    serde_json::from_slice(&peregrine_ok(args).stdout).unwrap()
}

/// A fresh scratch folder for one test, removed when dropped.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("peregrine-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch folder: a path while it lives, gone (with its files) once dropped, so that
/// test runs do not pile folders up in the temp folder.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn copy_fixture(arch: &str, to: &Path) {
    for entry in std::fs::read_dir(fixture(arch)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

/// Runs `generate` on `model` and returns stderr, asserting a clean failure.
pub fn expect_failure(model: &Path) -> String {
    let out = peregrine(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "one error line: {stderr}"
    );
    stderr
}

/// The fixture's reference input ids and transformers' logits.
pub fn reference(arch: &str) -> (Vec<u32>, Tensor) {
    let r = load(fixture(arch).join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    (ids, r["logits"].clone())
}

/// Runs `peregrine logits` on `model` for `ids` and reads back the logits.
pub fn cli_logits(model: &Path, ids: &[u32], extra: &[&str], scratch_name: &str) -> Tensor {
    let dir = scratch(scratch_name);
    let out_file = dir.join("logits.safetensors");
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let mut args = vec![
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--input-ids",
        &ids,
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--out", out_file.to_str().unwrap()]);
    let run = peregrine(&args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    load(&out_file, &Device::Cpu).unwrap()["logits"].clone()
}

// The repository's test helpers (`real_model`), shared rather than copied.
#[path = "../../../../tests/integration/common.rs"]
mod repo;
#[allow(unused_imports)] // each test binary uses its own subset
pub use repo::real_model;
