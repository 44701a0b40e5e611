//! Slots a batched GPU decode step writes in place (`LayerCache::decode_slot`).

use peregrine_tensor::{DType, Device, Result, Tensor};

use super::{KvBuffer, Store};

impl KvBuffer {
    /// Whether [`decode_slot`](Self::decode_slot) hands out slots for rows on `device`.
    pub(crate) fn has_decode_slots(&self, device: &Device) -> bool {
        let on_tensors = !device.is_cpu() || self.tensors_on_cpu;
        on_tensors && self.quant.is_none() && !self.values_are_keys
    }

    /// Room for one more position written by the caller in place (a batched decode step's
    /// one launch for every sequence): the key and value buffers (`[1, heads, capacity,
    /// head_dim]`) and the slot, which counts as stored from here on. `None`, changing
    /// nothing, where the buffer keeps no such tensors (CPU planes, quantized rows, keys as
    /// values). `dtype`: the rows', stored as the buffer's dtype says.
    pub(crate) fn decode_slot(
        &mut self,
        (heads, head_dim): (usize, usize),
        dtype: DType,
        device: &Device,
        keep: Option<usize>,
    ) -> Result<Option<(Tensor, Tensor, usize)>> {
        if !self.has_decode_slots(device) {
            return Ok(None);
        }
        let dtype = self.dtype.unwrap_or(dtype);
        self.make_room(1, keep, (heads, head_dim), dtype, device)?;
        let Some(Store::Tensors(k, Some(v))) = &self.store else {
            return Ok(None);
        };
        let slot = (k.clone(), v.clone(), self.used);
        self.used += 1;
        Ok(Some(slot))
    }
}
