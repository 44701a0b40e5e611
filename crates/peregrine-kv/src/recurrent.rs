//! A recurrent layer's memory (Mamba 2's conv and SSM states, gated delta-net's conv and delta
//! states): a fixed-size state instead of keys and values, so it cannot be cut back like a KV
//! cache. Rollback keeps the states before each of the last `depth` positions (a ring of
//! copies): `trim(n)` for `n ≤ depth` restores one exactly. Memory is `(1 + depth) · state`;
//! time one state copy per decoded position, and at most `depth` per prompt pass however long.
//! The alternative, a snapshot every k tokens plus re-running up to k of them, needs the model
//! inside the cache and saves memory only for deep rollbacks.

use std::collections::VecDeque;

use peregrine_tensor::{Result, Tensor, candle::bail};

use crate::{AttnParams, LayerCache};

/// Positions a recurrent layer can roll back by default (`KvOptions::recurrent_rollback`):
/// a speculative draft's length, not a prompt cache's whole prefix.
pub const DEFAULT_RECURRENT_ROLLBACK: usize = 8;

/// One recurrent layer's state (f32, laid out by its model) and the states after its last
/// `depth` positions.
#[derive(Debug, Clone)]
pub struct RecurrentCache {
    state: Vec<f32>,
    history: VecDeque<Vec<f32>>,
    depth: usize,
    len: usize,
}

impl RecurrentCache {
    /// A zero state of `state` values that rolls back up to `depth` positions.
    pub fn new(state: usize, depth: usize) -> Self {
        Self {
            state: vec![0.0; state],
            history: VecDeque::with_capacity(depth),
            depth,
            len: 0,
        }
    }

    /// Bytes a cache of `state` values rolling back `depth` positions holds at most.
    pub fn max_bytes(state: usize, depth: usize) -> usize {
        4 * state * (1 + depth)
    }

    /// Positions it can roll back at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Starts `n` positions run at once (a prompt's bulk, in a chunked form): no state within
    /// them is kept, so rollback reaches back to their end only (older copies are dropped).
    pub fn advance_span(&mut self, n: usize) -> &mut [f32] {
        if n > 0 {
            self.history.clear();
            self.len += n;
        }
        &mut self.state
    }

    /// The state after the last position.
    pub fn state(&self) -> &[f32] {
        &self.state
    }

    /// Starts the next position: the current state is kept for rollback and returned to be
    /// updated in place. `after` is how many more positions the same pass runs: a state that
    /// would fall out of the last `depth` by the pass's end is not copied (the older copies
    /// are dropped instead, since rollback needs an unbroken run), so a long prompt costs at
    /// most `depth` copies.
    pub fn advance(&mut self, after: usize) -> &mut [f32] {
        if after >= self.depth {
            self.history.clear();
        } else {
            let mut kept = match self.history.len() == self.depth {
                true => self.history.pop_front().expect("depth > 0"),
                false => Vec::with_capacity(self.state.len()),
            };
            kept.clear();
            kept.extend_from_slice(&self.state);
            self.history.push_back(kept);
        }
        self.len += 1;
        &mut self.state
    }
}

impl LayerCache for RecurrentCache {
    fn append(&mut self, _k: &Tensor, _v: &Tensor) -> Result<()> {
        bail!("a recurrent layer keeps a state, not keys and values")
    }

    fn attend(&self, _q: &Tensor, _params: &AttnParams) -> Result<Tensor> {
        bail!("a recurrent layer keeps a state, not keys and values")
    }

    fn len(&self) -> usize {
        self.len
    }

    fn can_trim(&self, n: usize) -> bool {
        n <= self.history.len()
    }

    fn trim(&mut self, n: usize) -> Result<()> {
        if !self.can_trim(n) {
            bail!(
                "cannot roll a recurrent state back {n} positions: it keeps the last {} \
                 (raise the recurrent rollback depth)",
                self.history.len()
            )
        }
        if n > 0 {
            let restored = self.history.len() - n;
            self.state.copy_from_slice(&self.history[restored]);
            self.history.truncate(restored);
            self.len -= n;
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        Self::max_bytes(self.state.len(), self.history.len())
    }

    fn snapshot(&self) -> Result<Box<dyn LayerCache>> {
        Ok(Box::new(self.clone()))
    }

    fn recurrent(&mut self) -> Option<&mut RecurrentCache> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Position `p`'s update: a state that depends on every earlier position's.
    fn step(cache: &mut RecurrentCache, p: usize) {
        for (i, s) in cache.advance(0).iter_mut().enumerate() {
            *s = *s * 0.5 + (p * 7 + i) as f32;
        }
    }

    #[test]
    fn trim_restores_the_state_after_the_kept_positions() {
        let mut long = RecurrentCache::new(3, 4);
        let mut short = RecurrentCache::new(3, 4);
        (0..10).for_each(|p| step(&mut long, p));
        (0..7).for_each(|p| step(&mut short, p));
        long.trim(3).unwrap();
        assert_eq!(long.len(), 7);
        assert_eq!(long.state(), short.state());
        // Only one more position is kept (4 were, 3 are gone).
        assert!(long.can_trim(1) && !long.can_trim(2));
        assert!(long.trim(2).is_err());
        assert_eq!(
            long.state(),
            short.state(),
            "a refused trim changes nothing"
        );
    }

    /// A pass of many positions keeps only the states its last `depth` positions need, and
    /// rolls back as one of single positions does.
    #[test]
    fn a_long_pass_keeps_only_the_last_states() {
        let (mut pass, mut single) = (RecurrentCache::new(3, 4), RecurrentCache::new(3, 4));
        for p in 0..10 {
            for (i, s) in pass.advance(9 - p).iter_mut().enumerate() {
                *s = *s * 0.5 + (p * 7 + i) as f32;
            }
            step(&mut single, p);
        }
        assert_eq!(pass.bytes(), single.bytes(), "4 states kept, not 10");
        assert!(pass.can_trim(4) && !pass.can_trim(5));
        pass.trim(4).unwrap();
        single.trim(4).unwrap();
        assert_eq!(pass.state(), single.state());
    }

    #[test]
    fn no_rollback_past_the_depth() {
        let mut cache = RecurrentCache::new(2, 2);
        (0..5).for_each(|p| step(&mut cache, p));
        assert!(cache.can_trim(2) && !cache.can_trim(3));
        assert_eq!(cache.bytes(), 4 * 2 * 3);
    }
}
