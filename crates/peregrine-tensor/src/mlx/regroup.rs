//! MLX 4-bit weights regrouped into GGUF Q4_1 blocks, so the integer kernels of
//! [`crate::quant`] (8-bit activations, panel GEMM for prefill) multiply them.
//!
//! Both formats mean `w = scale·q + bias` with 4-bit `q`: an MLX group of 32/64/128 values is
//! 1/2/4 Q4_1 blocks sharing its scale and bias. Only the packing differs: MLX puts value `i` of
//! a group in nibble `i % 8` of word `i / 8`; Q4_1 puts value `j` of a block in the low nibble of
//! byte `j` and value `j + 16` in its high nibble. Q4_1 stores scale and bias as f16, so a
//! matrix regroups only when every stored scale and bias is exactly an f16 (bf16 values of
//! magnitude 2⁻¹⁴..65504 always are): the regrouped weights are the same numbers, bit for bit.

use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use candle_core::{DType, Result};
use half::f16;

use super::MlxQuantized;

/// Values per Q4_1 block.
const BLOCK: usize = 32;
/// Bytes per Q4_1 block: f16 scale, f16 bias, 16 bytes of codes.
const BLOCK_BYTES: usize = 20;

impl MlxQuantized {
    /// The same matrix as a GGUF Q4_1 tensor, or `None` when it is not 4-bit or a scale or bias
    /// is not exactly representable in f16.
    pub fn to_q4_1(&self) -> Result<Option<QTensor>> {
        if self.bits != 4 {
            return Ok(None);
        }
        let (out, in_dim) = self.dims();
        let f32s = |t: &candle_core::Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1();
        let (scales, biases): (Vec<f32>, Vec<f32>) = (f32s(&self.scales)?, f32s(&self.biases)?);
        let exact = |v: f32| f16::from_f32(v).to_f32().to_bits() == v.to_bits();
        if !scales.iter().chain(&biases).all(|&v| exact(v)) {
            return Ok(None);
        }
        let words = self.packed.flatten_all()?.to_vec1::<u32>()?;
        let blocks_per_group = self.group_size / BLOCK;
        let mut bytes = Vec::with_capacity(out * in_dim / BLOCK * BLOCK_BYTES);
        // 4 words (32 nibbles) per block, in row-major order in both layouts.
        for (b, w) in words.chunks_exact(4).enumerate() {
            let g = b / blocks_per_group;
            bytes.extend_from_slice(&f16::from_f32(scales[g]).to_le_bytes());
            bytes.extend_from_slice(&f16::from_f32(biases[g]).to_le_bytes());
            let code = |i: usize| ((w[i / 8] >> (4 * (i % 8))) & 0xF) as u8;
            bytes.extend((0..BLOCK / 2).map(|j| code(j) | code(j + BLOCK / 2) << 4));
        }
        qtensor_from_ggml(
            GgmlDType::Q4_1,
            &bytes,
            vec![out, in_dim],
            self.packed.device(),
        )
        .map(Some)
    }
}
