//! Typed access to the fields of a JSON config object, with errors that name the file and the
//! field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{ModelError, Result};

/// Reads fields from a JSON object, with errors that name the file and the field.
pub struct Fields<'a> {
    pub(super) file: PathBuf,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// Wraps a parsed JSON object read from `file`.
    pub fn new(file: &Path, map: &'a Map<String, Value>) -> Self {
        Self {
            file: file.to_path_buf(),
            map,
        }
    }

    /// An error naming this file.
    pub fn err(&self, message: String) -> ModelError {
        ModelError::config(&self.file, message)
    }

    /// Whether `key` is present, even as JSON `null` (which can mean "off" where the field's
    /// default is on, as Gemma 2's soft caps).
    pub fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// The keys present (JSON `null` ones too).
    pub fn keys(&self) -> impl Iterator<Item = &'a String> + use<'a> {
        self.map.keys()
    }

    /// The raw value of `key`, treating JSON `null` as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// A required positive integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing required field `{key}`")))
    }

    /// An optional positive integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.err(format!("field `{key}` must be a positive integer, got {v}"))),
            },
        }
    }

    /// An optional number.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a number, got {v}"))),
        }
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be true or false, got {v}"))),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a string, got {v}"))),
        }
    }

    /// Token ids given as one integer or a list of integers.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = || {
            self.err(format!(
                "field `{key}` must be a token id or a list of token ids"
            ))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|n| n as u32).ok_or_else(bad))
                .collect(),
            Some(v) => Ok(vec![v.as_u64().ok_or_else(bad)? as u32]),
        }
    }

    /// A list of non-negative integers (empty when absent).
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        let bad = || {
            self.err(format!(
                "field `{key}` must be a list of non-negative integers"
            ))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|n| n as usize).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }

    /// A list of numbers (empty when absent).
    pub fn f64_list(&self, key: &str) -> Result<Vec<f64>> {
        let bad = || self.err(format!("field `{key}` must be a list of numbers"));
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items.iter().map(|v| v.as_f64().ok_or_else(bad)).collect(),
            Some(_) => Err(bad()),
        }
    }

    /// The JSON object these fields read.
    pub fn map(&self) -> &'a Map<String, Value> {
        self.map
    }

    /// The nested object `key` as fields of the same file, when present.
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                file: self.file.clone(),
                map,
            })),
            Some(v) => Err(self.err(format!("field `{key}` must be an object, got {v}"))),
        }
    }
}

/// Reads and parses a JSON object file.
pub fn read_json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ModelError::config(path, "expected a JSON object")),
        Err(e) => Err(ModelError::config(path, format!("invalid JSON: {e}"))),
    }
}
