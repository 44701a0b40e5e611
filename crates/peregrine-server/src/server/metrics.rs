//! Prometheus counters and histograms for `/metrics`, kept with atomics and one small mutex.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use peregrine_engine::{PromptCacheStats, SpeculationStats};

/// Upper bounds (seconds) of the time-to-first-token histogram.
const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds of the decode tokens-per-second histogram.
const TPS_BUCKETS: [f64; 9] = [1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// A cumulative histogram.
#[derive(Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], x: f64) {
        self.counts.resize(bounds.len(), 0);
        for (c, &b) in self.counts.iter_mut().zip(bounds) {
            if x <= b {
                *c += 1;
            }
        }
        self.sum += x;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, bounds: &[f64]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in bounds.iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct Locked {
    by_status: BTreeMap<(String, u16), u64>,
    ttft: Histogram,
    tps: Histogram,
}

/// The server's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    locked: Mutex<Locked>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Requests submitted and not yet finished (waiting or generating).
    pub in_flight: AtomicUsize,
    /// Connections open now.
    pub connections: AtomicUsize,
    /// Connections refused over `--max-connections`.
    pub refused: AtomicU64,
    /// Connections dropped for sending a request head too slowly.
    pub header_timeouts: AtomicU64,
    /// Connections dropped for sitting idle.
    pub idle_timeouts: AtomicU64,
    /// Requests that ended with an internal error (a failed or panicked generation).
    pub internal_errors: AtomicU64,
}

/// What `/metrics` shows of the engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineFigures {
    /// KV cache held by running sequences.
    pub kv_bytes: usize,
    /// KV the running requests may grow to (their reservations), and the budget.
    pub kv_reserved: (usize, usize),
    /// Prefills run (a request's `n` choices share one).
    pub prefills: u64,
    /// The prompt cache's state.
    pub cache: PromptCacheStats,
    /// Sequences the scheduler runs now (prefilling or decoding).
    pub running: usize,
    /// Batched forward passes, and the sequences they carried.
    pub batch_steps: (u64, u64),
    /// Streamed experts (`--stream-experts`), when the model streams them.
    pub expert_reads: Option<ExpertFigures>,
    /// Speculative decoding's counters (all 0 when it is off).
    pub speculation: SpeculationStats,
    /// Pictures run through the vision tower, and pictures whose rows were reused.
    pub images: (u64, u64),
}

/// What streamed MoE layers read.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExpertFigures {
    /// Experts used, and of those, read ahead by a prefetch.
    pub used: (u64, u64),
    /// Experts guessed ahead of their layer's routing, and of those, routed to.
    pub guessed: (u64, u64),
    /// Experts served by the hot set.
    pub hot_hits: u64,
}

impl Metrics {
    /// Counts a finished request.
    pub fn request(&self, path: &str, status: u16) {
        let mut l = self.locked.lock().unwrap_or_else(|e| e.into_inner());
        *l.by_status.entry((path.to_string(), status)).or_default() += 1;
    }

    /// Records one finished generation.
    pub fn generation(&self, prompt: usize, completion: usize, ttft_s: f64, tps: f64) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        let mut l = self.locked.lock().unwrap_or_else(|e| e.into_inner());
        l.ttft.observe(&TTFT_BUCKETS, ttft_s);
        if completion > 1 {
            l.tps.observe(&TPS_BUCKETS, tps);
        }
    }

    /// The Prometheus text exposition; `parallel` is the number of generation slots.
    pub fn render(&self, parallel: usize, engine: EngineFigures) -> String {
        let EngineFigures {
            kv_bytes,
            kv_reserved,
            prefills,
            cache,
            running,
            batch_steps,
            expert_reads,
            speculation,
            images,
        } = engine;
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed) as usize;
        let mut out = String::new();
        let l = self.locked.lock().unwrap_or_else(|e| e.into_inner());
        out.push_str("# HELP peregrine_requests_total HTTP requests by path and status.\n");
        out.push_str("# TYPE peregrine_requests_total counter\n");
        for ((path, status), n) in &l.by_status {
            let _ = writeln!(
                out,
                "peregrine_requests_total{{path=\"{path}\",status=\"{status}\"}} {n}"
            );
        }
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let counters = [
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                count(&self.prompt_tokens),
            ),
            (
                "completion_tokens_total",
                "counter",
                "Tokens generated.",
                count(&self.completion_tokens),
            ),
            (
                "prefills_total",
                "counter",
                "Prompt prefills run (the choices of one request share one).",
                prefills as usize,
            ),
            (
                "running_sequences",
                "gauge",
                "Sequences the scheduler advances together (prefilling or decoding).",
                running,
            ),
            (
                "batch_steps_total",
                "counter",
                "Forward passes over several sequences (a lone decode takes the single step).",
                batch_steps.0 as usize,
            ),
            (
                "batch_sequences_total",
                "counter",
                "Sequences carried by those passes (divided by the steps: the mean batch).",
                batch_steps.1 as usize,
            ),
            (
                "speculative_rounds_total",
                "counter",
                "Forward passes that verified drafted tokens.",
                speculation.rounds as usize,
            ),
            (
                "speculative_drafted_tokens_total",
                "counter",
                "Tokens drafted for verification.",
                speculation.drafted as usize,
            ),
            (
                "speculative_accepted_tokens_total",
                "counter",
                "Drafted tokens verification kept (divided by the drafted: the acceptance rate).",
                speculation.accepted as usize,
            ),
            (
                "speculative_skipped_steps_total",
                "counter",
                "Steps of speculating sequences that drafted nothing: drafting measured as a loss.",
                speculation.skipped as usize,
            ),
            (
                "connections",
                "gauge",
                "HTTP connections open now.",
                self.connections.load(Ordering::Relaxed),
            ),
            (
                "connections_refused_total",
                "counter",
                "Connections answered 503 over --max-connections.",
                count(&self.refused),
            ),
            (
                "connections_header_timeout_total",
                "counter",
                "Connections closed for sending a request head too slowly.",
                count(&self.header_timeouts),
            ),
            (
                "connections_idle_timeout_total",
                "counter",
                "Connections closed for sitting idle.",
                count(&self.idle_timeouts),
            ),
            (
                "internal_errors_total",
                "counter",
                "Requests ended by an internal error (a failed or panicked generation).",
                count(&self.internal_errors),
            ),
            (
                "active_slots",
                "gauge",
                "Generations running now.",
                in_flight.min(parallel),
            ),
            (
                "queue_depth",
                "gauge",
                "Requests waiting for a slot.",
                in_flight.saturating_sub(parallel),
            ),
            (
                "kv_bytes",
                "gauge",
                "KV cache bytes held by running sequences.",
                kv_bytes,
            ),
            (
                "kv_reserved_bytes",
                "gauge",
                "KV cache bytes the running requests may grow to (their reservations).",
                kv_reserved.0,
            ),
            (
                "kv_budget_bytes",
                "gauge",
                "KV cache bytes all running requests together may grow to (--kv-budget-mb).",
                kv_reserved.1,
            ),
            (
                "prompt_cache_hits_total",
                "counter",
                "Requests whose prompt prefix came from the prompt cache.",
                cache.hits as usize,
            ),
            (
                "prompt_cache_misses_total",
                "counter",
                "Requests the prompt cache had no prefix for.",
                cache.misses as usize,
            ),
            (
                "prompt_cache_reused_tokens_total",
                "counter",
                "Prompt tokens taken from the prompt cache instead of prefilled.",
                cache.reused_tokens as usize,
            ),
            (
                "prompt_cache_entries",
                "gauge",
                "Sequences the prompt cache holds.",
                cache.entries,
            ),
            (
                "prompt_cache_bytes",
                "gauge",
                "KV cache bytes the prompt cache holds.",
                cache.bytes,
            ),
            (
                "images_encoded_total",
                "counter",
                "Pictures run through the vision tower.",
                images.0 as usize,
            ),
            (
                "images_reused_total",
                "counter",
                "Pictures whose encoded rows were reused from an earlier request.",
                images.1 as usize,
            ),
        ];
        let streamed = expert_reads.map(|e| {
            let ((reads, prefetched), (guessed, hits), hot) = (e.used, e.guessed, e.hot_hits);
            [
                (
                    "expert_reads_total",
                    "counter",
                    "Experts the MoE layers used (--stream-experts), each read from the \
                     checkpoint's files unless the hot set had it.",
                    reads as usize,
                ),
                (
                    "expert_cache_hits_total",
                    "counter",
                    "Of those, experts served by the hot set (--expert-cache-mb) or still mapped \
                     (--expert-map-mb).",
                    hot as usize,
                ),
                (
                    "expert_reads_prefetched_total",
                    "counter",
                    "Of those, reads started before the expert was asked for.",
                    prefetched as usize,
                ),
                (
                    "expert_guesses_total",
                    "counter",
                    "Experts read on a guess from the previous layer, before their router ran.",
                    guessed as usize,
                ),
                (
                    "expert_guess_hits_total",
                    "counter",
                    "Of those, experts the router then chose (the speculative prefetch's hits).",
                    hits as usize,
                ),
            ]
        });
        for (name, kind, help, value) in counters.into_iter().chain(streamed.into_iter().flatten())
        {
            let _ = writeln!(
                out,
                "# HELP peregrine_{name} {help}\n# TYPE peregrine_{name} {kind}\nperegrine_{name} {value}"
            );
        }
        let ttft_help = "Time to first token in seconds.";
        l.ttft.render(
            &mut out,
            "peregrine_time_to_first_token_seconds",
            ttft_help,
            &TTFT_BUCKETS,
        );
        let tps_help = "Decode speed per request in tokens per second.";
        l.tps.render(
            &mut out,
            "peregrine_decode_tokens_per_second",
            tps_help,
            &TPS_BUCKETS,
        );
        out
    }
}
