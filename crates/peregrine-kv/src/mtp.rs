//! What a multi-token-prediction (MTP) head keeps beside its sequence's cache: its own layers'
//! caches and the target's latest final hidden states. MTP row `j` joins the target's hidden
//! state at position `j` with the token at position `j + 1` and predicts the one after, so the
//! head's cache holds one row fewer than the target's: rows `0..len - 1`, each of whose next
//! token the target has run.

use peregrine_tensor::{Result, Tensor};

use crate::{AttnParams, KvOptions, LayerCache, LayerKind, SequenceCache};

/// Hidden states kept behind the latest position, so that a rollback this deep (speculative
/// rejection, a prompt-cache entry trimmed near its end) still finds the row the head resumes
/// from.
pub const MTP_HIDDEN_KEPT: usize = 64;

/// An MTP head's memory for one sequence ([`SequenceCache::enable_mtp`]).
pub struct MtpState {
    cache: SequenceCache,
    width: usize,
    /// Final hidden states (f32 rows of `width`) of positions `first..first + rows`.
    hidden: Vec<f32>,
    first: usize,
    /// Rows the head could not compute (their hidden state was gone): it drafts no more.
    lost: bool,
}

impl MtpState {
    /// An empty state for head layers `spec` over hidden states of `width`.
    pub fn new(spec: &[LayerKind], options: &KvOptions, width: usize) -> Self {
        Self {
            cache: SequenceCache::new(spec, options),
            width,
            hidden: Vec::new(),
            first: 0,
            lost: false,
        }
    }

    /// The head layers' caches (row `j` at position `j`).
    pub fn cache(&mut self) -> &mut SequenceCache {
        &mut self.cache
    }

    /// The width of a hidden state.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Whether the head fell behind for good (a rollback deeper than the kept hidden states):
    /// its drafts would be guesses without context, so none are made.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Gives up on this sequence's head, freeing what it holds.
    pub fn lose(&mut self) {
        self.lost = true;
        self.hidden = Vec::new();
        self.cache = SequenceCache::new(&[], &KvOptions::default());
    }

    /// The target's final hidden state at `pos`, when kept.
    pub fn hidden_at(&self, pos: usize) -> Option<&[f32]> {
        let at = pos.checked_sub(self.first)?.checked_mul(self.width)?;
        self.hidden.get(at..at.checked_add(self.width)?)
    }

    /// Records the target's final hidden states of positions `start..` (`rows`, whole rows of
    /// the width), keeping the last [`MTP_HIDDEN_KEPT`]. A gap before `start` loses the head.
    pub fn record(&mut self, start: usize, rows: &[f32]) {
        let end = self.first + self.hidden.len() / self.width;
        // A gap after the kept states, or rows before them (which trims never leave): lost.
        if (start > end || start < self.first) && !self.hidden.is_empty() {
            self.lose();
        }
        if self.lost {
            return;
        }
        if self.hidden.is_empty() {
            self.first = start;
        }
        self.hidden.truncate((start - self.first) * self.width);
        self.hidden.extend_from_slice(rows);
        let rows_kept = self.hidden.len() / self.width;
        if rows_kept > MTP_HIDDEN_KEPT {
            let drop = rows_kept - MTP_HIDDEN_KEPT;
            self.hidden.drain(..drop * self.width);
            self.first += drop;
        }
    }

    /// Follows the target back to `len` positions: the head keeps rows `0..len - 1` and needs
    /// the hidden state at `len - 1` to go on; without it the head is lost.
    pub(crate) fn trim_to(&mut self, len: usize) {
        if self.lost {
            return;
        }
        let rows = len.saturating_sub(1);
        let extra = self.cache.len().saturating_sub(rows);
        if extra > 0 && self.cache.trim(extra).is_err() {
            return self.lose();
        }
        let kept = len.saturating_sub(self.first) * self.width;
        self.hidden.truncate(kept);
        if len > 0 && self.hidden_at(len - 1).is_none() {
            self.lose();
        }
    }

    /// Bytes held: the head's caches and the kept hidden states.
    pub fn bytes(&self) -> usize {
        self.cache.bytes() + self.hidden.capacity() * 4
    }

    /// An independent copy.
    pub fn snapshot(&self) -> Result<Self> {
        Ok(Self {
            cache: self.cache.snapshot()?,
            hidden: self.hidden.clone(),
            ..*self
        })
    }
}

/// Another layer's cache as a drafter's attention sees it (Gemma 4's assistant, whose layers
/// project no keys or values): its query, one row past the cache's end, reads the last
/// `last` positions ([`LayerCache::attend_shared`]); nothing is written.
pub struct SharedView<'a> {
    inner: &'a dyn LayerCache,
    last: Option<usize>,
}

impl<'a> SharedView<'a> {
    /// A view of `inner` over its last `last` positions (`None`: all).
    pub fn new(inner: &'a dyn LayerCache, last: Option<usize>) -> Self {
        Self { inner, last }
    }
}

impl LayerCache for SharedView<'_> {
    fn append(&mut self, _: &Tensor, _: &Tensor) -> Result<()> {
        peregrine_tensor::candle::bail!("a shared view of a cache is read-only")
    }

    fn attend(&self, q: &Tensor, params: &AttnParams) -> Result<Tensor> {
        self.inner.attend_shared(q, params, self.last)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn can_trim(&self, _: usize) -> bool {
        false
    }

    fn trim(&mut self, _: usize) -> Result<()> {
        peregrine_tensor::candle::bail!("a shared view of a cache is read-only")
    }

    fn bytes(&self) -> usize {
        0
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        peregrine_tensor::candle::bail!("a shared view of a cache is read-only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_tensor::{DType, Device};

    fn state() -> MtpState {
        let kv = KvOptions {
            dtype: Some(DType::F32),
            ..KvOptions::default()
        };
        MtpState::new(&[LayerKind::Full], &kv, 2)
    }

    fn append(s: &mut MtpState, rows: usize) {
        let t = Tensor::zeros((1, 1, rows, 4), DType::F32, &Device::Cpu).unwrap();
        s.cache().layer(0).append(&t, &t).unwrap();
    }

    #[test]
    fn keeps_the_latest_hidden_states_and_follows_trims() {
        let mut s = state();
        let rows: Vec<f32> = (0..200).map(|i| i as f32).collect();
        s.record(0, &rows); // positions 0..100
        assert_eq!(s.hidden_at(35), None, "older than the kept window");
        assert_eq!(s.hidden_at(99), Some(&[198.0, 199.0][..]));
        append(&mut s, 99);
        s.trim_to(90);
        assert_eq!((s.cache().len(), s.is_lost()), (89, false));
        assert_eq!(s.hidden_at(90), None);
        s.record(90, &[7.0, 8.0]);
        assert_eq!(s.hidden_at(90), Some(&[7.0, 8.0][..]));
        s.trim_to(20); // deeper than the kept states
        assert!(s.is_lost());
        assert_eq!((s.cache().len(), s.bytes()), (0, 0));
    }

    #[test]
    fn a_gap_in_the_hidden_states_loses_the_head() {
        let mut s = state();
        s.record(0, &[0.0; 6]);
        s.record(5, &[0.0; 2]);
        assert!(s.is_lost());
        let mut s = state();
        s.record(0, &[0.0; 200]); // positions 0..100, the last 64 kept
        s.record(10, &[0.0; 2]);
        assert!(s.is_lost(), "rows before the kept ones");
    }
}
