//! `peregrine info` (and `serve --info`): what a model is and what it will hold in memory —
//! its weights, and the KV cache and recurrent state one sequence takes at the context length,
//! counted per kind of layer (full attention grows with the context, sliding layers stop at
//! their window, recurrent layers keep a fixed state).

use anyhow::Result;
use clap::Args;
use peregrine_engine::{Engine, LayerMemory, cache_memory};
use serde_json::{Value, json};

use crate::cli::ModelArgs;

#[derive(Debug, Args)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The report as JSON: `weight_bytes` (held in memory), `streamed_expert_bytes` (left on disk
/// by `--stream-experts`, as they would be held) and `weight_bytes_without_streaming`,
/// `expert_map_bytes` and `expert_cache_bytes` (the most a streamed model keeps of its experts:
/// `--expert-map-mb`, where they are multiplied from the mapped file, `--expert-cache-mb`),
/// `context_length`, `cache_bytes` (KV + recurrent state of one sequence at that context) and
/// `layers` (`kind`, `layers`, `bytes` per kind).
pub fn report(engine: &Engine, model_id: &str, args: &ModelArgs) -> Value {
    let model = engine.model();
    let kv = args.engine_config().kv;
    let memory = cache_memory(
        model.config(),
        &model.cache_spec(),
        &kv,
        engine.max_context(),
    );
    let layers: Vec<Value> = (memory.iter())
        .map(
            |LayerMemory {
                 kind,
                 layers,
                 bytes,
             }| { json!({"kind": kind, "layers": layers, "bytes": bytes}) },
        )
        .collect();
    let pool = engine.expert_reads();
    let streamed = pool.map_or(0, |p| p.stats().expert_bytes()) as usize;
    json!({
        "model": model_id,
        "architecture": model.config().model_type,
        "weight_bytes": model.weight_bytes(),
        "streamed_expert_bytes": streamed,
        "weight_bytes_without_streaming": model.weight_bytes() + streamed,
        "expert_map_bytes": pool.map_or(0, |p| p.mapped_bytes()),
        "expert_cache_bytes": pool.map_or(0, |p| p.hot_bytes()),
        "context_length": engine.max_context(),
        "vocab_size": engine.tokenizer().vocab_size(),
        "kv_cache": kv_label(args),
        "cache_bytes": memory.iter().map(|m| m.bytes).sum::<usize>(),
        "layers": layers,
    })
}

/// One line for the server's startup log: weights, and the cache of one sequence at the
/// context length by kind of layer.
pub fn summary(engine: &Engine, args: &ModelArgs) -> String {
    let r = report(engine, "", args);
    let kinds: Vec<String> = (r["layers"].as_array().into_iter().flatten())
        .map(|l| format!("{} {}", l["layers"], l["kind"].as_str().unwrap_or("")))
        .collect();
    let streamed = match r["streamed_expert_bytes"].as_u64().unwrap_or(0) {
        0 => String::new(),
        _ => format!(
            " (+ {} of experts streamed)",
            mib(&r["streamed_expert_bytes"])
        ),
    };
    format!(
        "weights {}{streamed}; KV + state per sequence at {} positions {} ({})",
        mib(&r["weight_bytes"]),
        r["context_length"],
        mib(&r["cache_bytes"]),
        kinds.join(", ")
    )
}

/// The KV storage the flags choose, as `--cache-type` names it (or `q4`/`q8`, `turbo`).
fn kv_label(args: &ModelArgs) -> String {
    match (args.turbo_kv, args.kv_bits) {
        (true, _) => "turbo".into(),
        (false, Some(bits)) => format!("q{bits}"),
        (false, None) => args.cache_type.as_deref().unwrap_or("f16").into(),
    }
}

fn mib(bytes: &Value) -> String {
    format!(
        "{:.1} MiB",
        bytes.as_u64().unwrap_or(0) as f64 / (1 << 20) as f64
    )
}

/// Runs `peregrine info`.
pub fn run(args: InfoArgs) -> Result<()> {
    let engine = args.model.load()?;
    let r = report(
        &engine,
        &crate::server::model_id(&args.model.model),
        &args.model,
    );
    if args.json {
        println!("{r:#}");
        return Ok(());
    }
    let text = |key: &str| r[key].as_str().unwrap_or("").to_string();
    println!("model         {} ({})", text("model"), text("architecture"));
    println!("weights       {} in memory", mib(&r["weight_bytes"]));
    if r["streamed_expert_bytes"].as_u64().unwrap_or(0) > 0 {
        println!(
            "  experts     {} streamed from disk (--stream-experts); {} without streaming",
            mib(&r["streamed_expert_bytes"]),
            mib(&r["weight_bytes_without_streaming"])
        );
        println!(
            "  kept        up to {} mapped (--expert-map-mb), {} copied (--expert-cache-mb)",
            mib(&r["expert_map_bytes"]),
            mib(&r["expert_cache_bytes"])
        );
    }
    println!(
        "cache         {} for one sequence of {} positions ({} KV)",
        mib(&r["cache_bytes"]),
        r["context_length"],
        text("kv_cache")
    );
    for layer in r["layers"].as_array().into_iter().flatten() {
        println!(
            "  {:<22} {:>4} layers  {}",
            layer["kind"].as_str().unwrap_or(""),
            layer["layers"],
            mib(&layer["bytes"])
        );
    }
    Ok(())
}
