//! The prompt cache: the KV caches of recent sequences, kept after their requests end, so that
//! a prompt sharing a token prefix with one of them prefills only what follows the prefix (a
//! chat's next turn resends the whole conversation; agents resend long system prompts).
//!
//! Entries are whole [`SequenceCache`]s with the token ids they hold. A lookup takes the entry
//! with the longest common prefix: when the new prompt extends it, the entry itself (it is
//! superseded); otherwise a copy trimmed back to the prefix, exactly ([`SequenceCache::trim`];
//! a sliding-window cache that cannot roll back that far is a miss). Least recently used
//! entries go first when the count or byte cap would be passed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use peregrine_models::{KvOptions, SequenceCache};

/// A reused prefix shorter than this is not worth a cache copy.
const MIN_REUSE: usize = 16;

/// Recent sequences' caches, reused by token prefix.
pub(crate) struct PromptCache {
    max_entries: usize,
    max_bytes: usize,
    state: Mutex<State>,
    hits: AtomicU64,
    misses: AtomicU64,
    reused_tokens: AtomicU64,
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    /// Use counter: an entry's `used` is the counter when it was last stored or read.
    clock: u64,
}

struct Entry {
    ids: Vec<u32>,
    cache: SequenceCache,
    /// How the cache stores KV: only a request asking for the same reuses it.
    kv: KvOptions,
    used: u64,
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Lookups that reused a prefix.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Prompt tokens not prefilled thanks to the cache, over all hits.
    pub reused_tokens: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes the entries' caches hold now.
    pub bytes: usize,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    /// A cache of at most `max_entries` sequences and `max_bytes` of KV (0 entries: off).
    pub(crate) fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            max_entries,
            max_bytes,
            state: Mutex::new(State::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            reused_tokens: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cache holding the longest prefix of `ids` that an entry shares (at most all but the
    /// last id, whose logits the caller needs), with its length; `None` when no entry shares
    /// [`MIN_REUSE`] ids or more.
    #[cfg(test)]
    pub(crate) fn lookup(
        &self,
        ids: &[u32],
        kv: &KvOptions,
        moe_top_k: Option<usize>,
    ) -> Option<(SequenceCache, usize)> {
        self.lookup_within(ids, kv, moe_top_k, &|n| n)
    }

    /// [`lookup`](Self::lookup) reusing at most `limit(n)` ids of a prefix of `n` shared ones
    /// (a prompt with images stops before a run of image tokens it would cut).
    pub(crate) fn lookup_within(
        &self,
        ids: &[u32],
        kv: &KvOptions,
        moe_top_k: Option<usize>,
        limit: &dyn Fn(usize) -> usize,
    ) -> Option<(SequenceCache, usize)> {
        if self.max_entries == 0 {
            return None;
        }
        let found = self.find(ids, kv, moe_top_k, limit);
        let counter = match found {
            Some((_, n)) => {
                self.reused_tokens.fetch_add(n as u64, Ordering::Relaxed);
                &self.hits
            }
            None => &self.misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    fn find(
        &self,
        ids: &[u32],
        kv: &KvOptions,
        moe_top_k: Option<usize>,
        limit: &dyn Fn(usize) -> usize,
    ) -> Option<(SequenceCache, usize)> {
        let mut state = self.state();
        let wanted = ids.len().saturating_sub(1);
        // Longest shared prefix first; among equals, the shortest entry (the least to trim).
        let mut order: Vec<(usize, usize)> = (state.entries.iter().enumerate())
            // Keys computed under other storage or routing are not this request's.
            .filter(|(_, e)| e.kv == *kv && e.cache.moe_top_k() == moe_top_k)
            .map(|(i, e)| (limit(common_prefix(&e.ids, ids).min(wanted)), i))
            .filter(|&(n, _)| n >= MIN_REUSE)
            .collect();
        order.sort_by_key(|&(n, i)| (std::cmp::Reverse(n), state.entries[i].ids.len()));
        for (n, i) in order {
            let entry = &state.entries[i];
            let excess = entry.ids.len() - n;
            if excess == 0 {
                // The prompt extends the entry: take it; the finished request stores its successor.
                return Some((state.entries.swap_remove(i).cache, n));
            }
            let Ok(mut cache) = entry.cache.snapshot() else {
                continue;
            };
            if cache.trim(excess).is_ok() {
                state.clock += 1;
                state.entries[i].used = state.clock;
                return Some((cache, n));
            }
        }
        None
    }

    /// Keeps `cache`, which holds `ids`, dropping entries it extends and then the least
    /// recently used ones beyond the caps.
    pub(crate) fn store(&self, ids: Vec<u32>, cache: SequenceCache, kv: KvOptions) {
        if self.max_entries == 0 || ids.len() < MIN_REUSE || cache.bytes() > self.max_bytes {
            return;
        }
        let mut state = self.state();
        state
            .entries
            .retain(|e| e.kv != kv || common_prefix(&e.ids, &ids) < e.ids.len());
        state.clock += 1;
        let used = state.clock;
        state.entries.push(Entry {
            ids,
            cache,
            kv,
            used,
        });
        let bytes = |s: &State| s.entries.iter().map(|e| e.cache.bytes()).sum::<usize>();
        while state.entries.len() > self.max_entries || bytes(&state) > self.max_bytes {
            let oldest = (state.entries.iter().enumerate())
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
                .expect("not empty: the new entry is there");
            state.entries.swap_remove(oldest);
        }
    }

    /// Counters and sizes now.
    pub(crate) fn stats(&self) -> PromptCacheStats {
        let state = self.state();
        PromptCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            reused_tokens: self.reused_tokens.load(Ordering::Relaxed),
            entries: state.entries.len(),
            bytes: state.entries.iter().map(|e| e.cache.bytes()).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_models::{KvOptions, LayerKind};
    use peregrine_tensor::{Device, Tensor};

    /// A one-layer cache holding `n` positions appended one at a time, as decoding does
    /// (their values do not matter here).
    fn cache_of(kind: LayerKind, n: usize) -> SequenceCache {
        let mut c = SequenceCache::new(&[kind], &KvOptions::default());
        let kv = Tensor::ones((1, 1, 1, 4), peregrine_tensor::DType::F32, &Device::Cpu).unwrap();
        for _ in 0..n {
            c.layer(0).append(&kv, &kv).unwrap();
        }
        c
    }

    fn ids(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn reuses_the_longest_prefix_trimmed_exactly() {
        let pc = PromptCache::new(4, usize::MAX);
        pc.store(
            ids(0..40),
            cache_of(LayerKind::Full, 40),
            KvOptions::default(),
        );
        pc.store(
            ids(100..140),
            cache_of(LayerKind::Full, 40),
            KvOptions::default(),
        );
        // Shares 30 ids with the first entry, then diverges.
        let prompt: Vec<u32> = ids(0..30).into_iter().chain([999, 998]).collect();
        let (cache, n) = pc
            .lookup(&prompt, &KvOptions::default(), None)
            .expect("a hit");
        assert_eq!((n, cache.len()), (30, 30));
        // The entry stays whole for prompts that share more of it.
        assert_eq!(pc.stats().entries, 2);
        let (cache, n) = pc
            .lookup(&ids(0..41), &KvOptions::default(), None)
            .expect("a hit");
        assert_eq!(
            (n, cache.len()),
            (40, 40),
            "an extension takes the entry itself"
        );
        assert_eq!(pc.stats().entries, 1);
        // The whole prompt cached: all but its last id are reused, to compute its logits.
        pc.store(
            ids(0..40),
            cache_of(LayerKind::Full, 40),
            KvOptions::default(),
        );
        let (cache, n) = pc.lookup(&ids(0..40), &KvOptions::default(), None).unwrap();
        assert_eq!((n, cache.len()), (39, 39));
        let stats = pc.stats();
        assert_eq!((stats.hits, stats.misses, stats.reused_tokens), (3, 0, 109));
    }

    #[test]
    fn misses_short_prefixes_and_rollbacks_a_window_cannot_make() {
        let pc = PromptCache::new(4, usize::MAX);
        pc.store(
            ids(0..40),
            cache_of(LayerKind::Full, 40),
            KvOptions::default(),
        );
        assert!(
            pc.lookup(&ids(0..MIN_REUSE as u32 - 1), &KvOptions::default(), None)
                .is_none()
        );
        let quantized = KvOptions {
            quant: Some(peregrine_models::KvQuant {
                bits: 8,
                group_size: 32,
            }),
            ..KvOptions::default()
        };
        assert!(
            pc.lookup(&ids(0..41), &quantized, None).is_none(),
            "a request storing KV another way does not reuse the entry"
        );
        assert!(
            pc.lookup(&ids(0..41), &KvOptions::default(), Some(1))
                .is_none(),
            "a request routing to other experts does not reuse the entry"
        );
        let mut routed = cache_of(LayerKind::Full, 40);
        routed.set_moe_top_k(Some(1));
        pc.store(ids(100..140), routed, KvOptions::default());
        assert!(
            pc.lookup(&ids(100..141), &KvOptions::default(), None)
                .is_none()
        );
        let (cache, _) = (pc.lookup(&ids(100..141), &KvOptions::default(), Some(1)))
            .expect("the same routing reuses it");
        assert_eq!(cache.moe_top_k(), Some(1));
        let window = LayerKind::Sliding { window: 4 };
        let pc = PromptCache::new(4, usize::MAX);
        pc.store(ids(0..1000), cache_of(window, 1000), KvOptions::default());
        // Rolling 1000 positions back to 20 passes what the window cache keeps.
        assert!(
            pc.lookup(&ids(0..21), &KvOptions::default(), None)
                .is_none()
        );
        assert_eq!(pc.stats().misses, 1);
        // Extending it needs no rollback.
        assert!(
            pc.lookup(&ids(0..1001), &KvOptions::default(), None)
                .is_some()
        );
    }

    #[test]
    fn a_newer_prompt_replaces_what_it_extends_and_caps_evict_the_oldest() {
        let pc = PromptCache::new(2, usize::MAX);
        pc.store(
            ids(0..20),
            cache_of(LayerKind::Full, 20),
            KvOptions::default(),
        );
        pc.store(
            ids(0..30),
            cache_of(LayerKind::Full, 30),
            KvOptions::default(),
        );
        assert_eq!(pc.stats().entries, 1, "0..30 extends 0..20");
        pc.store(
            ids(100..130),
            cache_of(LayerKind::Full, 30),
            KvOptions::default(),
        );
        pc.lookup(&ids(0..25), &KvOptions::default(), None).unwrap(); // 0..30 is now the most recently used
        pc.store(
            ids(200..230),
            cache_of(LayerKind::Full, 30),
            KvOptions::default(),
        );
        assert!(
            pc.lookup(&ids(100..125), &KvOptions::default(), None)
                .is_none(),
            "the least recently used went"
        );
        assert!(
            pc.lookup(&ids(0..25), &KvOptions::default(), None)
                .is_some()
        );
        let one = cache_of(LayerKind::Full, 30).bytes();
        let pc = PromptCache::new(8, 2 * one);
        for start in [0, 100, 200] {
            pc.store(
                ids(start..start + 30),
                cache_of(LayerKind::Full, 30),
                KvOptions::default(),
            );
        }
        assert_eq!(pc.stats().bytes, 2 * one, "the byte cap holds");
        assert_eq!(
            PromptCache::new(0, usize::MAX)
                .lookup(&ids(0..30), &KvOptions::default(), None)
                .map(|x| x.1),
            None
        );
    }

    /// A recurrent layer's entry is reused where the prompt departs within the state's
    /// rollback depth (8 by default: a chat's next turn departs at the reply's last tokens),
    /// with the state as it was at that position; further back the entry is no use (a miss,
    /// the entry kept).
    #[test]
    fn recurrent_entries_are_reused_within_their_rollback_depth() {
        let recurrent = |n: usize| {
            let kind = LayerKind::Recurrent { state: 1 };
            let mut c = SequenceCache::new(&[kind], &KvOptions::default());
            for p in 0..n {
                c.layer(0).recurrent().unwrap().advance(0)[0] = p as f32;
            }
            c
        };
        let pc = PromptCache::new(4, usize::MAX);
        pc.store(ids(0..40), recurrent(40), KvOptions::default());
        let mut prompt = ids(0..35);
        prompt.extend(500..510);
        let (mut cache, n) = pc
            .lookup(&prompt, &KvOptions::default(), None)
            .expect("a hit");
        assert_eq!((n, cache.len()), (35, 35));
        let state = cache.layer(0).recurrent().unwrap().state()[0];
        assert_eq!(state, 34.0, "the state after position 34");
        let mut far = ids(0..20);
        far.extend(500..510);
        assert!(pc.lookup(&far, &KvOptions::default(), None).is_none());
        assert_eq!(pc.stats().entries, 1);
    }
}
