//! Resolving `--model`: a GGUF file, a checkpoint folder, or a hub id downloaded with a
//! progress bar.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Files of an HF checkpoint folder that Peregrine reads.
const CHECKPOINT_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// A local path to load `model` from, downloading `owner/name[:file.gguf]` hub ids first.
pub fn resolve_model(model: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let looks_like_hub_id =
        model.split('/').count() == 2 && !model.starts_with('.') && !model.starts_with('/');
    if !looks_like_hub_id {
        bail!("{model}: no such file or folder");
    }
    download(model)
}

fn download(id: &str) -> Result<PathBuf> {
    let (repo, gguf) = match id.split_once(':') {
        Some((repo, file)) => (repo, Some(file)),
        None => (id, None),
    };
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_progress(true)
        .build()?;
    let repo = api.model(repo.to_string());
    let unreachable = |e: hf_hub::api::sync::ApiError| {
        anyhow::anyhow!(
            "{id}: not a local path, and the model hub could not be reached or has no such model ({e})"
        )
    };
    if let Some(file) = gguf {
        return repo.get(file).map_err(unreachable);
    }
    let config = repo.get("config.json").map_err(unreachable)?;
    for file in CHECKPOINT_FILES.iter().skip(1) {
        let _ = repo.get(file); // optional files
    }
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index)?;
            let map: serde_json::Value =
                serde_json::from_str(&text).context("model.safetensors.index.json")?;
            let mut shards: Vec<&str> = map["weight_map"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(_, v)| v.as_str())
                .collect();
            shards.sort_unstable();
            shards.dedup();
            for shard in shards {
                repo.get(shard).map_err(unreachable)?;
            }
        }
        Err(_) => {
            repo.get("model.safetensors").map_err(unreachable)?;
        }
    }
    Ok(config.parent().context("hub cache path")?.to_path_buf())
}
