//! Embed the engine in your own hyper service: `POST /complete` with a prompt as the body
//! answers `{"text": ...}` (greedy, 32 tokens). One engine serves every connection; its workers
//! run the model, so the async threads only wait.
//!
//! `cargo run --release --example service -- [MODEL] [--once]` prints its address; `--once`
//! serves one request and exits.

mod common;

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request as HttpRequest, Response, StatusCode};
use hyper_util::rt::TokioIo;
use peregrine::{Engine, EngineConfig, Event, Prompt, Request};

async fn complete(engine: Arc<Engine>, prompt: String) -> Result<String, String> {
    let mut request = Request::new(Prompt::Text(prompt));
    request.max_tokens = Some(32);
    request.sampling.temperature = 0.0;
    // `submit` tokenizes: CPU work, so off the async threads.
    let submitted = tokio::task::spawn_blocking(move || engine.submit(request));
    let mut events = submitted
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Delta { text: t, .. } => text.push_str(&t),
            Event::Done { .. } => return Ok(text),
            Event::Error(e) => return Err(e.to_string()),
        }
    }
    Err("the engine stopped".into())
}

async fn handle(
    engine: Arc<Engine>,
    req: HttpRequest<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, body: serde_json::Value| {
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        Ok(response)
    };
    if req.uri().path() != "/complete" {
        return reply(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "POST /complete"}),
        );
    }
    let body = match req.into_body().collect().await {
        Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": e.to_string()}),
            );
        }
    };
    match complete(engine, body).await {
        Ok(text) => reply(StatusCode::OK, serde_json::json!({"text": text})),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({"error": e}),
        ),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let once = args.iter().any(|a| a == "--once");
    let model = args.iter().find(|a| !a.starts_with("--")).cloned();
    let engine = Arc::new(Engine::load(
        &common::model_path(model),
        EngineConfig::default(),
    )?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on http://{}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            let engine = engine.clone();
            let service = hyper::service::service_fn(move |req| handle(engine.clone(), req));
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            if once {
                return Ok(connection.await?);
            }
            tokio::spawn(connection);
        }
    })
}
