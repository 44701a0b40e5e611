//! The GPU expert tables (`kernels/cuda/moe_gemv.cu`) against the f32 MoE of the same experts
//! dequantized on the CPU. Built only with the `cuda` feature and run on a GPU machine (`cargo
//! test -p peregrine-tensor --features cuda --test moe_cuda`).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use common::{f32s, flat, ramp};
use peregrine_tensor::moe::ExpertTables;
use peregrine_tensor::{DType, Device, QLinear};

/// A matrix of `format` on the GPU as the loader makes it, and its dequantized f32 values
/// `[out, in]` on the CPU.
fn matrix(
    gpu: &Device,
    (out, inp): (usize, usize),
    format: GgmlDType,
    seed: f32,
) -> (QLinear, Vec<f32>) {
    let w = ramp(&[out, inp], seed, DType::F32);
    let q = QTensor::quantize(&w, format).unwrap();
    let exact = flat(&q.dequantize(&Device::Cpu).unwrap());
    let blocks = QStorage::from_data(q.data().unwrap(), gpu, format).unwrap();
    let q = Arc::new(QTensor::new(blocks, (out, inp)).unwrap());
    (QLinear::from_qtensor(q, None).unwrap(), exact)
}

/// `w [out, in] · x [in]` in f64, and the same over absolute values.
fn matvec(w: &[f32], x: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let inp = x.len();
    (w.chunks(inp))
        .map(|row| {
            let dot: f64 = row.iter().zip(x).map(|(&w, x)| f64::from(w) * x).sum();
            let abs: f64 = row
                .iter()
                .zip(x)
                .map(|(&w, x)| f64::from(w.abs()) * x.abs())
                .sum();
            (dot, abs)
        })
        .unzip()
}

/// Routed tokens through Q4_K/Q6_K experts (both formats in both kernels), 1, 3 and 8 tokens
/// a choice at a time and 40 grouped by expert, bf16 and f16, one choice unused: each output
/// within its dtype's rounding step plus 1e-4 of the sum of absolute products (the kernels add
/// f32 products in another order than the f64 reference; their inputs and weights are exactly
/// the reference's).
#[test]
fn expert_tables_match_the_f32_experts() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (experts, inter, hidden, k) = (6, 256, 512, 3);
    for (gate_up, down) in [
        (GgmlDType::Q4K, GgmlDType::Q6K),
        (GgmlDType::Q6K, GgmlDType::Q4K),
    ] {
        let mats: Vec<[(QLinear, Vec<f32>); 3]> = (0..experts)
            .map(|e| {
                let s = 3.0 * e as f32;
                [
                    matrix(&gpu, (inter, hidden), gate_up, s),
                    matrix(&gpu, (inter, hidden), gate_up, s + 1.0),
                    matrix(&gpu, (hidden, inter), down, s + 2.0),
                ]
            })
            .collect();
        let parts: Vec<[&QLinear; 3]> = mats.iter().map(|m| [&m[0].0, &m[1].0, &m[2].0]).collect();
        let tables = ExpertTables::new(&parts)
            .unwrap()
            .expect("Q4_K/Q6_K experts on the GPU");
        for dtype in [DType::BF16, DType::F16] {
            for n in [1, 3, 8, 40] {
                let x = ramp(&[n, hidden], n as f32 + 0.25, dtype);
                let xs = flat(&f32s(&x));
                let ids: Vec<usize> = (0..n * k)
                    .map(|s| {
                        if s == 1 {
                            usize::MAX
                        } else {
                            (5 * s + s / k) % experts
                        }
                    })
                    .collect();
                let weights: Vec<f32> = (0..n * k).map(|s| 0.2 + 0.1 * (s % 5) as f32).collect();
                let got = tables
                    .forward(&x.to_device(&gpu).unwrap(), &ids, &weights)
                    .unwrap();
                assert_eq!(got.dims(), &[n, hidden]);
                let got = flat(&got);
                let step = if dtype == DType::BF16 {
                    1.0 / 128.0
                } else {
                    1.0 / 1024.0
                };
                for t in 0..n {
                    let xt: Vec<f64> = xs[t * hidden..][..hidden]
                        .iter()
                        .map(|&v| v.into())
                        .collect();
                    let (mut want, mut scale) = (vec![0f64; hidden], vec![0f64; hidden]);
                    for s in t * k..(t + 1) * k {
                        let Some(m) = mats.get(ids[s]) else { continue };
                        let (g, _) = matvec(&m[0].1, &xt);
                        let (u, _) = matvec(&m[1].1, &xt);
                        let h: Vec<f64> = g
                            .iter()
                            .zip(&u)
                            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                            .collect();
                        let (y, abs) = matvec(&m[2].1, &h);
                        let w = f64::from(weights[s]);
                        (0..hidden).for_each(|c| {
                            want[c] += w * y[c];
                            scale[c] += w * abs[c];
                        });
                    }
                    for c in 0..hidden {
                        let g = f64::from(got[t * hidden + c]);
                        let near = want[c].abs() * step + 1e-4 * scale[c] + 1e-6;
                        assert!(
                            (g - want[c]).abs() <= near,
                            "{gate_up:?}/{down:?} {dtype:?}, {n} tokens, token {t} output {c}: {g} against {}",
                            want[c]
                        );
                    }
                }
            }
        }
        // A format the kernels lack: no tables.
        let (q8, _) = matrix(&gpu, (inter, hidden), GgmlDType::Q8_0, 0.5);
        let mut parts = parts.clone();
        parts[0][1] = &q8;
        assert!(ExpertTables::new(&parts).unwrap().is_none());
    }
    // CPU matrices: no tables either.
    let cpu = QLinear::from_qtensor(
        Arc::new(
            QTensor::quantize(&ramp(&[inter, hidden], 0.0, DType::F32), GgmlDType::Q4K).unwrap(),
        ),
        None,
    )
    .unwrap();
    assert!(ExpertTables::new(&[[&cpu, &cpu, &cpu]]).unwrap().is_none());
}

/// The host router's choice for one token (`peregrine-moe`'s `Router::softmax`): softmax, the
/// `k` best (the first of equal scores), renormalised when `normalize`, times `scale`.
fn host_route(logits: &[f32], k: usize, normalize: bool, scale: f32) -> (Vec<usize>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut p: Vec<f32> = exp.iter().map(|e| e / sum).collect();
    let (mut ids, mut weights) = (vec![], vec![]);
    for _ in 0..k {
        let best = (0..p.len()).fold(0, |b, i| if p[i] > p[b] { i } else { b });
        ids.push(best);
        weights.push(p[best]);
        p[best] = f32::NEG_INFINITY;
    }
    let total: f32 = weights.iter().sum();
    let weights = weights
        .iter()
        .map(|w| if normalize { w / total } else { *w } * scale)
        .collect();
    (ids, weights)
}

/// Routing on the device (`forward_routed`) chooses the host router's experts with its weights
/// (to an f32 rounding): its output equals `forward` over the host's choice within one
/// rounding step of the output dtype.
#[test]
fn routing_on_the_device_matches_the_host_router() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let (experts, inter, hidden) = (40, 256, 256);
    let mats: Vec<[QLinear; 3]> = (0..experts)
        .map(|e| {
            let s = 3.0 * e as f32 + 0.125;
            [
                matrix(&gpu, (inter, hidden), GgmlDType::Q4K, s).0,
                matrix(&gpu, (inter, hidden), GgmlDType::Q4K, s + 1.0).0,
                matrix(&gpu, (hidden, inter), GgmlDType::Q6K, s + 2.0).0,
            ]
        })
        .collect();
    let parts: Vec<[&QLinear; 3]> = mats.iter().map(|m| [&m[0], &m[1], &m[2]]).collect();
    let tables = ExpertTables::new(&parts).unwrap().unwrap();
    for (n, k, normalize, scale) in [(1, 8, true, 1.0), (5, 3, false, 2.5), (8, 1, true, 1.0)] {
        let x = ramp(&[n, hidden], 7.0 + n as f32, DType::BF16)
            .to_device(&gpu)
            .unwrap();
        let logits = (ramp(&[n, experts], k as f32, DType::F32) * 4.0).unwrap();
        let host = flat(&logits.to_dtype(DType::BF16).unwrap());
        let (mut ids, mut weights) = (vec![], vec![]);
        for row in host.chunks(experts) {
            let (i, w) = host_route(row, k, normalize, scale);
            ids.extend(i);
            weights.extend(w);
        }
        let logits = logits
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(&gpu)
            .unwrap();
        let got = flat(
            &tables
                .forward_routed(&x, &logits, k, (normalize, scale))
                .unwrap(),
        );
        let want = flat(&tables.forward(&x, &ids, &weights).unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= w.abs() / 128.0 + 1e-6,
                "{n} tokens, top {k}: output {i}: {g} routed on the device, {w} by the host"
            );
        }
    }
}
