//! Images through the OpenAI chat API, black-box: each tiny VLM fixture (Gemma 3, SmolVLM,
//! SmolVLM 2, Qwen2-VL, Qwen2.5-VL, Mistral 3, Gemma 4) served, a PNG sent as a base64 `data:` URL, and the answer's first-token
//! log-probability checked against transformers' logits for the same image and prompt
//! (tests/fixtures/vlm, made by scripts/fixtures/make_vlm.py). Then every kind of bad media:
//! each a 400 naming its part.

mod support;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use peregrine_engine::tensor::Device;
use peregrine_engine::tensor::candle::safetensors::load;
use serde_json::{Value, json};
use support::{Reply, Server};

const CHAT: &str = "/v1/chat/completions";

fn vlm(family: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vlm")
        .join(family)
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", STANDARD.encode(bytes))
}

/// The fixture's prompt: its image, then its text, in one user message.
fn ask(url: &str) -> Value {
    json!({"model": "tiny", "temperature": 0, "max_tokens": 2, "logprobs": true,
           "messages": [{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "Describe this image in one sentence."}]}]})
}

fn assert_bad(reply: &Reply, param: &str, says: &str) {
    assert_eq!(reply.status, 400, "{}", reply.body);
    let error = &reply.json()["error"];
    assert_eq!(error["param"], param, "{}", reply.body);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "`{says}` not in: {message}");
}

/// Serves the VLM fixture `family`, asks about its photo through the chat API and checks the
/// prompt's length and the first answer token's log-probability against transformers: the
/// template, the processor, the tower and the splice all play a part.
fn answer_matches_transformers(family: &str) -> (Server, Vec<u8>, usize) {
    let dir = vlm(family);
    let server = Server::start_model(&dir.join("hf"), &[]);
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let reply = server.post(CHAT, &ask(&data_url(&png)));
    assert_eq!(reply.status, 200, "{family}: {}", reply.body);
    let body = reply.json();
    let (prompt_tokens, _) = support::check_first_logprob(&dir, &body);
    (server, png, prompt_tokens)
}

#[test]
fn smolvlm_answers_as_transformers_does() {
    answer_matches_transformers("smolvlm");
}

/// Gemma 4: per-layer inputs, and the picture seen both ways in sliding layers only.
#[test]
fn gemma4_answers_as_transformers_does() {
    answer_matches_transformers("gemma4");
}

/// Mistral 3: the picture's rows of merged patches as separate runs between `[IMG_BREAK]`s.
#[test]
fn mistral3_answers_as_transformers_does() {
    answer_matches_transformers("mistral3");
}

/// SmolVLM 2: the same model as SmolVLM under transformers' `smolvlm` names.
#[test]
fn smolvlm2_answers_as_transformers_does() {
    answer_matches_transformers("smolvlm2");
}

/// llama.cpp's files of the Gemma 3 fixture: the text model's GGUF and its projector file
/// (`--mmproj`), both from llama.cpp's converter (scripts/fixtures/make_mmproj.py). The prompt
/// (template, tokenizer and image expansion from the GGUF) is transformers' to the token; the
/// logits are not (llama.cpp's Gemma 3 makes every sixth layer global, the 2-layer fixture's
/// second layer is), so tests/integration/vision.rs checks them against the tower in-process.
#[test]
fn gemma3_gguf_with_its_mmproj_takes_images() {
    let dir = vlm("gemma3");
    let mmproj = dir.join("gguf/mmproj-f32.gguf");
    let args = ["--mmproj", mmproj.to_str().unwrap()];
    let server = Server::start_model(&dir.join("gguf/model-bf16.gguf"), &args);
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let reply = server.post(CHAT, &ask(&data_url(&png)));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let r = load(dir.join("hf/reference.safetensors"), &Device::Cpu).unwrap();
    let body = reply.json();
    assert_eq!(
        body["usage"]["prompt_tokens"],
        r["input_ids"].dim(0).unwrap(),
        "{body}"
    );
}

/// llama.cpp's files of the Qwen VLM fixtures (scripts/fixtures/make_mmproj.py): the text
/// model's GGUF (`qwen2vl`, `qwen3vl`, `qwen35`: its tokenizer, template and M-RoPE sections from
/// the metadata) with the projector file: the prompt and the first answer token's
/// log-probability are transformers'.
#[test]
fn qwen_ggufs_with_their_mmproj_answer_as_transformers_does() {
    for family in ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5"] {
        let dir = vlm(family);
        let mmproj = dir.join("gguf/mmproj-f32.gguf");
        let args = ["--mmproj", mmproj.to_str().unwrap()];
        let server = Server::start_model(&dir.join("gguf/model-bf16.gguf"), &args);
        let png = std::fs::read(dir.join("image.png")).unwrap();
        let reply = server.post(CHAT, &ask(&data_url(&png)));
        assert_eq!(reply.status, 200, "{family}: {}", reply.body);
        support::check_first_logprob(&dir, &reply.json());
    }
}

/// Qwen2.5-VL: a run of image tokens whose length the picture decides, at M-RoPE positions.
#[test]
fn qwen2_5_vl_answers_as_transformers_does() {
    answer_matches_transformers("qwen2_5_vl");
}

/// Qwen3-VL: the same prompt form, a Qwen3 text model taking DeepStack's rows after its first
/// layers, interleaved M-RoPE.
#[test]
fn qwen3_vl_answers_as_transformers_does() {
    answer_matches_transformers("qwen3_vl");
}

/// Qwen3.5: Qwen3-VL's tower without DeepStack before the hybrid (gated delta-net) text model.
#[test]
fn qwen3_5_answers_as_transformers_does() {
    answer_matches_transformers("qwen3_5");
}

/// An MLX checkpoint as mlx-vlm converts one (4-bit language model, the tower under its
/// names, its own tokenizer and processor files), computing as mlx-lm does: its answer against
/// transformers on the dequantized weights.
#[test]
fn an_mlx_vlm_conversion_answers_as_its_reference() {
    for family in ["qwen3_vl", "smolvlm"] {
        let dir = vlm(family);
        let args = ["--mlx-activations", "f32"];
        let server = Server::start_model(&dir.join("mlx-q4-g32"), &args);
        let png = std::fs::read(dir.join("image.png")).unwrap();
        let reply = server.post(CHAT, &ask(&data_url(&png)));
        assert_eq!(reply.status, 200, "{family}: {}", reply.body);
        support::check_first_logprob_of(&dir, "mlx-q4-g32", &reply.json());
    }
}

/// Qwen2-VL: the same prompt form and text model, its own tower.
#[test]
fn qwen2_vl_answers_as_transformers_does() {
    answer_matches_transformers("qwen2_vl");
}

#[test]
fn an_image_answer_matches_transformers_and_bad_media_is_refused() {
    let (server, png, prompt_tokens) = answer_matches_transformers("gemma3");

    // Bad media: nothing decoded past the checks, nothing read from disk, no panic.
    let part = "messages[0].content[0]";
    let mut huge = png[..33].to_vec(); // signature + IHDR, its size rewritten
    huge[16..24].copy_from_slice(&[0, 0, 0x4e, 0x20, 0, 0, 0x4e, 0x20]); // 20000 × 20000
    let crc = crc32(&huge[12..29]);
    huge[29..33].copy_from_slice(&crc.to_be_bytes());
    huge.extend_from_slice(&png[33..]); // the photo's own (far too short) pixel data
    for (url, says) in [
        ("data:image/png;base64,%%%%".to_string(), "base64"),
        (data_url(b"GIF? no, plain text"), "cannot be used"),
        (data_url(&png[..200]), "cannot be used"),
        (data_url(&huge), "20000"),
        ("http://example.test/cat.png".to_string(), "remote"),
        (
            "file:///etc/passwd".to_string(),
            "local files are never read",
        ),
    ] {
        let reply = server.post(CHAT, &ask(&url));
        assert_bad(&reply, part, says);
    }
    // The server still answers, and the same picture is not encoded again.
    assert_eq!(server.post(CHAT, &ask(&data_url(&png))).status, 200);
    let metrics = server.get("/metrics").body;
    for line in [
        "peregrine_images_encoded_total 1",
        "peregrine_images_reused_total 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no `{line}` in /metrics"
        );
    }

    // Anthropic's base64 image blocks, behind a system prompt (one more chat message): the
    // same answer, and errors name the Anthropic block.
    let b64 = STANDARD.encode(&png);
    let anthropic = |data: &str| {
        json!({"model": "tiny", "max_tokens": 2, "temperature": 0, "system": "Be brief.",
               "messages": [{"role": "user", "content": [
                   {"type": "text", "text": "Look:"},
                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": data}}]}]})
    };
    let reply = server.post("/v1/messages", &anthropic(&b64));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let tokens = reply.json()["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(
        tokens > 16,
        "the image's 16 tokens and the text: {}",
        reply.body
    );
    let reply = server.post("/v1/messages", &anthropic("bm90IGFuIGltYWdl"));
    assert_eq!(reply.status, 400, "{}", reply.body);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // Anthropic's errors carry no `param`: the message names the block.
    assert!(
        message.starts_with("messages[0].content[1]: the image cannot be used"),
        "{message}"
    );
    // Responses' input_image parts.
    let responses = json!({"model": "tiny", "max_output_tokens": 16, "input": [
        {"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(&png)},
            {"type": "input_text", "text": "Describe this image in one sentence."}]}]});
    let reply = server.post("/v1/responses", &responses);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["usage"]["input_tokens"],
        prompt_tokens,
        "{}",
        reply.body
    );
}

#[test]
fn a_text_model_refuses_an_image_naming_the_part() {
    let server = Server::start(&[]);
    let png = std::fs::read(vlm("gemma3").join("image.png")).unwrap();
    let reply = server.post(CHAT, &ask(&data_url(&png)));
    assert_bad(&reply, "messages[0].content[0]", "no image input");
}

/// CRC-32 (IEEE) as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// A local HTTP server on a free port, in a thread that lives as long as the test process:
/// `/cat.png` is `png`, `/huge` declares 30 MiB, `/endless` sends 21 MiB with no length,
/// `/to-file` redirects to `file:///etc/passwd`, anything else is a 404. Returns its base URL.
fn media_host(png: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut request = Vec::new();
            let mut byte = [0u8];
            while !request.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                request.push(byte[0]);
            }
            let request = String::from_utf8_lossy(&request);
            let path = request.split(' ').nth(1).unwrap_or("/");
            let head = |status: &str, extra: &str| format!("HTTP/1.1 {status}\r\n{extra}\r\n");
            let reply: Vec<u8> = match path {
                "/cat.png" => {
                    let h = head("200 OK", &format!("Content-Length: {}\r\n", png.len()));
                    [h.as_bytes(), &png].concat()
                }
                "/huge" => head("200 OK", "Content-Length: 31457280\r\n").into_bytes(),
                "/endless" => {
                    let h = head("200 OK", "Connection: close\r\n");
                    [h.as_bytes(), &vec![0u8; 21 << 20]].concat()
                }
                "/to-file" => head(
                    "302 Found",
                    "Location: file:///etc/passwd\r\nContent-Length: 0\r\n",
                )
                .into_bytes(),
                _ => head("404 Not Found", "Content-Length: 0\r\n").into_bytes(),
            };
            let _ = conn.write_all(&reply);
        }
    });
    base
}

#[test]
fn remote_images_are_fetched_only_with_allow_remote_media() {
    let dir = vlm("smolvlm");
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let host = media_host(png.clone());
    let server = Server::start_model(&dir.join("hf"), &["--allow-remote-media"]);
    let logprob = |reply: &Reply| {
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["choices"][0]["logprobs"]["content"][0]["logprob"].as_f64()
    };
    // The same picture fetched or inline: the same answer, to the bit.
    let inline = logprob(&server.post(CHAT, &ask(&data_url(&png))));
    let fetched = logprob(&server.post(CHAT, &ask(&format!("{host}/cat.png"))));
    assert!(
        inline.is_some() && inline == fetched,
        "{inline:?} vs {fetched:?}"
    );
    // Anthropic's `url` image source goes the same way.
    let anthropic = json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user",
        "content": [{"type": "image", "source": {"type": "url", "url": format!("{host}/cat.png")}},
                    {"type": "text", "text": "Look."}]}]});
    let reply = server.post("/v1/messages", &anthropic);
    assert_eq!(reply.status, 200, "{}", reply.body);
    // What cannot be fetched, or is too large, is a 400 naming the part; local files stay unread.
    let part = "messages[0].content[0]";
    for (path, says) in [
        ("/missing.png", "HTTP 404"),
        ("/huge", "larger than"),
        ("/endless", "larger than"),
        ("/to-file", "fetching the image failed"),
    ] {
        assert_bad(
            &server.post(CHAT, &ask(&format!("{host}{path}"))),
            part,
            says,
        );
    }
    let file = server.post(CHAT, &ask("file:///etc/passwd"));
    assert_bad(&file, part, "local files are never read");
    // Without the flag the same URL is refused before anything is fetched.
    let plain = Server::start_model(&dir.join("hf"), &[]);
    let refused = plain.post(CHAT, &ask(&format!("{host}/cat.png")));
    assert_bad(&refused, part, "--allow-remote-media");
    // An allow-list of hosts: the host named reaches the picture, others are refused by name.
    let flags = [
        "--allow-remote-media",
        "--remote-media-hosts",
        "example.test,127.0.0.1",
    ];
    let listed = Server::start_model(&dir.join("hf"), &flags);
    assert_eq!(
        logprob(&listed.post(CHAT, &ask(&format!("{host}/cat.png")))),
        inline
    );
    let elsewhere = host.replace("127.0.0.1", "localhost");
    let refused = listed.post(CHAT, &ask(&format!("{elsewhere}/cat.png")));
    assert_bad(
        &refused,
        part,
        "`localhost` is not one of --remote-media-hosts",
    );
}
