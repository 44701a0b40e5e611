//! Helpers shared by the golden tests.

use peregrine_models::{CausalLm, KvOptions, Logits, SequenceCache};

/// The greedy continuation of `prompt`, `n` tokens long, decoded one token at a time.
pub fn greedy_ids(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let mut next = prompt.to_vec();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let logits = model.forward(&next, &mut cache, Logits::Last).unwrap();
        let id = logits
            .squeeze(0)
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        out.push(id);
        next = vec![id];
    }
    out
}
