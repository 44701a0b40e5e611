//! The feed-forward half of a decoder layer: a dense gated MLP, or a mixture of gated-MLP
//! experts behind a router (Mixtral, Qwen3-MoE). Experts come from an [`ExpertStore`], so the
//! block does not know whether they are resident or streamed.
//!
//! Prefill groups the tokens by expert and runs each chosen expert once over all its tokens
//! (never a loop over tokens × experts); the decode step routes one token over buffers it
//! reuses and allocates nothing.

use std::sync::{Arc, OnceLock};

use peregrine_moe::{
    ExpertCheck, ExpertReader, ExpertStore, ResidentExperts, Router, Scoring, StreamedExperts,
    tokens_by_expert,
};
use peregrine_tensor::moe::ExpertTables;
use peregrine_tensor::ops::{rms_norm, sigmoid};
use peregrine_tensor::{DType, QLinear, Tensor};

use crate::config::{Activation, ExpertNaming, MoeConfig};
use crate::layers::mlp::GatedMlp;
use crate::layers::norm_weight;
use crate::layers::step::{MoeBuffers, StepBuffers, add_into, norm_into};
use crate::weights::Weights;
use crate::{ModelConfig, ModelError, Result};

/// A decoder layer's feed-forward block.
pub enum Ffn {
    /// One gated MLP.
    Dense(GatedMlp),
    /// Routed experts.
    Moe(Box<MoeBlock>),
}

impl Ffn {
    /// Loads layer `layer`'s block: MoE where the config says so, else the dense MLP at
    /// `model.layers.{layer}.mlp`.
    pub fn load(c: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        match &c.moe {
            Some(moe) if moe.sparse_layers[layer] => {
                Ok(Self::Moe(Box::new(MoeBlock::load(c, w, layer, moe)?)))
            }
            _ => Ok(Self::Dense(GatedMlp::load(
                c,
                w,
                &format!("model.layers.{layer}.mlp"),
            )?)),
        }
    }

    /// `x: [1, n, hidden]` → `[1, n, hidden]`; `limits`: each row's most experts
    /// ([`moe_limits`](super::batch::moe_limits); empty: the model's number for every row).
    pub fn forward(&self, x: &Tensor, limits: &[usize]) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x),
            Self::Moe(moe) => moe.forward(x, limits),
        }
    }

    /// [`forward`](Self::forward) over a decode step's buffers: reads `b.normed`, leaves the
    /// output in `b.out`; `limit`: the sequence's most experts, when below the model's.
    pub fn step(&self, b: &mut StepBuffers, limit: Option<usize>) -> Result<()> {
        match self {
            Self::Dense(mlp) => mlp.step(b),
            Self::Moe(moe) => moe.step(b, limit),
        }
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.weight_bytes(),
            Self::Moe(moe) => moe.weight_bytes(),
        }
    }

    /// Guesses this block's routing from `x` `[1, n, hidden]`, an earlier layer's input, and
    /// lets a streaming store start reading the guessed experts (nothing otherwise).
    pub fn speculate(&self, x: &Tensor) -> Result<()> {
        match self {
            Self::Moe(moe) if moe.experts.speculates() => moe.speculate(x),
            _ => Ok(()),
        }
    }

    /// [`speculate`](Self::speculate) from one row (a CPU decode step's `normed`).
    pub fn speculate_row(&self, x: &[f32]) -> Result<()> {
        match self {
            Self::Moe(moe) if moe.experts.speculates() => {
                let cpu = &peregrine_tensor::Device::Cpu;
                moe.speculate(&Tensor::from_slice(x, (1, 1, x.len()), cpu)?)
            }
            _ => Ok(()),
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
    /// The shared expert's sigmoid gate, `[1, hidden]` (Qwen3-Next's `shared_expert_gate`).
    shared_gate: Option<QLinear>,
    /// RMSNorm weight of the router's input, when the router sees a normed copy of the
    /// block's input (Gemma 4: `router.scale · hidden^-0.5`, folded at load).
    router_norm: Option<Tensor>,
    /// RMSNorm weight of the experts' input (Gemma 4's `pre_feedforward_layernorm_2`).
    input_norm: Option<Tensor>,
    eps: f32,
    /// The experts' GPU tables, made on the first pass that can use them (`None`: they cannot).
    tables: OnceLock<Option<ExpertTables>>,
}

/// HF names of one MoE layer's tensors: the block's prefix, its router's name and the
/// per-expert projection names (gate, up, down).
fn names(layer: usize, naming: ExpertNaming) -> (String, &'static str, [&'static str; 3]) {
    let glu = ["gate_proj", "up_proj", "down_proj"];
    match naming {
        ExpertNaming::Qwen => (format!("model.layers.{layer}.mlp"), "gate", glu),
        ExpertNaming::Mixtral => (
            format!("model.layers.{layer}.block_sparse_moe"),
            "gate",
            ["w1", "w3", "w2"],
        ),
        ExpertNaming::Gemma4 => (format!("model.layers.{layer}.experts"), "gate", glu),
        ExpertNaming::Jamba => (format!("model.layers.{layer}.feed_forward"), "router", glu),
    }
}

/// Gemma 4's expert `e`: HF stacks them as `{prefix}.gate_up_proj` `[n, 2i, hidden]` (rows
/// `[gate; up]`) and `{prefix}.down_proj` `[n, hidden, i]`, split per expert at load (GGUF's
/// `ffn_gate_up_exps` / `ffn_down_exps` alike, without dequantizing); MLX splits them into
/// `{prefix}.switch_glu.{gate,up,down}_proj`.
fn gemma4_expert(
    w: &Weights,
    prefix: &str,
    (n, e): (usize, usize),
    (h, i): (usize, usize),
    act: Activation,
) -> Result<GatedMlp> {
    let fused = format!("{prefix}.gate_up_proj");
    if w.contains(&fused) {
        let mut gate_up = w
            .expert_linear_rows(&fused, (n, e), &[i, i], h)?
            .into_iter();
        let mut down = w.expert_linear_rows(&format!("{prefix}.down_proj"), (n, e), &[h], i)?;
        return match (gate_up.next(), gate_up.next(), down.pop()) {
            (Some(g), Some(u), Some(d)) => Ok(GatedMlp::new(g, u, d, act)),
            _ => unreachable!("expert_linear_rows gives one layer per part"),
        };
    }
    let load = |name: &str, out: usize, inp: usize| {
        let each = |e: usize| format!("{prefix}.{e}.{name}");
        w.expert_linear(
            &format!("{prefix}.switch_glu.{name}"),
            &each,
            (n, e),
            out,
            inp,
        )
    };
    let (g, u) = (load("gate_proj", i, h)?, load("up_proj", i, h)?);
    Ok(GatedMlp::new(g, u, load("down_proj", h, i)?, act))
}

/// How an MoE block reads its expert `e` from the checkpoint.
type ReadExpert = dyn Fn(&Weights, usize) -> Result<GatedMlp> + Send + Sync;

/// A layer's `n` experts, each read by `read`: all loaded now, or, when `w` streams experts,
/// read on each use (expert 0 is read once now, so a checkpoint whose experts do not fit the
/// config fails at load, not on the first request, and its size counts the bytes the layer
/// leaves on disk).
fn expert_store(
    w: &Weights,
    moe: &MoeConfig,
    read: Arc<ReadExpert>,
) -> Result<Box<dyn ExpertStore<GatedMlp>>> {
    let n = moe.num_experts;
    let Some(pool) = w.expert_reads() else {
        let experts = (0..n).map(|e| read(w, e)).collect::<Result<Vec<_>>>()?;
        let bytes = experts.iter().map(GatedMlp::weight_bytes).sum();
        return Ok(Box::new(ResidentExperts::new(experts, bytes)));
    };
    let w = w.positional();
    let first = read(&w, 0)?;
    let bytes = first.weight_bytes();
    pool.stats().add_expert_bytes(n * bytes);
    // The hot set's budget, shared equally by the MoE layers: for experts multiplied from the
    // file's mapping, the bytes kept mapped (no copy: the page cache's own pages).
    let budget = match first.is_mapped() {
        true => pool.mapped_bytes(),
        false => pool.hot_bytes(),
    };
    let layers = moe.sparse_layers.iter().filter(|&&s| s).count();
    let hot = (budget / layers.max(1) / bytes.max(1)).min(n);
    let check: ExpertCheck = {
        let w = w.clone();
        Arc::new(move || (w.still_whole()).map_err(|err| std::io::Error::other(err.to_string())))
    };
    let verify: ExpertCheck = {
        let w = w.clone();
        Arc::new(move || (w.unharmed()).map_err(|err| std::io::Error::other(err.to_string())))
    };
    let reader: ExpertReader<GatedMlp> =
        Arc::new(move |e| read(&w, e).map_err(|err| std::io::Error::other(err.to_string())));
    Ok(Box::new(
        StreamedExperts::new(n, reader, pool.clone())
            .with_hot_set(hot)
            .with_check(check)
            .with_verify(verify),
    ))
}

impl MoeBlock {
    /// Loads layer `layer`'s router and experts (per-expert HF tensors, or the stacked
    /// `switch_mlp` of MLX and `ffn_*_exps` of GGUF files).
    pub fn load(c: &ModelConfig, w: &Weights, layer: usize, moe: &MoeConfig) -> Result<Self> {
        if moe.naming == ExpertNaming::Gemma4 {
            return Self::load_gemma4(c, w, layer, moe);
        }
        let (prefix, router_name, per_expert) = names(layer, moe.naming);
        let (h, i, n, act) = (
            c.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            c.activation,
        );
        let stack = prefix.clone();
        let read = move |w: &Weights, e: usize| -> Result<GatedMlp> {
            let load = |(stacked, out, inp): (&str, usize, usize), name: &str| {
                let each = |e: usize| format!("{stack}.experts.{e}.{name}");
                w.expert_linear(
                    &format!("{stack}.switch_mlp.{stacked}"),
                    &each,
                    (n, e),
                    out,
                    inp,
                )
            };
            let [g, u, d] = per_expert;
            Ok(GatedMlp::new(
                load(("gate_proj", i, h), g)?,
                load(("up_proj", i, h), u)?,
                load(("down_proj", h, i), d)?,
                act,
            ))
        };
        let experts = expert_store(w, moe, Arc::new(read))?;
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
                let p = match moe.shared_gated {
                    true => format!("{prefix}.shared_expert"),
                    false => format!("{prefix}.shared_experts"),
                };
                Some(GatedMlp::new(
                    w.linear(&format!("{p}.gate_proj"), si, h, false)?,
                    w.linear(&format!("{p}.up_proj"), si, h, false)?,
                    w.linear(&format!("{p}.down_proj"), h, si, false)?,
                    c.activation,
                ))
            }
            None => None,
        };
        let shared_gate = (moe.shared_gated)
            .then(|| w.linear(&format!("{prefix}.shared_expert_gate"), 1, h, false))
            .transpose()?;
        Ok(Self {
            gate: w.linear(&format!("{prefix}.{router_name}"), n, h, false)?,
            router,
            experts,
            shared,
            shared_gate,
            router_norm: None,
            input_norm: None,
            eps: c.rms_norm_eps as f32,
            tables: OnceLock::new(),
        })
    }

    /// Gemma 4's block: the router sees the layer's residual RMS-normed and scaled by
    /// `router.scale · hidden^-0.5`, softmax over all experts, the top k renormalised, then
    /// times `router.per_expert_scale`; the experts see it through `pre_feedforward_layernorm_2`.
    fn load_gemma4(c: &ModelConfig, w: &Weights, layer: usize, moe: &MoeConfig) -> Result<Self> {
        let (h, n) = (c.hidden_size, moe.num_experts);
        let p = format!("model.layers.{layer}");
        let (i, act, stack) = (moe.intermediate_size, c.activation, format!("{p}.experts"));
        let read = move |w: &Weights, e: usize| gemma4_expert(w, &stack, (n, e), (h, i), act);
        let experts = expert_store(w, moe, Arc::new(read))?;
        let mut router = Router::softmax(moe.top_k, true);
        let scale = w.tensor(&format!("{p}.router.per_expert_scale"), &[n])?;
        router.expert_scale = Some(scale.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        let router_norm = w.tensor(&format!("{p}.router.scale"), &[h])?;
        let input_norm = format!("{p}.pre_feedforward_layernorm_2.weight");
        Ok(Self {
            gate: w.linear(&format!("{p}.router.proj"), n, h, false)?,
            router,
            experts,
            shared: None,
            shared_gate: None,
            router_norm: Some((router_norm * (h as f64).powf(-0.5))?),
            input_norm: Some(norm_weight(c, w, &input_norm, h)?),
            eps: c.rms_norm_eps as f32,
            tables: OnceLock::new(),
        })
    }

    /// Every row of `flat` `[rows, hidden]` routed: `top_k` expert ids and weights per row, of
    /// which a row with a lower limit (`limits[row]`, when given) uses only the first, leaving
    /// the rest unused (id past the experts, weight 0).
    fn route_rows(&self, flat: &Tensor, limits: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let routed = match &self.router_norm {
            Some(w) => rms_norm(flat, w, self.eps)?,
            None => flat.clone(),
        };
        let logits = self.gate.forward(&routed)?.to_dtype(DType::F32)?; // [rows, experts]
        let mut logits = logits.flatten_all()?.to_vec1::<f32>()?;
        let (experts, k) = (self.experts.len(), self.router.top_k);
        let rows = logits.len() / experts;
        let mut scratch = vec![0f32; experts];
        let (mut ids, mut weights) = (vec![usize::MAX; rows * k], vec![0f32; rows * k]);
        for (t, row) in logits.chunks_mut(experts).enumerate() {
            let used = limits.get(t).map_or(k, |&limit| limit.min(k));
            let (ids, weights) = (&mut ids[t * k..][..used], &mut weights[t * k..][..used]);
            self.router.route(row, &mut scratch, ids, weights);
        }
        Ok((ids, weights))
    }

    /// Routes `x` `[1, n, hidden]` and hands the chosen experts to the store as a guess.
    fn speculate(&self, x: &Tensor) -> Result<()> {
        let (b, n, h) = x.dims3()?;
        let (mut ids, _) = self.route_rows(&x.reshape((b * n, h))?, &[])?;
        ids.sort_unstable();
        ids.dedup();
        self.experts.speculate(&ids);
        Ok(())
    }

    /// `x: [1, n, hidden]` → `[1, n, hidden]`: every token routed (to at most `limits[row]`
    /// experts, when given), then each chosen expert run once over the tokens sent to it, its
    /// outputs weighted and summed back in place.
    pub fn forward(&self, x: &Tensor, limits: &[usize]) -> Result<Tensor> {
        let (b, n, h) = x.dims3()?;
        let flat = x.reshape((b * n, h))?;
        let tables = self.tables(&flat)?;
        let (flat, mut out) = match tables {
            Some(tables) if self.routes_on_device(&flat, limits) => {
                let (logits, r) = (self.gate.forward(&flat)?, &self.router);
                let out = tables.forward_routed(&flat, &logits, r.top_k, (r.normalize, r.scale))?;
                (flat, out)
            }
            _ => {
                let (ids, weights) = self.route_rows(&flat, limits)?;
                let flat = match &self.input_norm {
                    Some(w) => rms_norm(&flat, w, self.eps)?,
                    None => flat,
                };
                let out = match tables {
                    Some(tables) => tables.forward(&flat, &ids, &weights)?,
                    None => self.routed(&flat, &ids, &weights)?,
                };
                (flat, out)
            }
        };
        if let Some(shared) = &self.shared {
            let mut y = shared.forward(&flat)?;
            if let Some(gate) = &self.shared_gate {
                let g = sigmoid(&gate.forward(&flat)?)?;
                y = y.broadcast_mul(&g)?;
            }
            out = (out + y)?;
        }
        Ok(out.reshape((b, n, h))?)
    }

    /// The routed experts' weighted sum for `flat` `[rows, hidden]`: each chosen expert run
    /// once over the rows sent to it.
    fn routed(&self, flat: &Tensor, ids: &[usize], weights: &[f32]) -> Result<Tensor> {
        let (experts, k) = (self.experts.len(), self.router.top_k);
        let groups = tokens_by_expert(experts, k, ids, weights);
        let hit: Vec<usize> = (0..experts).filter(|&e| !groups[e].0.is_empty()).collect();
        self.experts.prefetch(&hit);
        let mut out = flat.zeros_like()?;
        for e in hit {
            let (tokens, weights) = &groups[e];
            let idx = Tensor::new(tokens.as_slice(), flat.device())?;
            let expert = self.experts.expert(e).map_err(expert_err(e))?;
            let y = expert.forward(&flat.index_select(&idx, 0)?)?; // [m, hidden]
            let w = Tensor::new(weights.as_slice(), flat.device())?
                .to_dtype(y.dtype())?
                .unsqueeze(1)?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        self.experts.verify().map_err(experts_err)?;
        Ok(out)
    }

    /// Whether the expert tables route a pass themselves: softmax top-k routing of the
    /// block's input as it is (Mixtral, Qwen-MoE), every row to the model's number of experts,
    /// and `PEREGRINE_CUDA_MOE_ROUTE=1` (off by default until its test has run on a GPU).
    fn routes_on_device(&self, flat: &Tensor, limits: &[usize]) -> bool {
        let r = &self.router;
        let rows = flat.dims().first().copied().unwrap_or(0);
        rows <= ExpertTables::MAX_TOKENS
            && r.scoring == Scoring::Softmax
            && r.choice_bias.is_none()
            && r.groups.is_none()
            && r.expert_scale.is_none()
            && self.router_norm.is_none()
            && self.input_norm.is_none()
            && limits.iter().all(|&l| l >= r.top_k)
            && switch("PEREGRINE_CUDA_MOE_ROUTE", false)
    }

    /// The experts' GPU tables when they take `flat` (bf16/f16 rows on a CUDA device, every
    /// expert resident in a format the tables take; `PEREGRINE_CUDA_MOE_TABLES=0`: never; more
    /// than a few rows only with `PEREGRINE_CUDA_MOE_GROUPED=1`, off until its test has run on
    /// a GPU), made on first use.
    fn tables(&self, flat: &Tensor) -> Result<Option<&ExpertTables>> {
        let rows = flat.dims().first().copied().unwrap_or(0);
        let applies = flat.device().is_cuda()
            && matches!(flat.dtype(), DType::BF16 | DType::F16)
            && ((1..=ExpertTables::MAX_TOKENS).contains(&rows)
                || (rows > 0 && switch("PEREGRINE_CUDA_MOE_GROUPED", false)))
            && flat.is_contiguous()
            && switch("PEREGRINE_CUDA_MOE_TABLES", true);
        if !applies {
            return Ok(None);
        }
        if let Some(tables) = self.tables.get() {
            return Ok(tables.as_ref());
        }
        let parts: Option<Vec<[&QLinear; 3]>> =
            (self.experts.all()).and_then(|all| all.iter().map(|e| e.silu_parts()).collect());
        let made = match parts {
            Some(parts) => ExpertTables::new(&parts)?,
            None => None,
        };
        Ok(self.tables.get_or_init(|| made).as_ref())
    }

    /// [`forward`](Self::forward) for one token over a decode step's buffers: reads
    /// `b.normed`, leaves the output in `b.out`; routed to at most `limit` experts, when given.
    pub fn step(&self, b: &mut StepBuffers, limit: Option<usize>) -> Result<()> {
        let StepBuffers {
            normed,
            out,
            gate,
            up,
            linear,
            moe,
            ..
        } = b;
        let MoeBuffers {
            logits,
            scratch,
            ids,
            weights,
            out: expert_out,
            input,
        } = moe;
        let eps = self.eps;
        let routed: &[f32] = match &self.router_norm {
            Some(w) => {
                norm_into(normed, w, eps, input)?;
                input
            }
            None => normed,
        };
        QLinear::forward_group_into(&[&self.gate], routed, &mut [&mut logits[..]], linear)?;
        let used = limit.map_or(ids.len(), |l| l.min(ids.len()));
        let (ids, weights) = (&mut ids[..used], &mut weights[..used]);
        self.router.route(logits, scratch, ids, weights);
        let x: &[f32] = match &self.input_norm {
            Some(w) => {
                norm_into(normed, w, eps, input)?;
                input
            }
            None => normed,
        };
        self.experts.prefetch(ids);
        out.fill(0.0);
        for (&e, &weight) in ids.iter().zip(weights.iter()) {
            let expert = self.experts.expert(e).map_err(expert_err(e))?;
            expert.row_into(x, gate, up, expert_out, linear)?;
            out.iter_mut()
                .zip(expert_out.iter())
                .for_each(|(o, y)| *o += weight * y);
        }
        self.experts.verify().map_err(experts_err)?;
        if let Some(shared) = &self.shared {
            shared.row_into(x, gate, up, expert_out, linear)?;
            if let Some(g) = &self.shared_gate {
                let mut logit = [0f32];
                QLinear::forward_group_into(&[g], x, &mut [&mut logit[..]], linear)?;
                let g = 1.0 / (1.0 + (-logit[0]).exp());
                expert_out.iter_mut().for_each(|y| *y *= g);
            }
            add_into(out, expert_out);
        }
        Ok(())
    }

    /// Bytes of weights: the router and every expert.
    pub fn weight_bytes(&self) -> usize {
        let shared = self.shared.as_ref().map_or(0, GatedMlp::weight_bytes)
            + self.shared_gate.as_ref().map_or(0, QLinear::weight_bytes);
        self.gate.weight_bytes() + self.experts.weight_bytes() + shared
    }
}

/// Whether a GPU switch of the MoE block is on: `default` unless its variable `name` is set
/// (`0`: off, anything else: on; each read once).
fn switch(name: &'static str, default: bool) -> bool {
    static READ: OnceLock<[(&str, Option<bool>); 3]> = OnceLock::new();
    let set = |n: &str| std::env::var(n).ok().map(|v| v != "0");
    let names = [
        "PEREGRINE_CUDA_MOE_TABLES",
        "PEREGRINE_CUDA_MOE_ROUTE",
        "PEREGRINE_CUDA_MOE_GROUPED",
    ];
    let read = READ.get_or_init(|| names.map(|n| (n, set(n))));
    let found = read.iter().find(|(n, _)| *n == name);
    found.and_then(|&(_, v)| v).unwrap_or(default)
}

/// The routed experts' bytes were lost while they were used (see [`ExpertStore::verify`]).
fn experts_err(source: std::io::Error) -> ModelError {
    ModelError::Tensor(peregrine_tensor::candle::Error::Msg(format!(
        "the routed experts: {source}"
    )))
}

fn expert_err(e: usize) -> impl FnOnce(std::io::Error) -> ModelError {
    move |source| {
        ModelError::Tensor(peregrine_tensor::candle::Error::Msg(format!(
            "expert {e}: {source}"
        )))
    }
}
