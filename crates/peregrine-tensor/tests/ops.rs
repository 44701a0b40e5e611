//! Each fused op against its plain candle-op reference (`*_ref`), on odd shapes. Tolerances are
//! f32 rounding (both compute in f32; only operation order differs).

use peregrine_tensor::attention::{MaskSpec, attention, attention_ref};
use peregrine_tensor::ops::{
    gelu_mul, gelu_mul_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref,
};
use peregrine_tensor::{DType, Device, RopeScaling, RopeStyle, RotaryEmbedding, Tensor};

const TOL: f32 = 1e-5;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    peregrine_tensor::ops::max_abs_diff(a, b).unwrap()
}

#[test]
fn rms_norm_matches_reference() {
    let (x, w) = (randn(&[3, 7, 33], 1), randn(&[33], 2));
    assert!(
        max_diff(
            &rms_norm(&x, &w, 1e-6).unwrap(),
            &rms_norm_ref(&x, &w, 1e-6).unwrap()
        ) < TOL
    );
}

#[test]
fn silu_mul_matches_reference() {
    let (g, u) = (randn(&[5, 19], 3), randn(&[5, 19], 4));
    assert!(max_diff(&silu_mul(&g, &u).unwrap(), &silu_mul_ref(&g, &u).unwrap()) < TOL);
    let (g4, u4) = ((&g * 4.0).unwrap(), (&u * 4.0).unwrap()); // reach GELU's tails
    assert!(
        max_diff(
            &gelu_mul(&g4, &u4).unwrap(),
            &gelu_mul_ref(&g4, &u4).unwrap()
        ) < 4.0 * TOL
    );
}

#[test]
fn rope_matches_reference_for_every_style_and_scaling() {
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        },
        long_rope(8, 40),
    ];
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        for scaling in &scalings {
            let rope = RotaryEmbedding::new(
                16,
                10_000.0,
                scaling,
                style,
                100,
                peregrine_tensor::DType::F32,
                &Device::Cpu,
            )
            .unwrap();
            let x = randn(&[1, 3, 9, 16], 5);
            let diff = max_diff(
                &rope.apply(&x, 37).unwrap(),
                &rope.apply_ref(&x, 37).unwrap(),
            );
            assert!(diff < TOL, "{style:?} {scaling:?}: {diff}");
        }
    }
}

/// M-RoPE (sections 2, 3, 3 of 8 pairs): rows whose three positions agree turn as plain RoPE
/// does; otherwise pair `i` turns by the position of the axis whose section holds it, as
/// transformers' `apply_multimodal_rotary_pos_emb` does, or in Qwen3-VL's interleaved layout
/// by the axis `recomposition_frequencies` gives it (pairs 1, 4, 7 height, 2, 5 width, the
/// rest time); checked by hand in f64.
#[test]
fn multimodal_rope_turns_each_section_by_its_axis() {
    let plain = || {
        let none = RopeScaling::None;
        RotaryEmbedding::new(
            16,
            1e4,
            &none,
            RopeStyle::Half,
            100,
            DType::F32,
            &Device::Cpu,
        )
    };
    let chunked = |i: usize| match i {
        0..2 => 0,
        2..5 => 1,
        _ => 2,
    };
    let interleaved = |i: usize| match i {
        1 | 4 | 7 => 1,
        2 | 5 => 2,
        _ => 0,
    };
    let layouts: [(RotaryEmbedding, &dyn Fn(usize) -> usize); 2] = [
        (plain().unwrap().with_sections([2, 3, 3]).unwrap(), &chunked),
        (
            plain()
                .unwrap()
                .with_interleaved_sections([2, 3, 3])
                .unwrap(),
            &interleaved,
        ),
    ];
    let x = randn(&[1, 2, 5, 16], 9);
    let mut results = Vec::new();
    for (rope, axis_of) in layouts {
        let same: Vec<u32> = (40..45).collect();
        let got = rope
            .apply_positions(&x, &[same.clone(), same.clone(), same])
            .unwrap();
        assert!(max_diff(&got, &rope.apply(&x, 40).unwrap()) < TOL);

        let axes = [
            vec![3u32, 3, 3, 3, 9],
            vec![3, 3, 4, 4, 9],
            vec![3, 4, 3, 4, 9],
        ];
        let got = rope.apply_positions(&x, &axes).unwrap();
        let data = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = data.clone();
        for h in 0..2 {
            for r in 0..5 {
                let row = &mut want[(h * 5 + r) * 16..][..16];
                for i in 0..8 {
                    let angle = axes[axis_of(i)][r] as f64 / 1e4f64.powf(2.0 * i as f64 / 16.0);
                    let (a, b) = (row[i] as f64, row[i + 8] as f64);
                    row[i] = (a * angle.cos() - b * angle.sin()) as f32;
                    row[i + 8] = (a * angle.sin() + b * angle.cos()) as f32;
                }
            }
        }
        let want = Tensor::from_vec(want, (1, 2, 5, 16), &Device::Cpu).unwrap();
        assert!(max_diff(&got, &want) < TOL);
        results.push(got);
    }
    assert!(
        max_diff(&results[0], &results[1]) > 0.1,
        "the layouts differ"
    );
    let uneven = plain().unwrap().with_sections([2, 3, 4]);
    assert!(uneven.is_err(), "sections must cover the rotated pairs");
    // Interleaved sections wider than the pairs (llama.cpp's Qwen3.5 metadata on a narrow
    // rotation): pair 1 by height, the rest by time, positions that agree as plain RoPE.
    let wide = plain()
        .unwrap()
        .with_interleaved_sections([11, 11, 10])
        .unwrap();
    let same: Vec<u32> = (7..12).collect();
    let got = wide
        .apply_positions(&x, &[same.clone(), same.clone(), same])
        .unwrap();
    assert!(max_diff(&got, &wide.apply(&x, 7).unwrap()) < TOL);
}

/// LongRoPE factors for `pairs` rotated pairs, switching past `original` positions.
fn long_rope(pairs: usize, original: usize) -> RopeScaling {
    RopeScaling::LongRope {
        short_factor: (0..pairs).map(|i| 1.0 + 0.1 * i as f64).collect(),
        long_factor: (0..pairs).map(|i| 1.0 + 2.0 * i as f64).collect(),
        original_max_position_embeddings: original,
        attention_factor: 1.25,
    }
}

/// `x` rotated as transformers does, in f64: the first `rotary` dimensions of each head by
/// `scale · (cos, sin)` of `p / (factor_i · theta^(2i/rotary))` (rotate_half pairs), the rest
/// unchanged. `x: [heads, seq, head_dim]` at positions `start..`.
fn rope_by_hand(
    x: &[f32],
    (heads, seq, head_dim): (usize, usize, usize),
    rotary: usize,
    start: usize,
    factors: &[f64],
    scale: f64,
) -> Vec<f32> {
    let mut out = x.to_vec();
    let half = rotary / 2;
    for h in 0..heads {
        for s in 0..seq {
            let row = &mut out[(h * seq + s) * head_dim..][..head_dim];
            for i in 0..half {
                let freq = 1.0 / (factors[i] * 1e4f64.powf(2.0 * i as f64 / rotary as f64));
                let angle = (start + s) as f64 * freq;
                let (c, sn) = (scale * angle.cos(), scale * angle.sin());
                let (a, b) = (row[i] as f64, row[i + half] as f64);
                row[i] = (a * c - b * sn) as f32;
                row[i + half] = (a * sn + b * c) as f32;
            }
        }
    }
    out
}

/// Partial rotary (12 of 16 dimensions, the last 4 pass through) with LongRoPE: a rotation
/// ending at or before position `original - 1` uses the short factors, one that reaches past
/// it the long factors for every position it rotates (transformers picks by
/// `max(position_ids) + 1`); cos and sin carry the attention factor; `apply`, `apply_ref` and
/// the decode step's `apply_rows_in_place` agree.
#[test]
fn long_rope_picks_factors_by_the_rotation_end_and_rotates_a_partial_head() {
    let (head_dim, rotary, original) = (16, 12, 40);
    let scaling = long_rope(rotary / 2, original);
    let RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    } = &scaling
    else {
        unreachable!()
    };
    let build = |dims, style| {
        RotaryEmbedding::new_partial(dims, 1e4, &scaling, style, 100, DType::F32, &Device::Cpu)
    };
    let rope = build((head_dim, rotary), RopeStyle::Half).unwrap();
    let (heads, seq) = (3, 5);
    let x = randn(&[1, heads, seq, head_dim], 21);
    let flat = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // start 35: positions 35..40, end 40 = original → short; start 36: end 41 → long.
    for (start, factors) in [(35, short_factor), (36, long_factor), (0, short_factor)] {
        let want = rope_by_hand(&flat, (heads, seq, head_dim), rotary, start, factors, 1.25);
        let want = Tensor::from_vec(want, x.dims(), &Device::Cpu).unwrap();
        let got = rope.apply(&x, start).unwrap();
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-4, "start {start}: {diff}");
        assert!(max_diff(&rope.apply_ref(&x, start).unwrap(), &want) < 1e-4);
        // the passed-through dimensions are bit-identical
        let pass = |t: &Tensor| t.narrow(3, rotary, head_dim - rotary).unwrap();
        assert_eq!(max_diff(&pass(&got), &pass(&x)), 0.0);
    }
    // The decode step at position p rotates as a one-token forward at p: short up to
    // position original - 1, long from position original on.
    let one = randn(&[1, heads, 1, head_dim], 22);
    for pos in [0, original - 1, original, 99] {
        let mut rows = one.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        rope.apply_rows_in_place(&mut rows, pos).unwrap();
        let want = rope.apply(&one, pos).unwrap();
        let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let diff = rows
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff < TOL,
            "position {pos}: rows differ from apply by {diff}"
        );
        let factors = if pos + 1 > original {
            long_factor
        } else {
            short_factor
        };
        let flat = one.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let by_hand = rope_by_hand(&flat, (heads, 1, head_dim), rotary, pos, factors, 1.25);
        let diff = rows
            .iter()
            .zip(&by_hand)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff < 1e-4, "position {pos}: {diff} from the hand rotation");
    }
    // Interleaved pairs rotate only the first 12 dimensions too.
    let gptj = build((head_dim, rotary), RopeStyle::Interleaved).unwrap();
    let a = gptj.apply(&x, 36).unwrap();
    assert!(max_diff(&a, &gptj.apply_ref(&x, 36).unwrap()) < TOL);
    let mut rows = one.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    gptj.apply_rows_in_place(&mut rows, 41).unwrap();
    let want = gptj.apply(&one, 41).unwrap();
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(rows.iter().zip(&want).all(|(a, b)| (a - b).abs() < TOL));
    // Factor lists must cover the rotated pairs.
    assert!(build((head_dim, head_dim), RopeStyle::Half).is_err());
}

/// Tables grow as positions are first reached; the rows are the same whichever way they grew.
#[test]
fn rope_tables_grow_to_the_positions_used() {
    let rope = |_| {
        RotaryEmbedding::new(
            16,
            1e4,
            &RopeScaling::None,
            RopeStyle::Half,
            8192,
            peregrine_tensor::DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    };
    let (stepwise, direct) = (rope(0), rope(1));
    let x = randn(&[1, 2, 3, 16], 13);
    for start in [5, 1500, 4000] {
        stepwise.apply(&x, start).unwrap();
    }
    let at_end = 8192 - 3;
    let (a, b) = (
        stepwise.apply(&x, at_end).unwrap(),
        direct.apply(&x, at_end).unwrap(),
    );
    assert_eq!(max_diff(&a, &b), 0.0);
    assert!(max_diff(&a, &stepwise.apply_ref(&x, at_end).unwrap()) < TOL);
    assert!(direct.apply(&x, 8190).is_err());
}

#[test]
fn rope_past_the_table_is_an_error() {
    let rope = RotaryEmbedding::new(
        8,
        1e4,
        &RopeScaling::None,
        RopeStyle::Half,
        10,
        peregrine_tensor::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert!(rope.apply(&randn(&[1, 1, 4, 8], 6), 8).is_err());
}

#[test]
fn grouped_attention_matches_reference() {
    // 6 or 10 query heads over 2 kv heads (groups of 3, and of 5: a call for 4 heads and one
    // for 1); queries at positions 10..15 over keys 3..15.
    for (heads, d) in [(6, 16), (10, 32)] {
        for window in [None, Some(4)] {
            for (q_len, k_len, k_start) in [(5, 12, 3), (1, 12, 3), (5, 5, 10)] {
                let q_start = k_start + k_len - q_len;
                let q = randn(&[1, heads, q_len, d], 7);
                let k = randn(&[1, 2, k_len, d], 8);
                let v = randn(&[1, 2, k_len, d], 9);
                let mask = MaskSpec {
                    q_start,
                    k_start,
                    window,
                    both_ways: None,
                };
                let ours = attention(&q, &k, &v, 0.25, None, &mask).unwrap();
                let reference = attention_ref(&q, &k, &v, 0.25, None, &mask).unwrap();
                let diff = max_diff(&ours, &reference);
                let case = format!("heads {heads} d {d} window {window:?} q {q_len} k {k_len}");
                assert!(diff < TOL, "{case}: {diff}");
            }
        }
    }
}

#[test]
fn attention_reads_narrowed_caches_of_every_storage_dtype() {
    // Batch 2, 6 query heads over 2 kv heads, keys a window into a larger buffer (strided), and
    // queries transposed from [b, n, heads, d] (strided): the layouts the decoder passes.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in [16, 12] {
            let buffer_k = randn(&[2, 2, 20, d], 10).to_dtype(dtype).unwrap();
            let buffer_v = randn(&[2, 2, 20, d], 11).to_dtype(dtype).unwrap();
            let (k, v) = (
                buffer_k.narrow(2, 3, 12).unwrap(),
                buffer_v.narrow(2, 3, 12).unwrap(),
            );
            for (q_len, window) in [(1, None), (4, None), (4, Some(3))] {
                let q = randn(&[2, q_len, 6, d], 12).transpose(1, 2).unwrap();
                let mask = MaskSpec {
                    q_start: 20 - q_len,
                    k_start: 8,
                    window,
                    both_ways: None,
                };
                let ours = attention(&q, &k, &v, 0.3, None, &mask).unwrap();
                let (kf, vf) = (
                    k.to_dtype(DType::F32).unwrap(),
                    v.to_dtype(DType::F32).unwrap(),
                );
                let reference =
                    attention_ref(&q.contiguous().unwrap(), &kf, &vf, 0.3, None, &mask).unwrap();
                let diff = max_diff(&ours, &reference);
                assert!(
                    diff < TOL,
                    "{dtype:?} d {d} q {q_len} window {window:?}: {diff}"
                );
            }
        }
    }
}

/// SmolLM2's (9 heads over 3, d 64) and Gemma 3's (4 over 1, d 256) shapes, decode and prefill,
/// queries strided as the decoder passes them: decode takes the split-keys path.
#[test]
fn attention_matches_reference_on_real_model_shapes() {
    let shapes = [
        (9, 3, 64, 70, 1),
        (9, 3, 64, 60, 60),
        (4, 1, 256, 33, 1),
        (4, 1, 256, 33, 33),
    ];
    for (heads, kv, d, k_len, q_len) in shapes {
        let q = randn(&[1, q_len, heads, d], 7).transpose(1, 2).unwrap();
        let k = randn(&[1, kv, k_len, d], 8);
        let v = randn(&[1, kv, k_len, d], 9);
        let mask = MaskSpec {
            q_start: k_len - q_len,
            k_start: 0,
            window: None,
            both_ways: None,
        };
        let ours = attention(&q, &k, &v, 0.125, None, &mask).unwrap();
        let reference =
            attention_ref(&q.contiguous().unwrap(), &k, &v, 0.125, None, &mask).unwrap();
        let diff = max_diff(&ours, &reference);
        assert!(
            diff < TOL,
            "heads {heads}/{kv} d {d} q {q_len} k {k_len}: {diff}"
        );
    }
}

/// Soft-capped scores (Gemma 2: `cap · tanh(s / cap)` before the mask) on the CPU kernel's
/// prefill and split-keys decode paths, with windows and grouped heads, and on the candle path
/// other devices take (reached here with f64 queries), against the reference. The cap is small
/// enough to change the result.
#[test]
fn softcapped_attention_matches_reference() {
    let (scale, cap) = (0.5, Some(0.5f32));
    for (heads, kv, d, k_len, q_len, window) in [
        (6, 2, 16, 12, 5, None),
        (6, 2, 16, 12, 5, Some(4)),
        (4, 1, 32, 70, 1, None),
        (4, 1, 32, 70, 1, Some(9)),
        (9, 3, 64, 40, 40, Some(8)),
    ] {
        let q = randn(&[1, q_len, heads, d], 21).transpose(1, 2).unwrap();
        let k = randn(&[1, kv, k_len, d], 22);
        let v = randn(&[1, kv, k_len, d], 23);
        let mask = MaskSpec {
            q_start: k_len - q_len,
            k_start: 0,
            window,
            both_ways: None,
        };
        let case = format!("heads {heads}/{kv} d {d} q {q_len} k {k_len} window {window:?}");
        let reference = attention_ref(&q.contiguous().unwrap(), &k, &v, scale, cap, &mask).unwrap();
        let ours = attention(&q, &k, &v, scale, cap, &mask).unwrap();
        let diff = max_diff(&ours, &reference);
        assert!(diff < TOL, "{case}: {diff}");
        let uncapped = attention(&q, &k, &v, scale, None, &mask).unwrap();
        let moved = max_diff(&uncapped, &reference);
        assert!(
            moved > 1e-2,
            "{case}: the cap moves the output by only {moved}"
        );

        let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let generic = attention(&f64s(&q), &f64s(&k), &f64s(&v), scale, cap, &mask).unwrap();
        let diff = max_diff(&generic.to_dtype(DType::F32).unwrap(), &reference);
        assert!(diff < TOL, "{case}, candle path: {diff}");
    }
}

/// A row's attention must not depend on which rows came with it or on the thread count: a
/// prompt prefilled in pieces, or a sequence decoded beside others, must give the bits it gives
/// prefilled whole (the prompt cache and continuous batching promise exact outputs). Keys span
/// several chunks, and the tail of rows is taken on its own, as decode (one row) and as a short
/// prefill (few tasks), on pools of 1 to 3 threads.
#[test]
fn a_rows_attention_does_not_depend_on_its_batch_or_threads() {
    for (heads, kv, d) in [(9, 3, 64), (4, 1, 256)] {
        for window in [None, Some(150)] {
            let k_len = 300;
            let q = randn(&[1, k_len, heads, d], 31).transpose(1, 2).unwrap();
            let k = randn(&[1, kv, k_len, d], 32).to_dtype(DType::F16).unwrap();
            let v = randn(&[1, kv, k_len, d], 33).to_dtype(DType::F16).unwrap();
            let run = |threads: usize, q_len: usize| -> Vec<f32> {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let q = q.narrow(2, k_len - q_len, q_len).unwrap();
                let mask = MaskSpec {
                    q_start: k_len - q_len,
                    k_start: 0,
                    window,
                    both_ways: None,
                };
                let out = pool.install(|| attention(&q, &k, &v, 0.125, None, &mask).unwrap());
                let last = out.narrow(2, q_len - 1, 1).unwrap();
                last.flatten_all().unwrap().to_vec1().unwrap()
            };
            let whole = run(2, k_len);
            for (threads, q_len) in [(1, k_len), (3, k_len), (1, 1), (2, 1), (3, 1), (2, 2)] {
                assert!(
                    run(threads, q_len) == whole,
                    "heads {heads}/{kv} d {d} window {window:?}: the last row differs with \
                     {q_len} rows on {threads} threads"
                );
            }
        }
    }
}

#[test]
fn rows_into_copies_each_row_and_keeps_the_vectors_it_has() {
    use peregrine_tensor::ops::rows_into;
    let t = Tensor::arange(0f32, 12.0, &Device::Cpu)
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let mut rows = vec![Vec::with_capacity(64), vec![9.0; 7]];
    let kept = rows[0].as_ptr();
    rows_into(&t, &mut rows).unwrap();
    assert_eq!(rows, t.to_vec2::<f32>().unwrap());
    assert_eq!(
        rows[0].as_ptr(),
        kept,
        "the first row's allocation was reused"
    );
    // A transposed view: its rows are strided in memory.
    let tt = t.t().unwrap();
    rows_into(&tt, &mut rows).unwrap();
    assert_eq!(rows, tt.to_vec2::<f32>().unwrap());
    assert_eq!(rows.len(), 4);
}

/// A batched decode step's rows turned at once (`apply_at`, each row its own position) equal,
/// bit for bit, each row turned alone by `apply` at its position, for both styles and a partial
/// head; rows on both sides of LongRoPE's original context (two tables) are refused, rows on
/// one side are not.
#[test]
fn rows_turned_at_their_own_positions_equal_each_turned_alone() {
    let (head_dim, rotary, original) = (16, 12, 40);
    let scaling = long_rope(rotary / 2, original);
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let rope = RotaryEmbedding::new_partial(
            (head_dim, rotary),
            1e4,
            &scaling,
            style,
            100,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let x = randn(&[1, 3, 4, head_dim], 23);
        for positions in [[0u32, 7, 3, 39], [40, 99, 41, 40]] {
            let got = rope
                .apply_at(&[&x], &positions)
                .unwrap()
                .expect("one table")
                .remove(0);
            for (j, &p) in positions.iter().enumerate() {
                let row = |t: &Tensor| t.narrow(2, j, 1).unwrap().contiguous().unwrap();
                let alone = rope.apply(&row(&x), p as usize).unwrap();
                assert_eq!(
                    max_diff(&row(&got), &alone),
                    0.0,
                    "{style:?} row {j} at {p}"
                );
            }
        }
        let mixed = rope.apply_at(&[&x], &[39, 40, 1, 2]).unwrap();
        assert!(
            mixed.is_none(),
            "{style:?}: rows across the original context"
        );
    }
}
