//! HF safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use peregrine_tensor::candle::safetensors::MmapedSafetensors;
use peregrine_tensor::{Device, Tensor};

use crate::config::read_json_object;
use crate::{ModelError, Result};

/// A checkpoint's safetensors files, memory-mapped.
pub struct SafetensorsFiles {
    root: PathBuf,
    files: MmapedSafetensors,
}

impl SafetensorsFiles {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let paths = if index.exists() {
            let map = read_json_object(&index)?;
            let Some(serde_json::Value::Object(weight_map)) = map.get("weight_map") else {
                return Err(ModelError::config(
                    &index,
                    "missing object field `weight_map`",
                ));
            };
            let names: BTreeSet<&str> = weight_map.values().filter_map(|v| v.as_str()).collect();
            names.into_iter().map(|n| dir.join(n)).collect::<Vec<_>>()
        } else {
            vec![dir.join("model.safetensors")]
        };
        for p in &paths {
            check_file(p)?;
        }
        // SAFETY: the files are mapped read-only; like every mmap reader we rely on them not
        // being truncated while the process runs.
        let files =
            unsafe { MmapedSafetensors::multi(&paths) }.map_err(|e| ModelError::Checkpoint {
                file: if paths.len() == 1 {
                    paths[0].clone()
                } else {
                    dir.to_path_buf()
                },
                message: format!(
                    "not a valid safetensors file: {}",
                    peregrine_tensor::error_message(&e)
                ),
            })?;
        Ok(Self {
            root: dir.to_path_buf(),
            files,
        })
    }

    /// The checkpoint folder.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Whether a tensor named `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.files.get(name).is_ok()
    }

    /// Loads `name` as stored (dtype unchanged).
    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        if !self.contains(name) {
            return Err(ModelError::MissingTensor {
                file: self.root.clone(),
                tensor: name.to_string(),
            });
        }
        self.files
            .load(name, device)
            .map_err(|e| ModelError::Checkpoint {
                file: self.root.clone(),
                message: format!("tensor `{name}`: {}", peregrine_tensor::error_message(&e)),
            })
    }
}

fn check_file(path: &Path) -> Result<()> {
    std::fs::metadata(path)
        .map(|_| ())
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
}
