//! MLX affine kernels against their bit-by-bit reference, for every supported bit width and
//! group size, on shapes chosen to hit the edges: row counts that are not a multiple of the
//! tile, a single output row, decode (one input row) and batches.
//!
//! Tolerance: the dequantized rows must be bit-identical (same `s * q + b` in f32); products
//! may differ by summation order only (the fused decode factors `s·Σqx + b·Σx` and uses 8
//! partial sums), so we allow 1e-5 × the sum of |w·x| terms, far below any decoding mistake
//! (one wrong code shifts a product by at least |scale| × |x|).

use peregrine_tensor::mlx::{MlxQuantized, SUPPORTED_BITS};
use peregrine_tensor::{DType, Device, Embedding, QLinear, Tensor};

/// Deterministic xorshift; the tests need no statistical quality, only variety.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn random_quantized(
    rng: &mut Rng,
    out: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
) -> MlxQuantized {
    let words = in_dim * bits / 32;
    let packed: Vec<u32> = (0..out * words).map(|_| rng.next() as u32).collect();
    let groups = in_dim / group;
    // Negative scales occur in real checkpoints (MLX stores max→min ranges that way).
    let scale = 1.0 / (1u32 << bits) as f32;
    let scales: Vec<f32> = (0..out * groups).map(|_| rng.uniform() * scale).collect();
    let biases: Vec<f32> = (0..out * groups).map(|_| rng.uniform() * 0.5).collect();
    let dev = Device::Cpu;
    MlxQuantized::new(
        Tensor::from_vec(packed, (out, words), &dev).unwrap(),
        Tensor::from_vec(scales, (out, groups), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
        Tensor::from_vec(biases, (out, groups), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
        bits,
        group,
    )
    .unwrap()
}

fn random_input(rng: &mut Rng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(
        (0..n).map(|_| rng.uniform()).collect::<Vec<f32>>(),
        dims,
        &Device::Cpu,
    )
    .unwrap()
}

/// Max |a - b| and the allowed error 1e-5 × max over outputs of Σ|w||x|.
fn check_product(q: &MlxQuantized, x: &Tensor, y: &Tensor, what: &str) {
    let w = q.dequantize_ref().unwrap();
    let y_ref = q.forward_ref(x).unwrap();
    assert_eq!(y.dims(), y_ref.dims(), "{what}: shape");
    let x2 = x.flatten_to(x.rank() - 2).unwrap();
    let bound = x2
        .abs()
        .unwrap()
        .matmul(&w.abs().unwrap().t().unwrap())
        .unwrap();
    let scale = bound
        .max_keepdim(1)
        .unwrap()
        .max(0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let tol = 1e-5 * scale.to_scalar::<f32>().unwrap();
    let diff = (y - y_ref)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let diff = diff.to_scalar::<f32>().unwrap();
    assert!(diff <= tol, "{what}: max abs diff {diff} > {tol}");
}

const GROUPS: [usize; 3] = [32, 64, 128];

#[test]
fn dequantized_rows_equal_reference_exactly() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            let q = random_quantized(&mut rng, 5, group * 3, bits, group);
            let fused = q.dequantize_rows(0, 5).unwrap().to_vec2::<f32>().unwrap();
            let reference = q.dequantize_ref().unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(fused, reference, "bits {bits} group {group}");
        }
    }
}

#[test]
fn decode_matvec_equals_reference() {
    let mut rng = Rng(42);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            for out in [1, 37] {
                let q = random_quantized(&mut rng, out, group * 5, bits, group);
                let x = random_input(&mut rng, &[1, 1, group * 5]);
                let what = format!("decode bits {bits} group {group} out {out}");
                check_product(&q, &x, &q.forward(&x).unwrap(), &what);
            }
        }
    }
}

#[test]
fn tiled_batch_equals_reference() {
    let mut rng = Rng(7);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            // 37 rows with 8-row tiles leaves a 5-row tail; 1 row is a single short tile.
            for (out, tile) in [(37, 8), (1, 8), (37, 0)] {
                let q = random_quantized(&mut rng, out, group * 3, bits, group);
                let x = random_input(&mut rng, &[2, 3, group * 3]);
                let what = format!("batch bits {bits} group {group} out {out} tile {tile}");
                check_product(&q, &x, &q.forward_tiled(&x, tile).unwrap(), &what);
            }
        }
    }
}

#[test]
fn bf16_input_keeps_its_dtype() {
    let mut rng = Rng(3);
    let q = random_quantized(&mut rng, 9, 64, 4, 32);
    let x = random_input(&mut rng, &[4, 64])
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(q.forward(&x).unwrap().dtype(), DType::BF16);
}

#[test]
fn quantized_embedding_looks_up_dequantized_rows() {
    let mut rng = Rng(11);
    for bits in SUPPORTED_BITS {
        let q = random_quantized(&mut rng, 13, 96, bits, 32);
        let emb = Embedding::MlxAffine(q.clone());
        let ids = Tensor::new(&[[12u32, 0, 5], [5, 7, 1]], &Device::Cpu).unwrap();
        let got = emb.forward(&ids, DType::F32).unwrap();
        let want = q
            .dequantize_ref()
            .unwrap()
            .index_select(&ids.flatten_all().unwrap(), 0)
            .unwrap();
        assert_eq!(got.dims(), &[2, 3, 96]);
        let got = got.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, want.to_vec2::<f32>().unwrap(), "bits {bits}");
        assert!(
            emb.forward(&Tensor::new(&[13u32], &Device::Cpu).unwrap(), DType::F32)
                .is_err()
        );
    }
}

#[test]
fn linear_adds_bias_and_reports_packed_bytes() {
    let mut rng = Rng(5);
    let q = random_quantized(&mut rng, 6, 128, 4, 64);
    let b = Tensor::new(&[1f32, 2., 3., 4., 5., 6.], &Device::Cpu).unwrap();
    let lin = QLinear::MlxAffine {
        w: q.clone(),
        b: Some(b.clone()),
    };
    let x = random_input(&mut rng, &[2, 128]);
    let want = q.forward_ref(&x).unwrap().broadcast_add(&b).unwrap();
    let diff = (lin.forward(&x).unwrap() - want)
        .unwrap()
        .abs()
        .unwrap()
        .max(1)
        .unwrap()
        .max(0)
        .unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() < 1e-4);
    // 6 rows × 16 words × 4 B packed + 2 × 6 × 2 groups × 4 B scales/biases + 6 × 4 B bias.
    assert_eq!(lin.weight_bytes(), 6 * 16 * 4 + 2 * 6 * 2 * 4 + 6 * 4);
}

#[test]
fn rejects_inconsistent_shapes() {
    let dev = Device::Cpu;
    let packed = Tensor::zeros((4, 8), DType::U32, &dev).unwrap();
    let sb = Tensor::zeros((4, 2), DType::F32, &dev).unwrap();
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 4, 32).is_ok());
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 7, 32).is_err());
    assert!(MlxQuantized::new(packed.clone(), sb.clone(), sb.clone(), 4, 64).is_err());
    assert!(
        MlxQuantized::new(packed.to_dtype(DType::F32).unwrap(), sb.clone(), sb, 4, 32).is_err()
    );
}

#[test]
fn quantize_round_trips_within_a_step() {
    let mut rng = Rng(13);
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            let w = random_input(&mut rng, &[7, group * 2]);
            let q = MlxQuantized::quantize(&w, bits, group).unwrap();
            let back = q.dequantize_ref().unwrap().to_vec2::<f32>().unwrap();
            let scales = q.parts().1.to_vec2::<f32>().unwrap();
            for (r, (orig, back)) in w.to_vec2::<f32>().unwrap().iter().zip(&back).enumerate() {
                for (i, (a, b)) in orig.iter().zip(back).enumerate() {
                    // One step (the exact extreme can push the other one up to a step past
                    // the top code), plus the bf16 rounding of the bias (2^-8 of |edge| ≤ 1).
                    let step = scales[r][i / group].abs();
                    let tol = step + 1.0 / 256.0 + 1e-6;
                    assert!(
                        (a - b).abs() <= tol,
                        "bits {bits} group {group}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
