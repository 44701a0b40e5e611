//! Where experts live: the [`ExpertStore`] seam and the in-memory store.

use std::sync::Arc;

/// The experts of one MoE layer, looked up by id. `E` is the model's expert type (for the
/// llama-family blocks a gated MLP). Implementations decide where the weights live; a
/// returned `Arc` keeps the expert alive while the caller computes with it.
pub trait ExpertStore<E>: Send + Sync {
    /// Number of experts.
    fn len(&self) -> usize;
    /// True when the layer has no experts.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Expert `id` (`id < len()`), ready to compute with (a streamed store may have to read
    /// it first, and that may fail).
    fn expert(&self, id: usize) -> std::io::Result<Arc<E>>;
    /// A hint that `ids` will be asked for soon (a streamed store starts reading them); the
    /// resident store has nothing to do.
    fn prefetch(&self, _ids: &[usize]) {}
    /// A guess that `ids` will be routed to next (a streamed store may start reading them;
    /// the next [`prefetch`](Self::prefetch) drops the guesses it does not name).
    fn speculate(&self, _ids: &[usize]) {}
    /// Whether [`speculate`](Self::speculate) does anything, so that a caller computes its
    /// guesses only for a store that reads.
    fn speculates(&self) -> bool {
        false
    }
    /// Every expert, where all of them are held in memory (the resident store); `None` for a
    /// store that reads them on use.
    fn all(&self) -> Option<&[Arc<E>]> {
        None
    }
    /// Bytes of expert weights held in memory.
    fn weight_bytes(&self) -> usize;
    /// After a pass computed with experts from [`expert`](Self::expert): an error if their
    /// bytes were lost under them meanwhile (a mapped file cut short mid-read reads as zeros),
    /// so that the pass's output is thrown away. The resident store has nothing to check.
    fn verify(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Every expert in memory, loaded once.
pub struct ResidentExperts<E> {
    experts: Vec<Arc<E>>,
    bytes: usize,
}

impl<E> ResidentExperts<E> {
    /// Wraps loaded experts that occupy `bytes` of memory together.
    pub fn new(experts: Vec<E>, bytes: usize) -> Self {
        Self {
            experts: experts.into_iter().map(Arc::new).collect(),
            bytes,
        }
    }
}

impl<E: Send + Sync> ExpertStore<E> for ResidentExperts<E> {
    fn len(&self) -> usize {
        self.experts.len()
    }

    fn expert(&self, id: usize) -> std::io::Result<Arc<E>> {
        Ok(self.experts[id].clone())
    }

    fn all(&self) -> Option<&[Arc<E>]> {
        Some(&self.experts)
    }

    fn weight_bytes(&self) -> usize {
        self.bytes
    }
}

/// For each of `experts` experts, the positions routed to it and their routing weights, from
/// per-position choices `ids` / `weights` (`top_k` per position, row-major): the grouping that
/// lets a prefill run each expert once over all its tokens instead of once per token.
pub fn tokens_by_expert(
    experts: usize,
    top_k: usize,
    ids: &[usize],
    weights: &[f32],
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut groups = vec![(Vec::new(), Vec::new()); experts];
    for (i, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        if e >= experts {
            continue; // an unused slot of a row routed to fewer experts
        }
        groups[e].0.push((i / top_k) as u32);
        groups[e].1.push(w);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_group_by_expert_in_position_order() {
        // Three positions, two experts each, over four experts.
        let ids = [2, 0, 0, 3, 2, 1];
        let weights = [0.6, 0.4, 0.7, 0.3, 0.9, 0.1];
        let groups = tokens_by_expert(4, 2, &ids, &weights);
        assert_eq!(groups[0], (vec![0, 1], vec![0.4, 0.7]));
        assert_eq!(groups[1], (vec![2], vec![0.1]));
        assert_eq!(groups[2], (vec![0, 2], vec![0.6, 0.9]));
        assert_eq!(groups[3], (vec![1], vec![0.3]));
    }

    #[test]
    fn unused_slots_of_rows_routed_to_fewer_experts_are_skipped() {
        // Row 1 was routed to one expert of two: its second slot holds an id past the end.
        let groups = tokens_by_expert(4, 2, &[2, 0, 3, usize::MAX], &[0.6, 0.4, 1.0, 0.0]);
        assert_eq!(groups[3], (vec![1], vec![1.0]));
        assert_eq!(groups.iter().map(|g| g.0.len()).sum::<usize>(), 3);
    }
}
