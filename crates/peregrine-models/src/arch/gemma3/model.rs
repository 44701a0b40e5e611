//! The Gemma 3 decoder: the shared attention (q/k norm, `query_pre_attn_scalar`, soft-capped
//! scores when the config caps them) and gated MLP (GELU-tanh) wrapped in four norms per layer,
//! with one RoPE table per layer kind; output logits soft-capped when the config says so. Gemma 2
//! is the same decoder without q/k norms, with one RoPE base and both caps.

use peregrine_kv::{LayerCache, LayerKind, SequenceCache};
use peregrine_tensor::ops::rms_norm;
use peregrine_tensor::{DType, Device, Embedding, QLinear, RopeScaling, RotaryEmbedding, Tensor};

use crate::layers::attention::Attention;
use crate::layers::mlp::GatedMlp;
use crate::layers::step::{
    StepBuffers, StepPool, add_normed_into, norm_into, output_logits_into, softcap_in_place,
};
use crate::layers::{add_normed, norm_weight, softcapped};
use crate::weights::Weights;
use crate::{CausalLm, Logits, ModelConfig, Result};

struct Layer {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    pre_feedforward_layernorm: Tensor,
    mlp: GatedMlp,
    post_feedforward_layernorm: Tensor,
    sliding: bool,
}

/// Gemma 3 (text) and Gemma 2: see the [module above](super) for what differs from llama.
pub struct Gemma3Lm {
    config: ModelConfig,
    embed_tokens: Embedding,
    /// `sqrt(hidden_size)` in the compute dtype, as HF multiplies it.
    embed_scale: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QLinear,
    rope_global: RotaryEmbedding,
    rope_local: RotaryEmbedding,
    device: Device,
    dtype: DType,
    steps: StepPool,
}

impl Gemma3Lm {
    /// Loads the weights for `config`; RoPE tables cover `max_context` positions.
    pub fn load(config: ModelConfig, w: &Weights, max_context: usize) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
        let sliding = |i: usize| match (&c.sliding_layers, c.sliding_window) {
            (Some(s), Some(_)) => s[i],
            (None, Some(_)) => true,
            (_, None) => false,
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let norm = |name: &str| norm_weight(c, w, &format!("{p}.{name}.weight"), h);
                Ok(Layer {
                    input_layernorm: norm("input_layernorm")?,
                    self_attn: Attention::load(c, w, &format!("{p}.self_attn"))?,
                    post_attention_layernorm: norm("post_attention_layernorm")?,
                    pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
                    mlp: GatedMlp::load(c, w, &format!("{p}.mlp"))?,
                    post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
                    sliding: sliding(i),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = w.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = crate::layers::lm_head(c, w, &embed_tokens)?;
        let rope = |theta: f64, scaling: &RopeScaling| {
            RotaryEmbedding::new(
                c.head_dim,
                theta,
                scaling,
                c.rope_style,
                max_context,
                DType::F32,
                w.device(),
            )
        };
        let rope_global = rope(c.rope_theta, &c.rope_scaling)?;
        let rope_local = match c.rope_local_theta {
            Some(theta) => rope(theta, &RopeScaling::None)?,
            None => rope_global.clone(),
        };
        let embed_scale = Tensor::new(&[(h as f32).sqrt()], w.device())?.to_dtype(w.dtype())?;
        Ok(Self {
            norm: norm_weight(c, w, "model.norm.weight", h)?,
            embed_tokens,
            embed_scale,
            layers,
            lm_head,
            rope_global,
            rope_local,
            device: w.device().clone(),
            dtype: w.dtype(),
            config,
            steps: StepPool::default(),
        })
    }
}

impl Layer {
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
        let x = add_normed(x, &attn, &self.post_attention_layernorm, eps)?;
        let mlp = self
            .mlp
            .forward(&rms_norm(&x, &self.pre_feedforward_layernorm, eps)?)?;
        add_normed(&x, &mlp, &self.post_feedforward_layernorm, eps)
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
        add_normed_into(
            &mut b.x,
            &b.out,
            &self.post_attention_layernorm,
            eps,
            &mut b.normed,
        )?;
        norm_into(&b.x, &self.pre_feedforward_layernorm, eps, &mut b.normed)?;
        self.mlp.step(b)?;
        add_normed_into(
            &mut b.x,
            &b.out,
            &self.post_feedforward_layernorm,
            eps,
            &mut b.normed,
        )
    }
}

impl Gemma3Lm {
    fn rope(&self, layer: &Layer) -> &RotaryEmbedding {
        match layer.sliding {
            true => &self.rope_local,
            false => &self.rope_global,
        }
    }
}

impl CausalLm for Gemma3Lm {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> Vec<LayerKind> {
        let window = self.config.sliding_window.unwrap_or(usize::MAX);
        self.layers
            .iter()
            .map(|l| match l.sliding {
                true => LayerKind::Sliding { window },
                false => LayerKind::Full,
            })
            .collect()
    }

    fn forward(&self, tokens: &[u32], cache: &mut SequenceCache, want: Logits) -> Result<Tensor> {
        let n = tokens.len();
        let start = cache.len();
        crate::layers::check_room(n, start, self.rope_global.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        let ids = Tensor::new(tokens, &self.device)?.unsqueeze(0)?; // [1, n]
        let mut x = self
            .embed_tokens
            .forward(&ids, self.dtype)?
            .broadcast_mul(&self.embed_scale)?; // [1, n, hidden]
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, eps, self.rope(layer), cache.layer(i), start)?;
        }
        let logits = crate::layers::output_logits(&x, want, &self.norm, eps, &self.lm_head)?;
        softcapped(logits, self.config.final_logit_softcapping)
    }

    fn decode(&self, token: u32, cache: &mut SequenceCache, logits: &mut Vec<f32>) -> Result<()> {
        if !self.device.is_cpu() {
            return crate::decode_with_forward(self, token, cache, logits);
        }
        let pos = cache.len();
        crate::layers::check_room(1, pos, self.rope_global.max_positions())?;
        let eps = self.config.rms_norm_eps as f32;
        // `embed_scale` in f32, the CPU's compute dtype.
        let scale = (self.config.hidden_size as f32).sqrt();
        self.steps.run(&self.config, |b| {
            self.embed_tokens.row_into(token, &mut b.x)?;
            b.x.iter_mut().for_each(|x| *x *= scale);
            for (i, layer) in self.layers.iter().enumerate() {
                layer.step(b, eps, self.rope(layer), cache.layer(i), pos)?;
            }
            let vocab = self.config.vocab_size;
            output_logits_into(b, &self.norm, eps, &self.lm_head, vocab, logits)?;
            if let Some(cap) = self.config.final_logit_softcapping {
                softcap_in_place(logits, cap as f32);
            }
            Ok(())
        })
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        let layers = self.layers.iter();
        let layer_bytes = layers.map(|l| l.self_attn.weight_bytes() + l.mlp.weight_bytes());
        crate::layers::decoder_weight_bytes(
            &self.config,
            self.dtype,
            4,
            layer_bytes.sum(),
            &self.embed_tokens,
            &self.lm_head,
        )
    }
}
