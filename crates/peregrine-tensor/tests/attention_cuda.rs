//! The CUDA decode-attention kernel (`kernels/cuda/attn_decode.cu`) against the f32 reference
//! (`attention_ref` on the CPU, over the same rounded values): one query position over a cache
//! view that starts past slot 0 of a larger buffer, as the KV cache hands it over, for every
//! head size the kernel is built for, 1-8 query heads per kv head, 1 to 8,200 keys (one chunk
//! to hundreds), with and without a soft cap, in bf16, f16 and f32. Built only with the `cuda`
//! feature and run on a GPU machine (`cargo test -p peregrine-tensor --features cuda --test
//! attention_cuda`; passed on an H100, 2026-12-07).
//!
//! Tolerance: the kernel computes in f32 (its exponentials `__expf`, within a few f32 units)
//! and rounds once to the cache's type, as the reference's f32 result is rounded here: the two
//! may land one unit apart in the last place (2⁻⁷ relative for bf16, 2⁻¹⁰ for f16), plus 1e-4
//! for values near zero. A wrong head, chunk join or key offset moves values by far more.
#![cfg(feature = "cuda")]

mod common;

use common::{close, flat, wave};
use peregrine_tensor::attention::{MaskSpec, attention, attention_ref, decode_attention};
use peregrine_tensor::{DType, Device, Tensor};

#[test]
fn decode_attention_matches_the_f32_reference() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let mut cases = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let step = match dtype {
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 1e-5,
        };
        for d in [16, 32, 64, 128, 256] {
            for (heads, kv_heads) in [(4, 4), (9, 3), (32, 8), (16, 2)] {
                for n in [1, 37, 1000, 8200] {
                    let softcap = (n == 37).then_some(20.0);
                    let case = format!("{dtype:?} d {d}, {heads}/{kv_heads} heads, {n} keys");
                    let seed = (d * 7 + heads * 3 + n) as f32;
                    let q = wave(&[1, heads, 1, d], seed, dtype, &gpu);
                    // A cache of n + 11 slots whose visible keys start at slot 5.
                    let cache = |s: f32| {
                        let full = wave(&[1, kv_heads, n + 11, d], s, dtype, &gpu);
                        full.narrow(2, 5, n).unwrap()
                    };
                    let (k, v) = (cache(seed + 1.0), cache(seed + 2.0));
                    let scale = 1.0 / (d as f64).sqrt();
                    let got = decode_attention(&q, &k, &v, scale, softcap)
                        .unwrap()
                        .unwrap_or_else(|| panic!("{case}: the kernel should take these"));
                    let cpu = |t: &Tensor| {
                        let t = t.to_device(&Device::Cpu).unwrap();
                        t.to_dtype(DType::F32).unwrap().contiguous().unwrap()
                    };
                    let mask = MaskSpec {
                        q_start: n - 1,
                        k_start: 0,
                        window: None,
                        both_ways: None,
                    };
                    let want = attention_ref(&cpu(&q), &cpu(&k), &cpu(&v), scale, softcap, &mask)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    close(&flat(&got), &flat(&want), (step, 1e-4), &case);
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 240);
}

#[test]
fn attention_takes_the_kernel_for_one_query_and_leaves_the_rest() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (d, n) = (128, 300);
    let q = wave(&[1, 32, 1, d], 1.0, DType::BF16, &gpu);
    let k = wave(&[1, 8, n, d], 2.0, DType::BF16, &gpu);
    let v = wave(&[1, 8, n, d], 3.0, DType::BF16, &gpu);
    let mask = MaskSpec {
        q_start: n - 1,
        k_start: 0,
        window: None,
        both_ways: None,
    };
    let direct = decode_attention(&q, &k, &v, 0.088, None).unwrap().unwrap();
    let through = attention(&q, &k, &v, 0.088, None, &mask).unwrap();
    assert_eq!(
        flat(&through),
        flat(&direct),
        "attention dispatches to the kernel"
    );
    // Shapes it does not take: 9 query heads per kv head, a head size it is not built for,
    // two query positions.
    let many = wave(&[1, 72, 1, d], 4.0, DType::BF16, &gpu);
    assert!(
        decode_attention(&many, &k, &v, 0.088, None)
            .unwrap()
            .is_none()
    );
    let odd = |s| wave(&[1, 8, n, 80], s, DType::BF16, &gpu);
    let q80 = wave(&[1, 32, 1, 80], 5.0, DType::BF16, &gpu);
    assert!(
        decode_attention(&q80, &odd(6.0), &odd(7.0), 0.1, None)
            .unwrap()
            .is_none()
    );
    let two = wave(&[1, 32, 2, d], 8.0, DType::BF16, &gpu);
    assert!(
        decode_attention(&two, &k, &v, 0.088, None)
            .unwrap()
            .is_none()
    );
}

/// The batched kernel (`decode_attention_many`): sequences of 1 to 5,000 keys in caches of
/// different capacities (so different head strides), each row of its output against the f32
/// reference over that sequence's cache, with the tolerance above (passed on an H100,
/// 2026-12-07, with the two tests below).
#[test]
fn decode_attention_many_matches_each_sequence_alone() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (heads, kv_heads) = (32, 8);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let step = match dtype {
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 1e-5,
        };
        for d in [64, 128] {
            let lengths = [1, 37, 300, 5000, 64, 2];
            let kvs: Vec<(Tensor, Tensor)> = (lengths.iter().enumerate())
                .map(|(s, &n)| {
                    // A cache of n + 3s + 7 slots whose visible keys start at slot s.
                    let cache = |seed: f32| {
                        let full = wave(&[1, kv_heads, n + 3 * s + 7, d], seed, dtype, &gpu);
                        full.narrow(2, s, n).unwrap()
                    };
                    (cache(s as f32 + 1.0), cache(s as f32 + 50.0))
                })
                .collect();
            let q = wave(&[lengths.len(), heads, d], 9.0, dtype, &gpu);
            let scale = 1.0 / (d as f64).sqrt();
            let many = |out| {
                peregrine_tensor::attention::decode_attention_many(&q, &kvs, (scale, None), out)
                    .unwrap()
                    .expect("the kernel takes these")
            };
            let got = many(dtype);
            // The join writes the dtype asked for: f32 out, rounded after, gives the same bits.
            let wide = many(DType::F32).to_dtype(dtype).unwrap();
            assert_eq!(
                flat(&wide),
                flat(&got),
                "{dtype:?} d {d}: f32 out, rounded after"
            );
            for (s, (k, v)) in kvs.iter().enumerate() {
                let case = format!("{dtype:?} d {d}, sequence {s} of {} keys", lengths[s]);
                let cpu = |t: &Tensor| {
                    let t = t.to_device(&Device::Cpu).unwrap();
                    t.to_dtype(DType::F32).unwrap().contiguous().unwrap()
                };
                let q_s = q
                    .narrow(0, s, 1)
                    .unwrap()
                    .reshape((1, heads, 1, d))
                    .unwrap();
                let n = lengths[s];
                let mask = MaskSpec {
                    q_start: n - 1,
                    k_start: 0,
                    window: None,
                    both_ways: None,
                };
                let want = attention_ref(&cpu(&q_s), &cpu(k), &cpu(v), scale, None, &mask)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let row = got.narrow(0, s, 1).unwrap();
                close(&flat(&row), &flat(&want), (step, 1e-4), &case);
            }
        }
    }
}

/// The batched append (`append_rows`): a step's bf16 keys (contiguous) and values (a transposed
/// view, as the projections hand them over) written into caches of different capacities and
/// dtypes at different slots, each cache then equal, bit for bit, to the same rows written by
/// candle's cast and `slice_set`; the slots not written stay as they were.
#[test]
fn append_rows_matches_slice_set() {
    use peregrine_tensor::attention::{AppendSlot, append_rows, append_rows_takes};
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (kv_heads, d, rows) = (8, 128, 5);
    let k = wave(&[1, kv_heads, rows, d], 3.0, DType::BF16, &gpu);
    let v = wave(&[1, rows, kv_heads, d], 4.0, DType::BF16, &gpu)
        .transpose(1, 2)
        .unwrap();
    for cache_dtype in [DType::F16, DType::BF16, DType::F32] {
        assert!(append_rows_takes(&k, &v, cache_dtype));
        // (source row, capacity, slot): rows out of order, one skipped, capacities apart.
        let plan = [(2, 256, 0), (0, 512, 300), (4, 256, 255), (1, 768, 17)];
        let caches: Vec<(Tensor, Tensor)> = (plan.iter().enumerate())
            .map(|(i, &(_, cap, _))| {
                let c = |s: f32| wave(&[1, kv_heads, cap, d], s + i as f32, cache_dtype, &gpu);
                (c(10.0), c(20.0))
            })
            .collect();
        let want: Vec<(Tensor, Tensor)> = (caches.iter().zip(&plan))
            .map(|((ck, cv), &(row, _, slot))| {
                let (ck, cv) = (ck.copy().unwrap(), cv.copy().unwrap());
                let put = |dst: &Tensor, src: &Tensor| {
                    let src = src
                        .narrow(2, row, 1)
                        .unwrap()
                        .to_dtype(cache_dtype)
                        .unwrap();
                    dst.slice_set(&src.contiguous().unwrap(), 2, slot).unwrap();
                };
                put(&ck, &k);
                put(&cv, &v);
                (ck, cv)
            })
            .collect();
        let slots: Vec<AppendSlot> = (caches.iter().zip(&plan))
            .map(|((ck, cv), &(row, _, slot))| AppendSlot {
                row,
                k: ck.clone(),
                v: cv.clone(),
                slot,
            })
            .collect();
        append_rows(&k, &v, &slots).unwrap();
        for (i, ((gk, gv), (wk, wv))) in caches.iter().zip(&want).enumerate() {
            for (got, want, what) in [(gk, wk, "keys"), (gv, wv, "values")] {
                let (got, want) = (flat(got), flat(want));
                assert_eq!(got, want, "{cache_dtype:?} cache {i}: {what} differ");
            }
        }
    }
}

/// The fused decode rows (`RotaryEmbedding::turn_and_append`): queries and keys of sequences at
/// different positions turned and the keys and values written into their caches in one launch,
/// against candle's `rope` of each row alone (`apply`), cast and `slice_set`, bit for bit: the
/// kernel turns in the activations' type operation by operation as candle's kernels do. Both
/// RoPE styles, a partial rotation, bf16 and f16 rows, f16 and bf16 caches.
#[test]
fn turn_and_append_matches_rope_and_slice_set() {
    use peregrine_tensor::attention::AppendSlot;
    use peregrine_tensor::{RopeScaling, RopeStyle, RotaryEmbedding};
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (heads, kv_heads, d) = (8, 2, 64);
    let positions = [0u32, 1500, 7, 4095];
    let n = positions.len();
    for (style, rot) in [
        (RopeStyle::Half, 64),
        (RopeStyle::Interleaved, 64),
        (RopeStyle::Half, 32),
    ] {
        for (dtype, cache_dtype) in [(DType::BF16, DType::F16), (DType::F16, DType::BF16)] {
            let case =
                format!("{style:?} rotating {rot} of {d}, {dtype:?} rows, {cache_dtype:?} caches");
            let scaling = RopeScaling::None;
            let rope =
                RotaryEmbedding::new_partial((d, rot), 1e4, &scaling, style, 8192, dtype, &gpu)
                    .unwrap();
            let q = wave(&[1, n, heads, d], 1.0, dtype, &gpu)
                .transpose(1, 2)
                .unwrap();
            let k = wave(&[1, n, kv_heads, d], 2.0, dtype, &gpu)
                .transpose(1, 2)
                .unwrap();
            let v = wave(&[1, kv_heads, n, d], 3.0, dtype, &gpu);
            assert!(rope.turns_in_place(&q, (&k, &v), &positions), "{case}");
            let caches: Vec<(Tensor, Tensor)> = (0..n)
                .map(|i| {
                    let c = |s: f32| wave(&[1, kv_heads, 256 * (i + 1), d], s, cache_dtype, &gpu);
                    (c(10.0 + i as f32), c(20.0 + i as f32))
                })
                .collect();
            let slot_of = |i: usize| 3 * i + 1;
            let mut want_q = Vec::new();
            let mut want_caches = Vec::new();
            for (i, (ck, cv)) in caches.iter().enumerate() {
                let row = |t: &Tensor| t.narrow(2, i, 1).unwrap();
                let p = positions[i] as usize;
                let (tq, tk) = (
                    rope.apply(&row(&q), p).unwrap(),
                    rope.apply(&row(&k), p).unwrap(),
                );
                want_q.push(tq.to_dtype(DType::F32).unwrap());
                let (ck, cv) = (ck.copy().unwrap(), cv.copy().unwrap());
                let put = |dst: &Tensor, src: &Tensor| {
                    let src = src.to_dtype(cache_dtype).unwrap().contiguous().unwrap();
                    dst.slice_set(&src, 2, slot_of(i)).unwrap();
                };
                put(&ck, &tk);
                put(&cv, &row(&v));
                want_caches.push((ck, cv));
            }
            let slots: Vec<AppendSlot> = (caches.iter().enumerate())
                .map(|(i, (ck, cv))| AppendSlot {
                    row: i,
                    k: ck.clone(),
                    v: cv.clone(),
                    slot: slot_of(i),
                })
                .collect();
            let got_q = rope
                .turn_and_append(&q, (&k, &v), &positions, &slots)
                .unwrap();
            assert_eq!(got_q.dims(), &[n, heads, d], "{case}");
            for i in 0..n {
                let got = flat(&got_q.narrow(0, i, 1).unwrap());
                assert_eq!(got, flat(&want_q[i]), "{case}: queries of row {i}");
                let ((gk, gv), (wk, wv)) = (&caches[i], &want_caches[i]);
                assert_eq!(flat(gk), flat(wk), "{case}: keys of row {i}");
                assert_eq!(flat(gv), flat(wv), "{case}: values of row {i}");
            }
        }
    }
}
