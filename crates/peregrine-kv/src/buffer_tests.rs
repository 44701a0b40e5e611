//! The buffer's tests: both stores, keys as values, quantized rows against their decoded values.

use super::*;

fn rows(from: usize, n: usize, salt: f32) -> Vec<f32> {
    (0..2 * n * 8)
        .map(|i| ((from * 16 + i) as f32 * 0.37 + salt).sin())
        .collect()
}

/// A buffer whose values are its keys attends exactly as one given `v = k`, on both stores,
/// across growth and trims, and a snapshot keeps attending alike; it holds half the bytes.
#[test]
fn keys_as_values_attend_as_keys_given_as_values() {
    let params = AttnParams::scaled(0.3);
    for dtype in [None, Some(DType::F16)] {
        let mut full = KvBuffer::new(dtype);
        let mut shared = [
            KvBuffer::keys_as_values(dtype),
            KvBuffer {
                tensors_on_cpu: true,
                ..KvBuffer::keys_as_values(dtype)
            },
        ];
        let mut end = 0;
        for n in [5, 1, 300, 1] {
            let k = rows(end, n, 0.0);
            let junk = rows(end, n, 9.0);
            if n == 1 {
                full.append_row(&k, &k, 8, None).unwrap();
                for b in &mut shared {
                    b.append_row(&k, &junk, 8, None).unwrap();
                }
            } else {
                let t = |x: &[f32]| Tensor::from_slice(x, (1, 2, n, 8), &Device::Cpu).unwrap();
                full.append(&t(&k), &t(&k), None).unwrap();
                for b in &mut shared {
                    b.append(&t(&k), &t(&junk), None).unwrap();
                }
            }
            end += n;
            if n == 300 {
                full.trim(7);
                shared.iter_mut().for_each(|b| b.trim(7));
                end -= 7;
            }
            let q = Tensor::from_vec(rows(end, 2, 2.0), (1, 4, 1, 8), &Device::Cpu).unwrap();
            let want = full.attend(&q, &params, None).unwrap();
            for b in &shared {
                let copy = b.deep_copy().unwrap();
                for b in [b, &copy] {
                    let got = b.attend(&q, &params, None).unwrap();
                    let diff = peregrine_tensor::ops::max_abs_diff(&want, &got).unwrap();
                    assert!(diff < 1e-6, "{dtype:?} after {end}: {diff}");
                }
                assert_eq!(2 * b.bytes(), full.bytes(), "{dtype:?} after {end}");
            }
        }
    }
}

/// Rows as a quantized cache stores them: quantized and decoded again.
fn dequantized(x: &[f32], format: KvQuant, d: usize) -> Vec<f32> {
    let (cb, pb) = Plane::quant_row(format, d);
    let rows = x.len() / d;
    let (mut codes, mut params) = (vec![0u8; rows * cb], vec![f16::ZERO; rows * pb]);
    let (bits, group) = (format.bits, format.group_size);
    quantize_rows(x, d, bits, group, &mut codes, &mut params);
    (0..x.len())
        .map(|i| {
            let (r, c) = (i / d, i % d);
            let code = match bits {
                8 => codes[r * cb + c],
                _ => (codes[r * cb + c / 2] >> (4 * (c % 2))) & 15,
            };
            let (s, b) = (
                params[r * pb + 2 * (c / group)],
                params[r * pb + 2 * (c / group) + 1],
            );
            s.to_f32().mul_add(code as f32, b.to_f32())
        })
        .collect()
}

/// A quantized buffer attends exactly as an f32 one holding the decoded rows, through
/// tensor and row appends, growth, window drops and trims, on both attend paths; at 8 bits
/// it holds (8 + 32/group)/32 of the f32 bytes.
#[test]
fn quantized_rows_attend_as_their_decoded_values() {
    let (d, heads, q_heads) = (64, 2, 6);
    let rows = |from: usize, n: usize, salt: f32| -> Vec<f32> {
        (0..heads * n * d)
            .map(|i| ((from * 131 + i) as f32 * 0.37 + salt).sin() * 2.0)
            .collect()
    };
    let params = AttnParams::scaled(0.2);
    for (bits, group_size) in [(8, 64), (4, 32), (4, 64)] {
        let format = KvQuant { bits, group_size };
        let mut quant = KvBuffer::new(None);
        quant.quant = Some(format);
        let mut exact = KvBuffer::new(None);
        let (keep, window) = (Some(300), Some(280));
        let mut end = 0;
        for n in [5, 1, 300, 1, 1] {
            let (k, v) = (rows(end, n, 0.0), rows(end, n, 1.0));
            // Heads are the outer dimension: decode each head's rows on their own.
            let (dk, dv) = (dequantized(&k, format, d), dequantized(&v, format, d));
            if n == 1 {
                quant.append_row(&k, &v, d, keep).unwrap();
                exact.append_row(&dk, &dv, d, keep).unwrap();
            } else {
                let t = |x: Vec<f32>| Tensor::from_vec(x, (1, heads, n, d), &Device::Cpu);
                quant.append(&t(k).unwrap(), &t(v).unwrap(), keep).unwrap();
                exact
                    .append(&t(dk).unwrap(), &t(dv).unwrap(), keep)
                    .unwrap();
            }
            end += n;
            if n == 300 {
                quant.trim(3);
                exact.trim(3);
                end -= 3;
            }
            let q_rows: Vec<f32> = (0..q_heads * d).map(|i| (i as f32 * 0.11).cos()).collect();
            let q = Tensor::from_vec(q_rows.clone(), (1, q_heads, 1, d), &Device::Cpu).unwrap();
            let want = exact.attend(&q, &params, window).unwrap();
            let got = quant.attend(&q, &params, window).unwrap();
            let diff = peregrine_tensor::ops::max_abs_diff(&want, &got).unwrap();
            assert!(diff < 1e-5, "{bits}/{group_size} after {end}: {diff}");
            let mut out = vec![0f32; q_heads * d];
            let scratch = &mut AttnScratch::default();
            (quant.attend_row(&q_rows, d, &params, window, (&mut out, scratch))).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let diff = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{bits}/{group_size} row after {end}: {diff}");
            let per_value = bits as usize * group_size + 32;
            assert_eq!(
                quant.bytes() * 8 * group_size,
                exact.bytes() / 4 * per_value
            );
        }
    }
}

/// The CPU store and the tensor store (other devices') take the same appends, tensor and
/// row ones, across growth and window drops, and attend identically after each, with and
/// without a soft cap.
#[test]
fn cpu_and_tensor_stores_attend_alike() {
    let capped = AttnParams {
        scale: 0.3,
        softcap: Some(0.8),
        both_ways: None,
    };
    let dtypes = [None, Some(DType::F16), Some(DType::BF16)];
    let cases = [AttnParams::scaled(0.3), capped]
        .into_iter()
        .flat_map(|p| dtypes.map(|d| (p, d)));
    for (params, dtype) in cases {
        let (mut cpu, mut tensors) = (KvBuffer::new(dtype), KvBuffer::new_on_tensors(dtype));
        let (keep, window) = (Some(300), Some(280));
        let mut end = 0;
        for n in [5, 1, 1, 300, 1, 260, 1] {
            for b in [&mut cpu, &mut tensors] {
                if n == 1 {
                    b.append_row(&rows(end, 1, 0.0), &rows(end, 1, 1.0), 8, keep)
                        .unwrap();
                } else {
                    let t = |s| Tensor::from_vec(rows(end, n, s), (1, 2, n, 8), &Device::Cpu);
                    b.append(&t(0.0).unwrap(), &t(1.0).unwrap(), keep).unwrap();
                }
            }
            end += n;
            assert_eq!((cpu.start, cpu.used), (tensors.start, tensors.used));
            assert_eq!(cpu.bytes(), tensors.bytes());
            let q = Tensor::from_vec(rows(end, 2, 2.0), (1, 4, 1, 8), &Device::Cpu).unwrap();
            let a = cpu.attend(&q, &params, window).unwrap();
            let b = tensors.attend(&q, &params, window).unwrap();
            let diff = peregrine_tensor::ops::max_abs_diff(&a, &b).unwrap();
            assert!(diff < 1e-6, "{dtype:?} {params:?} after {end}: {diff}");
            let mut out = vec![0f32; 32];
            let scratch = &mut AttnScratch::default();
            let q_row = rows(end, 2, 2.0);
            cpu.attend_row(&q_row, 8, &params, window, (&mut out, scratch))
                .unwrap();
            let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                out, a,
                "{dtype:?} {params:?} after {end}: attend_row differs from attend"
            );
        }
    }
}

/// A slot handed out by `decode_slot` and written in place (as the GPU's batched append does)
/// leaves the buffer as `append` of the same row does, across growth and window drops; buffers
/// that keep anything but plain tensors hand out none and stay as they were.
#[test]
fn decode_slots_written_in_place_match_appends() {
    let (keep, window) = (Some(300), Some(280));
    let params = AttnParams::scaled(0.3);
    for dtype in [None, Some(DType::F16)] {
        let (mut appended, mut slotted) = (
            KvBuffer::new_on_tensors(dtype),
            KvBuffer::new_on_tensors(dtype),
        );
        let t = |x: Vec<f32>, n| Tensor::from_vec(x, (1, 2, n, 8), &Device::Cpu).unwrap();
        let (k, v) = (t(rows(0, 5, 0.0), 5), t(rows(0, 5, 1.0), 5));
        appended.append(&k, &v, keep).unwrap();
        slotted.append(&k, &v, keep).unwrap();
        for end in 5..700 {
            let (k, v) = (t(rows(end, 1, 0.0), 1), t(rows(end, 1, 1.0), 1));
            appended.append(&k, &v, keep).unwrap();
            let slot = slotted.decode_slot((2, 8), DType::F32, &Device::Cpu, keep);
            let (bk, bv, at) = slot.unwrap().expect("a tensor store hands out slots");
            bk.slice_set(&k.to_dtype(bk.dtype()).unwrap(), 2, at)
                .unwrap();
            bv.slice_set(&v.to_dtype(bv.dtype()).unwrap(), 2, at)
                .unwrap();
            assert_eq!(
                (appended.start, appended.used),
                (slotted.start, slotted.used)
            );
            let q = Tensor::from_vec(rows(end, 2, 2.0), (1, 4, 1, 8), &Device::Cpu).unwrap();
            let a = appended.attend(&q, &params, window).unwrap();
            let b = slotted.attend(&q, &params, window).unwrap();
            let diff = peregrine_tensor::ops::max_abs_diff(&a, &b).unwrap();
            assert_eq!(diff, 0.0, "{dtype:?} after {end}");
        }
    }
    let mut quant = KvBuffer::new_on_tensors(None);
    quant.quant = Some(KvQuant {
        bits: 8,
        group_size: 32,
    });
    for mut b in [
        KvBuffer::new(None),
        quant,
        KvBuffer {
            tensors_on_cpu: true,
            ..KvBuffer::keys_as_values(None)
        },
    ] {
        let slot = b
            .decode_slot((2, 8), DType::F32, &Device::Cpu, None)
            .unwrap();
        assert!(slot.is_none() && b.used == 0 && b.store.is_none());
    }
}
