//! Image content parts: `data:` URLs (and, with `--allow-remote-media`, `http(s)` ones), and
//! audio parts (base64 WAV), decoded and checked here, at the edge, so that a bad picture or
//! clip is a 400 naming its part. Nothing is ever read from the server's disk.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use peregrine_models::audio::{AudioClip, decode_flac, decode_wav};
use peregrine_models::vision::{ImageLimits, RgbImage, decode_image};
use serde_json::{Value, json};

use super::error::ApiError;

/// Most images in one request.
pub(super) const MAX_IMAGES: usize = 16;

/// Most audio clips in one request, and the longest one decoded (the model's window, checked
/// by the engine, is usually shorter: 30 s for Whisper's towers).
const MAX_CLIPS: usize = 8;
const MAX_CLIP_SECONDS: f64 = 600.0;

/// The limits every picture is held to: its encoded bytes and its pixels.
pub(super) fn limits() -> ImageLimits {
    ImageLimits::default()
}

/// Redirects a remote image may take.
const MAX_REDIRECTS: usize = 3;

/// Fetches `http(s)` image URLs for a server run with `--allow-remote-media`.
pub struct RemoteMedia {
    agent: ureq::Agent,
    /// The hosts URLs (and redirects) may name, lowercase; empty: any.
    hosts: Vec<String>,
}

impl RemoteMedia {
    /// A fetcher with 10 s to connect and 30 s for each exchange, reaching only `hosts` (any
    /// host when empty).
    pub fn new(hosts: &[String]) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(10))
            .timeout(Duration::from_secs(30))
            // Followed here: ureq 2.12 panics on a redirect to a URL without a host.
            .redirects(0)
            .user_agent(concat!("peregrine/", env!("CARGO_PKG_VERSION")))
            .build();
        let hosts = hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        Self { agent, hosts }
    }

    /// The body of `url` after at most [`MAX_REDIRECTS`] redirects to other `http(s)` URLs,
    /// refused past `max` bytes (by its `Content-Length` before reading, or once `max` bytes
    /// have arrived).
    fn fetch(&self, url: &str, max: usize) -> Result<Vec<u8>, String> {
        let failed = |why: &dyn std::fmt::Display| format!("fetching the image failed: {why}");
        let mut url = url::Url::parse(url).map_err(|e| failed(&e))?;
        for _ in 0..=MAX_REDIRECTS {
            let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
            if !self.hosts.is_empty() && !self.hosts.contains(&host) {
                let why = format!("the host `{host}` is not one of --remote-media-hosts");
                return Err(failed(&why));
            }
            let response = self
                .agent
                .request_url("GET", &url)
                .call()
                .map_err(|e| match e {
                    ureq::Error::Status(code, _) => failed(&format!("HTTP {code}")),
                    ureq::Error::Transport(t) => failed(&t),
                })?;
            if !(300..400).contains(&response.status()) {
                return read_at_most(response, max);
            }
            let location = response.header("location").unwrap_or_default();
            url = url.join(location).map_err(|e| failed(&e))?;
            if !is_remote(url.as_str()) {
                return Err(failed(&"redirected to a URL that is not http(s)"));
            }
        }
        Err(failed(&format!("more than {MAX_REDIRECTS} redirects")))
    }
}

/// A response's body, refused past `max` bytes.
fn read_at_most(response: ureq::Response, max: usize) -> Result<Vec<u8>, String> {
    let too_large = || format!("the image is larger than {max} bytes");
    let declared = response
        .header("content-length")
        .and_then(|n| n.parse().ok());
    if declared.is_some_and(|n: usize| n > max) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    (response.into_reader().take(max as u64 + 1))
        .read_to_end(&mut bytes)
        .map_err(|e| format!("fetching the image failed: {e}"))?;
    match bytes.len() > max {
        true => Err(too_large()),
        false => Ok(bytes),
    }
}

/// The pictures of a request's image parts and the clips of its audio parts, in order, with
/// the parts that held them.
#[derive(Default)]
pub(super) struct Images<'a> {
    pub images: Vec<Arc<RgbImage>>,
    /// Each image's part (`messages[0].content[1]`), for errors.
    pub parts: Vec<String>,
    pub audio: Vec<Arc<AudioClip>>,
    /// Each clip's part.
    pub audio_parts: Vec<String>,
    /// Where remote URLs may be fetched (`--allow-remote-media`).
    remote: Option<&'a RemoteMedia>,
}

impl<'a> Images<'a> {
    /// No images yet; `remote` fetches `http(s)` URLs, refused without it.
    pub fn new(remote: Option<&'a RemoteMedia>) -> Self {
        Self {
            remote,
            ..Self::default()
        }
    }

    /// Decodes the image part `part` (at `param`): an OpenAI `image_url` part whose URL is a
    /// `data:` URL, or an `http(s)` one where the server fetches them (the URL as
    /// `{"url": ...}` or as a bare string). Returns the part the chat template sees in its
    /// place, `{"type": "image"}`.
    pub(super) fn take(&mut self, param: &str, part: &Value) -> Result<Value, ApiError> {
        if self.images.len() == MAX_IMAGES {
            let message = format!("a request holds at most {MAX_IMAGES} images");
            return Err(ApiError::invalid(param, message));
        }
        let url = match part.get("image_url") {
            Some(Value::String(url)) => url.as_str(),
            Some(Value::Object(o)) => match o.get("url") {
                Some(Value::String(url)) => url.as_str(),
                _ => return Err(ApiError::invalid(param, "`image_url.url` must be a string")),
            },
            _ => return Err(ApiError::invalid(param, "an image part needs `image_url`")),
        };
        let bytes = match (is_remote(url), self.remote) {
            (true, Some(remote)) => remote.fetch(url, limits().max_bytes),
            _ => data_url_bytes(url),
        };
        let bytes = bytes.map_err(|m| ApiError::invalid(param, m))?;
        let image = decode_image(&bytes, &limits())
            .map_err(|e| ApiError::invalid(param, format!("the image cannot be used: {e}")))?;
        self.images.push(Arc::new(image));
        self.parts.push(param.to_string());
        Ok(json!({"type": "image"}))
    }

    /// Decodes the audio part `part` (at `param`): an OpenAI `input_audio` part,
    /// `{"input_audio": {"data": BASE64, "format": "wav"}}` (or `"flac"`). Returns the part the chat
    /// template sees in its place, `{"type": "audio"}`.
    pub(super) fn take_audio(&mut self, param: &str, part: &Value) -> Result<Value, ApiError> {
        let bad = |m: &str| ApiError::invalid(param, m);
        if self.audio.len() == MAX_CLIPS {
            let message = format!("a request holds at most {MAX_CLIPS} audio clips");
            return Err(ApiError::invalid(param, message));
        }
        let Some(Value::Object(audio)) = part.get("input_audio") else {
            return Err(bad(
                "an audio part needs `input_audio` ({\"data\": base64, \"format\": \"wav\"})",
            ));
        };
        let Some(Value::String(data)) = audio.get("data") else {
            return Err(bad("`input_audio.data` must be a base64 string"));
        };
        let decode = match audio.get("format").and_then(Value::as_str) {
            Some("wav") => decode_wav,
            Some("flac") => decode_flac,
            Some(other) => {
                let message = format!(
                    "`input_audio.format` `{other}` is not supported (`wav` and `flac` are)"
                );
                return Err(ApiError::invalid(param, message));
            }
            None => {
                return Err(bad(
                    "`input_audio.format` must be a string (`wav` or `flac`)",
                ));
            }
        };
        let max = limits().max_bytes;
        if data.len() / 4 * 3 > max {
            return Err(ApiError::invalid(
                param,
                format!("the clip is larger than {max} bytes"),
            ));
        }
        let bytes = (STANDARD.decode(data.trim_end())).map_err(|e| {
            ApiError::invalid(
                param,
                format!("`input_audio.data` is not valid base64: {e}"),
            )
        })?;
        let clip = decode(&bytes, MAX_CLIP_SECONDS)
            .map_err(|e| ApiError::invalid(param, format!("the audio cannot be used: {e}")))?;
        self.audio.push(Arc::new(clip));
        self.audio_parts.push(param.to_string());
        Ok(json!({"type": "audio"}))
    }
}

/// A 400 naming the first image or audio part (`parts`) that the served model has no tower for.
pub(super) fn check_towers(
    state: &super::State,
    (images, clips): (&[String], &[String]),
) -> Result<(), ApiError> {
    let refuse = |part: &String, what: &str, tower: &str| {
        let message = format!("this model takes no {what} input (it has no {tower} tower)");
        Err(ApiError::invalid(part.as_str(), message))
    };
    if let Some(part) = images.first()
        && !state.engine()?.accepts_images()
    {
        return refuse(part, "image", "vision");
    }
    match clips.first() {
        Some(part) if !state.engine()?.accepts_audio() => refuse(part, "audio", "audio"),
        _ => Ok(()),
    }
}

/// Whether `url` is an `http(s)` one.
fn is_remote(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// The bytes of a base64 `data:` URL; any other URL is refused with the reason.
fn data_url_bytes(url: &str) -> Result<Vec<u8>, String> {
    if is_remote(url) {
        return Err(
            "remote image URLs are fetched only by a server started with \
             `--allow-remote-media`: send the image inline as a base64 `data:` URL"
                .into(),
        );
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err("only base64 `data:` URLs are accepted (local files are never read)".into());
    };
    let Some((header, data)) = rest.split_once(',') else {
        return Err("a `data:` URL needs a `,` before its data".into());
    };
    if !header.ends_with(";base64") {
        return Err("the `data:` URL must be base64 (`data:image/png;base64,...`)".into());
    }
    let max = limits().max_bytes;
    if data.len() / 4 * 3 > max {
        return Err(format!("the image is larger than {max} bytes"));
    }
    STANDARD
        .decode(data.trim_end())
        .map_err(|e| format!("the `data:` URL is not valid base64: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_base64_data_urls_are_read() {
        for (url, why) in [
            ("http://example.test/a.png", "remote"),
            ("https://example.test/a.png", "remote"),
            ("file:///etc/passwd", "local files are never read"),
            ("/etc/passwd", "local files are never read"),
            ("data:image/png,abc", "must be base64"),
            ("data:image/png;base64", "needs a `,`"),
            ("data:image/png;base64,@@@@", "not valid base64"),
        ] {
            let err = data_url_bytes(url).unwrap_err();
            assert!(err.contains(why), "{url}: {err}");
        }
        assert_eq!(data_url_bytes("data:image/png;base64,aGk=").unwrap(), b"hi");
    }
}
