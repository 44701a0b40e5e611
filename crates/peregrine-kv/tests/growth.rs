//! A sliding-window cache grows with its contents until the window fills (a short prompt must
//! not allocate and zero a whole window per layer), and attends the same across every regrowth
//! and compaction as a cache that took all positions in one append.

use peregrine_kv::{AttnParams, LayerCache, RotatingCache};
use peregrine_tensor::{Device, Tensor};

const HEADS: usize = 2;
const DIM: usize = 8;
const WINDOW: usize = 600;

fn rows(start: usize, n: usize, salt: f32) -> Tensor {
    let data: Vec<f32> = (0..HEADS * n * DIM)
        .map(|i| {
            let (h, rest) = (i / (n * DIM), i % (n * DIM));
            ((start + rest / DIM) as f32 * 0.13 + (rest % DIM + 3 * h) as f32 * 0.7 + salt).sin()
        })
        .collect();
    Tensor::from_vec(data, (1, HEADS, n, DIM), &Device::Cpu).unwrap()
}

fn fill(cache: &mut RotatingCache, from: usize, n: usize) {
    let (k, v) = (rows(from, n, 0.1), rows(from, n, 0.9));
    cache.append(&k, &v).unwrap();
}

/// Bytes of `slots` positions of k and v.
fn slot_bytes(slots: usize) -> usize {
    2 * HEADS * slots * DIM * 4
}

#[test]
fn sliding_cache_grows_with_its_contents() {
    let mut cache = RotatingCache::new(WINDOW, 0, None);
    fill(&mut cache, 0, 40);
    assert_eq!(
        cache.bytes(),
        slot_bytes(256),
        "40 positions take one growth step"
    );
    fill(&mut cache, 40, 300);
    assert_eq!(cache.bytes(), slot_bytes(512));
    // Past the window, room for two windows so that compaction is rare.
    fill(&mut cache, 340, 400);
    assert!(
        cache.bytes() >= slot_bytes(2 * (WINDOW - 1)),
        "{}",
        cache.bytes()
    );
}

#[test]
fn sliding_cache_attends_the_same_across_regrowth() {
    let params = AttnParams::scaled(0.35);
    let mut grown = RotatingCache::new(WINDOW, 0, None);
    let mut end = 0;
    for chunk in [40, 1, 200, 300, 1, 1, 500, 37, 700] {
        fill(&mut grown, end, chunk);
        end += chunk;
        let mut whole = RotatingCache::new(WINDOW, 0, None);
        fill(&mut whole, 0, end);
        let q = rows(end - chunk, chunk, 1.7);
        let (a, b) = (
            grown.attend(&q, &params).unwrap(),
            whole.attend(&q, &params).unwrap(),
        );
        let diff = peregrine_tensor::ops::max_abs_diff(&a, &b).unwrap();
        assert!(diff < 1e-6, "after {end} positions: {diff}");
    }
}
