//! `peregrine serve`: an OpenAI-compatible HTTP server on hyper 1 and tokio.
//!
//! The server binds first and loads the model in the background, so `/health` answers 503 while
//! loading. Each request is decoded strictly (`openai`), submitted to the engine (`complete`) and
//! answered as JSON or server-sent events (`wire`, `sse`); every failure is an OpenAI-shaped
//! error (`error`). SIGINT/SIGTERM stop accepting connections and let open ones finish briefly.

mod anthropic;
mod anthropic_wire;
mod complete;
mod conn;
#[cfg(test)]
mod decode_fuzz;
mod error;
mod media;
mod metrics;
pub mod openai;
mod prompt;
mod reasoning;
mod responses;
mod responses_wire;
mod routes;
mod semantic;
mod sse;
mod tool_calls;
mod tools;
mod webui;
mod wire;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Args;
use hyper::Response;
use hyper_util::server::graceful::GracefulShutdown;
use media::RemoteMedia;
use peregrine_engine::{Engine, EngineConfig, SamplingParams};

use crate::cli::ModelArgs;
use complete::Totals;
use error::ApiError;
pub use sse::Body;

/// `peregrine serve` options.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the bound address is printed).
    #[arg(long, default_value_t = 5413)]
    port: u16,
    /// Sequences generating at once; their steps share one forward pass (continuous
    /// batching: weights are read once per step for all of them). Default: twice the cores,
    /// at most 16.
    #[arg(long)]
    parallel: Option<usize>,
    /// Tokens one forward pass may take: a token for each decoding sequence, then chunks of
    /// waiting prompts (so a long prompt never stalls the decodes).
    #[arg(long, default_value_t = 512)]
    batch_tokens: usize,
    /// Prompt tokens one forward pass may take while other sequences decode. On a CPU each
    /// prompt token costs about as much as a decode: a small value (e.g. 4) keeps streams
    /// flowing while a long prompt arrives, and that prompt's first token comes later.
    #[arg(long, default_value_t = 512)]
    prefill_while_decoding: usize,
    /// While others decode, prompts longer than one chunk get only the tokens that keep the
    /// mean step within this many times a step of decodes alone (measured as it runs; shorter
    /// prompts go at once). 1 turns it off: chunks of --prefill-while-decoding.
    #[arg(long, default_value_t = 1.5)]
    decode_stretch: f64,
    /// MiB of KV cache all running requests together may grow to (default: half the memory
    /// available at start). A request waits until its prompt and max_tokens fit beside the
    /// running ones'; one that could never fit gets 400.
    #[arg(long)]
    kv_budget_mb: Option<usize>,
    /// Requests that may wait for a slot; more get 503.
    #[arg(long, default_value_t = 64)]
    queue_size: usize,
    /// Completion tokens when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    /// Default temperature for requests that give none.
    #[arg(long, default_value_t = 1.0)]
    temp: f32,
    /// Default top-p.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Default top-k (0 disables).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Default min-p.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Default repetition penalty.
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Require `Authorization: Bearer KEY` on /v1 routes. Visible to other users in the
    /// process list: prefer `--api-key-file`.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from the first line of this file.
    #[arg(long)]
    api_key_file: Option<std::path::PathBuf>,
    /// Answer CORS preflights and allow any origin.
    #[arg(long)]
    cors: bool,
    /// Do not serve the chat page at `/` (the API alone).
    #[arg(long)]
    no_webui: bool,
    /// Fetch `http(s)` image URLs that requests name (20 MiB at most each, 30 s, 3 redirects).
    /// The server then reaches any host a client names, its own network's included: allow it
    /// only for trusted clients. Without it such URLs are a 400; local files are never read.
    #[arg(long)]
    allow_remote_media: bool,
    /// With `--allow-remote-media`: the only hosts image URLs (and their redirects) may name,
    /// comma-separated (default: any).
    #[arg(long, value_delimiter = ',', requires = "allow_remote_media")]
    remote_media_hosts: Vec<String>,
    /// Largest request body in MiB; larger ones get 413.
    #[arg(long, default_value_t = 16)]
    max_body_mb: usize,
    /// A model id clients may use; repeat for more names. The first is the id the server
    /// reports (default: the file or folder name).
    #[arg(long)]
    alias: Vec<String>,
    /// Print the model, its weight and cache bytes and context length as JSON, and exit (as
    /// `peregrine info --json`).
    #[arg(long)]
    info: bool,
    /// Shut down when stdin reaches end-of-file (for supervisors and tests: the server goes
    /// away with the process that started it).
    #[arg(long)]
    exit_on_stdin_eof: bool,
    /// Seconds a stream may stay silent (a long prefill, a wait for a slot) before it gets an
    /// SSE comment line (`: keep-alive`), so proxies and clients keep waiting. Fractions work.
    #[arg(long, default_value_t = 5.0, value_parser = positive_secs)]
    keepalive_secs: f64,
    /// Seconds a client may take to send a request head, from its first byte; slower ones
    /// (slow-loris) are disconnected.
    #[arg(long, default_value_t = 10.0, value_parser = positive_secs)]
    header_timeout: f64,
    /// Seconds a connection may sit with no request running and nothing arriving, before it is
    /// closed (keep-alive connections between requests, connections that never send).
    #[arg(long, default_value_t = 60.0, value_parser = positive_secs)]
    idle_timeout: f64,
    /// Seconds a client may take to send a request body once its head is in (408 after), and
    /// that a stream may wait on a client that reads nothing before it is dropped.
    #[arg(long, default_value_t = 30.0, value_parser = positive_secs)]
    body_timeout: f64,
    /// Connections open at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Seconds running requests get to finish after SIGTERM/SIGINT; then they are cancelled
    /// (streams get an error event and `[DONE]`, others a 503) and the process exits, within
    /// this deadline.
    #[arg(long, default_value_t = 30.0, value_parser = positive_secs)]
    shutdown_timeout: f64,
    /// Test-only (hidden): a generation whose prompt contains this text panics after its first
    /// token (fault injection: the request must fail cleanly and the server go on).
    #[arg(long, hide = true)]
    test_panic_marker: Option<String>,
    /// Test-only (hidden): wait this many milliseconds before loading the model, so a test can
    /// see `/health` answer 503 while the model loads. 0, the default, waits for nothing.
    #[arg(long, hide = true, default_value_t = 0)]
    test_load_delay_ms: u64,
}

fn positive_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() && x <= 86_400.0 => Ok(x),
        _ => Err(format!("`{s}` is not a number of seconds in (0, 86400]")),
    }
}

/// Most Responses answers kept in memory; the oldest go first.
const RESPONSES_KEPT: usize = 1024;

/// What every handler shares.
pub struct State {
    engine: OnceLock<Arc<Engine>>,
    model_id: String,
    /// The `--model` argument and every `--alias`, also accepted as the `model` field.
    model_names: Vec<String>,
    api_key: Option<ApiKey>,
    cors: bool,
    /// Whether `/` serves the chat page.
    webui: bool,
    /// Fetches remote image URLs (`--allow-remote-media`).
    remote_media: Option<RemoteMedia>,
    max_body: usize,
    /// Longest a request body may take to arrive, and a stream may wait on a stalled reader.
    body_timeout: Duration,
    /// Turns true when running requests must end (the shutdown deadline is near).
    stopping: tokio::sync::watch::Sender<bool>,
    max_tokens: usize,
    sampling: SamplingParams,
    parallel: usize,
    /// Silence after which a stream gets a keep-alive comment.
    keepalive: Duration,
    /// Finished Responses answers, for `GET`, `DELETE` and `previous_response_id`.
    responses: responses::Store,
    metrics: metrics::Metrics,
}

/// The API key; compared in constant time and never printed.
pub struct ApiKey(String);

impl ApiKey {
    /// Whether `given` is the key, taking the same time wherever the first difference is.
    fn matches(&self, given: &[u8]) -> bool {
        let key = self.0.as_bytes();
        let mut diff = key.len() ^ given.len();
        for (i, &k) in key.iter().enumerate() {
            diff |= usize::from(k ^ given.get(i).copied().unwrap_or(!k));
        }
        std::hint::black_box(diff) == 0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

impl State {
    /// Whether `name` (a request's `model`) names the served model.
    fn serves(&self, name: &str) -> bool {
        name == self.model_id || self.model_names.iter().any(|n| n == name)
    }

    /// The 404 for a `model` this server does not serve.
    fn unknown_model(&self, name: &str) -> ApiError {
        let message = format!(
            "the model `{name}` does not exist; this server serves `{}`",
            self.model_id
        );
        ApiError::invalid("model", message)
            .status(hyper::StatusCode::NOT_FOUND)
            .code("model_not_found")
    }

    /// Resolves once running requests must end (at once if they already must).
    async fn stopping(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|&stop| stop).await;
    }

    /// The engine, or 503 while it loads.
    fn engine(&self) -> Result<&Arc<Engine>, ApiError> {
        self.engine.get().ok_or_else(|| {
            ApiError::with_status(
                hyper::StatusCode::SERVICE_UNAVAILABLE,
                "the model is loading",
            )
        })
    }
}

/// One request's identity and clock, for its one log line. Clones share the line: it is written
/// by `finish`, or, if every clone is dropped unfinished (the client went away), with status 499.
#[derive(Clone)]
pub struct RequestLog(Arc<LogInner>);

struct LogInner {
    /// Unique per process: time-based prefix and a counter.
    id: String,
    method: String,
    path: &'static str,
    start: Instant,
    state: Arc<State>,
    finished: std::sync::atomic::AtomicBool,
}

impl RequestLog {
    fn new(state: &Arc<State>, method: &str, path: &'static str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Self(Arc::new(LogInner {
            id: format!("{secs:x}{n:06x}"),
            method: method.to_string(),
            path,
            start: Instant::now(),
            state: state.clone(),
            finished: Default::default(),
        }))
    }

    /// The request id.
    pub fn id(&self) -> &str {
        &self.0.id
    }

    /// Writes the request's log line and counts it (once; later calls do nothing).
    fn finish(&self, status: u16, totals: Option<Totals>) {
        if !self.0.finished.swap(true, Ordering::Relaxed) {
            self.0.write(status, totals);
        }
    }
}

impl LogInner {
    fn write(&self, status: u16, totals: Option<Totals>) {
        self.state.metrics.request(self.path, status);
        let ms = self.start.elapsed().as_millis();
        let mut line = format!(
            "request id={} method={} path={} status={status} ms={ms}",
            self.id, self.method, self.path
        );
        if let Some(t) = totals {
            let ttft = t.ttft.map_or(0, |d| d.as_millis());
            line += &format!(
                " prompt_tokens={} completion_tokens={} ttft_ms={ttft} tok_s={:.1}",
                t.usage.prompt_tokens, t.usage.completion_tokens, t.tps
            );
        }
        eprintln!("{line}");
    }
}

impl Drop for LogInner {
    fn drop(&mut self) {
        if !*self.finished.get_mut() {
            // 499: nginx's "client closed request".
            self.write(499, None);
        }
    }
}

/// A JSON response with `status`.
fn json_response(status: u16, body: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(sse::full(body.to_string()));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

pub(crate) fn model_id(arg: &str) -> String {
    let path = Path::new(arg.trim_end_matches('/'));
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.map_or_else(|| arg.to_string(), |n| n.to_string_lossy().into_owned())
}

/// `--parallel`, or twice the cores (at most 16): on a CPU a step of a few sequences costs
/// little more than one, and the KV budget keeps more from outgrowing memory.
fn parallel(args: &ServeArgs) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match args.parallel {
        Some(n) => n.max(1),
        None => (2 * cores).min(16),
    }
}

fn load(args: &ServeArgs, parallel: usize, queue_size: usize) -> Result<Engine> {
    let config = EngineConfig {
        parallel: parallel.max(1),
        batch_tokens: args.batch_tokens.max(1),
        prefill_while_decoding: args.prefill_while_decoding.max(1),
        decode_stretch: args.decode_stretch,
        kv_budget: args.kv_budget_mb.map(|mb| mb << 20),
        queue_size,
        panic_marker: args.test_panic_marker.clone(),
        ..args.model.engine_config()
    };
    let args = &args.model;
    args.load_with(config)
        .with_context(|| format!("loading {}", args.model))
}

/// Runs `peregrine serve` until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> Result<()> {
    if args.info {
        let engine = load(&args, 1, 1)?;
        let info = crate::info::report(&engine, &model_id(&args.model.model), &args.model);
        println!("{info:#}");
        return Ok(());
    }
    let sampling = SamplingParams {
        temperature: args.temp,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repeat_penalty,
        ..SamplingParams::default()
    };
    sampling.validate().context("default sampling flags")?;
    let state = Arc::new(State {
        engine: OnceLock::new(),
        model_id: (args.alias.first().cloned()).unwrap_or_else(|| model_id(&args.model.model)),
        model_names: [&args.model.model]
            .into_iter()
            .chain(&args.alias)
            .cloned()
            .collect(),
        api_key: api_key(&args)?,
        cors: args.cors,
        webui: !args.no_webui,
        remote_media: (args.allow_remote_media).then(|| RemoteMedia::new(&args.remote_media_hosts)),
        max_body: args.max_body_mb.saturating_mul(1 << 20),
        body_timeout: Duration::from_secs_f64(args.body_timeout),
        stopping: tokio::sync::watch::channel(false).0,
        max_tokens: args.max_tokens,
        sampling,
        parallel: parallel(&args),
        keepalive: Duration::from_secs_f64(args.keepalive_secs),
        responses: responses::Store::new(RESPONSES_KEPT),
        metrics: Default::default(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = runtime.block_on(serve(args, state));
    // Past the deadline nothing is waited for: not a model still loading, not a tokenizer run.
    runtime.shutdown_background();
    served
}

/// The key from `--api-key` or the first line of `--api-key-file`.
fn api_key(args: &ServeArgs) -> Result<Option<ApiKey>> {
    let key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => key.clone(),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the API key from {}", path.display()))?;
            text.lines().next().unwrap_or("").trim().to_string()
        }
        (None, None) => return Ok(None),
    };
    anyhow::ensure!(!key.is_empty(), "the API key is empty");
    Ok(Some(ApiKey(key)))
}

async fn serve(args: ServeArgs, state: Arc<State>) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    eprintln!(
        "peregrine: listening on http://{addr} (loading {})",
        args.model.model
    );
    let exit_on_stdin_eof = args.exit_on_stdin_eof;
    let limits = conn::Limits {
        header: Duration::from_secs_f64(args.header_timeout),
        idle: Duration::from_secs_f64(args.idle_timeout),
    };
    let max_connections = args.max_connections as usize;
    let deadline = Duration::from_secs_f64(args.shutdown_timeout);
    let loader = state.clone();
    let delay = Duration::from_millis(args.test_load_delay_ms);
    tokio::task::spawn_blocking(move || {
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        match load(&args, parallel(&args), args.queue_size) {
            Ok(engine) => {
                let memory = crate::info::summary(&engine, &args.model);
                let _ = loader.engine.set(Arc::new(engine));
                eprintln!("peregrine: model `{}` ready ({memory})", loader.model_id);
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        }
    });
    let (stdin_closed, on_stdin_closed) = tokio::sync::oneshot::channel::<()>();
    if exit_on_stdin_eof {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            let _ = stdin_closed.send(());
        });
    }
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let refusals = Arc::new(tokio::sync::Semaphore::new(64));
    let mut shutdown = std::pin::pin!(shutdown_signal(on_stdin_closed));
    loop {
        tokio::select! {
            conn = listener.accept() => {
                let Ok((stream, _)) = conn else { continue };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    state.metrics.refused.fetch_add(1, Ordering::Relaxed);
                    // Answered while few are being answered; under a flood, just closed.
                    if let Ok(refusing) = refusals.clone().try_acquire_owned() {
                        tokio::spawn(async move {
                            conn::refuse(stream, max_connections).await;
                            drop(refusing);
                        });
                    }
                    continue;
                };
                conn::serve(&state, stream, limits, slot, &graceful);
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    // Cancelled requests need a moment to write their final event before the deadline.
    let drain = deadline
        .saturating_sub(Duration::from_secs(1))
        .max(deadline / 2);
    eprintln!(
        "peregrine: shutting down; running requests have {:.1} s to finish",
        drain.as_secs_f64()
    );
    let all_closed = graceful.shutdown();
    let mut all_closed = std::pin::pin!(all_closed);
    tokio::select! {
        () = &mut all_closed => {}
        () = tokio::time::sleep(drain) => {
            eprintln!("peregrine: cancelling the requests still running");
            state.stopping.send_replace(true);
            let left = deadline - drain;
            if tokio::time::timeout(left, &mut all_closed).await.is_err() {
                eprintln!("peregrine: closing the connections still open");
            }
        }
    }
    Ok(())
}

/// Resolves on SIGINT, SIGTERM, or when `stdin_closed` fires.
async fn shutdown_signal(stdin_closed: tokio::sync::oneshot::Receiver<()>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    let stdin_closed = async {
        if stdin_closed.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
        () = stdin_closed => {}
    }
}
