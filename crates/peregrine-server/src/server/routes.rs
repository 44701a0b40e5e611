//! Routing, authentication, CORS and body limits; every answer goes through here.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{ALLOW, AUTHORIZATION, CONTENT_LENGTH, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use super::error::ApiError;
use super::metrics::{EngineFigures, ExpertFigures};
use super::openai::Endpoint;
use super::sse::{self, Body};
use super::{RequestLog, State, anthropic_wire, complete, json_response, responses, webui};

/// The routes and the methods each accepts; the name doubles as the metrics label.
const ROUTES: [(&str, &[Method]); 11] = [
    ("/", &[Method::GET]),
    ("/health", &[Method::GET]),
    ("/metrics", &[Method::GET]),
    ("/v1/models", &[Method::GET]),
    ("/v1/models/{id}", &[Method::GET]),
    ("/v1/chat/completions", &[Method::POST]),
    ("/v1/completions", &[Method::POST]),
    ("/v1/messages", &[Method::POST]),
    ("/v1/messages/count_tokens", &[Method::POST]),
    ("/v1/responses", &[Method::POST]),
    ("/v1/responses/{id}", &[Method::GET, Method::DELETE]),
];

fn route_of(path: &str) -> Option<&'static str> {
    if webui::is_page(path) {
        return Some("/");
    }
    let path = path.trim_end_matches('/');
    for (prefix, route) in [
        ("/v1/models/", "/v1/models/{id}"),
        ("/v1/responses/", "/v1/responses/{id}"),
    ] {
        if let Some(id) = path.strip_prefix(prefix)
            && !id.is_empty()
        {
            return Some(route);
        }
    }
    ROUTES.iter().map(|(r, _)| *r).find(|r| *r == path)
}

/// Routes of Anthropic's API, whose errors take Anthropic's shape.
fn anthropic_route(route: Option<&str>) -> bool {
    route.is_some_and(|r| r.starts_with("/v1/messages"))
}

/// Answers one request; never fails (errors become OpenAI error bodies).
pub async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let route = route_of(req.uri().path());
    let log = RequestLog::new(&state, req.method().as_str(), route.unwrap_or("other"));
    let cors = state.cors;
    let mut response = match dispatch(&state, route, req, log.clone()).await {
        Ok(response) => response,
        Err(e) => {
            log.finish(e.status.as_u16(), None);
            let body = match anthropic_route(route) {
                true => anthropic_wire::error_body(&e),
                false => e.body(),
            };
            let mut response = json_response(e.status.as_u16(), &body);
            if e.status == StatusCode::METHOD_NOT_ALLOWED
                && let Some(allow) = route.and_then(allowed)
            {
                response.headers_mut().insert(ALLOW, allow);
            }
            response
        }
    };
    if cors {
        let headers = response.headers_mut();
        headers.insert("access-control-allow-origin", HeaderValue::from_static("*"));
    }
    Ok(response)
}

fn allowed(route: &str) -> Option<HeaderValue> {
    let (_, methods) = ROUTES.iter().find(|(r, _)| *r == route)?;
    let names: Vec<&str> = methods.iter().map(Method::as_str).collect();
    HeaderValue::from_str(&names.join(", ")).ok()
}

fn accepts(route: &str, method: &Method) -> bool {
    ROUTES
        .iter()
        .any(|(r, methods)| *r == route && methods.contains(method))
}

async fn dispatch(
    state: &Arc<State>,
    route: Option<&'static str>,
    req: Request<Incoming>,
    log: RequestLog,
) -> Result<Response<Body>, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let no_route = || {
        ApiError::with_status(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {path}"),
        )
    };
    // A POST under `/v1/responses/` is an endpoint we lack (`compact`), not a stored response.
    let route = route.filter(|r| !(*r == "/v1/responses/{id}" && method == Method::POST));
    let route = route.filter(|r| *r != "/" || state.webui);
    let Some(route) = route else {
        return Err(drained(state, req, no_route()).await);
    };
    if method == Method::OPTIONS && state.cors {
        log.finish(204, None);
        let mut response = Response::new(sse::full(""));
        *response.status_mut() = StatusCode::NO_CONTENT;
        let h = response.headers_mut();
        h.insert(
            "access-control-allow-methods",
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        h.insert(
            "access-control-allow-headers",
            HeaderValue::from_static("authorization, content-type, x-api-key, anthropic-version"),
        );
        h.insert("access-control-max-age", HeaderValue::from_static("86400"));
        return Ok(response);
    }
    // The page holds no secrets: it asks for the API key, which its API calls then carry.
    if route == "/" && method == Method::GET {
        log.finish(200, None);
        return webui::file(&path).ok_or_else(no_route);
    }
    if route.starts_with("/v1/")
        && let Err(e) = authorize(state, &req)
    {
        return Err(drained(state, req, e).await);
    }
    if !accepts(route, &method) {
        let e = ApiError::with_status(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{path} does not accept {method}"),
        );
        return Err(drained(state, req, e).await);
    }
    let endpoint = match route {
        "/v1/chat/completions" => Endpoint::Chat,
        "/v1/completions" => Endpoint::Completions,
        "/v1/messages" => Endpoint::Messages,
        "/v1/responses" => Endpoint::Responses,
        "/v1/messages/count_tokens" => {
            let body = read_body(state, req).await?;
            state.engine()?;
            let response = complete::count_tokens(state.clone(), body).await?;
            log.finish(200, None);
            return Ok(response);
        }
        _ => {
            let response = simple_get(state, route, &method, &path)?;
            log.finish(response.status().as_u16(), None);
            return Ok(response);
        }
    };
    let body = read_body(state, req).await?;
    state.engine()?;
    complete::run(state.clone(), endpoint, body, log).await
}

/// Reads and drops the body of a request refused before its body was needed, so the connection
/// stays usable for the client's next request (within the usual size and time limits).
async fn drained(state: &State, req: Request<Incoming>, e: ApiError) -> ApiError {
    let _ = read_body(state, req).await;
    e
}

fn authorize(state: &State, req: &Request<Incoming>) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let token = given.and_then(|v| v.strip_prefix("Bearer "));
    // Anthropic's clients send the key as `x-api-key`.
    let anthropic = req.headers().get("x-api-key").map(|v| v.as_bytes());
    if token.is_some_and(|t| key.matches(t.as_bytes())) || anthropic.is_some_and(|t| key.matches(t))
    {
        return Ok(());
    }
    Err(ApiError::with_status(
        StatusCode::UNAUTHORIZED,
        "missing or incorrect API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
    )
    .code("invalid_api_key"))
}

async fn read_body(state: &State, req: Request<Incoming>) -> Result<bytes::Bytes, ApiError> {
    let too_large = || {
        ApiError::with_status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is larger than {} bytes", state.max_body),
        )
        .code("request_too_large")
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok());
    if declared
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n > state.max_body)
    {
        return Err(too_large());
    }
    let collect = Limited::new(req.into_body(), state.max_body).collect();
    match tokio::time::timeout(state.body_timeout, collect).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::bad_request(format!(
            "reading the body failed: {e}"
        ))),
        Err(_) => Err(ApiError::with_status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body did not arrive within {} s (--body-timeout)",
                state.body_timeout.as_secs_f64()
            ),
        )
        .code("request_timeout")),
    }
}

/// `GET` or `DELETE` of a stored Responses answer.
fn stored_response(state: &State, method: &Method, path: &str) -> Result<Response<Body>, ApiError> {
    let id = path
        .trim_end_matches('/')
        .trim_start_matches("/v1/responses/");
    let body = match *method {
        Method::DELETE if state.responses.delete(id) => {
            json!({"id": id, "object": "response.deleted", "deleted": true})
        }
        Method::GET => match state.responses.get(id) {
            Some(stored) => stored.resource,
            None => return Err(responses::not_found(id, "response_id")),
        },
        _ => return Err(responses::not_found(id, "response_id")),
    };
    Ok(json_response(200, &body))
}

fn simple_get(
    state: &State,
    route: &str,
    method: &Method,
    path: &str,
) -> Result<Response<Body>, ApiError> {
    let model = json!({
        "id": state.model_id, "object": "model", "created": 0, "owned_by": "peregrine",
    });
    let body = match route {
        "/health" => {
            let engine = state.engine()?;
            json!({
                "status": "ok",
                "model": state.model_id,
                "capabilities": ["chat", "completions", "streaming", "logprobs"],
                "context_length": engine.max_context(),
                "memory": {"weight_bytes": engine.model().weight_bytes()},
            })
        }
        "/metrics" => {
            let figures = (state.engine.get()).map_or_else(Default::default, |e| EngineFigures {
                kv_bytes: e.kv_bytes_in_use(),
                kv_reserved: e.kv_reserved(),
                prefills: e.prefills(),
                cache: e.prompt_cache_stats(),
                running: e.running(),
                batch_steps: e.batch_steps(),
                expert_reads: (e.expert_reads()).map(|p| ExpertFigures {
                    used: p.stats().counts(),
                    guessed: p.stats().speculation(),
                    hot_hits: p.stats().hot_hits(),
                }),
                speculation: e.speculation_stats(),
                images: e.image_stats(),
            });
            let text = state.metrics.render(state.parallel, figures);
            let mut response = Response::new(sse::full(text));
            response.headers_mut().insert(
                "content-type",
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            return Ok(response);
        }
        "/v1/models" => json!({"object": "list", "data": [model]}),
        "/v1/responses/{id}" => return stored_response(state, method, path),
        _ => {
            let id = path.trim_end_matches('/').trim_start_matches("/v1/models/");
            if !state.serves(id) {
                return Err(state.unknown_model(id));
            }
            model
        }
    };
    Ok(json_response(200, &body))
}
