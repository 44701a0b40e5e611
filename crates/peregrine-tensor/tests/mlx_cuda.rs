//! The CUDA MLX kernels (`kernels/cuda/mlx_affine.cu`) against the bit-by-bit reference on the
//! CPU, for every bit width, group size and scale dtype: the GEMV at 1, 3 and 8 input rows, the
//! dequantize-and-cuBLAS path at 9, and embedding rows. Built only with the `cuda` feature and
//! run on a GPU machine (`cargo test -p peregrine-tensor --features cuda --test mlx_cuda`).
//!
//! Tolerance: f32 activations give the reference's products up to summation order (1e-5 of
//! Σ|w·x|, as tests/mlx.rs); dequantized rows must be bit-identical (the same `s * q + b` in
//! f32). A wrong code or group moves an output by at least |scale · x|, far above both.
#![cfg(feature = "cuda")]

use peregrine_tensor::mlx::{MlxQuantized, SUPPORTED_BITS};
use peregrine_tensor::{DType, Device, Embedding, Tensor};

mod common;

use common::{GROUPS, Rng, random_quantized_as};

fn on(device: &Device, q: &MlxQuantized) -> MlxQuantized {
    let (p, s, b) = q.parts();
    let (bits, group) = q.params();
    let to = |t: &Tensor| t.to_device(device).unwrap();
    MlxQuantized::new(to(p), to(s), to(b), bits, group).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn gemv_and_batched_products_match_the_reference() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let mut rng = Rng(7);
    let dtypes = [DType::BF16, DType::F16, DType::F32];
    for bits in SUPPORTED_BITS {
        for group in GROUPS {
            for (i, rows) in [1, 3, 8, 9].into_iter().enumerate() {
                let dtype = dtypes[(i + bits) % 3];
                let q = random_quantized_as(&mut rng, 45, group * 3, bits, group, dtype);
                let n = rows * group * 3;
                let x: Vec<f32> = (0..n).map(|_| rng.uniform()).collect();
                let x = Tensor::from_vec(x, (rows, group * 3), &Device::Cpu).unwrap();
                let want = q.forward_ref(&x).unwrap();
                let got = on(&gpu, &q).forward(&x.to_device(&gpu).unwrap()).unwrap();
                let got = got.to_device(&Device::Cpu).unwrap();
                let w = q.dequantize_ref().unwrap();
                let bound = x
                    .abs()
                    .unwrap()
                    .matmul(&w.abs().unwrap().t().unwrap())
                    .unwrap();
                let tol = 1e-5 * max_abs(&bound);
                let diff = max_abs(&(got - &want).unwrap());
                let what = format!("bits {bits} group {group} rows {rows} scales {dtype:?}");
                assert!(diff <= tol, "{what}: max abs diff {diff} > {tol}");
            }
        }
    }
}

#[test]
fn embedding_rows_equal_the_reference_exactly() {
    let gpu = Device::new_cuda(0).expect("these tests need a CUDA GPU");
    let mut rng = Rng(3);
    for bits in SUPPORTED_BITS {
        let q = random_quantized_as(&mut rng, 13, 96, bits, 32, DType::BF16);
        let ids = [12u32, 0, 5, 5, 7, 1];
        let want = q
            .dequantize_ref()
            .unwrap()
            .index_select(&Tensor::new(&ids, &Device::Cpu).unwrap(), 0)
            .unwrap();
        let emb = Embedding::MlxAffine(on(&gpu, &q));
        let got = emb
            .forward(&Tensor::new(&ids, &gpu).unwrap(), DType::F32)
            .unwrap();
        let got = got.to_device(&Device::Cpu).unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
            "bits {bits}"
        );
    }
}
