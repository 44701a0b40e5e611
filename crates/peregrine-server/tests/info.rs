//! `peregrine info`: the cache one sequence holds at a context length, counted per kind of
//! layer, on a random-weight checkpoint with Qwen3-Next's real layer pattern and shapes, and
//! on a dense model (where it is the full-attention formula).

mod cli_support;

use std::collections::HashMap;
use std::path::Path;

use cli_support::*;
use peregrine_engine::tensor::candle::safetensors::save;
use peregrine_engine::tensor::{Device, Tensor};

/// Qwen3-Next-80B-A3B's attention and delta-net shapes and layer pattern (48 layers, every
/// fourth full attention); hidden width, MLP and vocabulary tiny, since the cache does not
/// depend on them.
const LAYERS: usize = 48;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 256;
const HEADS: usize = 16;
const K_HEADS: usize = 16;
const V_HEADS: usize = 32;
const K_DIM: usize = 128;
const V_DIM: usize = 128;
const CONV: usize = 4;
const HIDDEN: usize = 8;

/// A tensor of `shape` with values from a small linear congruential generator.
fn random(shape: &[usize], seed: &mut u64) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

/// Writes the checkpoint (config, random weights, the fixtures' tokenizer) into `dir`.
fn qwen3_next_pattern(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "model_type": "qwen3_next", "vocab_size": 512, "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "full_attention_interval": 4,
        "linear_num_key_heads": K_HEADS, "linear_num_value_heads": V_HEADS,
        "linear_key_head_dim": K_DIM, "linear_value_head_dim": V_DIM,
        "linear_conv_kernel_dim": CONV, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": false, "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("qwen3_next").join(file), dir.join(file)).unwrap();
    }
    let (h, seed) = (HIDDEN, &mut 7u64);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        t.insert(name, random(shape, seed));
    };
    put("model.embed_tokens.weight".into(), &[512, h]);
    put("lm_head.weight".into(), &[512, h]);
    put("model.norm.weight".into(), &[h]);
    let (kw, vw) = (K_HEADS * K_DIM, V_HEADS * V_DIM);
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            put(format!("{p}.{n}.weight"), &[h]);
        }
        for n in ["gate_proj", "up_proj"] {
            put(format!("{p}.mlp.{n}.weight"), &[h, h]);
        }
        put(format!("{p}.mlp.down_proj.weight"), &[h, h]);
        if (i + 1) % 4 == 0 {
            let a = format!("{p}.self_attn");
            put(format!("{a}.q_proj.weight"), &[2 * HEADS * HEAD_DIM, h]);
            put(format!("{a}.k_proj.weight"), &[KV_HEADS * HEAD_DIM, h]);
            put(format!("{a}.v_proj.weight"), &[KV_HEADS * HEAD_DIM, h]);
            put(format!("{a}.o_proj.weight"), &[h, HEADS * HEAD_DIM]);
            put(format!("{a}.q_norm.weight"), &[HEAD_DIM]);
            put(format!("{a}.k_norm.weight"), &[HEAD_DIM]);
        } else {
            let l = format!("{p}.linear_attn");
            put(format!("{l}.in_proj_qkvz.weight"), &[2 * kw + 2 * vw, h]);
            put(format!("{l}.in_proj_ba.weight"), &[2 * V_HEADS, h]);
            put(format!("{l}.conv1d.weight"), &[2 * kw + vw, 1, CONV]);
            put(format!("{l}.dt_bias"), &[V_HEADS]);
            put(format!("{l}.A_log"), &[V_HEADS]);
            put(format!("{l}.norm.weight"), &[V_DIM]);
            put(format!("{l}.out_proj.weight"), &[h, vw]);
        }
    }
    save(&t, dir.join("model.safetensors")).unwrap();
}

fn info(model: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["info", "--json", "--model", model.to_str().unwrap()];
    args.extend_from_slice(extra);
    peregrine_json(&args)
}

fn bytes_of(report: &serde_json::Value, kind: &str) -> (u64, u64) {
    let layers = report["layers"].as_array().unwrap();
    let l = layers.iter().find(|l| l["kind"] == kind).unwrap();
    (l["layers"].as_u64().unwrap(), l["bytes"].as_u64().unwrap())
}

/// At 32K positions with f16 KV: 12 full layers hold `2 · kv_heads · head_dim · 32768 · 2`
/// bytes each; 36 delta-net layers hold their conv window and `[k, v]` state per value head
/// in f32, once plus once per rollback position (8 by default), whatever the context. The
/// total is their sum, a quarter of what counting every layer as full attention would give.
#[test]
fn a_hybrid_counts_each_layer_by_its_kind() {
    let dir = scratch("info-qwen3-next-pattern");
    qwen3_next_pattern(&dir);
    let r = info(&dir, &["--ctx-size", "32768"]);
    let full_layer = 2 * KV_HEADS * HEAD_DIM * 32_768 * 2;
    let state = (2 * K_HEADS * K_DIM + V_HEADS * V_DIM) * (CONV - 1) + V_HEADS * K_DIM * V_DIM;
    let recurrent_layer = 4 * state * (1 + 8);
    assert_eq!(bytes_of(&r, "full"), (12, (12 * full_layer) as u64));
    assert_eq!(
        bytes_of(&r, "recurrent"),
        (36, (36 * recurrent_layer) as u64)
    );
    let total = r["cache_bytes"].as_u64().unwrap();
    assert_eq!(total, (12 * full_layer + 36 * recurrent_layer) as u64);
    assert!(total < (LAYERS * full_layer / 2) as u64, "{total}");
    // No rollback copies: the state alone.
    let r = info(&dir, &["--ctx-size", "32768", "--recurrent-rollback", "0"]);
    assert_eq!(bytes_of(&r, "recurrent"), (36, (36 * 4 * state) as u64));
    std::fs::remove_dir_all(&dir).ok();
}

/// A dense model's figure is the full-attention formula: `layers · 2 · kv_heads · head_dim ·
/// positions · bytes per value` (llama fixture: 2 layers, 2 KV heads of 16).
#[test]
fn a_dense_model_is_the_full_attention_formula() {
    for (cache, bytes) in [("f16", 2), ("f32", 4)] {
        let r = info(
            &fixture("llama"),
            &["--ctx-size", "32768", "--cache-type", cache],
        );
        let want = 2 * 2 * 2 * 16 * 32_768 * bytes;
        assert_eq!(r["cache_bytes"].as_u64(), Some(want), "{cache}");
        assert_eq!(bytes_of(&r, "full"), (2, want));
        assert_eq!(r["layers"].as_array().unwrap().len(), 1);
    }
}

/// `--stream-experts` leaves the experts on disk: `weight_bytes` drops by exactly the experts'
/// bytes, which `streamed_expert_bytes` reports, so that with and without streaming add up to
/// what a resident load holds; the budgets of kept experts are the flags'; a dense model with
/// the flag is refused by name.
#[test]
fn streamed_experts_are_counted_apart() {
    for arch in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let model = fixture(arch);
        let resident = info(&model, &[]);
        let streamed = info(&model, &["--stream-experts"]);
        let held = |r: &serde_json::Value, key: &str| r[key].as_u64().unwrap();
        assert_eq!(held(&resident, "streamed_expert_bytes"), 0, "{arch}");
        assert!(held(&streamed, "streamed_expert_bytes") > 0, "{arch}");
        assert_eq!(
            held(&streamed, "weight_bytes_without_streaming"),
            held(&resident, "weight_bytes"),
            "{arch}"
        );
        let kept = info(
            &model,
            &[
                "--stream-experts",
                "--expert-map-mb",
                "3",
                "--expert-cache-mb",
                "2",
            ],
        );
        assert_eq!(held(&kept, "expert_map_bytes"), 3 << 20, "{arch}");
        assert_eq!(held(&kept, "expert_cache_bytes"), 2 << 20, "{arch}");
        assert_eq!(held(&resident, "expert_map_bytes"), 0, "{arch}");
    }
    let out = peregrine(&[
        "info",
        "--stream-experts",
        "--model",
        fixture("llama").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no expert layers"), "{stderr}");
}
