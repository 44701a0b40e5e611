//! The TurboQuant cache: identical to an f16 cache below its threshold, close to exact
//! attention above it, the same however positions arrive, exact under rollback, and at least
//! 3.5× smaller than f16 at 8K positions.

use peregrine_kv::{AttnParams, LayerCache, RotatingCache, SimpleCache, TurboCache, TurboOptions};
use peregrine_tensor::attention::AttnScratch;
use peregrine_tensor::{DType, Device, Tensor};

const KV_HEADS: usize = 2;
const HEADS: usize = 4;

/// Pseudo-random `[1, heads, n, d]` rows for positions `start..start + n`, with a few outlier
/// channels as real keys have.
fn rows(heads: usize, start: usize, n: usize, d: usize, salt: f32) -> Tensor {
    let data: Vec<f32> = (0..heads * n * d)
        .map(|i| {
            let (h, rest) = (i / (n * d), i % (n * d));
            let (p, c) = (start + rest / d, rest % d);
            let x = ((p * 131 + c * 17 + h * 7) as f32 * 0.618 + salt).sin();
            if c % 16 == 3 { 4.0 * x } else { x }
        })
        .collect();
    Tensor::from_vec(data, (1, heads, n, d), &Device::Cpu).unwrap()
}

/// Appends positions `from..from + n`, their queries (those [`queries`] gives) noted first, as
/// the attention layers do.
fn fill(cache: &mut dyn LayerCache, from: usize, n: usize, d: usize) {
    let (k, v) = (
        rows(KV_HEADS, from, n, d, 0.1),
        rows(KV_HEADS, from, n, d, 0.7),
    );
    cache
        .note_queries(&rows(HEADS, from, n, d, 1.3), KV_HEADS)
        .unwrap();
    cache.append(&k, &v).unwrap();
}

/// `fill` in chunks of `chunk` positions.
fn fill_chunked(cache: &mut dyn LayerCache, total: usize, chunk: usize, d: usize) {
    for from in (0..total).step_by(chunk) {
        fill(cache, from, chunk.min(total - from), d);
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

fn small(hot_window: usize, threshold: usize) -> TurboOptions {
    TurboOptions {
        hot_window,
        threshold,
        ..TurboOptions::default()
    }
}

/// Queries of the last `n` positions of a cache of `len`, and the attention parameters.
fn queries(len: usize, n: usize, d: usize) -> (Tensor, AttnParams) {
    let q = rows(HEADS, len - n, n, d, 1.3);
    (q, AttnParams::scaled(1.0 / (d as f64).sqrt()))
}

#[test]
fn below_the_threshold_it_is_an_f16_cache() {
    let d = 32;
    let mut turbo = TurboCache::new(small(8, 40), None, 4);
    let mut f16 = SimpleCache::new(Some(DType::F16));
    fill_chunked(&mut turbo, 40, 7, d);
    fill_chunked(&mut f16, 40, 7, d);
    let (q, p) = queries(40, 5, d);
    assert_eq!(
        max_diff(&turbo.attend(&q, &p).unwrap(), &f16.attend(&q, &p).unwrap()),
        0.0
    );
}

#[test]
fn above_the_threshold_it_stays_close_to_exact_attention() {
    let cases: [(usize, Option<usize>); 4] =
        [(64, None), (128, None), (64, Some(100)), (128, Some(48))];
    for (d, window) in cases {
        let mut turbo = TurboCache::new(small(16, 64), window, 4);
        let mut exact: Box<dyn LayerCache> = match window {
            None => Box::new(SimpleCache::new(None)),
            Some(w) => Box::new(RotatingCache::new(w, 4, None)),
        };
        fill_chunked(&mut turbo, 600, 100, d);
        fill_chunked(exact.as_mut(), 600, 100, d);
        let (q, p) = queries(600, 3, d);
        let want = exact.attend(&q, &p).unwrap();
        let got = turbo.attend(&q, &p).unwrap();
        // Outputs are convex mixtures of values of norm ~sqrt(d)/2..: a 3-bit codebook's
        // ~18 % per-row error averages down over hundreds of keys.
        let scale = want.abs().unwrap().max_keepdim(3).unwrap();
        let rel = ((&got - &want).unwrap().abs().unwrap().broadcast_div(&scale))
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            rel < 0.1,
            "d {d} window {window:?}: worst relative error {rel}"
        );
        eprintln!("d {d} window {window:?}: worst relative error {rel:.3}");
        // The decode step's row path attends as the tensor path does.
        let last = q.narrow(2, 2, 1).unwrap();
        let want = turbo.attend(&last, &p).unwrap().flatten_all().unwrap();
        let mut out = vec![0f32; HEADS * d];
        let q_row = last.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (turbo.attend_row(&q_row, d, &p, &mut out, &mut AttnScratch::default())).unwrap();
        let got = Tensor::from_vec(out, HEADS * d, &Device::Cpu).unwrap();
        assert!(max_diff(&want, &got) < 1e-6, "d {d}: row path");
    }
}

#[test]
fn chunked_and_stepwise_appends_attend_alike() {
    let d = 64;
    for window in [None, Some(48)] {
        let make = || TurboCache::new(small(16, 64), window, 4);
        let (mut chunked, mut stepped) = (make(), make());
        fill_chunked(&mut chunked, 300, 37, d);
        fill_chunked(&mut stepped, 300, 1, d);
        assert_eq!(chunked.len(), stepped.len());
        let (q, p) = queries(300, 1, d);
        let diff = max_diff(
            &chunked.attend(&q, &p).unwrap(),
            &stepped.attend(&q, &p).unwrap(),
        );
        assert!(diff < 1e-6, "window {window:?}: {diff}");
    }
}

#[test]
fn stepwise_noted_query_rows_scale_keys_as_noted_tensors_do() {
    let d = 64;
    let mut chunked = TurboCache::new(small(16, 64), None, 4);
    let mut stepped = TurboCache::new(small(16, 64), None, 4);
    fill_chunked(&mut chunked, 300, 50, d);
    for p in 0..300 {
        let row = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let q = row(rows(HEADS, p, 1, d, 1.3));
        let (k, v) = (
            row(rows(KV_HEADS, p, 1, d, 0.1)),
            row(rows(KV_HEADS, p, 1, d, 0.7)),
        );
        stepped.note_query_row(&q, d, KV_HEADS).unwrap();
        stepped.append_row(&k, &v, d).unwrap();
    }
    let (q, p) = queries(300, 2, d);
    let diff = max_diff(
        &chunked.attend(&q, &p).unwrap(),
        &stepped.attend(&q, &p).unwrap(),
    );
    assert!(diff < 1e-6, "{diff}");
}

#[test]
fn keys_are_scaled_to_the_queries_that_read_them() {
    // The keys put most of their energy in 8 of 64 channels that the queries barely read (as
    // Gemma 3's slowest RoPE pairs do). The codec spreads its error over every channel, so
    // unscaled, those channels' size sets the error the queries' other channels see.
    let d = 64;
    let loud = |c: usize| c < 8;
    let keys = |from: usize, n: usize| {
        let k = gaussian_rows(KV_HEADS, from, n, d, 1, |c| if loud(c) { 8.0 } else { 1.0 });
        (k, gaussian_rows(KV_HEADS, from, n, d, 2, |_| 1.0))
    };
    let query = |from: usize, n: usize| {
        gaussian_rows(HEADS, from, n, d, 3, |c| if loud(c) { 0.05 } else { 1.0 })
    };
    let p = AttnParams::scaled(0.25);
    let mut exact = SimpleCache::new(None);
    let (k, v) = keys(0, 600);
    exact.append(&k, &v).unwrap();
    let want = exact.attend(&query(597, 3), &p).unwrap();
    let error = |noted: bool| {
        let mut turbo = TurboCache::new(small(16, 64), None, 4);
        for from in (0..600).step_by(100) {
            if noted {
                turbo.note_queries(&query(from, 100), KV_HEADS).unwrap();
            }
            let (k, v) = keys(from, 100);
            turbo.append(&k, &v).unwrap();
        }
        let got = turbo.attend(&query(597, 3), &p).unwrap();
        let diff = (&got - &want).unwrap().abs().unwrap();
        diff.mean_all().unwrap().to_scalar::<f32>().unwrap()
    };
    let (plain, scaled) = (error(false), error(true));
    eprintln!("mean error: {plain:.4} unscaled, {scaled:.4} with keys scaled to the queries");
    assert!(scaled < 0.6 * plain, "{scaled} vs {plain}");
}

/// `[1, heads, n, d]` N(0, std(c)²) values, a function of `(seed, head, position, channel)`.
fn gaussian_rows(
    heads: usize,
    start: usize,
    n: usize,
    d: usize,
    seed: u64,
    std: impl Fn(usize) -> f32,
) -> Tensor {
    // splitmix64's finalizer of a counter: uniform in (0, 1].
    let uniform = |x: u64| {
        let mut z = x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + 1e-12
    };
    let data: Vec<f32> = (0..heads * n * d)
        .map(|i| {
            let (h, rest) = (i / (n * d), i % (n * d));
            let (p, c) = (start + rest / d, rest % d);
            let key = (((h * 1_000_003 + p) * 4096 + c) * 2) as u64;
            let (r, angle) = (uniform(key), std::f64::consts::TAU * uniform(key + 1));
            ((-2.0 * r.ln()).sqrt() * angle.cos()) as f32 * std(c)
        })
        .collect();
    Tensor::from_vec(data, (1, heads, n, d), &Device::Cpu).unwrap()
}

#[test]
fn turbo_is_at_least_3_5_times_smaller_than_f16_at_8k() {
    let d = 64;
    let mut turbo = TurboCache::new(TurboOptions::default(), None, 64);
    let mut f16 = SimpleCache::new(Some(DType::F16));
    fill_chunked(&mut turbo, 8000, 512, d);
    fill_chunked(&mut f16, 8000, 512, d);
    fill_chunked(&mut turbo, 1, 1, d); // one decode step: the hot window shrinks to its size
    // f16 holds 2 · 2 bytes per value; turbo 4.5 + 3.25 bits per value at d = 64 past the
    // 256-position hot window (and its slack).
    let f16_bytes = 8000 * KV_HEADS * d * 4;
    let ratio = f16_bytes as f64 / turbo.bytes() as f64;
    eprintln!(
        "turbo {} bytes, f16 {f16_bytes} ({ratio:.2}x)",
        turbo.bytes()
    );
    assert!(ratio >= 3.5, "{ratio:.2}x");
    assert!(f16.bytes() >= f16_bytes);
}

#[test]
fn head_dims_that_are_not_powers_of_two_are_refused_by_name() {
    let mut turbo = TurboCache::new(TurboOptions::default(), None, 4);
    let (k, v) = (rows(KV_HEADS, 0, 2, 48, 0.0), rows(KV_HEADS, 0, 2, 48, 1.0));
    let err = turbo.append(&k, &v).unwrap_err().to_string();
    assert!(err.contains("head_dim") && err.contains("48"), "{err}");
}

#[test]
fn a_shared_offset_in_keys_and_values_costs_no_accuracy() {
    // Exact attention ignores an offset shared by every key (softmax is shift-invariant) and
    // passes one shared by every value through. The codec's error grows with a row's norm, so
    // without centering on the rows' mean, an offset of 8 in 8 of 64 channels (norms ~3x)
    // would triple the error.
    let d = 64;
    let offset = |t: Tensor, o: f32| {
        let shift: Vec<f32> = (0..d).map(|c| if c % 8 == 1 { o } else { 0.0 }).collect();
        t.broadcast_add(&Tensor::from_vec(shift, d, &Device::Cpu).unwrap())
            .unwrap()
    };
    let (q, p) = queries(600, 3, d);
    let mut exact = SimpleCache::new(None);
    fill_chunked(&mut exact, 600, 100, d);
    let want = exact.attend(&q, &p).unwrap();
    let error = |o: f32| {
        let mut turbo = TurboCache::new(small(16, 64), None, 4);
        for from in (0..600).step_by(100) {
            let k = offset(rows(KV_HEADS, from, 100, d, 0.1), o);
            let v = offset(rows(KV_HEADS, from, 100, d, 0.7), o);
            turbo.append(&k, &v).unwrap();
        }
        let got = offset(turbo.attend(&q, &p).unwrap(), -o);
        max_diff(&got, &want)
    };
    let (plain, shifted) = (error(0.0), error(8.0));
    eprintln!("max error: {plain:.4} plain, {shifted:.4} with the offset");
    assert!(shifted <= 1.5 * plain, "{shifted} vs {plain}");
}

#[test]
fn the_first_positions_are_read_exact() {
    // Position 0 is an attention sink: its key points along every query of its kv head, so it
    // takes nearly all the weight, and its value is distinct. Read exact, it keeps the output
    // within the other rows' small share of the codec's error.
    let d = 64;
    let (q, p) = queries(300, 1, d);
    let q_rows = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let groups = HEADS / KV_HEADS;
    let mut sink_k = vec![0f32; KV_HEADS * d];
    for (h, row) in q_rows.chunks_exact(d).enumerate() {
        let k = &mut sink_k[h / groups * d..][..d];
        k.iter_mut().zip(row).for_each(|(k, q)| *k += 4.0 * q);
    }
    let sink_k = Tensor::from_vec(sink_k, (1, KV_HEADS, 1, d), &Device::Cpu).unwrap();
    let sink_v = (rows(KV_HEADS, 0, 1, d, 0.7) * 5.0).unwrap();
    let mut turbo = TurboCache::new(small(16, 64), None, 4);
    let mut exact = SimpleCache::new(None);
    for cache in [&mut turbo as &mut dyn LayerCache, &mut exact] {
        cache.append(&sink_k, &sink_v).unwrap();
        fill(cache, 1, 299, d);
    }
    let (want, got) = (exact.attend(&q, &p).unwrap(), turbo.attend(&q, &p).unwrap());
    let err = max_diff(&want, &got);
    eprintln!("sink: max error {err:.4}");
    assert!(err < 0.05, "{err}");
}

#[test]
fn sliding_layers_within_the_threshold_stay_f16_and_wider_ones_compress() {
    use peregrine_kv::{KvOptions, LayerKind, SequenceCache};
    let d = 64;
    let kv = KvOptions {
        turbo: Some(small(16, 64)),
        ..KvOptions::default()
    };
    // Windows 64 (= the threshold: never holds more, nothing to compress) and 100 (compresses).
    let spec = [
        LayerKind::Sliding { window: 64 },
        LayerKind::Sliding { window: 100 },
    ];
    let mut seq = SequenceCache::new(&spec, &kv);
    for (i, window) in [64, 100].into_iter().enumerate() {
        let mut f16 = RotatingCache::new(window, 64, Some(DType::F16));
        fill_chunked(seq.layer(i), 600, 100, d);
        fill_chunked(&mut f16, 600, 100, d);
        let (q, p) = queries(600, 3, d);
        let diff = max_diff(
            &seq.layer(i).attend(&q, &p).unwrap(),
            &f16.attend(&q, &p).unwrap(),
        );
        match window {
            64 => assert_eq!(diff, 0.0, "window 64 reads as f16"),
            _ => assert!(diff > 0.0, "window 100 reads compressed keys"),
        }
    }
}
