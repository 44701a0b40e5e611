//! The feed-forward half of a decoder layer: a dense gated MLP, or a mixture of gated-MLP
//! experts behind a router (Mixtral, Qwen3-MoE). Experts come from an [`ExpertStore`], so the
//! block does not know whether they are resident or streamed.
//!
//! Prefill groups the tokens by expert and runs each chosen expert once over all its tokens
//! (never a loop over tokens × experts); the decode step routes one token over buffers it
//! reuses and allocates nothing.

use peregrine_moe::{ExpertStore, ResidentExperts, Router, Scoring, tokens_by_expert};
use peregrine_tensor::{DType, QLinear, Tensor};

use crate::config::{ExpertNaming, MoeConfig};
use crate::layers::mlp::GatedMlp;
use crate::layers::step::StepBuffers;
use crate::weights::Weights;
use crate::{ModelConfig, ModelError, Result};

/// A decoder layer's feed-forward block.
pub enum Ffn {
    /// One gated MLP.
    Dense(GatedMlp),
    /// Routed experts.
    Moe(MoeBlock),
}

impl Ffn {
    /// Loads layer `layer`'s block: MoE where the config says so, else the dense MLP at
    /// `model.layers.{layer}.mlp`.
    pub fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        match &c.moe {
            Some(moe) if moe.sparse_layers[layer] => {
                Ok(Self::Moe(MoeBlock::load(c, w, layer, moe)?))
            }
            _ => Ok(Self::Dense(GatedMlp::load(
                c,
                w,
                &format!("model.layers.{layer}.mlp"),
            )?)),
        }
    }

    /// `x: [1, n, hidden]` → `[1, n, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x),
            Self::Moe(moe) => moe.forward(x),
        }
    }

    /// [`forward`](Self::forward) over a decode step's buffers: reads `b.normed`, leaves the
    /// output in `b.out`.
    pub fn step(&self, b: &mut StepBuffers) -> Result<()> {
        match self {
            Self::Dense(mlp) => mlp.step(b),
            Self::Moe(moe) => moe.step(b),
        }
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.weight_bytes(),
            Self::Moe(moe) => moe.weight_bytes(),
        }
    }
}

/// Routed gated-MLP experts.
pub struct MoeBlock {
    /// The router's projection, `[experts, hidden]`.
    gate: QLinear,
    router: Router,
    experts: Box<dyn ExpertStore<GatedMlp>>,
    /// Always-on experts added to the routed output (DeepSeek-V3's `shared_experts`).
    shared: Option<GatedMlp>,
}

/// HF names of one MoE layer's tensors: the block's prefix and the per-expert projection
/// names (gate, up, down).
fn names(layer: usize, naming: ExpertNaming) -> (String, [&'static str; 3]) {
    match naming {
        ExpertNaming::Qwen => (
            format!("model.layers.{layer}.mlp"),
            ["gate_proj", "up_proj", "down_proj"],
        ),
        ExpertNaming::Mixtral => (
            format!("model.layers.{layer}.block_sparse_moe"),
            ["w1", "w3", "w2"],
        ),
    }
}

impl MoeBlock {
    /// Loads layer `layer`'s router and experts (per-expert HF tensors, or the stacked
    /// `switch_mlp` of MLX and `ffn_*_exps` of GGUF files).
    pub fn load(c: &ModelConfig, w: &Weights, layer: usize, moe: &MoeConfig) -> Result<Self> {
        let (prefix, per_expert) = names(layer, moe.naming);
        let (h, i, n) = (c.hidden_size, moe.intermediate_size, moe.num_experts);
        let projections = [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)];
        let mut loaded = projections
            .iter()
            .zip(per_expert)
            .map(|(&(stacked, out, inp), name)| {
                let stacked = format!("{prefix}.switch_mlp.{stacked}");
                let each = |e: usize| format!("{prefix}.experts.{e}.{name}");
                w.expert_linears(&stacked, &each, n, out, inp)
            });
        let (gates, ups, downs) = (
            loaded.next().expect("three")?,
            loaded.next().expect("three")?,
            loaded.next().expect("three")?,
        );
        let experts: Vec<GatedMlp> = (gates.into_iter().zip(ups).zip(downs))
            .map(|((g, u), d)| GatedMlp::new(g, u, d, c.activation))
            .collect();
        let bytes = experts.iter().map(GatedMlp::weight_bytes).sum();
        let mut router = Router::softmax(moe.top_k, moe.normalize);
        if let Some(sigmoid) = &moe.sigmoid {
            let bias = w.tensor(&format!("{prefix}.gate.e_score_correction_bias"), &[n])?;
            router.scoring = Scoring::Sigmoid;
            router.groups = sigmoid.groups;
            router.scale = sigmoid.scale;
            router.choice_bias = Some(bias.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let shared = match moe.shared_intermediate_size {
            Some(si) => {
                let p = format!("{prefix}.shared_experts");
                Some(GatedMlp::new(
                    w.linear(&format!("{p}.gate_proj"), si, h, false)?,
                    w.linear(&format!("{p}.up_proj"), si, h, false)?,
                    w.linear(&format!("{p}.down_proj"), h, si, false)?,
                    c.activation,
                ))
            }
            None => None,
        };
        Ok(Self {
            gate: w.linear(&format!("{prefix}.gate"), n, h, false)?,
            router,
            experts: Box::new(ResidentExperts::new(experts, bytes)),
            shared,
        })
    }

    /// `x: [1, n, hidden]` → `[1, n, hidden]`: every token routed, then each chosen expert
    /// run once over the tokens sent to it, its outputs weighted and summed back in place.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, n, h) = x.dims3()?;
        let flat = x.reshape((b * n, h))?;
        let logits = self.gate.forward(&flat)?.to_dtype(DType::F32)?; // [n, experts]
        let mut logits = logits.flatten_all()?.to_vec1::<f32>()?;
        let (experts, k) = (self.experts.len(), self.router.top_k);
        let mut scratch = vec![0f32; experts];
        let (mut ids, mut weights) = (vec![0usize; b * n * k], vec![0f32; b * n * k]);
        for (t, row) in logits.chunks_mut(experts).enumerate() {
            let (ids, weights) = (&mut ids[t * k..][..k], &mut weights[t * k..][..k]);
            self.router.route(row, &mut scratch, ids, weights);
        }
        let groups = tokens_by_expert(experts, k, &ids, &weights);
        let hit: Vec<usize> = (0..experts).filter(|&e| !groups[e].0.is_empty()).collect();
        self.experts.prefetch(&hit);
        let mut out = flat.zeros_like()?;
        for e in hit {
            let (tokens, weights) = &groups[e];
            let idx = Tensor::new(tokens.as_slice(), x.device())?;
            let expert = self.experts.expert(e).map_err(expert_err(e))?;
            let y = expert.forward(&flat.index_select(&idx, 0)?)?; // [m, hidden]
            let w = Tensor::new(weights.as_slice(), x.device())?
                .to_dtype(y.dtype())?
                .unsqueeze(1)?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        if let Some(shared) = &self.shared {
            out = (out + shared.forward(&flat)?)?;
        }
        Ok(out.reshape((b, n, h))?)
    }

    /// [`forward`](Self::forward) for one token over a decode step's buffers: reads
    /// `b.normed`, leaves the output in `b.out`.
    pub fn step(&self, b: &mut StepBuffers) -> Result<()> {
        let StepBuffers {
            normed,
            out,
            gate,
            up,
            linear,
            moe,
            ..
        } = b;
        QLinear::forward_group_into(&[&self.gate], normed, &mut [&mut moe.logits], linear)?;
        (self.router).route(
            &mut moe.logits,
            &mut moe.scratch,
            &mut moe.ids,
            &mut moe.weights,
        );
        self.experts.prefetch(&moe.ids);
        out.fill(0.0);
        for (&e, &weight) in moe.ids.iter().zip(&moe.weights) {
            let expert = self.experts.expert(e).map_err(expert_err(e))?;
            expert.row_into(normed, gate, up, &mut moe.out, linear)?;
            out.iter_mut()
                .zip(&moe.out)
                .for_each(|(o, y)| *o += weight * y);
        }
        if let Some(shared) = &self.shared {
            shared.row_into(normed, gate, up, &mut moe.out, linear)?;
            out.iter_mut().zip(&moe.out).for_each(|(o, y)| *o += y);
        }
        Ok(())
    }

    /// Bytes of weights: the router and every expert.
    pub fn weight_bytes(&self) -> usize {
        let shared = self.shared.as_ref().map_or(0, GatedMlp::weight_bytes);
        self.gate.weight_bytes() + self.experts.weight_bytes() + shared
    }
}

fn expert_err(e: usize) -> impl FnOnce(std::io::Error) -> ModelError {
    move |source| {
        ModelError::Tensor(peregrine_tensor::candle::Error::Msg(format!(
            "expert {e}: {source}"
        )))
    }
}
