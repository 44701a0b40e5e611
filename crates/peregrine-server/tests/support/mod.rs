//! Test support for the server tests: start the real `peregrine serve` binary on a loopback
//! port with a tiny fixture model and speak raw HTTP/1.1 to it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a server may take to start and load the fixture.
const STARTUP: Duration = Duration::from_secs(60);

/// The tiny random-weight llama fixture (vocab 512, context 256).
pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/hf")
}

/// A running `peregrine serve`; killed on drop.
pub struct Server {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts the server with the fixture as model `tiny` and `extra` flags, and waits until
    /// `/health` answers 200.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_model(&fixture(), extra)
    }

    /// Starts the server with the checkpoint at `model` as model `tiny`.
    pub fn start_model(model: &std::path::Path, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_peregrine"))
            .args([
                "serve",
                "--port",
                "0",
                "--alias",
                "tiny",
                "--exit-on-stdin-eof",
                "--model",
            ])
            .arg(model)
            .args(extra)
            // The server exits when this pipe closes, so it never outlives a killed test.
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = rx
            .recv_timeout(STARTUP)
            .expect("the server prints its address");
        let server = Self { child, addr, log };
        let start = Instant::now();
        while server.get("/health").status != 200 {
            assert!(
                start.elapsed() < STARTUP,
                "the model did not load:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// Everything the server wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The log once `done` holds for it (the log is read on another thread, so a line may
    /// arrive after the reply it belongs to), or as it is after 10 s.
    pub fn log_until(&self, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let log = self.log();
            if done(&log) || start.elapsed() > Duration::from_secs(10) {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }

    /// Waits for the process to exit, up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// GET `path`.
    pub fn get(&self, path: &str) -> Reply {
        self.send("GET", path, &[], b"")
    }

    /// POST a JSON value to `path`.
    pub fn post(&self, path: &str, body: &Value) -> Reply {
        self.send("POST", path, &[], body.to_string().as_bytes())
    }

    /// Sends one request on a fresh connection and reads the whole answer.
    pub fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut stream = self.open(method, path, headers, body, None);
        let mut raw = vec![];
        stream.read_to_end(&mut raw).expect("reading the reply");
        Reply::parse(&raw)
    }

    /// Opens a connection and writes a request; `content_length` overrides the real length.
    pub fn open(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        content_length: Option<usize>,
    ) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).expect("connecting");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            content_length.unwrap_or(body.len())
        );
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body).unwrap();
        stream
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: String,
}

impl Reply {
    pub fn parse(raw: &[u8]) -> Self {
        let text = String::from_utf8_lossy(raw);
        let (head, rest) = text.split_once("\r\n\r\n").expect("a header block");
        let mut lines = head.lines();
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        Self {
            status,
            headers,
            body,
        }
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order (comments skipped).
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

// The repository's test helpers (`real_model`), shared rather than copied.
#[path = "../../../../tests/integration/common.rs"]
mod repo;
#[allow(unused_imports)] // each test binary uses its own subset
pub use repo::real_model;

/// Checks a chat reply (`body`, asked with `logprobs`) to a media fixture's prompt against
/// transformers' reference in `dir/hf/reference.safetensors`: the prompt's length, and the
/// first answer token's log-probability within 1e-3 (as the model tests: f32 on both sides,
/// summation order apart) of log-softmax over the tokenizer's ids of the reference's last
/// logits (the head's padding rows are never drawn, so they hold no probability). Returns the
/// prompt's length and that log-probability.
pub fn check_first_logprob(dir: &std::path::Path, body: &Value) -> (usize, f64) {
    check_first_logprob_of(dir, "hf", body)
}

/// [`check_first_logprob`] against the logits and greedy ids of the fixture's folder `variant`
/// (an MLX conversion's, whose prompt is the `hf` folder's).
pub fn check_first_logprob_of(dir: &std::path::Path, variant: &str, body: &Value) -> (usize, f64) {
    use peregrine_engine::tensor::candle::safetensors::load;
    use peregrine_engine::tensor::nn::ops::log_softmax;
    use peregrine_engine::tensor::{D, DType, Device};
    let mut r = load(dir.join("hf/reference.safetensors"), &Device::Cpu).unwrap();
    r.extend(
        load(
            dir.join(variant).join("reference.safetensors"),
            &Device::Cpu,
        )
        .unwrap(),
    );
    let u32s = |name: &str| {
        r[name]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    let ids = u32s("input_ids");
    assert_eq!(
        body["usage"]["prompt_tokens"],
        ids.len(),
        "{}: {body}",
        dir.display()
    );
    let vocab = peregrine_engine::Tokenizer::from_dir(&dir.join("hf"))
        .unwrap()
        .vocab_size();
    let last = r["logits"].get(ids.len() - 1).unwrap();
    let logp = log_softmax(&last.narrow(0, 0, vocab).unwrap(), D::Minus1).unwrap();
    let first = u32s("greedy_ids")[0] as usize;
    let expected = logp.get(first).unwrap().to_scalar::<f32>().unwrap();
    let got = body["choices"][0]["logprobs"]["content"][0]["logprob"].as_f64();
    let got = got.expect("a logprob");
    assert!(
        (got as f32 - expected).abs() < 1e-3,
        "{}: logprob {got} vs {expected}",
        dir.display()
    );
    (ids.len(), got)
}
