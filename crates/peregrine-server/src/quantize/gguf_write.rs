//! Writing a GGUF file through candle's writer, with one correction llama.cpp needs: candle types
//! an empty metadata array as `u32`, and llama.cpp refuses a `tokenizer.ggml.merges` that is not
//! a string array (a byte-level BPE without merges has an empty one).

use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use anyhow::{Context, Result};
use peregrine_engine::tensor::candle::quantized::QTensor;
use peregrine_engine::tensor::candle::quantized::gguf_file::{self, Value};

/// GGUF's element-type code for strings (`GGUF_TYPE_STRING`).
const STRING_TYPE: u32 = 8;
/// Magic, version, tensor count and metadata count precede the first key.
const HEADER_BYTES: u64 = 4 + 4 + 8 + 8;

/// Writes a GGUF file of `metadata` and `tensors`, empty metadata arrays typed as strings.
pub(super) fn write(
    out: &Path,
    metadata: &[(String, Value)],
    tensors: &BTreeMap<String, QTensor>,
) -> Result<()> {
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("{}: cannot create", out.display()))?,
    );
    gguf_file::write(&mut f, &md, &ts)
        .and_then(|()| f.flush().map_err(Into::into))
        .with_context(|| format!("{}: cannot write", out.display()))?;
    let mut f = f.into_inner().map_err(|e| e.into_error())?;
    for offset in empty_array_type_offsets(metadata) {
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.write_all(&STRING_TYPE.to_le_bytes()))
            .with_context(|| format!("{}: cannot write", out.display()))?;
    }
    Ok(())
}

/// File offsets of the element-type field of each empty top-level array in `metadata`, as
/// candle's writer lays the metadata out (key, value type, value).
fn empty_array_type_offsets(metadata: &[(String, Value)]) -> Vec<u64> {
    let mut offsets = vec![];
    let mut at = HEADER_BYTES;
    for (key, value) in metadata {
        at += 8 + key.len() as u64 + 4;
        if matches!(value, Value::Array(v) if v.is_empty()) {
            offsets.push(at);
        }
        at += value_bytes(value);
    }
    offsets
}

/// Bytes a metadata value takes after its type code.
fn value_bytes(value: &Value) -> u64 {
    match value {
        Value::U8(_) | Value::I8(_) | Value::Bool(_) => 1,
        Value::U16(_) | Value::I16(_) => 2,
        Value::U32(_) | Value::I32(_) | Value::F32(_) => 4,
        Value::U64(_) | Value::I64(_) | Value::F64(_) => 8,
        Value::String(s) => 8 + s.len() as u64,
        Value::Array(v) => 4 + 8 + v.iter().map(value_bytes).sum::<u64>(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty merges list reads back as an empty string array, and the values around it are
    /// intact (so the computed offset hit the type field and nothing else).
    #[test]
    fn empty_arrays_are_string_arrays() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("peregrine-gguf-write-{}", std::process::id()));
        let path = dir.join("empty.gguf");
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(vec![Value::String("a".into())]),
            ),
            ("tokenizer.ggml.merges".into(), Value::Array(vec![])),
            ("llama.block_count".into(), Value::U32(7)),
        ];
        write(&path, &metadata, &BTreeMap::new())?;
        let bytes = std::fs::read(&path)?;
        let offset = empty_array_type_offsets(&metadata)[0] as usize;
        let element_type = u32::from_le_bytes(bytes[offset..offset + 4].try_into()?);
        assert_eq!(element_type, STRING_TYPE);
        // The array's type code (9) just before it, its length (0) just after it.
        assert_eq!(u32::from_le_bytes(bytes[offset - 4..offset].try_into()?), 9);
        assert_eq!(
            u64::from_le_bytes(bytes[offset + 4..offset + 12].try_into()?),
            0
        );
        let content = gguf_file::Content::read(&mut std::fs::File::open(&path)?)?;
        assert_eq!(content.metadata["llama.block_count"].to_u32()?, 7);
        assert!(
            content.metadata["tokenizer.ggml.merges"]
                .to_vec()?
                .is_empty()
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
