//! The Gemma decoder's batched decode step: one new token per sequence over step buffers with
//! a row per sequence, as [`DecoderLm`](crate::layers::decoder::DecoderLm)'s is for the llama
//! family (Gemma 2 and 3, and Gemma 4 checkpoints without experts or per-layer inputs).

use peregrine_tensor::{RotaryEmbedding, Tensor};

use super::{GemmaLm, Layer};
use crate::Result;
use crate::layers::batch::BatchSeq;
use crate::layers::decoder::SelfAttention;
use crate::layers::step::{
    StepBuffers, StepRow, add_normed_into, batch_positions, decodes_only, head_rows_into,
    norm_rows_into, softcap_in_place, step_rows,
};

impl GemmaLm {
    /// Whether [`step_batch`](Self::step_batch) runs `batch`: one new token per sequence, no
    /// image rows or drafter state, on the CPU, through layers without experts or per-layer
    /// inputs.
    pub(super) fn steps_batch(&self, batch: &mut [BatchSeq]) -> bool {
        let layers = (self.layers.iter())
            .all(|l| l.moe.is_none() && l.per_layer.is_none() && l.self_attn.steps_rows());
        decodes_only(batch) && layers && self.per_layer_inputs.is_none() && self.device.is_cpu()
    }

    /// [`forward_batch`](crate::CausalLm::forward_batch) of one token per sequence over a
    /// batched step's buffers; each row's bits are its sequence's `forward`'s.
    pub(super) fn step_batch(&self, batch: &mut [BatchSeq]) -> Result<Tensor> {
        let (rows, h, vocab) = (batch.len(), self.config.hidden_size, self.config.vocab_size);
        let positions = batch_positions(batch, self.rope_global.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let scale = (h as f32).sqrt();
        let mut logits = vec![0f32; rows * vocab];
        self.steps.run_rows(&self.config, rows, |b| -> Result<()> {
            for (x, s) in b.x.chunks_mut(h).zip(batch.iter()) {
                self.embed_tokens.row_into(s.tokens[0], x)?;
            }
            b.x.iter_mut().for_each(|x| *x *= scale);
            for layer in &self.layers {
                let mut seqs = step_rows(batch, &positions, layer.slot);
                layer.step_rows(b, eps, self.rope(layer), &mut seqs)?;
            }
            head_rows_into(b, &self.norm, eps, &self.lm_head, &mut logits)?;
            if let Some(cap) = self.config.final_logit_softcapping {
                softcap_in_place(&mut logits, cap as f32);
            }
            Ok(())
        })?;
        Ok(Tensor::from_vec(logits, (rows, vocab), &self.device)?)
    }
}

impl Layer {
    /// [`step`](Layer::step) for a batched step's rows (`b.x`, one per sequence of `seqs`),
    /// on a layer without experts or a per-layer input.
    fn step_rows(
        &self,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        seqs: &mut [StepRow],
    ) -> Result<()> {
        norm_rows_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step_rows(b, rope, seqs)?;
        let (x, out, normed) = (&mut b.x, &b.out, &mut b.normed);
        add_normed_into(x, out, &self.post_attention_layernorm, eps, normed)?;
        norm_rows_into(&b.x, &self.pre_feedforward_layernorm, eps, &mut b.normed)?;
        self.mlp.step(b)?;
        let (x, out, normed) = (&mut b.x, &b.out, &mut b.normed);
        add_normed_into(x, out, &self.post_feedforward_layernorm, eps, normed)?;
        if self.scalar != 1.0 {
            b.x.iter_mut().for_each(|x| *x *= self.scalar);
        }
        Ok(())
    }
}
