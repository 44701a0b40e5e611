//! Random values and MLX matrices shared by the test files.
#![allow(dead_code)] // each test binary uses its own subset

use peregrine_tensor::mlx::MlxQuantized;
use peregrine_tensor::{DType, Device, Tensor};

/// MLX's group sizes.
pub const GROUPS: [usize; 3] = [32, 64, 128];

/// Deterministic xorshift; the tests need no statistical quality, only variety.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

pub fn random_quantized(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
) -> MlxQuantized {
    random_quantized_as(rng, out, in_dim, bits, group, DType::BF16)
}

/// Random codes, scales and biases with the scales and biases stored as `dtype`.
pub fn random_quantized_as(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
    dtype: DType,
) -> MlxQuantized {
    // Negative scales occur in real checkpoints (MLX stores max→min ranges that way).
    let scale = 1.0 / (1u32 << bits) as f32;
    let (scales, biases) = (
        |r: &mut Rng| r.uniform() * scale,
        |r: &mut Rng| r.uniform() * 0.5,
    );
    random_codes(rng, (out, in_dim), (bits, group), dtype, scales, biases)
}

/// Random codes of `bits` for an `[out, in_dim]` matrix, with scales and biases drawn by
/// `scale` and `bias` and stored as `dtype`.
pub fn random_codes(
    rng: &mut Rng,
    (out, in_dim): (usize, usize),
    (bits, group): (usize, usize),
    dtype: DType,
    scale: impl Fn(&mut Rng) -> f32,
    bias: impl Fn(&mut Rng) -> f32,
) -> MlxQuantized {
    let (words, groups) = (in_dim * bits / 32, in_dim / group);
    let packed: Vec<u32> = (0..out * words).map(|_| rng.next() as u32).collect();
    let scales: Vec<f32> = (0..out * groups).map(|_| scale(rng)).collect();
    let biases: Vec<f32> = (0..out * groups).map(|_| bias(rng)).collect();
    let t = |v: Vec<f32>| {
        let t = Tensor::from_vec(v, (out, groups), &Device::Cpu).unwrap();
        t.to_dtype(dtype).unwrap()
    };
    let packed = Tensor::from_vec(packed, (out, words), &Device::Cpu).unwrap();
    MlxQuantized::new(packed, t(scales), t(biases), bits, group).unwrap()
}

/// `got` within `step` relative, plus `floor`, of `want`, value by value.
pub fn close(got: &[f32], want: &[f32], (step, floor): (f32, f32), case: &str) {
    assert_eq!(got.len(), want.len(), "{case}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = w.abs() * step + floor;
        assert!((g - w).abs() <= tol, "{case}, value {i}: {g} against {w}");
    }
}

/// A deterministic tensor of `dims` with values in [-2, 2] of every magnitude, on `device`.
pub fn wave(dims: &[usize], seed: f32, dtype: DType, device: &Device) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| 2.0 * ((i as f32 * 0.618 + seed).sin() * (i as f32 * 0.0137 + seed).cos()))
        .collect();
    let t = Tensor::from_vec(v, dims, &Device::Cpu).unwrap();
    t.to_dtype(dtype).unwrap().to_device(device).unwrap()
}

/// `t`'s values in f32 on the CPU, flattened.
pub fn flat(t: &Tensor) -> Vec<f32> {
    let t = t
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// A deterministic tensor of `dims` with values in [-1, 1] of every magnitude.
pub fn ramp(dims: &[usize], seed: f32, dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as f32 * 0.7548777 + seed * 0.5698403).fract() * 2.0 - 1.0) * ((i % 7) as f32 + 1.0)
                / 7.0
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// `t` in f32.
pub fn f32s(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// `x: [1, m, in] · w[out, in]ᵀ` in f32 on the CPU.
pub fn product(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap().unsqueeze(0).unwrap()).unwrap()
}
