//! Image content parts: `data:` URLs decoded and checked here, at the edge, so that a bad
//! picture is a 400 naming its part. Nothing is ever read from the server's disk, and remote
//! URLs are refused (fetching them is not implemented).

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use peregrine_models::vision::{ImageLimits, RgbImage, decode_image};
use serde_json::{Value, json};

use super::error::ApiError;

/// Most images in one request.
pub(super) const MAX_IMAGES: usize = 16;

/// The limits every picture is held to: its encoded bytes and its pixels.
pub(super) fn limits() -> ImageLimits {
    ImageLimits::default()
}

/// The pictures of a request's image parts, in order, with the parts that held them.
#[derive(Default)]
pub(super) struct Images {
    pub images: Vec<Arc<RgbImage>>,
    /// Each image's part (`messages[0].content[1]`), for errors.
    pub parts: Vec<String>,
}

impl Images {
    /// Decodes the image part `part` (at `param`): an OpenAI `image_url` part whose URL is a
    /// `data:` URL (the URL as `{"url": ...}` or as a bare string). Returns the part the chat
    /// template sees in its place, `{"type": "image"}`.
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
        let bytes = data_url_bytes(url).map_err(|m| ApiError::invalid(param, m))?;
        let image = decode_image(&bytes, &limits())
            .map_err(|e| ApiError::invalid(param, format!("the image cannot be used: {e}")))?;
        self.images.push(Arc::new(image));
        self.parts.push(param.to_string());
        Ok(json!({"type": "image"}))
    }
}

/// The bytes of a base64 `data:` URL; any other URL is refused with the reason.
fn data_url_bytes(url: &str) -> Result<Vec<u8>, String> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(
            "remote image URLs are not fetched by this server: send the image inline \
                    as a base64 `data:` URL"
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
