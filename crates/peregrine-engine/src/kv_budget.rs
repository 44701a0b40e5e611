//! The KV budget (`--kv-budget-mb`): a request is admitted only when the KV its prompt and
//! token budget can grow to fits beside what the running requests reserved, so a full machine
//! makes requests wait in the queue (and, once that is full, get 503) instead of running out
//! of memory. Reservations are upper bounds from the model's shape, held until the request's
//! last choice ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use peregrine_kv::RecurrentCache;
use peregrine_models::{KvOptions, LayerKind, ModelConfig};
use peregrine_tensor::DType;

/// Positions a cache buffer may hold past its length (they grow in steps of this many).
const GROWTH_SLACK: usize = 256;

/// Bytes the caches of `spec` (one per layer) can take for `positions` positions with `kv`,
/// with room for the buffers' growth: the reservation a request holds.
pub(crate) fn kv_bytes(
    config: &ModelConfig,
    spec: &[LayerKind],
    kv: &KvOptions,
    positions: usize,
) -> usize {
    let rows = row_bytes(config, kv);
    (spec.iter())
        .map(|kind| layer_bytes(kind, rows, kv, positions, GROWTH_SLACK))
        .sum()
}

/// One attention position's keys and values in bytes: every layer as wide as the widest (an
/// upper bound where layers differ or share their KV).
fn row_bytes(config: &ModelConfig, kv: &KvOptions) -> usize {
    let widest = (config.layer_specs.iter())
        .map(|l| l.num_key_value_heads * l.head_dim)
        .chain([config.num_key_value_heads * config.head_dim])
        .chain(
            config
                .mla
                .as_ref()
                .map(|m| m.kv_lora_rank + m.qk_rope_head_dim),
        )
        .max()
        .unwrap_or(0);
    // Bytes per stored value, in thousandths (4-bit codes with f16 scales and biases).
    let milli = match (kv.turbo, kv.quant, kv.dtype) {
        (Some(_), ..) => 2000, // compressed old positions; recent ones f16
        (None, Some(q), _) => 1000 * usize::from(q.bits) / 8 + 4000 / q.group_size,
        (None, None, Some(DType::F16 | DType::BF16)) => 2000,
        _ => 4000,
    };
    (2 * widest * milli).div_ceil(1000)
}

/// One layer's cache at `positions` positions, `slack` more for attention buffers' growth; a
/// recurrent layer holds its state and a copy per position it can roll back, whatever the
/// context.
fn layer_bytes(
    kind: &LayerKind,
    row_bytes: usize,
    kv: &KvOptions,
    positions: usize,
    slack: usize,
) -> usize {
    match kind {
        LayerKind::Recurrent { state } => RecurrentCache::max_bytes(*state, kv.recurrent_depth()),
        LayerKind::FullAndRecurrent { state } => {
            RecurrentCache::max_bytes(*state, kv.recurrent_depth())
                + (positions + slack) * row_bytes
        }
        LayerKind::Sliding { window } => (positions.min(*window) + slack) * row_bytes,
        _ => (positions + slack) * row_bytes,
    }
}

/// What one kind of layer holds at a context length ([`cache_memory`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMemory {
    /// `full`, `sliding` (with its window) or `recurrent`.
    pub kind: String,
    /// Layers of this kind.
    pub layers: usize,
    /// Bytes they hold together.
    pub bytes: usize,
}

/// KV and recurrent-state bytes one sequence of `positions` positions holds with `kv`, per
/// kind of layer in the order they first appear: full attention grows with the context,
/// sliding layers stop at their window, recurrent layers are fixed. Never every layer counted
/// as full attention.
pub fn cache_memory(
    config: &ModelConfig,
    spec: &[LayerKind],
    kv: &KvOptions,
    positions: usize,
) -> Vec<LayerMemory> {
    let rows = row_bytes(config, kv);
    let mut out: Vec<LayerMemory> = Vec::new();
    for layer in spec {
        let kind = match layer {
            LayerKind::Recurrent { .. } => "recurrent".to_string(),
            LayerKind::FullAndRecurrent { .. } => "full + recurrent".to_string(),
            LayerKind::Sliding { window } => format!("sliding (window {window})"),
            _ => "full".to_string(),
        };
        let bytes = layer_bytes(layer, rows, kv, positions, 0);
        match out.iter_mut().find(|m| m.kind == kind) {
            Some(m) => (m.layers, m.bytes) = (m.layers + 1, m.bytes + bytes),
            None => out.push(LayerMemory {
                kind,
                layers: 1,
                bytes,
            }),
        }
    }
    out
}

/// A share of a total of KV bytes, given back when dropped: a sequence's live bytes (kept
/// current as its cache grows) or a request's reservation (held until its last choice ends,
/// however it ends).
pub(crate) struct KvGauge {
    total: Arc<AtomicUsize>,
    mine: usize,
}

impl KvGauge {
    /// A share of `total` holding `bytes` from the start.
    pub fn holding(total: &Arc<AtomicUsize>, bytes: usize) -> Self {
        let mut gauge = Self {
            total: total.clone(),
            mine: 0,
        };
        gauge.set(bytes);
        gauge
    }

    pub fn set(&mut self, bytes: usize) {
        if bytes >= self.mine {
            self.total.fetch_add(bytes - self.mine, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.mine - bytes, Ordering::Relaxed);
        }
        self.mine = bytes;
    }
}

impl Drop for KvGauge {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// The default budget: half the memory the system reports available (after the weights
/// were loaded), or 4 GiB where it reports none.
pub(crate) fn default_kv_budget() -> usize {
    available_memory().map_or(4 << 30, |bytes| bytes / 2)
}

/// The memory the system can give now (`MemAvailable`); `None` where /proc is unavailable.
pub(crate) fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recurrent layer costs its state and one copy per rollback position, whatever the
    /// context; an attention layer grows with it.
    #[test]
    fn recurrent_layers_count_their_state_not_positions() {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama/hf");
        let options = peregrine_models::LoadOptions::default();
        let loaded = peregrine_models::load_model(fixture.as_ref(), &options).unwrap();
        let config = loaded.model.config();
        assert_eq!((config.num_key_value_heads, config.head_dim), (2, 16));
        let kv = KvOptions {
            recurrent_rollback: Some(3),
            ..KvOptions::default()
        };
        let spec = [LayerKind::Recurrent { state: 1000 }, LayerKind::Full];
        let at = |n| kv_bytes(config, &spec, &kv, n);
        let full_row = 2 * 2 * 16 * 4;
        assert_eq!(
            at(32_768),
            4 * 1000 * 4 + (32_768 + GROWTH_SLACK) * full_row
        );
        assert_eq!(at(32_768) - at(0), 32_768 * full_row);
    }

    #[test]
    fn reservations_come_back_when_dropped() {
        let total = Arc::new(AtomicUsize::new(0));
        let a = KvGauge::holding(&total, 100);
        let b = KvGauge::holding(&total, 50);
        assert_eq!(total.load(Ordering::Relaxed), 150);
        drop(a);
        assert_eq!(total.load(Ordering::Relaxed), 50);
        drop(b);
        assert_eq!(total.load(Ordering::Relaxed), 0);
    }
}
