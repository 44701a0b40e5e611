//! `trim` is exact: after appending and trimming, attention equals a cache that never saw the
//! trimmed positions; a rollback the sliding window cannot honour exactly is refused.

use peregrine_kv::{
    AttnParams, KvOptions, KvQuant, LayerCache, LayerKind, RotatingCache, SequenceCache,
    SimpleCache, TurboCache, TurboKeys, TurboOptions,
};
use peregrine_tensor::{Device, Tensor};

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
// A multiple of the smallest quantization group, so that every storage can hold these rows.
const DIM: usize = 32;

/// Deterministic pseudo-random `[1, heads, n, DIM]` tensor for positions `start..start + n`.
fn rows(heads: usize, start: usize, n: usize, salt: f32) -> Tensor {
    let data: Vec<f32> = (0..heads * n * DIM)
        .map(|i| {
            let (h, rest) = (i / (n * DIM), i % (n * DIM));
            let (p, d) = (start + rest / DIM, rest % DIM);
            ((p * 31 + d * 7 + h * 13) as f32 * 0.37 + salt).sin()
        })
        .collect();
    Tensor::from_vec(data, (1, heads, n, DIM), &Device::Cpu).unwrap()
}

fn fill(cache: &mut dyn LayerCache, from: usize, n: usize) {
    fill_salted(cache, from, n, 0.0);
}

/// [`fill`] with other contents: what a rejected draft would have written.
fn fill_salted(cache: &mut dyn LayerCache, from: usize, n: usize, salt: f32) {
    let (k, v) = (
        rows(KV_HEADS, from, n, 0.1 + salt),
        rows(KV_HEADS, from, n, 0.7 + salt),
    );
    // The queries too, as attention layers note them (TurboQuant's key scales count them).
    let q = rows(HEADS, from, n, 1.3 + salt);
    cache.note_queries(&q, KV_HEADS).unwrap();
    cache.append(&k, &v).unwrap();
}

/// Appends one position at a time, as decoding does (one big append keeps everything).
fn decode_steps(cache: &mut dyn LayerCache, n: usize) {
    for p in 0..n {
        fill(cache, p, 1);
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

/// Appends `total` positions (the last `trim` of them other contents), trims those, and
/// regenerates them and 3 more: attention then equals a cache that only saw the kept ones.
fn check_trim_is_exact(mut make: impl FnMut() -> Box<dyn LayerCache>, total: usize, trim: usize) {
    let kept = total - trim;
    let mut trimmed = make();
    for start in (0..kept).step_by(5) {
        fill(trimmed.as_mut(), start, 5.min(kept - start));
    }
    fill_salted(trimmed.as_mut(), kept, trim, 2.5);
    trimmed.trim(trim).unwrap();
    let mut fresh = make();
    fill(fresh.as_mut(), 0, kept);
    assert_eq!(trimmed.len(), fresh.len());
    // Both then take the same next positions, one at a time as decoding does.
    for p in kept..total + 3 {
        fill(trimmed.as_mut(), p, 1);
        fill(fresh.as_mut(), p, 1);
    }
    let q = rows(HEADS, total, 3, 1.3);
    let params = AttnParams::scaled(0.35);
    let diff = max_diff(
        &trimmed.attend(&q, &params).unwrap(),
        &fresh.attend(&q, &params).unwrap(),
    );
    assert!(diff < 1e-6, "trimmed cache attends differently: {diff}");
}

#[test]
fn simple_cache_trims_exactly() {
    check_trim_is_exact(|| Box::new(SimpleCache::new(None)), 23, 7);
}

#[test]
fn rotating_cache_trims_exactly_after_the_window_wrapped() {
    // 300 positions through a window of 8 (the buffer compacts several times), then roll back 4.
    check_trim_is_exact(|| Box::new(RotatingCache::new(8, 4, None)), 300, 4);
}

#[test]
fn quantized_caches_trim_exactly() {
    for bits in [4, 8] {
        let q = Some(KvQuant {
            bits,
            group_size: 32,
        });
        check_trim_is_exact(|| Box::new(SimpleCache::new(None).quantized(q)), 23, 7);
        let rotating =
            || -> Box<dyn LayerCache> { Box::new(RotatingCache::new(8, 4, None).quantized(q)) };
        check_trim_is_exact(rotating, 300, 4);
    }
}

#[test]
fn turbo_caches_trim_exactly_across_the_hot_window_and_the_threshold() {
    // Both key forms: their rows differ in size and layout.
    for keys in [TurboKeys::Mse, TurboKeys::Qjl] {
        let options = TurboOptions {
            hot_window: 8,
            threshold: 20,
            keys,
        };
        let full = || -> Box<dyn LayerCache> { Box::new(TurboCache::new(options, None, 6)) };
        check_trim_is_exact(full, 24, 5); // back below the threshold: nothing compressed again
        check_trim_is_exact(full, 100, 6); // compressed positions return to the hot window
        let narrow = TurboOptions {
            hot_window: 4,
            ..options
        };
        // A rollback past the hot window: trimmed positions had been compressed too.
        check_trim_is_exact(|| Box::new(TurboCache::new(narrow, None, 6)), 100, 6);
        let sliding = || -> Box<dyn LayerCache> { Box::new(TurboCache::new(options, Some(12), 6)) };
        check_trim_is_exact(sliding, 300, 6);
        let mut cache = TurboCache::new(options, None, 6);
        decode_steps(&mut cache, 100);
        assert!(
            !cache.can_trim(40),
            "f16 rows of the positions 40 back are gone"
        );
        assert!(cache.trim(40).is_err());
        assert_eq!(cache.len(), 100, "a refused trim changes nothing");
    }
}

#[test]
fn rotating_cache_refuses_an_inexact_rollback() {
    let mut cache = RotatingCache::new(8, 4, None);
    decode_steps(&mut cache, 300);
    assert!(!cache.can_trim(100));
    assert!(cache.trim(100).is_err());
    assert_eq!(cache.len(), 300, "a refused trim changes nothing");
}

#[test]
fn sequence_trim_is_all_or_nothing() {
    let spec = [LayerKind::Full, LayerKind::Sliding { window: 4 }];
    let mut seq = SequenceCache::new(&spec, &KvOptions::default());
    for i in 0..seq.num_layers() {
        decode_steps(seq.layer(i), 400);
    }
    assert!(
        seq.trim(300).is_err(),
        "the sliding layer no longer holds what 300 back needs"
    );
    assert_eq!(seq.len(), 400);
    seq.trim(10).unwrap();
    assert_eq!(seq.len(), 390);
}

#[test]
fn f16_storage_halves_memory_and_stays_close() {
    let mut wide = SimpleCache::new(None);
    let mut half = SimpleCache::new(Some(peregrine_tensor::DType::F16));
    fill(&mut wide, 0, 40);
    fill(&mut half, 0, 40);
    assert_eq!(half.bytes() * 2, wide.bytes());
    let q = rows(HEADS, 39, 1, 0.5);
    let p = AttnParams::scaled(0.35);
    // f16 keeps 11 significant bits: values in [-1, 1] round by at most ~5e-4.
    assert!(max_diff(&wide.attend(&q, &p).unwrap(), &half.attend(&q, &p).unwrap()) < 5e-3);
}

/// M-RoPE's position shifts travel with the cache: a shift counts from its position on, a
/// trim back past it forgets it (one at the new end is an image still held whole), and a
/// snapshot keeps it.
#[test]
fn rope_shifts_follow_trims_and_snapshots() {
    let mut cache = SequenceCache::new(&[LayerKind::Full], &KvOptions::default());
    fill(cache.layer(0), 0, 20);
    assert_eq!(cache.rope_position(19), 19, "no shift yet");
    cache.shift_rope(10, -4).unwrap();
    cache.shift_rope(15, -2).unwrap();
    assert_eq!(
        (
            cache.rope_position(9),
            cache.rope_position(10),
            cache.rope_position(16)
        ),
        (9, 6, 10)
    );
    assert!(cache.shift_rope(12, 1).is_err(), "shifts come in order");
    let copy = cache.snapshot().unwrap();
    cache.trim(5).unwrap(); // 15 held: the second image is still whole
    assert_eq!(cache.rope_position(15), 9);
    cache.trim(3).unwrap(); // 12 held: the second shift is gone, the first stays
    assert_eq!(cache.rope_position(12), 8);
    cache.trim(5).unwrap(); // 7 held: both gone
    assert_eq!(cache.rope_position(7), 7);
    assert_eq!(copy.rope_position(19), 13, "the snapshot kept both shifts");
}
