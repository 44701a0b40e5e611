//! The codec's tests: rotation, codebook, unbiasedness, value sums, sizes, SIMD vs scalar.

use super::*;

fn gaussian(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v);
    v
}

fn norm(x: &[f32]) -> f32 {
    dot(x, x).sqrt()
}

fn dist(a: &[f32], b: &[f32]) -> f32 {
    let d: Vec<f32> = a.iter().zip(b).map(|(a, b)| a - b).collect();
    norm(&d)
}

/// Largest elementwise difference.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |m, (a, b)| m.max((a - b).abs()))
}

#[test]
fn rotation_is_orthonormal() {
    let mut rng = SplitMix64(1);
    for d in [16, 128, 1024] {
        let codec = TurboCodec::new(d, 7, TurboKeys::Qjl).unwrap();
        let x = gaussian(&mut rng, d);
        let mut y = x.clone();
        codec.rotate(&mut y);
        // 2·log2(d) f32 butterfly stages on unit-variance entries: errors ~1e-6, 1e-5 is ample.
        assert!(
            (norm(&y) - norm(&x)).abs() <= 1e-5 * norm(&x),
            "d {d}: norm"
        );
        let mut other = x.clone();
        TurboCodec::new(d, 8, TurboKeys::Qjl)
            .unwrap()
            .rotate(&mut other);
        assert!(max_diff(&other, &y) > 1e-3, "d {d}: the seed is unused");
        codec.unrotate(&mut y);
        assert!(max_diff(&x, &y) <= 1e-5, "d {d}: R⁻¹R ≠ 1");
        // A basis vector spreads to ±1/sqrt(d) everywhere: the Hadamard really mixes.
        let mut e = vec![0.0; d];
        e[d / 2 + 1] = 1.0;
        codec.rotate(&mut e);
        let unit = 1.0 / (d as f32).sqrt();
        assert!(e.iter().all(|y| (y.abs() - unit).abs() <= 1e-6), "d {d}");
    }
}

/// Mean `||u − û||²` over `rows` random unit vectors of `d`, `û` as `round_trip` gives it.
fn distortion(
    rng: &mut SplitMix64,
    d: usize,
    rows: usize,
    mut round_trip: impl FnMut(&[f32], &mut [f32]),
) -> f32 {
    let (mut u_hat, mut total) = (vec![0.0; d], 0.0);
    for _ in 0..rows {
        let mut u = gaussian(rng, d);
        let n = norm(&u);
        u.iter_mut().for_each(|x| *x /= n);
        round_trip(&u, &mut u_hat);
        total += dist(&u, &u_hat).powi(2);
    }
    total / rows as f32
}

#[test]
fn codebook_is_lloyd_max() {
    for d in [16, 64, 128, 1024] {
        let (c, _) = codebook(d);
        assert!(c.windows(2).all(|w| w[0] < w[1]), "d {d}: unsorted {c:?}");
        // The grid is symmetric about 0, so only rounding separates ±c.
        let asym = (0..4).map(|i| (c[i] + c[7 - i]).abs()).fold(0.0, f32::max);
        assert!(asym <= 1e-6 * c[7], "d {d}: {c:?}");
    }
    // d = 1024: the coordinate is N(0, 1/d) up to O(1/d); Max's (1960) 3-bit Gaussian levels.
    let (c, _) = codebook(1024);
    for (i, g) in [0.2451, 0.7560, 1.3440, 2.1520].iter().enumerate() {
        let got = c[4 + i] * 32.0;
        assert!((got - g).abs() <= 0.02 * g, "level {i}: {got} vs {g}");
    }
    // The 16 key levels: Max's 4-bit Gaussian ones at d = 1024, sorted and symmetric at all d.
    for d in [16, 64, 1024] {
        let (c, _) = codebook16(d);
        assert!(c.windows(2).all(|w| w[0] < w[1]), "d {d}: unsorted {c:?}");
        let asym = (0..8).map(|i| (c[i] + c[15 - i]).abs()).fold(0.0, f32::max);
        assert!(asym <= 1e-6 * c[15], "d {d}: {c:?}");
    }
    let (c, _) = codebook16(1024);
    let max_1960 = [
        0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326,
    ];
    for (i, g) in max_1960.iter().enumerate() {
        let got = c[8 + i] * 32.0;
        assert!((got - g).abs() <= 0.02 * g, "4-bit level {i}: {got} vs {g}");
    }
    // Distortion E||u − û||² of random unit vectors; the paper's b = 3 figure is ≈0.03 and
    // the Gaussian Lloyd–Max MSE 0.0345. 400 vectors put the mean within ~1e-3.
    let (d, rows) = (128, 400);
    let codec = TurboCodec::new(d, 3, TurboKeys::Qjl).unwrap();
    let mut rng = SplitMix64(2);
    let mut bytes = vec![0; codec.value_bytes()];
    let mse = distortion(&mut rng, d, rows, |u, u_hat| {
        codec.encode_values(u, &mut bytes);
        codec.decode_value(&bytes, u_hat);
    });
    eprintln!("d {d}: E||u - û||² = {mse:.5}");
    assert!((0.025..=0.04).contains(&mse), "distortion {mse}");
    // The distortion the estimator's weights are computed from is the one measured.
    let computed = codebook(d).1 as f32;
    assert!(
        (mse - computed).abs() <= 2e-3,
        "computed {computed} vs measured {mse}"
    );
    // The same for 4-bit keys (the Gaussian 4-bit figure is 0.0095; their per-row scale moves
    // it by ~2e-4), at d = 64, which keeps no exact outliers.
    let d = 64;
    let codec = TurboCodec::new(d, 3, TurboKeys::Mse).unwrap();
    let mut bytes = vec![0; codec.key_bytes()];
    let mse = distortion(&mut rng, d, rows, |u, u_hat| {
        codec.encode_keys(u, &mut bytes);
        codec.decode_key_mse(&bytes, u_hat);
    });
    let computed = codebook16(d).1 as f32;
    eprintln!("d {d}: 4-bit E||u - û||² = {mse:.5}, computed {computed:.5}");
    assert!((0.007..=0.012).contains(&mse), "4-bit distortion {mse}");
    assert!(
        (mse - computed).abs() <= 1e-3,
        "computed {computed} vs measured {mse}"
    );
}

/// Mean over `trials` codecs (seeds) of each pair's estimate: the QJL form's (blended), its
/// MSE part alone, and the 4-bit form's; and the mean squared errors of the blend, the paper's
/// estimate (weights 1 and 1) and the 4-bit form.
fn bias_check(d: usize, trials: u64) {
    let mut rng = SplitMix64(100 + d as u64);
    // `lean` ≠ 0 makes `<q, k>` large, where the MSE quantizer's shrinkage shows.
    let pairs: [(Vec<f32>, Vec<f32>); 4] = [0.0, 0.0, 1.0, -0.8].map(|lean| {
        let (q, e) = (gaussian(&mut rng, d), gaussian(&mut rng, d));
        let k: Vec<f32> = q.iter().zip(e).map(|(q, e)| 2.0 * (lean * q + e)).collect();
        (q, k)
    });
    let key_bytes = TurboCodec::new(d, 0, TurboKeys::Qjl).unwrap().key_bytes();
    let (mut pq, mut key, mut k_hat) = (PreparedQuery::default(), vec![0; key_bytes], vec![0.0; d]);
    let (mut pq4, mut key4) = (PreparedQuery::default(), vec![0; key_bytes - 2]);
    // Per pair: Σ and Σ² of the blended, the MSE-only and the 4-bit estimates, and Σ error²
    // of the blended, the paper's and the 4-bit ones.
    let mut stats = [[0f64; 9]; 4];
    for seed in 0..trials {
        let codec = TurboCodec::new(d, seed, TurboKeys::Qjl).unwrap();
        let paper = TurboCodec {
            mse_weight: 1.0,
            qjl_weight: 1.0,
            ..codec.clone()
        };
        let four = TurboCodec::new(d, seed, TurboKeys::Mse).unwrap();
        for ((q, k), st) in pairs.iter().zip(&mut stats) {
            let (mut s, mut sp, mut s4) = ([0.0], [0.0], [0.0]);
            codec.encode_keys(k, &mut key);
            codec.prepare_query(q, &mut pq);
            codec.scores(&pq, &key, 1.0, &mut s);
            paper.scores(&pq, &key, 1.0, &mut sp);
            four.encode_keys(k, &mut key4);
            four.prepare_query(q, &mut pq4);
            four.scores(&pq4, &key4, 1.0, &mut s4);
            codec.decode_key_mse(&key, &mut k_hat);
            let (s, m, s4) = (f64::from(s[0]), f64::from(dot(q, &k_hat)), f64::from(s4[0]));
            let (truth, sp) = (f64::from(dot(q, k)), f64::from(sp[0]));
            for (i, x) in [s, m, s4].into_iter().enumerate() {
                st[2 * i] += x;
                st[2 * i + 1] += x * x;
            }
            for (i, x) in [s, sp, s4].into_iter().enumerate() {
                st[6 + i] += (x - truth).powi(2);
            }
        }
    }
    let t = trials as f64;
    let stderr = |sum: f64, sq: f64| ((sq / t - (sum / t).powi(2)).max(0.0) / t).sqrt();
    for (i, ((q, k), st)) in pairs.iter().zip(&stats).enumerate() {
        let truth = f64::from(dot(q, k));
        let [bias, mse_bias, four_bias] = [0, 2, 4].map(|j| st[j] / t - truth);
        let [se, mse_se, four_se] = [0, 2, 4].map(|j| stderr(st[j], st[j + 1]));
        eprintln!(
            "d {d} pair {i}: <q,k> {truth:.3}, turbo bias {bias:+.4} (se {se:.4}), \
             MSE-only bias {mse_bias:+.4} (se {mse_se:.4}), 4-bit bias {four_bias:+.4} \
             (se {four_se:.4})"
        );
        // 4 standard errors: a false alarm has probability ~6e-5. `tiny` covers the f16
        // norms: ||k|| to 2^-11 relative, a fixed offset per pair, and γ to 2^-11 on a QJL
        // term of at most ~0.2·||q||·||k||.
        let tiny = 5e-4 * truth.abs() + 1e-4 * f64::from(norm(q) * norm(k));
        assert!(bias.abs() <= 4.0 * se + tiny, "d {d} pair {i}: biased");
        // The 4-bit form's rescaling takes out its shrinkage (over random-sign Hadamard
        // rotations as over Haar ones, to within the test's resolution).
        assert!(
            four_bias.abs() <= 4.0 * four_se + tiny,
            "d {d} pair {i}: 4-bit biased"
        );
        // The contrast: the same test rejects the MSE-only estimate where <q, k> is large.
        let rejected = mse_bias.abs() > 4.0 * mse_se + tiny;
        assert!(i < 2 || rejected, "d {d} pair {i}: MSE-only unbiased?");
        // The blend's mean squared error is 40-56 % of the paper's (~60 % predicted by
        // `estimator_weights`, which bounds QJL's variance from below); 2000
        // trials measure each within ~5 %.
        let ratio = st[6] / st[7];
        // The 4-bit form's: 0.40-0.46 of the blend's for independent q and k (D₄ ≈ 0.0095
        // against a blend that measures below its bound, ~0.6 · π/2 · D₃ = 0.033), and
        // 0.17-0.23 where k leans on q: EDEN's per-row scale is exact along k (a fixed
        // 1 / (1 − D₄) measured 0.54-0.59 there).
        let four = st[8] / st[6];
        eprintln!("d {d} pair {i}: blended / paper {ratio:.3}, 4-bit / blended {four:.3}");
        assert!(
            ratio < 0.75,
            "d {d} pair {i}: the blend is no better ({ratio})"
        );
        assert!(four < 0.6, "d {d} pair {i}: 4 bits no better ({four})");
        assert!(
            i < 2 || four < 0.35,
            "d {d} pair {i}: not exact along k ({four})"
        );
    }
}

#[test]
fn scores_are_unbiased_d64() {
    bias_check(64, 2000);
}

#[test]
fn scores_are_unbiased_d128() {
    bias_check(128, 2000);
}

#[test]
fn values_round_trip() {
    let (d, rows) = (128, 37);
    let codec = TurboCodec::new(d, 11, TurboKeys::Qjl).unwrap();
    let mut rng = SplitMix64(5);
    let mut v = gaussian(&mut rng, rows * d);
    for (j, row) in v.chunks_exact_mut(d).enumerate() {
        row.iter_mut().for_each(|x| *x *= 0.1 + j as f32 * 0.3);
    }
    let p: Vec<f32> = (0..rows).map(|_| rng.uniform() as f32).collect();
    let vb = codec.value_bytes();
    let mut bytes = vec![0; rows * vb];
    codec.encode_values(&v, &mut bytes);
    // Two calls over the halves accumulate like one over all rows.
    let (mut acc, half) = (vec![0.0; d], rows / 2);
    codec.accumulate_values(&p[..half], &bytes[..half * vb], &mut acc);
    codec.accumulate_values(&p[half..], &bytes[half * vb..], &mut acc);
    codec.finish_values(&mut acc);
    let (mut expected, mut row, mut errs) = (vec![0.0; d], vec![0.0; d], Vec::new());
    for ((b, pj), v) in bytes.chunks_exact(vb).zip(&p).zip(v.chunks_exact(d)) {
        codec.decode_value(b, &mut row);
        expected
            .iter_mut()
            .zip(&row)
            .for_each(|(e, x)| *e += pj * x);
        errs.push(dist(v, &row) / norm(v));
    }
    // Same sum in another order and domain: f32 rounding, ~1e-6 of the sum's norm.
    assert!(max_diff(&acc, &expected) <= 1e-4 * norm(&expected));
    // Relative error ≈ sqrt(0.0345) = 0.186 on average, rows spread by ~0.015; the outer cell
    // is unbounded, and one row here (seeded) has a 4.9σ coordinate that lifts it to 0.30.
    let mean = errs.iter().sum::<f32>() / rows as f32;
    let worst = errs.iter().fold(0f32, |a, &b| a.max(b));
    eprintln!("decode_value relative error: mean {mean:.4}, worst {worst:.4}");
    assert!(mean <= 0.2 && worst <= 0.35, "mean {mean}, worst {worst}");
    // A zero row is all-zero bytes and decodes, scores and sums to zero.
    let mut zero = vec![1; codec.key_bytes()];
    codec.encode_keys(&vec![0.0; d], &mut zero);
    assert!(zero.iter().all(|&b| b == 0));
    codec.decode_value(&zero[..vb], &mut row);
    assert!(row.iter().all(|&x| x == 0.0));
    let (mut pq, mut s) = (PreparedQuery::default(), [1.0]);
    codec.prepare_query(&v[..d], &mut pq);
    codec.scores(&pq, &zero, 1.0, &mut s);
    assert_eq!(s[0], 0.0);
}

#[test]
fn sizes_errors_and_seeds() {
    for (d, kb, vb) in [(64, 36, 26), (128, 80, 50), (256, 180, 98), (512, 324, 194)] {
        let c = TurboCodec::new(d, 0, TurboKeys::Qjl).unwrap();
        assert_eq!((c.key_bytes(), c.value_bytes(), c.head_dim()), (kb, vb, d));
        // The 4-bit form has no γ.
        let c = TurboCodec::new(d, 0, TurboKeys::Mse).unwrap();
        assert_eq!((c.key_bytes(), c.value_bytes()), (kb - 2, vb));
    }
    for d in [8, 96, 2048, 0] {
        let err = TurboCodec::new(d, 0, TurboKeys::Qjl)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("head_dim") && err.contains("power of two"),
            "{err}"
        );
    }
    let k = gaussian(&mut SplitMix64(9), 3 * 64);
    let encode = |seed| {
        let mut out = vec![0; 3 * 36];
        TurboCodec::new(64, seed, TurboKeys::Qjl)
            .unwrap()
            .encode_keys(&k, &mut out);
        out
    };
    assert_eq!(encode(4), encode(4));
    assert_ne!(encode(4), encode(5));
}

#[test]
fn avx2_matches_scalar() {
    if !simd_available() {
        eprintln!("no AVX2+FMA: nothing to compare");
        return;
    }
    let (mut rng, rows, scale) = (SplitMix64(21), 45, 0.125);
    let forms = [TurboKeys::Qjl, TurboKeys::Mse];
    for (d, keys) in [16, 32, 64, 128, 256]
        .into_iter()
        .flat_map(|d| forms.map(|f| (d, f)))
    {
        let simd = TurboCodec::new(d, d as u64, keys).unwrap();
        assert!(simd.simd);
        let scalar = TurboCodec {
            simd: false,
            ..simd.clone()
        };
        let mut k = gaussian(&mut rng, rows * d);
        for (j, row) in k.chunks_exact_mut(d).enumerate() {
            row.iter_mut().for_each(|x| *x *= 1.0 + j as f32);
        }
        let mut keys = vec![0; rows * simd.key_bytes()];
        let mut values = vec![0; rows * simd.value_bytes()];
        simd.encode_keys(&k, &mut keys);
        simd.encode_values(&k, &mut values);
        // 5 query heads: the grouped kernels run a group of 4 and one of 1.
        let heads = 5;
        let qs: Vec<Vec<f32>> = (0..heads).map(|_| gaussian(&mut rng, d)).collect();
        let pqs: Vec<PreparedQuery> = (qs.iter())
            .map(|q| {
                let mut pq = PreparedQuery::default();
                simd.prepare_query(q, &mut pq);
                pq
            })
            .collect();
        let (mut a, mut b) = (vec![0.0; heads * rows], vec![0.0; heads * rows]);
        simd.scores_grouped(&pqs, &keys, scale, &mut a);
        for (pq, b) in pqs.iter().zip(b.chunks_exact_mut(rows)) {
            scalar.scores(pq, &keys, scale, b);
        }
        // Relative to the terms' size scale·||q||·||k||: both sums cancel, in another order.
        for (h, q) in qs.iter().enumerate() {
            let (a, b) = (&a[h * rows..][..rows], &b[h * rows..][..rows]);
            for ((a, b), k) in a.iter().zip(b).zip(k.chunks_exact(d)) {
                let tol = 1e-5 * (b.abs() + scale * norm(q) * norm(k));
                assert!(
                    (a - b).abs() <= tol,
                    "d {d} {keys:?} head {h}: score {a} vs {b}"
                );
            }
        }
        let p: Vec<f32> = (0..heads * rows).map(|_| rng.uniform() as f32).collect();
        let (mut a, mut b) = (vec![0.5; heads * d], vec![0.5; heads * d]);
        simd.accumulate_values_grouped(&p, &values, &mut a);
        for (p, b) in p.chunks_exact(rows).zip(b.chunks_exact_mut(d)) {
            scalar.accumulate_values(p, &values, b);
        }
        // Relative to Σ p_j ||v_j|| · max |c|, the size of any accumulated term (p < 1).
        let size: f32 = k.chunks_exact(d).map(norm).sum();
        let tol = 1e-5 * size * simd.centroids[7];
        assert!(max_diff(&a, &b) <= tol, "d {d}: values");
    }
}

#[test]
fn a_key_rows_largest_values_are_kept_exact() {
    let forms = [TurboKeys::Qjl, TurboKeys::Mse];
    for (d, keys) in [128, 256, 512]
        .into_iter()
        .flat_map(|d| forms.map(|f| (d, f)))
    {
        let codec = TurboCodec::new(d, 3, keys).unwrap();
        let mut k = gaussian(&mut SplitMix64(d as u64), d);
        // A few channels far larger than the rest, as some models' keys have.
        let big = [(5, 90.0), (d - 1, -70.5), (d / 2, 40.25)];
        for &(i, v) in &big {
            k[i] = v;
        }
        let mut key = vec![0; codec.key_bytes()];
        codec.encode_keys(&k, &mut key);
        let mut k_hat = vec![0.0; d];
        codec.decode_key_mse(&key, &mut k_hat);
        let (mut pq, mut score) = (PreparedQuery::default(), [0.0]);
        for &(i, v) in &big {
            // The decoded channel is the value plus the codec's small error on the rest.
            assert!(
                (k_hat[i] - v).abs() < 0.5,
                "d {d} channel {i}: {}",
                k_hat[i]
            );
            let mut q = vec![0.0; d];
            q[i] = 1.0;
            codec.prepare_query(&q, &mut pq);
            codec.scores(&pq, &key, 1.0, &mut score);
            assert!(
                (score[0] - v).abs() < 0.5,
                "d {d} score of channel {i}: {}",
                score[0]
            );
        }
        // The rest's norm is what the codes carry: the outliers are not in it.
        let n = f16::from_le_bytes([key[0], key[1] & 0x7f]).to_f32();
        assert!(n < 0.2 * norm(&k), "d {d}: {n} of {}", norm(&k));
    }
}

#[test]
fn centred_rows_score_with_their_mean_added_back() {
    let d = 64;
    let mut rng = SplitMix64(31);
    let mean: Vec<f32> = gaussian(&mut rng, d).iter().map(|x| 3.0 * x).collect();
    let noise = gaussian(&mut rng, d);
    let k: Vec<f32> = mean.iter().zip(&noise).map(|(m, e)| m + 0.5 * e).collect();
    let q: Vec<f32> = mean
        .iter()
        .zip(gaussian(&mut rng, d))
        .map(|(m, e)| 0.3 * m + e)
        .collect();
    let centred: Vec<f32> = k.iter().zip(&mean).map(|(k, m)| k - m).collect();
    // The codec's error on the centred row is a few percent of ||q||·||k − mean||; the offset
    // <q, mean> is far larger, so a kernel that dropped it would miss by it.
    let tol = 0.2 * norm(&q) * norm(&centred) / (d as f32).sqrt();
    let offset = dot(&q, &mean);
    assert!(offset.abs() > 20.0 * tol, "{offset} vs {tol}");
    for keys in [TurboKeys::Qjl, TurboKeys::Mse] {
        let simd = TurboCodec::new(d, 9, keys).unwrap();
        let scalar = TurboCodec {
            simd: false,
            ..simd.clone()
        };
        let mut key = vec![0; simd.key_bytes()];
        simd.encode_key_near(&k, &mean, &mut key);
        assert!(TurboCodec::is_centered(&key), "{keys:?}: stored centred");
        for codec in [&simd, &scalar] {
            let (mut pq, mut s) = (PreparedQuery::default(), [0.0]);
            codec.prepare_query(&q, &mut pq);
            codec.scores(&pq, &key, 1.0, &mut s);
            let want = dot(&q, &centred);
            assert!((s[0] - want).abs() <= tol, "{keys:?}: {} vs {want}", s[0]);
            pq.set_centred_offset(offset);
            codec.scores(&pq, &key, 1.0, &mut s);
            let want = dot(&q, &k);
            assert!((s[0] - want).abs() <= tol, "{keys:?}: {} vs {want}", s[0]);
        }
    }
}
