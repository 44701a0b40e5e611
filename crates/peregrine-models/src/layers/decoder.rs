//! The llama-family decoder (pre-norm attention + gated MLP), parameterised by config flags:
//! q/k/v bias (Qwen2), q/k norm (Qwen3), sliding window (Mistral), routed experts in place of
//! the MLP (Mixtral, Qwen3-MoE). Architectures that differ only in such flags reuse it rather
//! than copying it.

use peregrine_kv::{LayerCache, LayerKind, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Device, Embedding, QLinear, RotaryEmbedding, Tensor};

use crate::layers::attention::Attention;
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::Ffn;
use crate::layers::norm_weight;
use crate::layers::step::{StepBuffers, StepPool, add_into, norm_into, output_logits_into};
use crate::weights::Weights;
use crate::{CausalLm, Logits, ModelConfig, Result};

struct DecoderLayer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    mlp: Ffn,
}

/// A decoder-only transformer of the llama family.
pub struct DecoderLm {
    config: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: QLinear,
    rope: RotaryEmbedding,
    device: Device,
    dtype: DType,
    steps: StepPool,
}

impl DecoderLm {
    /// Loads the weights for `config`; RoPE tables cover `max_context` positions.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                // Phi-3 fuses q/k/v and gate/up: split at load, the layers stay the same.
                let fused = |name: &str| w.contains(&format!("{p}.{name}.weight"));
                let (attn, mlp) = (format!("{p}.self_attn"), format!("{p}.mlp"));
                Ok(DecoderLayer {
                    input_layernorm: norm_weight(c, w, &format!("{p}.input_layernorm.weight"), h)?,
                    self_attn: match fused("self_attn.qkv_proj") {
                        true => Attention::load_fused(c, w, &attn)?,
                        false => Attention::load(c, w, &attn)?,
                    },
                    post_attention_layernorm: norm_weight(
                        c,
                        w,
                        &format!("{p}.post_attention_layernorm.weight"),
                        h,
                    )?,
                    mlp: match fused("mlp.gate_up_proj") {
                        true => Ffn::Dense(GatedMlp::load_fused(c, w, &mlp)?),
                        false => Ffn::load(c, w, i)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = super::lm_head(c, w, &embed_tokens)?;
        let rope = RotaryEmbedding::new_partial(
            (c.head_dim, c.rotary_dim()),
            c.rope_theta,
            &c.rope_scaling,
            c.rope_style,
            max_context,
            DType::F32,
            w.device(),
        )?;
        Ok(Self {
            norm: norm_weight(c, w, "model.norm.weight", h)?,
            embed_tokens,
            layers,
            lm_head,
            rope,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
            steps: StepPool::default(),
        })
    }
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Tensor,
        eps: f32,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        start: usize,
    ) -> Result<Tensor> {
        let attn = self.self_attn.forward(
            &rms_norm(x, &self.input_layernorm, eps)?,
            rope,
            cache,
            start,
        )?;
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&rms_norm(&x, &self.post_attention_layernorm, eps)?)?;
        Ok((x + mlp)?)
    }

    /// [`forward`](Self::forward) for one token over a decode step's buffers (`b.x`).
    fn step(
        &self,
        b: &mut StepBuffers,
        eps: f32,
        rope: &RotaryEmbedding,
        cache: &mut dyn LayerCache,
        pos: usize,
    ) -> Result<()> {
        norm_into(&b.x, &self.input_layernorm, eps, &mut b.normed)?;
        self.self_attn.step(b, rope, cache, pos)?;
        add_into(&mut b.x, &b.out);
        norm_into(&b.x, &self.post_attention_layernorm, eps, &mut b.normed)?;
        self.mlp.step(b)?;
        add_into(&mut b.x, &b.out);
        Ok(())
    }
}

impl CausalLm for DecoderLm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        let kind = match self.config.sliding_window {
            Some(window) => LayerKind::Sliding { window },
            None => LayerKind::Full,
        };
        vec![kind; self.layers.len()]
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let n = tokens.len();
        let start = cache.len();
        super::check_room(n, start, self.rope.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?; // [1, n]
        let mut x = self.embed_tokens.forward(&ids, self.dtype)?; // [1, n, hidden]
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, eps, &self.rope, cache.layer(i), start)?;
        }
        super::output_logits(&x, want, &self.norm, eps, &self.lm_head)
    }

    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        if !self.device.is_cpu() {
            return crate::decode_with_forward(self, token, cache, logits);
        }
        let pos = cache.len();
        super::check_room(1, pos, self.rope.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        self.steps.run(&self.config, |b| {
            self.embed_tokens.row_into(token, &mut b.x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                layer.step(b, eps, &self.rope, cache.layer(i), pos)?;
            }
            let vocab = self.config.vocab_size;
            output_logits_into(b, &self.norm, eps, &self.lm_head, vocab, logits)
        })
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layers = self.layers.iter();
        let layer_bytes = layers.map(|l| l.self_attn.weight_bytes() + l.mlp.weight_bytes());
        super::decoder_weight_bytes(
            &self.config,
            self.dtype,
            2,
            layer_bytes.sum(),
            &self.embed_tokens,
            &self.lm_head,
        )
    }
}
