//! HF safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped. Each tensor is copied out once and its pages are then released, so loading
//! never holds the file and the weights made from it at the same time.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use peregrine_tensor::candle::safetensors::Load;
use peregrine_tensor::{Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo, TensorView};

use super::LoadProgress;
use super::mapped::release;
use crate::config::read_json_object;
use crate::{ModelError, Result};

/// One mapped file and where its tensors lie.
struct Mapped {
    path: PathBuf,
    /// For positioned reads ([`SafetensorsFiles::read_rows`]).
    file: std::fs::File,
    mmap: Mmap,
    /// Where the data section starts (after the length and the JSON header).
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// A checkpoint's safetensors files, memory-mapped.
pub struct SafetensorsFiles {
    root: PathBuf,
    files: Vec<Mapped>,
    /// Tensor name → index in `files` (the last file naming a tensor wins).
    routing: HashMap<String, usize>,
    /// Another name → the name stored ([`alias_prefix`](Self::alias_prefix)).
    aliases: HashMap<String, String>,
    /// Counts the bytes of every tensor read.
    progress: Arc<LoadProgress>,
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
        let mut files = Vec::with_capacity(paths.len());
        let mut routing = HashMap::new();
        for path in paths {
            let mapped = map_file(path)?;
            routing.extend(
                mapped
                    .tensors
                    .keys()
                    .map(|name| (name.clone(), files.len())),
            );
            files.push(mapped);
        }
        Ok(Self {
            root: dir.to_path_buf(),
            files,
            routing,
            aliases: HashMap::new(),
            progress: Default::default(),
        })
    }

    /// Counts the bytes of every tensor read into `progress`.
    pub fn count_reads_in(&mut self, progress: Arc<LoadProgress>) {
        self.progress = progress;
    }

    /// Makes every tensor stored as `{from}…` also found as `{to}…`: a multimodal checkpoint's
    /// language model read under the text model's names.
    pub fn alias_prefix(&mut self, from: &str, to: &str) {
        let aliased: Vec<(String, usize, String)> = (self.routing.iter())
            .filter_map(|(name, &i)| {
                let rest = name.strip_prefix(from)?;
                Some((format!("{to}{rest}"), i, name.clone()))
            })
            .collect();
        for (alias, i, stored) in aliased {
            self.routing.insert(alias.clone(), i);
            self.aliases.insert(alias, stored);
        }
    }

    /// Bytes of the mapped files together.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.mmap.len() as u64).sum()
    }

    /// The checkpoint folder.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Whether a tensor named `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// The stored shape of `name`.
    pub fn dims(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.find(name)?.1.shape)
    }

    /// Runs `f` over `name`'s bytes as the file stores them (`dtype` checked), with a callback
    /// that releases the pages under a sub-range of them (relative to the tensor) once read; the
    /// rest are released when `f` returns. For loaders that transform a tensor as they read it.
    pub fn with_bytes<R>(
        &self,
        name: &str,
        dtype: Dtype,
        f: impl FnOnce(&[u8], &mut dyn FnMut(std::ops::Range<usize>)) -> R,
    ) -> Result<R> {
        let (file, info) = self.find(name)?;
        if info.dtype != dtype {
            return Err(ModelError::Checkpoint {
                file: file.path.clone(),
                message: format!("tensor `{name}`: {:?}, expected {dtype:?}", info.dtype),
            });
        }
        let range = file.data_start + info.data_offsets.0..file.data_start + info.data_offsets.1;
        let base = range.start;
        let mut done =
            |r: std::ops::Range<usize>| release(&file.mmap, base + r.start..base + r.end);
        self.progress.add(range.len());
        let result = f(&file.mmap[range.clone()], &mut done);
        release(&file.mmap, range);
        Ok(result)
    }

    fn find(&self, name: &str) -> Result<(&Mapped, &TensorInfo)> {
        let Some(&index) = self.routing.get(name) else {
            return Err(ModelError::MissingTensor {
                file: self.root.clone(),
                tensor: name.to_string(),
            });
        };
        let file = &self.files[index];
        let stored = self.aliases.get(name).map_or(name, String::as_str);
        Ok((file, &file.tensors[stored]))
    }

    /// Rows `first..first + count` of `name` (a row: its last dimension; the leading ones
    /// flattened, so a stack's expert `e` of `r` rows is rows `e·r..`), by a positioned read
    /// of exactly their bytes: the mapping is not touched, so a file cut short since it was
    /// opened gives an error naming it, never a crash. Returns the bytes and the stored dtype.
    pub fn read_rows(&self, name: &str, first: usize, count: usize) -> Result<(Vec<u8>, Dtype)> {
        let (_, info) = self.find(name)?;
        let row_bytes = info.shape.last().copied().unwrap_or(1) * info.dtype.bitsize() / 8;
        let mut bytes = vec![0u8; count * row_bytes];
        let dtype = self.read_rows_into(name, first, count, &mut bytes)?;
        Ok((bytes, dtype))
    }

    /// [`read_rows`](Self::read_rows) into `bytes`, which must hold exactly those rows.
    fn read_rows_into(
        &self,
        name: &str,
        first: usize,
        count: usize,
        bytes: &mut [u8],
    ) -> Result<Dtype> {
        let (file, info) = self.find(name)?;
        let last = info.shape.last().copied().unwrap_or(1);
        let rows = info.shape.iter().product::<usize>() / last.max(1);
        let row_bytes = last * info.dtype.bitsize() / 8;
        if first + count > rows || bytes.len() != count * row_bytes {
            return Err(ModelError::Checkpoint {
                file: file.path.clone(),
                message: format!(
                    "tensor `{name}` {:?}: rows {first}..{} asked, it has {rows}",
                    info.shape,
                    first + count
                ),
            });
        }
        self.progress.add(bytes.len());
        let at = file.data_start + info.data_offsets.0 + first * row_bytes;
        super::read_exact_at(&file.file, bytes, at as u64).map_err(|e| ModelError::Checkpoint {
            file: file.path.clone(),
            message: format!("tensor `{name}`: {e}"),
        })?;
        Ok(info.dtype)
    }

    /// Rows of an f32, f16 or bf16 tensor read straight into the tensor's own buffer on the
    /// CPU (a streamed expert then costs its size once, not a byte copy besides); `None` for
    /// other dtypes and devices.
    fn load_rows_in_place(
        &self,
        name: &str,
        (first, count): (usize, usize),
        device: &Device,
    ) -> Result<Option<Tensor>> {
        fn typed<T: peregrine_tensor::candle::WithDType>(
            s: &SafetensorsFiles,
            name: &str,
            (first, count, last): (usize, usize, usize),
        ) -> Result<Tensor> {
            let mut values = vec![T::from_f64(0.0); count * last];
            // SAFETY: any bytes are a valid f32/f16/bf16, and the slice covers exactly `values`.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(
                    values.as_mut_ptr() as *mut u8,
                    std::mem::size_of_val(values.as_slice()),
                )
            };
            s.read_rows_into(name, first, count, bytes)?;
            Ok(Tensor::from_vec(values, (count, last), &Device::Cpu)?)
        }
        // The file's bytes are little-endian, as the values in memory must be.
        if !device.is_cpu() || cfg!(target_endian = "big") {
            return Ok(None);
        }
        let (_, info) = self.find(name)?;
        let shape = (first, count, info.shape.last().copied().unwrap_or(1));
        Ok(match info.dtype {
            Dtype::F32 => Some(typed::<f32>(self, name, shape)?),
            Dtype::F16 => Some(typed::<half::f16>(self, name, shape)?),
            Dtype::BF16 => Some(typed::<half::bf16>(self, name, shape)?),
            _ => None,
        })
    }

    /// [`read_rows`](Self::read_rows) as a tensor `[count, last]` in the stored dtype.
    pub fn load_rows(
        &self,
        name: &str,
        first: usize,
        count: usize,
        device: &Device,
    ) -> Result<Tensor> {
        if let Some(t) = self.load_rows_in_place(name, (first, count), device)? {
            return Ok(t);
        }
        let (bytes, dtype) = self.read_rows(name, first, count)?;
        let last = self.dims(name)?.last().copied().unwrap_or(1);
        let view = TensorView::new(dtype, vec![count, last], &bytes);
        let err = |m: String| ModelError::Checkpoint {
            file: self.path().to_path_buf(),
            message: format!("tensor `{name}`: {m}"),
        };
        let view = view.map_err(|e| err(e.to_string()))?;
        view.load(device)
            .map_err(|e| err(peregrine_tensor::error_message(&e)))
    }

    /// Loads `name` as stored (dtype unchanged), then releases the file's pages under it.
    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (file, info) = self.find(name)?;
        let (start, end) = info.data_offsets;
        let range = file.data_start + start..file.data_start + end;
        let err = |message: String| ModelError::Checkpoint {
            file: file.path.clone(),
            message: format!("tensor `{name}`: {message}"),
        };
        let view = TensorView::new(info.dtype, info.shape.clone(), &file.mmap[range.clone()])
            .map_err(|e| err(e.to_string()))?;
        let tensor = view
            .load(device)
            .map_err(|e| err(peregrine_tensor::error_message(&e)))?;
        self.progress.add(range.len());
        release(&file.mmap, range);
        Ok(tensor)
    }
}

/// Maps `path` and reads its header (which must describe exactly the bytes that follow it).
fn map_file(path: PathBuf) -> Result<Mapped> {
    let file = std::fs::File::open(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    // SAFETY: the file is mapped read-only; like every mmap reader we rely on it not being
    // truncated or rewritten while the process runs.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Checkpoint {
            file: path.clone(),
            message: format!("not a valid safetensors file: {e}"),
        })?;
    let tensors = (metadata.tensors().into_iter())
        .map(|(name, info)| (name, info.clone()))
        .collect();
    Ok(Mapped {
        path,
        file,
        mmap,
        data_start: 8 + header_len,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_tensor::DType;

    /// Released pages come back from the file: tensors sharing pages load the same bytes again,
    /// in any order, and twice.
    #[test]
    fn released_tensors_load_again_unchanged() {
        let dir = std::env::temp_dir().join(format!("peregrine-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors: Vec<(String, Tensor)> = (0..6)
            .map(|i| {
                let n = 700 * (i + 1); // sizes that straddle 4 KiB pages
                let v: Vec<f32> = (0..n).map(|j| (i * 10_000 + j) as f32 * 0.5).collect();
                let t = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
                (format!("t{i}"), t.to_dtype(DType::BF16).unwrap())
            })
            .collect();
        let refs: HashMap<String, Tensor> = tensors.iter().cloned().collect();
        peregrine_tensor::candle::safetensors::save(&refs, dir.join("model.safetensors")).unwrap();
        let files = SafetensorsFiles::open_dir(&dir).unwrap();
        for name in ["t3", "t0", "t5", "t3", "t1", "t4", "t2", "t0"] {
            let got = files.load(name, &Device::Cpu).unwrap();
            let want = &refs[name];
            assert_eq!(got.dtype(), DType::BF16);
            let diff = (got.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "{name}");
        }
        assert!(matches!(
            files.load("missing", &Device::Cpu),
            Err(ModelError::MissingTensor { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
