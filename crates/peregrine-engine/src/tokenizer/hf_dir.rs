//! Loading a HuggingFace tokenizer directory: `tokenizer.json` plus the side files that say which
//! tokens are BOS/EOS, whether BOS is added, and the chat template.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{SpecialTokens, Tokenizer, TokenizerError};

/// Loads `dir/tokenizer.json` and its optional side files.
pub(super) fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let path = dir.join("tokenizer.json");
    let bytes = std::fs::read(&path).map_err(|source| TokenizerError::Io {
        path: path.clone(),
        source,
    })?;
    let inner =
        tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| invalid(&path, e.to_string()))?;

    let config_path = dir.join("tokenizer_config.json");
    let config = read_json(&config_path)?.unwrap_or(Value::Null);
    let generation_path = dir.join("generation_config.json");
    let generation = read_json(&generation_path)?.unwrap_or(Value::Null);

    let bos_token = token_text(&config, "bos_token", &config_path)?;
    let eos_token = token_text(&config, "eos_token", &config_path)?;
    let lookup = |token: Option<String>, key: &str| -> Result<Option<u32>, TokenizerError> {
        token
            .map(|t| {
                inner.token_to_id(&t).ok_or_else(|| {
                    invalid(
                        &config_path,
                        format!("`{key}` `{t}` is not in tokenizer.json"),
                    )
                })
            })
            .transpose()
    };
    let bos_id = match lookup(bos_token, "bos_token")? {
        Some(id) => Some(id),
        None => ids(&generation, "bos_token_id", &generation_path)?
            .first()
            .copied(),
    };
    let mut eos_ids: Vec<u32> = lookup(eos_token, "eos_token")?.into_iter().collect();
    eos_ids.extend(ids(&generation, "eos_token_id", &generation_path)?);

    // Without `add_bos_token`, BOS is added when tokenizer.json's post-processor adds it.
    let probe = inner
        .encode_fast("", true)
        .map_err(|e| invalid(&path, format!("post-processor fails on empty text: {e}")))?;
    let probe = probe.get_ids();
    let probe_bos = bos_id.is_some() && probe.first().copied() == bos_id;
    let probe_eos = probe.len() > usize::from(probe_bos) && probe.last() == eos_ids.first();
    let add_bos = flag(&config, "add_bos_token", &config_path)?.unwrap_or(probe_bos);
    let add_eos = flag(&config, "add_eos_token", &config_path)?.unwrap_or(probe_eos);

    let jinja_path = dir.join("chat_template.jinja");
    let chat_template = match std::fs::read_to_string(&jinja_path) {
        Ok(template) => Some(template),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => chat_template(&config, &config_path)?,
        Err(source) => {
            return Err(TokenizerError::Io {
                path: jinja_path,
                source,
            });
        }
    };

    let specials = SpecialTokens {
        bos_id,
        eos_ids,
        add_bos,
        add_eos,
        chat_template,
    };
    Ok(specials.build(inner))
}

fn invalid(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError::File {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Parses a JSON file; `None` when it does not exist.
fn read_json(path: &PathBuf) -> Result<Option<Value>, TokenizerError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| invalid(path, e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.clone(),
            source,
        }),
    }
}

/// A token given as a string or as an AddedToken object (`{"content": ...}`); null means none.
fn token_text(config: &Value, key: &str, path: &Path) -> Result<Option<String>, TokenizerError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(invalid(
                path,
                format!("`{key}` object has no string `content`"),
            )),
        },
        Some(_) => Err(invalid(
            path,
            format!("`{key}` must be a string or an object with `content`"),
        )),
    }
}

/// A token id given as an integer or a list of integers (generation_config.json's `eos_token_id`).
fn ids(config: &Value, key: &str, path: &Path) -> Result<Vec<u32>, TokenizerError> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| {
                invalid(
                    path,
                    format!("`{key}` must be a token id or a list of token ids"),
                )
            })
    };
    match config.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn flag(config: &Value, key: &str, path: &Path) -> Result<Option<bool>, TokenizerError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(path, format!("`{key}` must be true or false"))),
    }
}

/// `chat_template` as a string, or as a list of `{name, template}` where `default` is taken (the
/// first entry when none is called `default`).
fn chat_template(config: &Value, path: &Path) -> Result<Option<String>, TokenizerError> {
    let bad = || {
        invalid(
            path,
            "`chat_template` must be a string or a list of {name, template}",
        )
    };
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(items)) => {
            let named = |item: &Value| item.get("name").and_then(Value::as_str) == Some("default");
            let Some(item) = items.iter().find(|i| named(i)).or(items.first()) else {
                return Ok(None);
            };
            item.get("template")
                .and_then(Value::as_str)
                .map(|t| Some(t.to_owned()))
                .ok_or_else(bad)
        }
        Some(_) => Err(bad()),
    }
}
