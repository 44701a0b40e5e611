//! GGUF rows multiplied where they lie (`GgufMatrix::from_shared`: a mapped file's range, as a
//! streamed expert is) go through the interleaved kernels 8 rows at a time, transposed as they
//! load: the same bits as the interleaved copy of the same rows, for every batch size, kernel
//! and input refinement (the streamed and resident paths must agree exactly).

mod common;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use peregrine_tensor::GgufMatrix;
use peregrine_tensor::quant::{Format, Kernel, QK, SharedBytes};

use common::Rng;

#[derive(Debug)]
struct Owned(Vec<u8>);

impl SharedBytes for Owned {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| rng.uniform()).collect()
}

#[test]
fn rows_in_place_give_the_interleaved_bits() {
    for dtype in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let (n, k) = (40, if dtype.block_size() == 256 { 512 } else { 320 });
        let format = Format::of(dtype).unwrap();
        let w = Tensor::from_vec(values(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let q = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let bytes = q.data().unwrap().to_vec();
        let fast = GgufMatrix::new(q.clone()).unwrap();
        let shared = Arc::new(Owned(bytes.clone()));
        let in_place = GgufMatrix::from_shared(format, shared, (n, k)).unwrap();
        assert_eq!(in_place.weight_bytes(), bytes.len());
        assert_eq!(
            GgufMatrix::multiplies_in_place(format, n, k),
            fast.is_interleaved(),
            "{dtype:?}: in place wherever the interleaved kernels run"
        );
        // Decode, tiles of 1-8 inputs and their tails, and a prefill-sized batch; every
        // second input row has an outlier block, which the 32-value formats refine (the
        // K-quants take no refinements).
        for m in [1, 2, 5, 8, 13, 40] {
            let mut x = values(m * k, m as u64);
            for (i, row) in x.chunks_mut(k).enumerate().step_by(2) {
                row[(i % (k / QK)) * QK + 5] = 60.0;
            }
            for kernel in Kernel::available() {
                let want = fast.matmul_with(&x, m, kernel).unwrap();
                let got = in_place.matmul_with(&x, m, kernel).unwrap();
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} {kernel:?} m={m}: {want:?} vs {got:?}");
            }
        }
        // A lookup dequantizes the row as the file has it.
        let mut row = vec![0f32; k];
        in_place.row_into(17, &mut row).unwrap();
        let want: Vec<f32> = (q.dequantize(&Device::Cpu).unwrap())
            .get(17)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(row, want, "{dtype:?}");
    }
}

#[test]
fn a_shared_range_of_the_wrong_size_is_refused() {
    let shared = Arc::new(Owned(vec![0u8; 18 * 10 - 1]));
    let err = GgufMatrix::from_shared(Format::Q4_0, shared, (1, 320)).unwrap_err();
    assert!(err.to_string().contains("179 bytes"), "{err}");
}
