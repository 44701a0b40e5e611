//! The chat page at `/` (`serve --no-webui` turns it off): static files compiled into the binary,
//! so it works offline; the page talks only to this server's own OpenAI API.

use hyper::Response;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};

use super::sse::{self, Body};

/// Path, content type and content of each file of the page.
const FILES: [(&str, &str, &str); 4] = [
    (
        "/",
        "text/html; charset=utf-8",
        include_str!("../../webui/index.html"),
    ),
    (
        "/webui/app.js",
        "text/javascript; charset=utf-8",
        include_str!("../../webui/app.js"),
    ),
    (
        "/webui/markdown.js",
        "text/javascript; charset=utf-8",
        include_str!("../../webui/markdown.js"),
    ),
    (
        "/webui/style.css",
        "text/css; charset=utf-8",
        include_str!("../../webui/style.css"),
    ),
];

/// Only this origin's scripts, styles and API: a model's answer can never load anything.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
                      frame-ancestors 'none'";

/// Whether `path` is a file of the page.
pub fn is_page(path: &str) -> bool {
    FILES.iter().any(|(p, _, _)| *p == path)
}

/// The file at `path`, with headers that keep it from being framed, sniffed or cached stale.
pub fn file(path: &str) -> Option<Response<Body>> {
    let (_, content_type, content) = FILES.iter().find(|(p, _, _)| *p == path)?;
    let mut response = Response::new(sse::full(*content));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("content-security-policy", HeaderValue::from_static(POLICY));
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_the_page_names_is_served() {
        let (_, _, index) = FILES[0];
        for name in ["/webui/app.js", "/webui/markdown.js", "/webui/style.css"] {
            assert!(index.contains(name), "index.html does not load {name}");
            assert!(file(name).is_some(), "{name} is not served");
        }
        assert!(file("/webui/missing.js").is_none());
    }

    #[test]
    fn the_page_calls_only_this_servers_api() {
        let (_, _, app) = FILES[1];
        let targets: Vec<&str> = app.split("fetch(\"").skip(1).collect();
        assert!(
            targets.len() >= 2,
            "the page's API calls moved: update this test"
        );
        for target in targets {
            assert!(target.starts_with("/v1/"), "the page fetches {target:.40}");
        }
    }
}
