//! Experts streamed from the files (`ExpertOptions::stream`) against the same checkpoint
//! loaded resident: bitwise-identical logits, through the prompt at once, in chunks (prefill
//! groups tokens by expert) and token by token through the decode step, on every MoE layout —
//! per-expert HF tensors (Qwen3-MoE, Mixtral, DeepSeek-V3, Jamba), HF's fused Gemma 4 stack, MLX
//! `switch_mlp` / `switch_glu` stacks at 4 and 8 bits, and GGUF `ffn_*_exps` (Q8_0, bf16, fused
//! gate+up), with and without reads started on a guess a layer early and a hot set of recent
//! experts. A streamed model must also hold no expert weights and refuse a dense checkpoint.

mod common;

use peregrine_models::{
    BatchSeq, ExpertOptions, KvOptions, LoadOptions, LoadedModel, Logits, SequenceCache, load_model,
};
use peregrine_tensor::candle::safetensors::load;
use peregrine_tensor::{DType, Device, Tensor};

use common::fixture;

fn prompt(arch: &str) -> Vec<u32> {
    let r = load(fixture(arch).join("hf/reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    ids.to_vec1::<u32>().unwrap()
}

/// Streamed, each expert read (or mapped) on every use: none kept.
fn options(stream: bool) -> LoadOptions {
    LoadOptions {
        experts: ExpertOptions {
            stream,
            queue_depth: 4,
            mapped_bytes: 0,
            ..ExpertOptions::default()
        },
        ..LoadOptions::default()
    }
}

/// Streamed, with each layer's experts also read on a guess a layer early, and a hot set of
/// recently used experts (4 MiB over the model's MoE layers, copied or kept mapped: most of a
/// fixture's; the set's eviction is peregrine-moe's unit test).
fn guessing_and_keeping() -> LoadOptions {
    LoadOptions {
        experts: ExpertOptions {
            speculate: true,
            cache_bytes: 4 << 20,
            mapped_bytes: 4 << 20,
            ..options(true).experts
        },
        ..LoadOptions::default()
    }
}

/// Logits of every position, prompt in `chunk`-token passes, then the last 4 tokens again
/// through the decode step after a prefill of the rest.
fn run(model: &dyn peregrine_models::CausalLm, ids: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    run_routed(model, ids, chunk, None)
}

/// [`run`] with the sequence's tokens routed to `top_k` experts (a request's `moe_top_k`).
fn run_routed(
    model: &dyn peregrine_models::CausalLm,
    ids: &[u32],
    chunk: usize,
    top_k: Option<usize>,
) -> Vec<Vec<f32>> {
    let kv = KvOptions::default();
    let new_cache = || {
        let mut cache = SequenceCache::new(&model.cache_spec(), &kv);
        cache.set_moe_top_k(top_k);
        cache
    };
    let mut cache = new_cache();
    let mut rows = Vec::new();
    for part in ids.chunks(chunk) {
        let logits = model.forward(part, &mut cache, Logits::All).unwrap();
        let logits: Tensor = logits.to_dtype(DType::F32).unwrap();
        let n = logits.elem_count() / logits.dims().last().unwrap();
        rows.extend(logits.reshape((n, ())).unwrap().to_vec2::<f32>().unwrap());
    }
    let (head, tail) = ids.split_at(ids.len() - 4);
    let mut cache = new_cache();
    model.forward(head, &mut cache, Logits::Last).unwrap();
    let mut logits = Vec::new();
    for &token in tail {
        model.decode(token, &mut cache, &mut logits).unwrap();
        rows.push(logits.clone());
    }
    rows
}

fn check(checkpoint: &str) {
    let arch = checkpoint.split('/').next().unwrap();
    let ids = prompt(arch);
    let path = fixture(checkpoint);
    let resident = load_model(&path, &options(false)).unwrap().model;
    for opts in [options(true), guessing_and_keeping()] {
        let guess = opts.experts.speculate;
        let loaded = load_model(&path, &opts).unwrap_or_else(|e| panic!("{checkpoint}: {e}"));
        let (streamed, reads) = (loaded.model, loaded.expert_reads.expect("a read pool"));
        assert!(
            streamed.weight_bytes() < resident.weight_bytes(),
            "{checkpoint}: streamed {} bytes held, resident {}",
            streamed.weight_bytes(),
            resident.weight_bytes()
        );
        for chunk in [ids.len(), 5] {
            let (want, got) = (run(&*resident, &ids, chunk), run(&*streamed, &ids, chunk));
            assert_eq!(want.len(), got.len());
            for (pos, (w, g)) in want.iter().zip(&got).enumerate() {
                let same = w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{checkpoint} (chunk {chunk}, guesses {guess}): row {pos} differs"
                );
            }
        }
        let (asked, ahead) = reads.stats().counts();
        let (guessed, _) = reads.stats().speculation();
        assert!(asked > 0 && ahead > 0, "{checkpoint}: experts read ahead");
        if guess {
            assert!(
                reads.stats().hot_hits() > 0,
                "{checkpoint}: the hot set served some"
            );
            // Gemma 4 and Jamba run their own layer loops, which do not guess yet.
            let decoder = !checkpoint.starts_with("gemma4") && !checkpoint.starts_with("jamba");
            assert_eq!(guessed > 0, decoder, "{checkpoint}: guesses ({guessed})");
        }
    }
}

macro_rules! streamed {
    ($($name:ident: $checkpoint:literal,)*) => {$(
        #[test]
        fn $name() {
            check($checkpoint);
        }
    )*};
}

streamed! {
    qwen3_moe_hf: "qwen3_moe/hf",
    mixtral_hf: "mixtral/hf",
    deepseek_v3_hf: "deepseek_v3/hf",
    gemma4_moe_hf: "gemma4_text_moe/hf",
    jamba_hf: "jamba/hf",
    qwen3_5_moe_hf: "qwen3_5_moe/hf",
    qwen3_moe_mlx_q4: "qwen3_moe/mlx-q4-g64",
    mixtral_mlx_q8: "mixtral/mlx-q8-g64",
    gemma4_moe_mlx_q4: "gemma4_text_moe/mlx-q4-g64",
    qwen3_5_moe_mlx_q4: "qwen3_5_moe/mlx-q4-g64",
    qwen3_moe_gguf_q8_0: "qwen3_moe/gguf/model-q8_0.gguf",
    deepseek_v3_gguf_q8_0: "deepseek_v3/gguf/model-q8_0.gguf",
    gemma4_moe_gguf_q8_0: "gemma4_text_moe/gguf/model-q8_0.gguf",
    qwen3_5_moe_gguf_bf16: "qwen3_5_moe/gguf/model-bf16.gguf",
}

#[test]
fn a_model_without_experts_is_refused_by_name() {
    let err = load_model(&fixture("llama/hf"), &options(true))
        .err()
        .expect("a dense model with streamed experts is an error")
        .to_string();
    assert!(err.contains("no expert layers"), "{err}");
    assert!(err.contains("llama/hf"), "names the checkpoint: {err}");
}

/// `moe_top_k` routes each token to that many experts: the model's own k changes nothing (bit
/// for bit), fewer moves the logits, and a k of 0, above the expert count or on a dense model
/// is refused by name.
#[test]
fn a_top_k_override_routes_to_that_many_experts() {
    let ids = prompt("qwen3_moe");
    let path = fixture("qwen3_moe/hf");
    let with_k = |k: Option<usize>| {
        let opts = LoadOptions {
            experts: ExpertOptions {
                top_k: k,
                ..ExpertOptions::default()
            },
            ..LoadOptions::default()
        };
        load_model(&path, &opts).map(|m| run(&*m.model, &ids, ids.len()))
    };
    let own = with_k(None).unwrap();
    assert_eq!(with_k(Some(2)).unwrap(), own, "the fixture's own k is 2");
    let one = with_k(Some(1)).unwrap();
    let moved = own.iter().flatten().zip(one.iter().flatten());
    let worst = moved.map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(
        worst > 1e-3,
        "one expert instead of two moves the logits ({worst})"
    );
    for (k, path) in [(0, "qwen3_moe/hf"), (9, "qwen3_moe/hf"), (1, "llama/hf")] {
        let opts = LoadOptions {
            experts: ExpertOptions {
                top_k: Some(k),
                ..ExpertOptions::default()
            },
            ..LoadOptions::default()
        };
        let err = load_model(&fixture(path), &opts)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("top-k"), "{path}, k {k}: {err}");
    }
}

fn with_top_k(path: &std::path::Path, top_k: Option<usize>) -> LoadedModel {
    let opts = LoadOptions {
        experts: ExpertOptions {
            top_k,
            ..ExpertOptions::default()
        },
        ..LoadOptions::default()
    };
    load_model(path, &opts).unwrap()
}

/// A sequence's own top-k (a request's `moe_top_k`) routes exactly as the same top-k set at
/// load: bit for bit through the prompt at once, in chunks and the decode step, on the shared
/// decoder (Qwen3-MoE, DeepSeek-V3's group-limited router, the Qwen3.5 hybrid) and the families
/// with their own layer loops (Gemma 4, Jamba).
#[test]
fn a_sequences_top_k_routes_as_the_same_top_k_at_load() {
    for checkpoint in [
        "qwen3_moe/hf",
        "deepseek_v3/hf",
        "qwen3_5_moe/hf",
        "gemma4_text_moe/hf",
        "jamba/hf",
    ] {
        let ids = prompt(checkpoint.split('/').next().unwrap());
        let path = fixture(checkpoint);
        let (model, at_load) = (
            with_top_k(&path, None).model,
            with_top_k(&path, Some(1)).model,
        );
        for chunk in [ids.len(), 5] {
            let want = run(&*at_load, &ids, chunk);
            assert_eq!(
                run_routed(&*model, &ids, chunk, Some(1)),
                want,
                "{checkpoint}, chunk {chunk}"
            );
            assert_ne!(
                run(&*model, &ids, chunk),
                want,
                "{checkpoint}: k 1 changes nothing?"
            );
        }
    }
}

/// One batched pass over a sequence at the model's top-k and one at a lower one gives each
/// what it gets alone (GGUF Q8_0: its kernels give a row the same bits in any batch).
#[test]
fn sequences_of_different_top_k_share_a_batched_pass() {
    let path = fixture("qwen3_moe/gguf/model-q8_0.gguf");
    let ids = prompt("qwen3_moe");
    let model = with_top_k(&path, None).model;
    let new_cache = |top_k| {
        let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
        cache.set_moe_top_k(top_k);
        cache
    };
    let solo = |top_k, tokens: &[u32]| -> Vec<f32> {
        let mut cache = new_cache(top_k);
        let logits = model.forward(tokens, &mut cache, Logits::Last).unwrap();
        logits.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (short, long) = (&ids[..ids.len() - 3], &ids[..]);
    let (mut own, mut one) = (new_cache(None), new_cache(Some(1)));
    let batch = &mut [
        BatchSeq::last(short, &mut own),
        BatchSeq::last(long, &mut one),
    ];
    let rows = model
        .forward_batch(batch)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(rows[0], solo(None, short), "the model's own top-k");
    assert_eq!(rows[1], solo(Some(1), long), "top-k 1");
    assert_ne!(solo(None, long), rows[1]);
}

/// A GGUF file cut short while an expert's mapped rows are being multiplied (past the check
/// before each use): the lost pages read as zeros instead of ending the process with SIGBUS,
/// the file reports the damage by name so the pass is thrown away, and once the file is whole
/// again its pages are mapped afresh and the expert multiplies as before.
#[cfg(target_os = "linux")]
#[test]
fn a_file_cut_short_mid_multiply_is_reported_by_name_and_mended_once_whole() {
    use peregrine_models::weights::GgufFile;

    let path = std::env::temp_dir().join(format!("peregrine-cut-{}.gguf", std::process::id()));
    std::fs::copy(fixture("qwen3_moe/gguf/model-q8_0.gguf"), &path).unwrap();
    let whole = std::fs::read(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    // The last layer's last expert: its rows lie in the file's second half.
    let layers = (0..).find(|l| g.dims(&stack(*l)).is_err()).unwrap();
    let name = stack(layers - 1);
    let &[n, rows, cols] = &g.dims(&name).unwrap()[..] else {
        panic!("a stack of experts")
    };
    let mats = (g.expert_row_matrices(&name, (n, n - 1), &[rows], &Device::Cpu, true)).unwrap();
    assert!(
        mats[0].is_shared(),
        "multiplied where it lies in the mapping"
    );
    let x = Tensor::ones((1, cols), DType::F32, &Device::Cpu).unwrap();
    let y = |m: &peregrine_tensor::GgufMatrix| m.forward(&x).unwrap().to_vec2::<f32>().unwrap();
    let before = y(&mats[0]);
    assert!(g.still_whole().is_ok() && g.unharmed().is_ok());

    let cut = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    cut.set_len(whole.len() as u64 / 2).unwrap();
    let damaged = y(&mats[0]); // without the guard: SIGBUS
    assert_ne!(damaged, before);
    for err in [g.unharmed().unwrap_err(), g.still_whole().unwrap_err()] {
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }

    std::fs::write(&path, &whole).unwrap();
    g.still_whole().unwrap();
    g.unharmed().unwrap();
    assert_eq!(y(&mats[0]), before, "the file's bytes again");
    drop((mats, g));
    std::fs::remove_file(&path).unwrap();
}

fn stack(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.switch_mlp.gate_proj.weight")
}
