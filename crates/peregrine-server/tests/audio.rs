//! Audio through the OpenAI chat API, black-box: the tiny Qwen2-Audio and Gemma 4 fixtures
//! served, their espeak-ng WAV sent as an `input_audio` part, and the answer's first-token
//! log-probability checked against transformers' logits for the same clip and prompt
//! (tests/fixtures/audio, made by scripts/fixtures/make_audio.py). Then bad audio: each a
//! 400 naming its part.

mod support;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Value, json};
use support::{Reply, Server};

const CHAT: &str = "/v1/chat/completions";

fn fixture(family: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/audio")
        .join(family)
}

/// The fixture's prompt: the clip, then the question, in one user message.
fn ask(input_audio: Value) -> Value {
    json!({"model": "tiny", "temperature": 0, "max_tokens": 2, "logprobs": true,
           "messages": [{"role": "user", "content": [
               {"type": "input_audio", "input_audio": input_audio},
               {"type": "text", "text": "What does the speaker say?"}]}]})
}

fn wav(bytes: &[u8]) -> Value {
    json!({"data": STANDARD.encode(bytes), "format": "wav"})
}

fn assert_bad(reply: &Reply, param: &str, says: &str) {
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = &reply.json()["error"];
    assert_eq!(error["param"], param, "{}", reply.body);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "`{says}` not in: {message}");
}

/// A 16-bit mono WAV of `seconds` of a 440 Hz tone at `rate`.
fn tone(seconds: f64, rate: u32) -> Vec<u8> {
    let n = (seconds * f64::from(rate)) as usize;
    let mut out = Vec::with_capacity(44 + 2 * n);
    let data = (2 * n) as u32;
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&[1, 0, 1, 0]); // PCM, one channel
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(2 * rate).to_le_bytes());
    out.extend_from_slice(&[2, 0, 16, 0]);
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data.to_le_bytes());
    for i in 0..n {
        let x = (i as f64 * 440.0 * std::f64::consts::TAU / f64::from(rate)).sin();
        out.extend_from_slice(&((x * 8000.0) as i16).to_le_bytes());
    }
    out
}

/// Serves the audio fixture `family`, asks about its speech through the chat API and checks the
/// prompt's length and the first answer token's log-probability against transformers: the
/// template, the expansion, the features, the tower and the splice all play a part.
fn answer_matches_transformers(family: &str) -> (Server, Vec<u8>, Value) {
    let dir = fixture(family);
    let server = Server::start_model(&dir.join("hf"), &[]);
    let speech = std::fs::read(dir.join("speech.wav")).unwrap();
    let reply = server.post(CHAT, &ask(wav(&speech)));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    support::check_first_logprob(&dir, &body);
    (server, speech, body)
}

#[test]
fn gemma4_answers_as_transformers_does() {
    let (server, speech, body) = answer_matches_transformers("gemma4");
    // Responses' input_audio parts: the same prompt.
    let responses = json!({"model": "tiny", "max_output_tokens": 4, "input": [
        {"role": "user", "content": [
            {"type": "input_audio", "input_audio": wav(&speech)},
            {"type": "input_text", "text": "What does the speaker say?"}]}]});
    let reply = server.post("/v1/responses", &responses);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let tokens = &reply.json()["usage"]["input_tokens"];
    assert_eq!(tokens, &body["usage"]["prompt_tokens"], "{}", reply.body);
}

#[test]
fn qwen2_audio_answers_as_transformers_does() {
    let (server, speech, body) = answer_matches_transformers("qwen2_audio");
    let got = body["choices"][0]["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .unwrap();

    // The same clip again (its run reused from the prompt cache): the same answer, its
    // log-probability within 1e-5 (a reused prefix changes pass sizes, so summation order).
    let again = server.post(CHAT, &ask(wav(&speech))).json();
    let content = |b: &Value| b["choices"][0]["message"]["content"].clone();
    assert_eq!(content(&again), content(&body));
    let logprob = |b: &Value| b["choices"][0]["logprobs"]["content"][0]["logprob"].as_f64();
    assert!((logprob(&again).unwrap() - got).abs() < 1e-5, "{again}");
    // The same speech as FLAC (a lossless copy: tests/fixtures/audio/flac): the same answer.
    let flac = std::fs::read(fixture("flac").join("speech.flac")).unwrap();
    let as_flac = json!({"data": STANDARD.encode(&flac), "format": "flac"});
    let heard = server.post(CHAT, &ask(as_flac)).json();
    assert_eq!(content(&heard), content(&body), "{heard}");
    assert!((logprob(&heard).unwrap() - got).abs() < 1e-5, "{heard}");
    let not_flac = json!({"data": STANDARD.encode(&speech), "format": "flac"});
    let part = "messages[0].content[0]";
    assert_bad(&server.post(CHAT, &ask(not_flac)), part, "not a FLAC file");

    let part = "messages[0].content[0]";
    let corrupt = json!({"data": "@@@not base64@@@", "format": "wav"});
    assert_bad(&server.post(CHAT, &ask(corrupt)), part, "not valid base64");
    let mp3 = json!({"data": STANDARD.encode(&speech), "format": "mp3"});
    assert_bad(
        &server.post(CHAT, &ask(mp3)),
        part,
        "`mp3` is not supported",
    );
    let png = json!({"data": STANDARD.encode(b"\x89PNG\r\n\x1a\n0000"), "format": "wav"});
    assert_bad(&server.post(CHAT, &ask(png)), part, "not a WAV file");
    assert_bad(
        &server.post(CHAT, &ask(json!("abc"))),
        part,
        "needs `input_audio`",
    );
    // The fixture's window is 3 s, its rate 16 kHz.
    let long = server.post(CHAT, &ask(wav(&tone(3.5, 16000))));
    assert_bad(&long, "messages", "hears at most 3 s");
    let other_rate = server.post(CHAT, &ask(wav(&tone(1.0, 8000))));
    assert_bad(&other_rate, "messages", "8000 Hz");
    // A tone within the limits is heard, and answered otherwise than the speech.
    let heard = server.post(CHAT, &ask(wav(&tone(1.0, 16000))));
    assert_eq!(heard.status, 200, "{}", heard.body);
    assert_ne!(logprob(&heard.json()), logprob(&body));
}

#[test]
fn a_text_model_refuses_audio_naming_the_part() {
    let server = Server::start(&[]);
    let reply = server.post(CHAT, &ask(wav(&tone(0.5, 16000))));
    assert_bad(&reply, "messages[0].content[0]", "no audio input");
}
