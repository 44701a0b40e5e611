//! Helpers shared by the model tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use peregrine_models::{CausalLm, KvOptions, Logits, SequenceCache};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

/// The fixtures with recurrent layers: Mamba 2; Falcon-H1 (attention beside the mixer in every
/// layer); Jamba (Mamba layers, attention and experts between); the Qwen3-Next and Qwen3.5
/// hybrids (gated delta-net and full attention).
pub const RECURRENT: [&str; 6] = [
    "mamba2",
    "falcon_h1",
    "jamba",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
];

/// The greedy continuation of `prompt`, `n` tokens long: the prompt through `forward`, then
/// one token at a time through `decode`, as generation runs.
pub fn greedy_ids(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let logits = model.forward(prompt, &mut cache, Logits::Last).unwrap();
    let mut logits = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        out.push(id);
        if out.len() < n {
            model.decode(id, &mut cache, &mut logits).unwrap();
        }
    }
    out
}

/// `tests/fixtures/<path>` at the repository root.
pub fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(path)
}

/// A model from `${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}` (scripts/fetch-models.sh).
pub fn real_model(file: &str) -> PathBuf {
    let dir = std::env::var_os("PEREGRINE_MODELS").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/peregrine/models"),
        PathBuf::from,
    );
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    path
}

/// Every position's logits of `ids` with media rows: `runs` are each run's first index and
/// rows (in prompt order), seen both ways within a run when `both_ways`. One forward pass per
/// run, with the text up to the next run, as the engine feeds a prompt with media.
pub fn media_logits(
    model: &dyn CausalLm,
    ids: &[u32],
    runs: &[(usize, peregrine_tensor::Tensor)],
    both_ways: bool,
) -> peregrine_tensor::Tensor {
    media_logits_at(model, ids, runs, both_ways, None)
}

/// [`media_logits`] for an M-RoPE model: every run is a picture of merged grid `grid` (rows,
/// columns), or at plain positions where `None`.
pub fn media_logits_at(
    model: &dyn CausalLm,
    ids: &[u32],
    runs: &[(usize, peregrine_tensor::Tensor)],
    both_ways: bool,
    grid: Option<(usize, usize)>,
) -> peregrine_tensor::Tensor {
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let mut ends: Vec<usize> = runs.iter().map(|(s, r)| s + r.dim(0).unwrap()).collect();
    ends.pop();
    ends.push(ids.len());
    let (mut from, mut parts) = (0, Vec::new());
    for end in ends {
        let media = (runs.iter())
            .find(|(s, _)| (from..end).contains(s))
            .map(|(s, rows)| peregrine_models::Media {
                offset: s - from,
                rows,
                both_ways,
                grid,
            });
        let mut batch = [peregrine_models::BatchSeq {
            tokens: &ids[from..end],
            cache: &mut cache,
            logits: Logits::All,
            media,
        }];
        parts.push(model.forward_batch(&mut batch).unwrap());
        from = end;
    }
    peregrine_tensor::Tensor::cat(&parts, 0).unwrap()
}

/// The VLM fixture `family`'s llama.cpp projector file (`gguf/mmproj-f32.gguf`, written by its
/// converter) against its HF folder's tower on the fixture's photo: the same pixels, grid,
/// runs, prompt form and expansion, and the same rows within 1e-5.
pub fn check_mmproj_against_hf(family: &str) {
    use peregrine_models::vision::{decode_image, load_mmproj, load_vision};
    use peregrine_tensor::Device;
    use peregrine_tensor::ops::max_abs_diff;
    let dir = fixture(&format!("vlm/{family}"));
    let mmproj = load_mmproj(&dir.join("gguf/mmproj-f32.gguf"), &Device::Cpu)
        .expect("the projector file loads");
    let hf = (load_vision(&dir.join("hf"), &Device::Cpu).unwrap()).expect("a vision tower");
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let image = decode_image(&png, &Default::default()).unwrap();
    let (ours, theirs) = (
        mmproj.preprocess(&image).unwrap(),
        hf.preprocess(&image).unwrap(),
    );
    assert_eq!(ours.grid, theirs.grid, "{family}");
    assert_eq!(
        max_abs_diff(&ours.tiles, &theirs.tiles).unwrap(),
        0.0,
        "{family}: pixels"
    );
    assert_eq!(mmproj.prompt(), hf.prompt(), "{family}");
    assert_eq!(mmproj.runs(&ours), hf.runs(&theirs), "{family}");
    assert_eq!(mmproj.expansion(&ours), hf.expansion(&theirs), "{family}");
    let rows = mmproj.encode(&ours).unwrap();
    let diff = max_abs_diff(&rows, &hf.encode(&theirs).unwrap()).unwrap();
    eprintln!("{family}: mmproj rows vs the HF tower's: {diff:.2e}");
    assert!(diff < 1e-5, "{family}: {diff}");
}

/// The HF folder of `arch`'s fixture.
pub fn hf_fixture(arch: &str) -> PathBuf {
    fixture(arch).join("hf")
}

/// A fixture's `reference.safetensors`: the prompt, transformers' logits and greedy ids.
pub struct Reference {
    pub ids: Vec<u32>,
    pub logits: Tensor,
    pub greedy: Vec<u32>,
}

/// `arch`'s reference.
pub fn reference(arch: &str) -> Reference {
    reference_in(&hf_fixture(arch))
}

/// The reference of the checkpoint folder `dir`.
pub fn reference_in(dir: &std::path::Path) -> Reference {
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).expect("reference.safetensors");
    let ids = |name: &str| -> Vec<u32> {
        r[name]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    Reference {
        ids: ids("input_ids"),
        logits: r["logits"].clone(),
        greedy: ids("greedy_ids"),
    }
}

/// The largest absolute difference of two tensors of one shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

/// Every position's logits of `ids` run through `forward` `chunk` tokens at a time.
pub fn run_in_chunks(model: &dyn CausalLm, ids: &[u32], chunk: usize) -> Tensor {
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let parts: Vec<Tensor> = ids
        .chunks(chunk)
        .map(|c| model.forward(c, &mut cache, Logits::All).expect("forward"))
        .collect();
    Tensor::cat(&parts, 0).unwrap()
}
