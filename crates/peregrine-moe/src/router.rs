//! Top-k routing of one token over a layer's experts, as transformers computes it.

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over all experts (Mixtral, Qwen2/3-MoE).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// Most expert groups a group-limited router supports (DeepSeek-V3 has 8).
const MAX_GROUPS: usize = 64;

/// Chooses `top_k` experts per token and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Router {
    /// Experts per token.
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub scoring: Scoring,
    /// Divide the chosen weights by their sum (`norm_topk_prob`; Mixtral always does).
    pub normalize: bool,
    /// Group-limited choice (`n_group`, `topk_group`): experts come only from the `topk_group`
    /// groups whose two best scores sum highest (DeepSeek-V3).
    pub groups: Option<(usize, usize)>,
    /// Added to the scores for choosing only, not to the weights (`e_score_correction_bias`).
    pub choice_bias: Option<Vec<f32>>,
    /// Multiplies the final weights (`routed_scaling_factor`).
    pub scale: f32,
    /// Multiplies each chosen expert's final weight by its own factor (Gemma 4's
    /// `router.per_expert_scale`), `[experts]`.
    pub expert_scale: Option<Vec<f32>>,
}

impl Router {
    /// Softmax top-k routing, renormalised when `normalize` (Mixtral, Qwen-MoE).
    pub fn softmax(top_k: usize, normalize: bool) -> Self {
        Self {
            top_k,
            scoring: Scoring::Softmax,
            normalize,
            groups: None,
            choice_bias: None,
            scale: 1.0,
            expert_scale: None,
        }
    }

    /// Routes one token: `logits` (`[experts]`, the router's outputs) become scores in place;
    /// `scratch` (`[experts]`) holds the choice scores; the chosen experts and their weights go
    /// to `ids` / `weights`, best first. They are usually `[top_k]`; shorter ones route the token
    /// to fewer experts, exactly as a router of that `top_k` would (a per-request override).
    /// Allocates nothing.
    pub fn route(
        &self,
        logits: &mut [f32],
        scratch: &mut [f32],
        ids: &mut [usize],
        weights: &mut [f32],
    ) {
        let (n, k) = (logits.len(), ids.len());
        assert!(
            (1..=n).contains(&k) && weights.len() == k && scratch.len() == n,
            "router buffers: {n} experts, {k} ids, {} weights",
            weights.len()
        );
        match self.scoring {
            Scoring::Softmax => softmax_in_place(logits),
            Scoring::Sigmoid => logits
                .iter_mut()
                .for_each(|x| *x = 1.0 / (1.0 + (-*x).exp())),
        }
        scratch.copy_from_slice(logits);
        if let Some(bias) = &self.choice_bias {
            scratch.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
        }
        if let Some((groups, keep)) = self.groups {
            mask_groups(scratch, groups, keep);
        }
        for (id, weight) in ids.iter_mut().zip(weights.iter_mut()) {
            let best = argmax(scratch);
            *id = best;
            *weight = logits[best];
            scratch[best] = f32::NEG_INFINITY;
        }
        if self.normalize {
            // transformers adds 1e-20 for sigmoid scores, which cannot sum to zero otherwise.
            let eps = if self.scoring == Scoring::Sigmoid {
                1e-20
            } else {
                0.0
            };
            let sum = weights.iter().sum::<f32>() + eps;
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        if self.scale != 1.0 {
            weights.iter_mut().for_each(|w| *w *= self.scale);
        }
        if let Some(scale) = &self.expert_scale {
            (weights.iter_mut().zip(ids.iter())).for_each(|(w, &e)| *w *= scale[e]);
        }
    }
}

fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

/// The first index of the largest value.
fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Rules out the choice scores outside the `keep` groups whose two best scores sum highest, as
/// transformers' DeepSeek-V3 router does (5.x: `masked_fill(..., -inf)`; earlier versions
/// filled 0.0, which differs only when a kept score is negative).
fn mask_groups(scores: &mut [f32], groups: usize, keep: usize) {
    assert!(groups <= MAX_GROUPS && scores.len().is_multiple_of(groups));
    let per = scores.len() / groups;
    let mut group_scores = [f32::NEG_INFINITY; MAX_GROUPS];
    for (g, chunk) in scores.chunks(per).enumerate() {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &s in chunk {
            if s > a {
                (a, b) = (s, a);
            } else if s > b {
                b = s;
            }
        }
        group_scores[g] = if per > 1 { a + b } else { a };
    }
    let mut kept = [false; MAX_GROUPS];
    for _ in 0..keep {
        let g = argmax(&group_scores[..groups]);
        kept[g] = true;
        group_scores[g] = f32::NEG_INFINITY;
    }
    for (g, chunk) in scores.chunks_mut(per).enumerate() {
        if !kept[g] {
            chunk.iter_mut().for_each(|s| *s = f32::NEG_INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(r: &Router, logits: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let mut l = logits.to_vec();
        let mut scratch = vec![0.0; l.len()];
        let (mut ids, mut w) = (vec![0; r.top_k], vec![0.0; r.top_k]);
        r.route(&mut l, &mut scratch, &mut ids, &mut w);
        (ids, w)
    }

    #[test]
    fn softmax_top_k_renormalises_only_when_asked() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let (ids, w) = route(&Router::softmax(2, false), &logits);
        assert_eq!(ids, [1, 2]);
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((w[0] - 2f32.exp() / z).abs() < 1e-6 && (w[1] - 1f32.exp() / z).abs() < 1e-6);
        let (_, w) = route(&Router::softmax(2, true), &logits);
        let e = 1f32.exp();
        assert!((w[0] - e / (e + 1.0)).abs() < 1e-6, "{w:?}");
    }

    /// Shorter buffers route to fewer experts exactly as a router of that `top_k` does (a
    /// per-request top-k equals the same top-k set at load).
    #[test]
    fn shorter_buffers_route_as_a_smaller_top_k() {
        let logits = [0.3, 2.0, 1.0, -1.0, 0.7];
        for normalize in [false, true] {
            let (ids, w) = route(&Router::softmax(1, normalize), &logits);
            let mut l = logits.to_vec();
            let mut scratch = vec![0.0; l.len()];
            let (mut one_id, mut one_w) = ([0usize], [0f32]);
            Router::softmax(3, normalize).route(&mut l, &mut scratch, &mut one_id, &mut one_w);
            assert_eq!(
                (one_id.to_vec(), one_w.to_vec()),
                (ids, w),
                "normalize {normalize}"
            );
        }
    }

    /// Gemma 4: the renormalised weights, then each times its expert's own scale.
    #[test]
    fn per_expert_scales_follow_the_chosen_experts() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let mut r = Router::softmax(2, true);
        r.expert_scale = Some(vec![1.0, 3.0, 0.5, 1.0]);
        let (ids, w) = route(&r, &logits);
        assert_eq!(ids, [1, 2]);
        let e = 1f32.exp();
        assert!((w[0] - 3.0 * e / (e + 1.0)).abs() < 1e-6, "{w:?}");
        assert!((w[1] - 0.5 / (e + 1.0)).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn group_limited_sigmoid_routing_follows_the_bias_and_the_groups() {
        // Two groups of four; the bias makes group 1 win although expert 0 scores highest.
        let r = Router {
            top_k: 2,
            scoring: Scoring::Sigmoid,
            normalize: true,
            groups: Some((2, 1)),
            choice_bias: Some(vec![0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
            scale: 2.5,
            expert_scale: None,
        };
        let logits = [3.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0];
        let (ids, w) = route(&r, &logits);
        assert_eq!(ids, [4, 5]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let (a, b) = (s(1.0), s(0.5));
        assert!((w[0] - 2.5 * a / (a + b)).abs() < 1e-6, "{w:?}");
        assert!((w[1] - 2.5 * b / (a + b)).abs() < 1e-6, "{w:?}");
    }
}
