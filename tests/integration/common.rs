//! Shared helpers: locating the repository's data and the cached real models.

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A real model from the cache `scripts/fetch-models.sh` fills. Panics with the fix when absent:
/// these tests must run, not skip.
pub fn real_model(file: &str) -> PathBuf {
    let dir = std::env::var_os("PEREGRINE_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/peregrine/models")
        });
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        path.display()
    );
    path
}

/// Parses a committed JSON file under `tests/data`.
pub fn data_json(rel: &str) -> serde_json::Value {
    let path = repo_root().join("tests/data").join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// A JSON array of integers as token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
