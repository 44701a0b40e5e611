//! Helpers shared by the golden tests.

use peregrine_models::{CausalLm, KvOptions, Logits, SequenceCache};

/// The greedy continuation of `prompt`, `n` tokens long: the prompt through `forward`, then
/// one token at a time through `decode`, as generation runs.
pub fn greedy_ids(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = SequenceCache::new(&model.cache_spec(), &KvOptions::default());
    let logits = model.forward(prompt, &mut cache, Logits::Last).unwrap();
    let mut logits = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        out.push(id);
        if out.len() < n {
            model.decode(id, &mut cache, &mut logits).unwrap();
        }
    }
    out
}
