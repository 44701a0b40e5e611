//! Running a decoded request: submit its choices to the engine, then answer with one JSON
//! object or a server-sent event stream.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::{Response, StatusCode};
use peregrine_engine::{
    Engine, EngineError, Event, EventStream, Prompt, SamplingParams, TokenLogprob, Tokenizer, Usage,
};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::error::ApiError;
use super::media;
use super::openai::{self, Decoded, Endpoint};
use super::reasoning::{Tags, Think};
use super::responses::{self, Context};
use super::semantic::{Part, Reader};
use super::sse::{self, Body, Closed, SseSender};
use super::tool_calls::CallFormat;
use super::tools;
use super::wire::{Choice, Delta, Envelope};
use super::{RequestLog, State, anthropic, json_response};

/// Totals over a request's choices, for `usage`, the log line and metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    /// Summed over prompts (not over the `n` copies of one prompt) and over choices.
    pub usage: Usage,
    /// Time to first token of the first choice that finished.
    pub ttft: Option<Duration>,
    /// Decode tokens per second of the first choice that finished.
    pub tps: f64,
}

/// A request decoded and submitted, ready to be answered.
struct Prepared {
    decoded: Decoded,
    /// `n` per prompt, in order.
    streams: Vec<EventStream>,
    /// Text prepended to each prompt's choices (`echo`), per prompt.
    echo: Vec<String>,
    /// Where the output's thinking is, when it goes to `reasoning_content`.
    think: Option<Think>,
    /// The call syntax to look for, when the request has tools.
    calls: Option<CallFormat>,
    /// The prompt's length in tokens, for an Anthropic stream's `message_start`.
    prompt_tokens: usize,
    /// What a Responses answer repeats of its request.
    responses: Context,
}

/// Decodes `body`, submits every choice (`n` per prompt, sharing the prompt's prefill) and
/// answers. Errors found before generation (a bad field, a prompt too long, a full queue) come
/// back before any byte is sent.
pub async fn run(
    state: Arc<State>,
    endpoint: Endpoint,
    body: Bytes,
    log: RequestLog,
) -> Result<Response<Body>, ApiError> {
    // Parsing, templating and tokenizing are CPU work: off the async threads.
    let preparing = state.clone();
    let prepared = tokio::task::spawn_blocking(move || prepare(&preparing, endpoint, &body))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))??;
    let Prepared {
        decoded,
        streams,
        echo,
        think,
        calls,
        prompt_tokens,
        responses,
    } = prepared;
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
        Endpoint::Messages => "msg",
        Endpoint::Responses => "resp",
    };
    let env = Envelope {
        // Anthropic's ids read `msg_…`, OpenAI's `chatcmpl-…`.
        id: match endpoint {
            Endpoint::Messages | Endpoint::Responses => format!("{prefix}_{}", log.id()),
            _ => format!("{prefix}-{}", log.id()),
        },
        created,
        model: state.model_id.clone(),
        endpoint,
    };
    let events = merge(&state, streams);
    let job = Job {
        think,
        calls,
        state: state.clone(),
        env,
        n: decoded.n,
        echo,
        decoded,
        prompt_param: prompt_param(endpoint),
        request_id: log.id().to_string(),
        prompt_tokens,
        responses,
    };
    if job.decoded.stream {
        let (tx, body) = sse::channel(state.body_timeout);
        tokio::spawn(async move {
            let (mut events, mut totals) = (events, Totals::default());
            let outcome = match endpoint {
                Endpoint::Messages => job.stream_messages(&mut events, &tx, &mut totals).await,
                Endpoint::Responses => job.stream_responses(&mut events, &tx, &mut totals).await,
                _ => job.stream(&mut events, &tx, &mut totals).await,
            };
            let status = if outcome.is_err() { 499 } else { 200 };
            log.finish(status, Some(totals));
        });
        let response = Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(body)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(response)
    } else {
        let (choices, totals) = job.collect(events).await?;
        let body = match endpoint {
            Endpoint::Messages => job.message(&choices[0], totals.usage),
            Endpoint::Responses => {
                job.response_object(&choices[0].text, choices[0].finish, totals.usage)
            }
            _ => job.openai_response(choices, totals.usage)?,
        };
        log.finish(200, Some(totals));
        Ok(json_response(200, &body))
    }
}

fn prompt_param(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat | Endpoint::Messages => "messages",
        Endpoint::Responses => "input",
        Endpoint::Completions => "prompt",
    }
}

/// Decodes a body of `endpoint` (Anthropic and Responses ones through their translations)
/// and checks `model`.
fn decode(
    state: &State,
    endpoint: Endpoint,
    body: &[u8],
    count_only: bool,
) -> Result<(Decoded, Context), ApiError> {
    let (remote, store) = (state.remote_media.as_ref(), &state.responses);
    let defaults = (state.max_tokens, &state.sampling, remote);
    let (decoded, context) = decode_body(endpoint, body, count_only, defaults, store)?;
    if !state.serves(&decoded.model) {
        return Err(state.unknown_model(&decoded.model));
    }
    media::check_towers(state, (&decoded.image_parts, &decoded.audio_parts))?;
    Ok((decoded, context))
}

/// Decodes a body of any endpoint; `defaults`: `max_tokens`, sampling and the remote image
/// fetcher (if any); `store`: the stored responses `previous_response_id` may name.
pub(super) fn decode_body(
    endpoint: Endpoint,
    body: &[u8],
    count_only: bool,
    (max_tokens, sampling, remote): (usize, &SamplingParams, Option<&media::RemoteMedia>),
    store: &responses::Store,
) -> Result<(Decoded, Context), ApiError> {
    let chat = |body: &[u8]| openai::decode(body, Endpoint::Chat, max_tokens, sampling, remote);
    Ok(match endpoint {
        Endpoint::Messages => {
            let (body, renames) = anthropic::translate(body, count_only)?;
            let mut decoded = chat(&body).map_err(|e| anthropic::rename(renames.apply(e)))?;
            let parts = std::mem::take(&mut decoded.image_parts);
            decoded.image_parts = parts.iter().map(|p| renames.param(p)).collect();
            (decoded, Context::default())
        }
        Endpoint::Responses => {
            let (body, context) = responses::translate(body, store)?;
            let mut decoded = chat(&body).map_err(responses::rename)?;
            // Responses errors name `input` (its items do not map one to one).
            (decoded.image_parts.iter_mut()).for_each(|p| *p = "input".into());
            (decoded, context)
        }
        _ => (
            openai::decode(body, endpoint, max_tokens, sampling, remote)?,
            Context::default(),
        ),
    })
}

/// Shows a request's tools to the model (through its template) and holds a forced choice to a
/// call; returns the call syntax to parse, when there are tools.
fn apply_tools(engine: &Engine, decoded: &mut Decoded) -> Option<CallFormat> {
    let template = engine.tokenizer().chat_template();
    let tools = decoded.tools.as_ref()?;
    let format = CallFormat::of_template(template);
    for request in &mut decoded.requests {
        tools::apply(&mut request.prompt, tools, template);
        request.special_tokens = format.markers_are_special();
    }
    if let Some(grammar) = tools.grammar(format) {
        decoded.grammar = Some((grammar, "tool_choice"));
    }
    Some(format)
}

/// Anthropic's `/v1/messages/count_tokens`: the prompt's length as the model would see it.
pub async fn count_tokens(state: Arc<State>, body: Bytes) -> Result<Response<Body>, ApiError> {
    let counted = tokio::task::spawn_blocking(move || {
        let (mut decoded, _) = decode(&state, Endpoint::Messages, &body, true)?;
        let engine = state.engine()?;
        apply_tools(engine, &mut decoded);
        let ids = (engine.request_ids(&decoded.requests[0]))
            .map_err(|e| ApiError::from_engine(&e, "messages"))?;
        Ok::<_, ApiError>(ids.len())
    });
    let n = counted
        .await
        .map_err(|e| ApiError::internal(format!("counting tokens failed: {e}")))??;
    Ok(json_response(200, &serde_json::json!({"input_tokens": n})))
}

fn prepare(state: &State, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let (mut decoded, responses) = decode(state, endpoint, body, false)?;
    let engine = state.engine()?;
    let calls = apply_tools(engine, &mut decoded);
    let tags = match (endpoint, engine.tokenizer().chat_template()) {
        (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, Some(t)) => {
            Tags::of_template(t)
        }
        _ => None,
    };
    if tags.is_some_and(Tags::markers_are_special) {
        for request in &mut decoded.requests {
            request.special_tokens = true;
        }
    }
    if let Some((grammar, param)) = &decoded.grammar {
        let constraint = (engine.compile(grammar)).map_err(|e| ApiError::from_engine(&e, param))?;
        for request in &mut decoded.requests {
            request.constraint = Some(constraint.clone());
        }
    }
    let mut streams = Vec::with_capacity(decoded.requests.len() * decoded.n);
    let mut echo = vec![];
    for request in &decoded.requests {
        // Dropping the streams already taken cancels them if a later submit fails.
        let choices = engine
            .submit_choices(request.clone(), decoded.n)
            .map_err(|e| ApiError::from_engine(&e, prompt_param(endpoint)))?;
        streams.extend(choices);
        echo.push(match (&request.prompt, decoded.echo) {
            (Prompt::Text(t), true) => t.clone(),
            (Prompt::Tokens(ids), true) => {
                engine.tokenizer().decode(ids, false).unwrap_or_default()
            }
            _ => String::new(),
        });
    }
    let think = tags.map(|tags| Think {
        tags,
        inside: opens_think(engine, &decoded.requests[0].prompt, tags),
    });
    let prompt_tokens = match endpoint {
        Endpoint::Messages if decoded.stream => engine
            .request_ids(&decoded.requests[0])
            .map_or(0, |ids| ids.len()),
        _ => 0,
    };
    Ok(Prepared {
        decoded,
        streams,
        echo,
        think,
        calls,
        prompt_tokens,
        responses,
    })
}

/// Forwards each choice's events into one channel tagged with the choice index. A forwarder
/// stops, dropping its `EventStream` and so cancelling generation, once the receiver is gone.
fn merge(state: &Arc<State>, streams: Vec<EventStream>) -> UnboundedReceiver<(usize, Event)> {
    let (tx, rx) = unbounded_channel();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let (tx, state) = (tx.clone(), state.clone());
        state.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    event = stream.recv() => match event {
                        Some(event) => if tx.send((i, event)).is_err() { break },
                        None => break,
                    },
                    () = tx.closed() => break,
                }
            }
            drop(stream);
            state.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }
    rx
}

/// Whether the rendered prompt ends inside an open thinking block (templates that start the
/// block in the generation prompt).
fn opens_think(engine: &Engine, prompt: &Prompt, tags: Tags) -> bool {
    let ids = engine.prompt_ids(prompt).unwrap_or_default();
    let tail = &ids[ids.len().saturating_sub(8)..];
    let text = engine.tokenizer().decode(tail, false).unwrap_or_default();
    text.trim_end().ends_with(tags.open)
}

/// A submitted request being answered.
pub(super) struct Job {
    /// Where the output's thinking is, when it goes to `reasoning_content`.
    pub(super) think: Option<Think>,
    /// The call syntax to look for, when the request has tools.
    pub(super) calls: Option<CallFormat>,
    pub(super) state: Arc<State>,
    pub(super) env: Envelope,
    n: usize,
    /// Text prepended to each prompt's choices (`echo`), per prompt.
    echo: Vec<String>,
    pub(super) decoded: Decoded,
    prompt_param: &'static str,
    /// For the log line of a failure.
    request_id: String,
    /// The prompt's length in tokens (Anthropic streams only).
    pub(super) prompt_tokens: usize,
    /// What a Responses answer repeats of its request.
    pub(super) responses: Context,
}

/// A stream that ended without its last event: a bug, never a client's doing.
pub(super) fn unfinished() -> EngineError {
    EngineError::Internal("generation ended without finishing".into())
}

/// Running requests are cancelled because the server is going away.
pub(super) fn shutting_down() -> ApiError {
    ApiError::with_status(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down; the request was cancelled",
    )
    .code("server_shutting_down")
}

/// What a stream gets while it waits.
pub(super) enum Next {
    /// Choice `.0`'s next event (already counted in the totals).
    Event(usize, Event),
    /// Nothing for `--keepalive-secs`: time for a keep-alive.
    Quiet,
    /// The server is shutting down.
    Stopping,
    /// Every choice's events have been received.
    End,
}

impl Job {
    /// Waits for the next event, a quiet spell, shutdown or the client leaving (`Closed`);
    /// an event is recorded into `totals`.
    pub(super) async fn next(
        &self,
        events: &mut UnboundedReceiver<(usize, Event)>,
        sse: &SseSender,
        stopping: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
        totals: &mut Totals,
    ) -> Result<Next, Closed> {
        tokio::select! {
            next = events.recv() => Ok(match next {
                Some((i, event)) => {
                    self.record(totals, i, &event);
                    Next::Event(i, event)
                }
                None => Next::End,
            }),
            () = tokio::time::sleep(self.state.keepalive) => Ok(Next::Quiet),
            () = sse.closed() => Err(Closed),
            () = stopping.as_mut() => Ok(Next::Stopping),
        }
    }

    /// The error answering `e`; server faults are counted and logged with the request id.
    pub(super) fn failed(&self, e: &EngineError) -> ApiError {
        let error = ApiError::from_engine(e, self.prompt_param);
        if error.status.is_server_error() {
            (self.state.metrics.internal_errors).fetch_add(1, Ordering::Relaxed);
            eprintln!("request id={} error: {e}", self.request_id);
        }
        error
    }

    fn record(&self, totals: &mut Totals, choice: usize, event: &Event) {
        if let Event::Done { usage, timings, .. } = event {
            if choice.is_multiple_of(self.n) {
                totals.usage.prompt_tokens += usage.prompt_tokens;
                totals.usage.cached_tokens += usage.cached_tokens;
            }
            totals.usage.completion_tokens += usage.completion_tokens;
            if totals.ttft.is_none() {
                totals.ttft = Some(timings.time_to_first_token);
                totals.tps = timings.decode_tps();
            }
            self.state.metrics.generation(
                usage.prompt_tokens,
                usage.completion_tokens,
                timings.time_to_first_token.as_secs_f64(),
                timings.decode_tps(),
            );
        }
    }

    /// Waits for every choice's whole output.
    async fn collect(
        &self,
        mut events: UnboundedReceiver<(usize, Event)>,
    ) -> Result<(Vec<Choice>, Totals), ApiError> {
        let mut totals = Totals::default();
        let mut choices: Vec<Choice> = (0..self.echo.len() * self.n)
            .map(|i| Choice {
                text: self.echo[i / self.n].clone(),
                ..Choice::default()
            })
            .collect();
        let mut stopping = std::pin::pin!(self.state.stopping());
        loop {
            let next = tokio::select! {
                next = events.recv() => next,
                () = &mut stopping => return Err(shutting_down()),
            };
            let Some((i, event)) = next else { break };
            self.record(&mut totals, i, &event);
            match event {
                Event::Delta { text, logprobs, .. } => {
                    choices[i].text.push_str(&text);
                    choices[i].logprobs.extend(logprobs);
                }
                Event::Done {
                    finish,
                    stop_string,
                    ..
                } => {
                    choices[i].finish = Some(finish);
                    choices[i].stop_string = stop_string;
                }
                Event::Error(e) => return Err(self.failed(&e)),
            }
        }
        if choices.iter().any(|c| c.finish.is_none()) {
            return Err(self.failed(&unfinished()));
        }
        Ok((choices, totals))
    }

    /// The whole chat or completions response.
    fn openai_response(
        &self,
        mut choices: Vec<Choice>,
        usage: Usage,
    ) -> Result<serde_json::Value, ApiError> {
        if self.think.is_some() || self.calls.is_some() {
            for c in &mut choices {
                let (mut reasoning, mut text) = (String::new(), String::new());
                for part in Reader::new(self.think, self.calls).read_all(&c.text) {
                    match part {
                        Part::Reasoning(r) => reasoning.push_str(&r),
                        Part::Text(t) => text.push_str(&t),
                        Part::Call(call) => c.tool_calls.push(call),
                    }
                }
                c.text = text;
                c.reasoning = (!reasoning.is_empty()).then_some(reasoning);
            }
        }
        let engine = self.state.engine()?;
        let tok = engine.tokenizer();
        Ok(self
            .env
            .response(&choices, usage, tok, self.decoded.logprobs))
    }

    /// Sends choice `i`'s decided parts; `lp` goes with the first chunk (alone, when the text
    /// is held back).
    async fn send_parts(
        &self,
        sse: &SseSender,
        i: usize,
        parts: Vec<Part>,
        mut lp: Option<(&[TokenLogprob], &Tokenizer)>,
        called: &mut usize,
    ) -> Result<(), Closed> {
        lp = lp.filter(|(l, _)| !l.is_empty());
        if parts.is_empty() && lp.is_some() {
            return sse.data(&self.env.chunk(i, Delta::Text(""), lp)).await;
        }
        for part in parts {
            let chunk = match &part {
                Part::Text(t) => self.env.chunk(i, Delta::Text(t), lp.take()),
                Part::Reasoning(r) => self.env.chunk(i, Delta::Reasoning(r), lp.take()),
                Part::Call(call) => {
                    *called += 1;
                    self.env
                        .chunk(i, Delta::ToolCall(*called - 1, call), lp.take())
                }
            };
            sse.data(&chunk).await?;
        }
        Ok(())
    }

    /// Streams every choice's chunks, then the usage chunk when asked, then `[DONE]`.
    async fn stream(
        &self,
        events: &mut UnboundedReceiver<(usize, Event)>,
        sse: &SseSender,
        totals: &mut Totals,
    ) -> Result<(), Closed> {
        let engine = self.state.engine().map_err(|_| Closed)?;
        let tok = engine.tokenizer();
        let choices = self.echo.len() * self.n;
        for i in 0..choices {
            let echo = &self.echo[i / self.n];
            if self.env.endpoint == Endpoint::Chat {
                sse.data(&self.env.chunk(i, Delta::Role, None)).await?;
            } else if !echo.is_empty() {
                sse.data(&self.env.chunk(i, Delta::Text(echo), None))
                    .await?;
            }
        }
        let mut readers: Vec<_> = (0..choices)
            .map(|_| Reader::new(self.think, self.calls))
            .collect();
        let mut called = vec![0; choices];
        let mut finished = vec![false; choices];
        let mut stopping = std::pin::pin!(self.state.stopping());
        loop {
            let (i, event) = match self.next(events, sse, &mut stopping, totals).await? {
                Next::Event(i, event) => (i, event),
                Next::Quiet => {
                    sse.comment("keep-alive").await?;
                    continue;
                }
                Next::Stopping => {
                    sse.data(&shutting_down().body()).await?;
                    return sse.done().await;
                }
                Next::End => break,
            };
            if matches!(event, Event::Done { .. }) {
                finished[i] = true;
            }
            let chunk = match event {
                Event::Delta { text, logprobs, .. } => {
                    let lp = self.decoded.logprobs.then_some((&logprobs[..], tok));
                    let parts = readers[i].push(&text);
                    self.send_parts(sse, i, parts, lp, &mut called[i]).await?;
                    continue;
                }
                Event::Done { finish, .. } => {
                    let parts = readers[i].finish();
                    self.send_parts(sse, i, parts, None, &mut called[i]).await?;
                    self.env
                        .chunk(i, Delta::Finish(finish, called[i] > 0), None)
                }
                Event::Error(e) => {
                    sse.data(&self.failed(&e).body()).await?;
                    return sse.done().await;
                }
            };
            sse.data(&chunk).await?;
        }
        if finished.contains(&false) {
            sse.data(&self.failed(&unfinished()).body()).await?;
            return sse.done().await;
        }
        if self.decoded.include_usage {
            sse.data(&self.env.usage_chunk(totals.usage)).await?;
        }
        sse.done().await
    }
}
