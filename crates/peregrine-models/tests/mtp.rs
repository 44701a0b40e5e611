//! Multi-token-prediction heads against transformers' `MtpModel` (scripts/fixtures/add_mtp.py):
//! each row's logits over the fixture prompt, run row by row through `mtp_step` and through the
//! rows every forward pass adds. Tolerance 1e-3 max abs, as the golden tests: the weights are
//! stored exactly (bf16) and both sides compute in f32, so only summation order differs; a
//! wrong norm, concatenation order or position moves logits by 1e-1 or more.

mod common;

use peregrine_models::{CausalLm, KvOptions, LoadOptions, Logits, SequenceCache, load_model};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

const TOLERANCE: f32 = 1e-3;
const ARCHS: [&str; 4] = ["deepseek_v3", "qwen3_next", "qwen3_5", "qwen3_5_moe"];

fn model(arch: &str, mtp: bool) -> std::sync::Arc<dyn CausalLm> {
    let opts = LoadOptions {
        mtp,
        ..LoadOptions::default()
    };
    load_model(&common::fixture(&format!("{arch}/hf")), &opts)
        .expect("fixture loads")
        .model
}

/// The prompt and transformers' MTP logits `[n - 1, vocab]`.
fn reference(arch: &str) -> (Vec<u32>, Tensor) {
    let path = common::fixture(&format!("{arch}/hf/reference.safetensors"));
    let r = load(path, &Device::Cpu).expect("reference.safetensors");
    let ids = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    (ids, r["mtp_logits"].clone())
}

/// A cache keeping the model's MTP head, the prompt run through it in chunks of `chunk`.
fn prefilled(model: &dyn CausalLm, ids: &[u32], chunk: usize) -> SequenceCache {
    let kv = KvOptions::default();
    let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
    let spec = model.mtp_spec().expect("the head loaded");
    cache.enable_mtp(&spec, &kv, model.config().hidden_size);
    for c in ids.chunks(chunk) {
        model.forward(c, &mut cache, Logits::Last).unwrap();
    }
    cache
}

fn row_diff(got: &[f32], want: &Tensor) -> f32 {
    let want = want.to_vec1::<f32>().unwrap();
    (got.iter().zip(&want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()))
}

#[test]
fn mtp_rows_match_transformers() {
    for arch in ARCHS {
        let model = model(arch, true);
        let (ids, want) = reference(arch);
        let mut cache = prefilled(model.as_ref(), &ids, ids.len());
        let state = cache.mtp().unwrap();
        assert_eq!(
            state.cache().len(),
            ids.len() - 1,
            "{arch}: one head row per next token"
        );
        // Every row again, one at a time from an empty head cache.
        let rows = state.cache().len();
        state.cache().trim(rows).unwrap();
        let (mut logits, mut out) = (Vec::new(), Vec::new());
        let mut worst = 0f32;
        for j in 0..ids.len() - 1 {
            let hidden = state.hidden_at(j).unwrap().to_vec();
            let head = state.cache();
            model
                .mtp_step((&hidden, ids[j + 1]), head, (&mut logits, &mut out))
                .unwrap();
            worst = worst.max(row_diff(&logits, &want.get(j).unwrap()));
        }
        eprintln!("{arch}: MTP rows one by one, max abs diff {worst:.2e}");
        assert!(worst < TOLERANCE, "{arch}: {worst}");
    }
}

#[test]
fn forward_passes_keep_the_head_caught_up() {
    for arch in ARCHS {
        let model = model(arch, true);
        let (ids, want) = reference(arch);
        let last = ids.len() - 2;
        for chunk in [ids.len(), 5, 1] {
            // The head's cache from the passes, its last row run again over it.
            let mut cache = prefilled(model.as_ref(), &ids, chunk);
            let state = cache.mtp().unwrap();
            state.cache().trim(1).unwrap();
            let hidden = state.hidden_at(last).unwrap().to_vec();
            let (mut logits, mut out) = (Vec::new(), Vec::new());
            let input = (&hidden[..], ids[last + 1]);
            (model.mtp_step(input, state.cache(), (&mut logits, &mut out))).unwrap();
            let diff = row_diff(&logits, &want.get(last).unwrap());
            eprintln!("{arch} (chunks of {chunk}): last MTP row, max abs diff {diff:.2e}");
            assert!(diff < TOLERANCE, "{arch}, chunks of {chunk}: {diff}");
        }
    }
}

#[test]
fn the_head_is_read_only_when_asked_for_and_rolls_back_with_the_cache() {
    for arch in ARCHS {
        assert!(model(arch, false).mtp_spec().is_none(), "{arch}");
        let model = model(arch, true);
        let (ids, _) = reference(arch);
        let mut cache = prefilled(model.as_ref(), &ids, ids.len());
        cache.trim(3).unwrap();
        let state = cache.mtp().unwrap();
        let len = ids.len() - 3;
        assert_eq!(
            state.cache().len(),
            len - 1,
            "{arch}: the head follows a trim"
        );
        assert!(
            !state.is_lost() && state.hidden_at(len - 1).is_some(),
            "{arch}"
        );
        assert!(
            state.hidden_at(len).is_none(),
            "{arch}: trimmed states are gone"
        );
    }
}

#[test]
fn a_checkpoint_without_the_head_is_refused_when_it_is_asked_for() {
    let opts = LoadOptions {
        mtp: true,
        ..LoadOptions::default()
    };
    // A config naming no MTP layer: nothing to load, nothing refused.
    let plain = load_model(&common::fixture("llama/hf"), &opts).unwrap();
    assert!(plain.model.mtp_spec().is_none());
    // A config naming one over weights without it (DeepSeek-V3's cut to one layer: its second
    // is a plain layer, not an MTP one): the error names the checkpoint and the tensors
    // looked for.
    let dir = std::env::temp_dir().join(format!("peregrine-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = common::fixture("deepseek_v3/hf");
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    let config = config.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let err = load_model(&dir, &opts).err().expect("refused").to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    let named = err.contains(&*dir.to_string_lossy());
    assert!(
        err.contains("model.layers.1.eh_proj.weight") && named,
        "{err}"
    );
}

/// Gemma 4's assistant drafting for the gemma4_text fixture (scripts/fixtures/
/// make_gemma4_assistant.py): four chained steps after the prompt, each step's logits against
/// transformers' drafting loop (its ordered-embeddings head included), reading the target's
/// sliding layer past its 8-position window. Same tolerance as above.
#[test]
fn gemma4_assistant_drafts_match_transformers() {
    use peregrine_models::Gemma4Assistant;
    let target = model("gemma4_text", false);
    let dir = common::fixture("gemma4_assistant/hf");
    assert!(Gemma4Assistant::is_assistant(&dir));
    let assistant = Gemma4Assistant::load(&dir, &LoadOptions::default()).unwrap();
    assistant.check(target.as_ref()).unwrap();
    let r = load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> = r["input_ids"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let first = r["first_token"]
        .to_dtype(DType::U32)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap();
    let kv = KvOptions::default();
    let mut cache = SequenceCache::new(&target.cache_spec(), &kv);
    cache.enable_mtp(&[], &kv, target.config().hidden_size);
    target.forward(&ids, &mut cache, Logits::Last).unwrap();
    let mut hidden = cache
        .mtp()
        .unwrap()
        .hidden_at(ids.len() - 1)
        .unwrap()
        .to_vec();
    let (mut logits, mut out, mut token) = (Vec::new(), Vec::new(), first);
    for step in 0..4 {
        let input = (&hidden[..], token);
        (assistant.step(target.as_ref(), &mut cache, input, (&mut logits, &mut out))).unwrap();
        let diff = row_diff(&logits, &r["draft_logits"].get(step).unwrap());
        eprintln!("gemma4_assistant step {step}: max abs diff {diff:.2e}");
        assert!(diff < TOLERANCE, "step {step}: {diff}");
        token = (0..logits.len() as u32)
            .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]))
            .unwrap();
        hidden = out.clone();
    }
    assert_eq!(
        cache.len(),
        ids.len(),
        "the assistant writes nothing to the target's cache"
    );
    let plain = model("llama", false);
    let err = assistant.check(plain.as_ref()).unwrap_err().to_string();
    assert!(
        err.contains("Gemma 4 models") && err.contains("llama"),
        "{err}"
    );
}
