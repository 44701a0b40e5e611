//! Checkpoint layouts other than the fixtures' single f32 file: sharded safetensors with an
//! index, and bf16/f16 weights. Built in a scratch folder from the llama fixture.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use peregrine_models::{KvOptions, LoadOptions, Logits, SequenceCache, load_model};
use peregrine_tensor::candle::safetensors::{load, save};
use peregrine_tensor::{DType, Device, Tensor};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/hf")
}

/// A scratch checkpoint folder holding the fixture's config and tokenizer, removed when dropped.
fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("peregrine-layouts-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    Scratch(dir)
}

/// A test's scratch folder, gone with its files once dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn logits(dir: &Path) -> Tensor {
    let reference = load(fixture().join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = reference["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    let model = load_model(dir, &LoadOptions::default()).unwrap().model;
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    model.forward(&ids, &mut cache, Logits::All).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

fn weights() -> HashMap<String, Tensor> {
    load(fixture().join("model.safetensors"), &Device::Cpu).unwrap()
}

#[test]
fn sharded_checkpoint_with_index_loads_identically() {
    let dir = scratch("sharded");
    let mut names: Vec<String> = weights().keys().cloned().collect();
    names.sort();
    let (mut shards, mut weight_map) =
        (vec![HashMap::new(), HashMap::new()], serde_json::Map::new());
    for (i, name) in names.iter().enumerate() {
        let shard = i % 2;
        shards[shard].insert(name.clone(), weights()[name].clone());
        weight_map.insert(
            name.clone(),
            format!("model-0000{}-of-00002.safetensors", shard + 1).into(),
        );
    }
    for (i, shard) in shards.iter().enumerate() {
        save(
            shard,
            dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
        )
        .unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(max_diff(&logits(&dir), &logits(&fixture())), 0.0);
}

#[test]
fn half_precision_weights_load_and_stay_close() {
    let exact = logits(&fixture());
    for dtype in [DType::BF16, DType::F16] {
        let dir = scratch(&format!("{dtype:?}"));
        let converted: HashMap<String, Tensor> = weights()
            .into_iter()
            .map(|(k, v)| (k, v.to_dtype(dtype).unwrap()))
            .collect();
        save(&converted, dir.join("model.safetensors")).unwrap();
        // Rounding every weight to 8 (bf16) or 11 (f16) significant bits moves these logits
        // (std ~1) by a few hundredths; a loading bug (wrong dtype read, transposed tensor) moves
        // them by ~1.
        let diff = max_diff(&logits(&dir), &exact);
        eprintln!("{dtype:?} weights: max abs logit diff {diff}");
        assert!(diff < 0.25, "{dtype:?}: max abs diff {diff}");
    }
}

/// A Gemma 3 VLM whose vision tower this build cannot run: `load_vision` names the field and
/// the file, while the text model still loads from `text_config` (the engine then serves text
/// with a warning, or refuses with `--vision`).
#[test]
fn an_unsupported_vision_tower_is_named_and_the_text_model_still_loads() {
    let dir = scratch("gemma3-vision");
    let vlm = fixture().join("../../vlm/gemma3/hf");
    for file in ["model.safetensors", "preprocessor_config.json"] {
        std::fs::copy(vlm.join(file), dir.join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(vlm.join("config.json")).unwrap()).unwrap();
    config["vision_config"]["model_type"] = "clip_vision_model".into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = (peregrine_models::vision::load_vision(&dir, &Device::Cpu))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("vision_config")
            && err.contains("clip_vision_model")
            && err.contains("config.json"),
        "{err}"
    );
    let text = load_model(&dir, &LoadOptions::default()).expect("the text model loads");
    assert_eq!(text.model.config().hidden_size, 64);
}

/// Bytes of tensor data in a safetensors file: all of it after the length and JSON header.
fn tensor_bytes(file: &Path) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - header
}

/// Bytes of tensor data in a GGUF file: each tensor's blocks (not the alignment between them).
fn gguf_tensor_bytes(file: &Path) -> u64 {
    let mut f = std::fs::File::open(file).unwrap();
    let content = peregrine_tensor::candle::quantized::gguf_file::Content::read(&mut f).unwrap();
    let size = |i: &peregrine_tensor::candle::quantized::gguf_file::TensorInfo| {
        i.shape.elem_count() / i.ggml_dtype.block_size() * i.ggml_dtype.type_size()
    };
    content.tensor_infos.values().map(size).sum::<usize>() as u64
}

/// A load counts each tensor's stored bytes once (what the progress bar shows): every byte of
/// the f32 fixture, of an MLX 4-bit one and of the GGUF file, no more.
#[test]
fn a_load_counts_every_stored_byte_once() {
    let gguf = fixture().join("../gguf/model-f32.gguf");
    for path in [fixture(), fixture().join("../mlx-q4-g64"), gguf.clone()] {
        let progress = std::sync::Arc::new(peregrine_models::LoadProgress::default());
        let options = LoadOptions {
            progress: Some(progress.clone()),
            ..LoadOptions::default()
        };
        load_model(&path, &options).unwrap();
        let stored = match path == gguf {
            true => gguf_tensor_bytes(&path),
            false => tensor_bytes(&path.join("model.safetensors")),
        };
        assert_eq!(progress.bytes_read(), stored, "{}", path.display());
    }
}
