//! A decode step's rows turned and written into their caches in one launch (CUDA): the
//! rotation's side of `kernels/cuda/kv_append.cu`.

use candle_core::{Result, Tensor};

use super::RotaryEmbedding;

impl RotaryEmbedding {
    /// Whether [`turn_and_append`](Self::turn_and_append) takes a decode step's rows `q: [1,
    /// heads, rows, d]`, `k, v: [1, kv_heads, rows, d]` at `positions` (no side effects): a
    /// CUDA build and device, rows in the tables' dtype with each head contiguous, no M-RoPE,
    /// one table for every position.
    pub fn turns_in_place(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        positions: &[u32],
    ) -> bool {
        let (Some(&lo), Some(&hi)) = (positions.iter().min(), positions.iter().max()) else {
            return false;
        };
        cfg!(feature = "cuda")
            && self.sections.is_none()
            && q.dims().get(2) == Some(&positions.len())
            && (hi as usize) < self.max_positions
            && std::ptr::eq(self.table(lo as usize + 1), self.table(hi as usize + 1))
            && [q, k, v]
                .iter()
                .all(|t| t.dtype() == self.dtype && t.dim(3).ok() == Some(self.head_dim))
            && crate::attention::append_rows_takes(q, q, k.dtype())
            && crate::attention::append_rows_takes(k, v, k.dtype())
    }

    /// A decode step's rows in one launch (CUDA): row `i` of `q` and `k` turned at
    /// `positions[i]` exactly as [`apply`](Self::apply) turns it, the keys and `v` written into
    /// `slots[i]`'s cache (converted to its dtype), and the turned queries returned as
    /// `[rows, heads, d]` f32. Errs, writing nothing, where
    /// [`turns_in_place`](Self::turns_in_place) does not hold.
    pub fn turn_and_append(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        positions: &[u32],
        slots: &[crate::attention::AppendSlot],
    ) -> Result<Tensor> {
        if !self.turns_in_place(q, (k, v), positions) || slots.len() != positions.len() {
            candle_core::bail!("rope: {} rows cannot be turned in place", positions.len())
        }
        #[cfg(feature = "cuda")]
        {
            let hi = positions.iter().max().map_or(0, |&p| p as usize);
            let (cos, sin) = self.tables(0, hi + 1)?;
            let turn = crate::kv_append_cuda::Turn {
                cos: &cos,
                sin: &sin,
                positions,
                half: self.rotary_dim / 2,
                interleaved: self.style == super::RopeStyle::Interleaved,
            };
            let q = crate::kv_append_cuda::decode_rows(Some(q), (k, v), slots, Some(turn))?;
            q.ok_or_else(|| candle_core::Error::Msg("rope: no query rows came back".into()))
        }
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("rope: turning rows in place needs a CUDA build")
    }
}
