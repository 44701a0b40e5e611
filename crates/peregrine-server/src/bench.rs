//! `peregrine bench`: prefill and decode speed, time to first token and memory, as JSON.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use peregrine_engine::{
    Constraint, Engine, Event, Grammar, Prompt, Request, SamplingParams, Timings, Usage,
};
use serde_json::json;

use crate::cli::ModelArgs;

/// Text repeated to make the synthetic prompt (any text works; speed does not depend on it).
const PROMPT_TEXT: &str = "The quick brown fox jumps over the lazy dog while the river runs to the sea, \
    and every morning the baker opens the shop before the sun rises over the old town. ";

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens to generate (greedy, end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs; figures are medians.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Untimed runs first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Print JSON only (the default output is JSON too; kept for scripts).
    #[arg(long)]
    json: bool,
    /// Also measure the prompt cache: per repeat, two requests sharing their first N tokens
    /// (then 16 of their own); reports both times to first token.
    #[arg(long, value_name = "N")]
    cached_prefix: Option<usize>,
    /// Also measure continuous batching: `C` requests at once (the engine decodes up to `C`
    /// together), each its own prompt of `--prompt-tokens` and `--gen-tokens`; reports the
    /// aggregate and per-stream decode speed and times to first token.
    #[arg(long, value_name = "C")]
    concurrency: Option<usize>,
    /// Also measure constrained decoding: the same runs with the output held to this JSON
    /// schema; reports decode speed against the unconstrained runs and the token mask's cost
    /// per token (median, p99), timed by replaying the generated tokens through the grammar.
    #[arg(long, value_name = "FILE")]
    schema: Option<std::path::PathBuf>,
    /// The prompt: this file's text, tokenized as `generate --prompt` does (write the chat
    /// markup in it for a chat model), the same for every run (instead of `--prompt-tokens`
    /// of synthetic text); for measuring speculative decoding on real work, such as a code
    /// edit, with llama.cpp given the same text.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["cached_prefix", "concurrency"])]
    prompt_file: Option<std::path::PathBuf>,
}

fn synthetic_prompt(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let unit = engine.prompt_ids(&Prompt::Text(PROMPT_TEXT.to_string()))?;
    if unit.is_empty() {
        bail!("the tokenizer turned the benchmark text into no tokens");
    }
    Ok(unit.iter().copied().cycle().take(n).collect())
}

fn run_once(engine: &Engine, ids: &[u32], gen_tokens: usize) -> Result<(Usage, Timings)> {
    let (usage, timings, _) = run_with(engine, ids, gen_tokens, None)?;
    Ok((usage, timings))
}

/// One greedy run, optionally constrained; also returns the generated token ids.
fn run_with(
    engine: &Engine,
    ids: &[u32],
    gen_tokens: usize,
    constraint: Option<&Constraint>,
) -> Result<(Usage, Timings, Vec<u32>)> {
    let mut generated = vec![];
    let request = Request {
        constraint: constraint.cloned(),
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens: Some(gen_tokens),
        ignore_eos: true,
        ..Request::new(Prompt::Tokens(ids.to_vec()))
    };
    for event in engine.submit(request)? {
        match event {
            Event::Done { usage, timings, .. } => return Ok((usage, timings, generated)),
            Event::Error(e) => return Err(e.into()),
            Event::Delta { tokens, .. } => generated.extend(tokens),
        }
    }
    bail!("the request ended without a result")
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// A memory figure of this process from /proc/self/status (`VmHWM` peak, `VmRSS` now), in
/// bytes; 0 where /proc is unavailable.
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

pub fn run(args: BenchArgs, threads: Option<usize>) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repeat == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeat must be at least 1");
    }
    let load_start = Instant::now();
    let mut config = args.model.engine_config();
    if args.cached_prefix.is_none() {
        config.prompt_cache_entries = 0;
    }
    if let Some(c) = args.concurrency {
        config.parallel = config.parallel.max(c);
    }
    let engine = args.model.load_with(config)?;
    let load_ms = load_start.elapsed().as_secs_f64() * 1e3;
    // The prompt cache would serve a repeated prompt whole: it is off unless measured, and each
    // run's prompt starts one token further into the text, sharing no prefix with the others.
    let runs_total = args.warmup + args.repeat;
    let streams = args.concurrency.unwrap_or(0);
    let (text, prompt_tokens, shift) = match &args.prompt_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--prompt-file {}: cannot read", path.display()))?;
            let ids = engine.prompt_ids(&Prompt::Text(text))?;
            (ids.clone(), ids.len(), 0)
        }
        None => {
            let n = args.prompt_tokens + runs_total + streams;
            (synthetic_prompt(&engine, n)?, args.prompt_tokens, 1)
        }
    };
    let prompt = |r: usize| &text[r * shift..r * shift + prompt_tokens];
    for r in 0..args.warmup {
        run_once(&engine, prompt(r), args.gen_tokens.min(8))?;
    }
    let spec_before = engine.speculation_stats();
    let runs = (args.warmup..runs_total)
        .map(|r| run_once(&engine, prompt(r), args.gen_tokens))
        .collect::<Result<Vec<_>>>()?;
    if let Some((u, _)) = runs.iter().find(|(u, _)| u.cached_tokens > 0) {
        bail!(
            "a timed run reused {} cached prompt tokens",
            u.cached_tokens
        );
    }
    let pick = |f: &dyn Fn(&(Usage, Timings)) -> f64| median(runs.iter().map(f).collect());
    let prompt_cache = match args.cached_prefix {
        Some(n) => Some(prompt_cache_report(&engine, &args, n)?),
        None => None,
    };
    let mut report = json!({
        "model": args.model.model,
        "threads": rayon_threads(threads),
        "prompt_tokens": prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "prefill_tps": pick(&|(u, t)| t.prefill_tps(u.prompt_tokens)),
        "decode_tps": pick(&|(_, t)| t.decode_tps()),
        "ttft_ms": pick(&|(_, t)| t.time_to_first_token.as_secs_f64() * 1e3),
        // The peak includes loading (safetensors are read through a mapping while the weights
        // are copied out of it); `rss_bytes` is what stays resident after the timed runs.
        "peak_rss_bytes": status_bytes("VmHWM"),
        "rss_bytes": status_bytes("VmRSS"),
        "kv_bytes": runs.iter().map(|(_, t)| t.kv_bytes).max().unwrap_or(0),
        "weight_bytes": engine.model().weight_bytes(),
        "load_ms": load_ms,
    });
    if let Some(cache) = prompt_cache {
        report["prompt_cache"] = cache;
    }
    if let Some(drafter) = args.model.drafter_name() {
        let (now, then) = (engine.speculation_stats(), spec_before);
        let rounds = now.rounds - then.rounds;
        let (drafted, accepted) = (now.drafted - then.drafted, now.accepted - then.accepted);
        report["speculative"] = json!({
            "drafter": drafter,
            "max_draft_tokens": args.model.num_draft_tokens,
            "adaptive": !args.model.draft_fixed,
            "verify_passes": rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted as f64 / drafted.max(1) as f64,
            "mean_accepted_per_pass": accepted as f64 / rounds.max(1) as f64,
            "steps_without_drafts": now.skipped - then.skipped,
        });
    }
    if let Some(pool) = engine.expert_reads() {
        let (reads, prefetched) = pool.stats().counts();
        let (guessed, hits) = pool.stats().speculation();
        report["expert_streaming"] = json!({
            "queue_depth": pool.depth(),
            "expert_reads": reads,
            "prefetched_reads": prefetched,
            "prefetch_hit_rate": prefetched as f64 / reads.max(1) as f64,
            "speculated_reads": guessed,
            "speculation_hit_rate": hits as f64 / guessed.max(1) as f64,
            "expert_cache_bytes": pool.hot_bytes(),
            "expert_map_bytes": pool.mapped_bytes(),
            // Uses served by either kept set: copied (`--expert-cache-mb`) or still mapped.
            "expert_cache_hit_rate": pool.stats().hot_hits() as f64 / reads.max(1) as f64,
            "expert_bytes_on_disk": pool.stats().expert_bytes(),
        });
    }
    if streams > 0 {
        let prompts = (0..streams)
            .map(|i| prompt(runs_total + i).to_vec())
            .collect();
        report["concurrency"] = concurrency_report(&engine, prompts, args.gen_tokens)?;
    }
    if let Some(path) = &args.schema {
        let prompts: Vec<&[u32]> = (args.warmup..runs_total).map(prompt).collect();
        report["constrained"] = constrained_report(&engine, &prompts, args.gen_tokens, path)?;
    }
    println!("{report}");
    Ok(())
}

/// Decode speed with the output held to the schema in `path` against plain runs of the same
/// prompts, interleaved (plain, constrained, plain, …) so that a noisy host skews both alike;
/// and the mask's cost per token: each run's tokens replayed through a fresh matcher, timing
/// the mask over a vocabulary-sized row plus the advance.
fn constrained_report(
    engine: &Engine,
    prompts: &[&[u32]],
    gen_tokens: usize,
    path: &std::path::Path,
) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the schema {}", path.display()))?;
    let schema: serde_json::Value =
        (serde_json::from_str(&text)).with_context(|| format!("{} is not JSON", path.display()))?;
    let constraint = engine.compile(&Grammar::JsonSchema(schema))?;
    let vocab = engine.tokenizer().vocab_size();
    let (mut plain, mut tps, mut tokens, mut mask_us) = (vec![], vec![], vec![], vec![]);
    for ids in prompts {
        plain.push(run_once(engine, ids, gen_tokens)?.1.decode_tps());
        let (_, timings, generated) = run_with(engine, ids, gen_tokens, Some(&constraint))?;
        tps.push(timings.decode_tps());
        tokens.push(generated.len() as f64);
        let mut matcher = constraint.start();
        let mut logits = vec![0.0f32; vocab];
        for &token in &generated {
            let start = Instant::now();
            matcher.mask(&mut logits)?;
            if !engine.tokenizer().is_eos(token) {
                matcher.consume(token)?;
            }
            mask_us.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    mask_us.sort_by(f64::total_cmp);
    let at = |p: f64| mask_us[((mask_us.len() - 1) as f64 * p).round() as usize];
    let (decode_tps, plain_tps) = (median(tps), median(plain));
    Ok(json!({
        "schema": path.display().to_string(),
        "decode_tps": decode_tps,
        "plain_decode_tps": plain_tps,
        "ratio_to_plain": decode_tps / plain_tps.max(1e-9),
        "gen_tokens": median(tokens),
        "mask_us_p50": at(0.5),
        "mask_us_p99": at(0.99),
        "mask_us_max": at(1.0),
    }))
}

/// All of `prompts` submitted at once, `gen_tokens` each: the sum of the streams' decode
/// speeds (they run side by side), the median stream's, the wall-clock rate of all generated
/// tokens, and times to first token.
fn concurrency_report(
    engine: &Engine,
    prompts: Vec<Vec<u32>>,
    gen_tokens: usize,
) -> Result<serde_json::Value> {
    let start = Instant::now();
    let streams = prompts.len();
    let runs = std::thread::scope(|scope| {
        let handles: Vec<_> = (prompts.iter())
            .map(|ids| scope.spawn(|| run_once(engine, ids, gen_tokens)))
            .collect();
        (handles.into_iter())
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a stream panicked"))?)
            .collect::<Result<Vec<_>>>()
    })?;
    let wall = start.elapsed().as_secs_f64();
    let decode: Vec<f64> = runs.iter().map(|(_, t)| t.decode_tps()).collect();
    let ttft: Vec<f64> = (runs.iter())
        .map(|(_, t)| (t.queued + t.time_to_first_token).as_secs_f64() * 1e3)
        .collect();
    let generated: usize = runs.iter().map(|(u, _)| u.completion_tokens).sum();
    let (steps, rows) = engine.batch_steps();
    let percentile = |xs: &[f64], p: f64| {
        let mut xs = xs.to_vec();
        xs.sort_by(f64::total_cmp);
        xs[((xs.len() - 1) as f64 * p).round() as usize]
    };
    Ok(json!({
        "streams": streams,
        "aggregate_decode_tps": decode.iter().sum::<f64>(),
        "per_stream_decode_tps": median(decode.clone()),
        "wall_tps": generated as f64 / wall,
        "ttft_ms_p50": percentile(&ttft, 0.5),
        "ttft_ms_p90": percentile(&ttft, 0.9),
        "ttft_ms_max": percentile(&ttft, 1.0),
        "mean_batch": rows as f64 / (steps.max(1)) as f64,
    }))
}

/// Times to first token of `args.repeat` pairs of requests that share their first `n` tokens
/// (each pair its own prefix, so the first of a pair finds nothing cached), medians.
fn prompt_cache_report(engine: &Engine, args: &BenchArgs, n: usize) -> Result<serde_json::Value> {
    const OWN: usize = 16;
    // Prefixes start further into the text than any speed run's prompt, one token apart.
    let skip = args.warmup + args.repeat + 1;
    let text = synthetic_prompt(engine, skip + n + OWN * 2 + args.repeat)?;
    let (mut cold, mut warm, mut reused) = (vec![], vec![], vec![]);
    for r in 0..args.repeat {
        let prefix = &text[skip + r..skip + r + n];
        let own = |k: usize| -> Vec<u32> {
            let own = &text[skip + args.repeat + n..][..2 * OWN];
            let tail = own.iter().rev().skip(k * OWN).take(OWN);
            prefix.iter().chain(tail).copied().collect()
        };
        let (_, first) = run_once(engine, &own(0), args.gen_tokens)?;
        let (usage, second) = run_once(engine, &own(1), args.gen_tokens)?;
        cold.push(first.time_to_first_token.as_secs_f64() * 1e3);
        warm.push(second.time_to_first_token.as_secs_f64() * 1e3);
        reused.push(usage.cached_tokens as f64);
    }
    let (cold, warm) = (median(cold), median(warm));
    Ok(json!({
        "prefix_tokens": n,
        "ttft_first_ms": cold,
        "ttft_second_ms": warm,
        "cached_tokens": median(reused),
        "ttft_ratio": warm / cold,
    }))
}

/// The compute threads in use: `--threads`, else what `main` put in RAYON_NUM_THREADS.
fn rayon_threads(flag: Option<usize>) -> usize {
    flag.or_else(|| std::env::var("RAYON_NUM_THREADS").ok()?.parse().ok())
        .unwrap_or_else(peregrine_engine::tensor::device::physical_cores)
}
