//! The gated delta rule for one value head, in its two forms: the recurrence (one position at
//! a time: decode, and the positions a rollback may return to) and the chunked form (a span
//! of positions through a few small matrix products per chunk: the bulk of a prompt). Both
//! leave the same state and give the same outputs up to f32 summation order.
//!
//! The state `S` is `[k_dim, v_dim]`. Per position, with `q`, `k` normalised and `g ≤ 0`:
//! `S = S · exp(g)`, `S += k ⊗ β (v - Sᵀk)`, `o = Sᵀq`.
//!
//! The chunked form (transformers' `torch_chunk_gated_delta_rule`, after the DeltaNet paper):
//! within a chunk, with `c` the running sum of `g`, the updates are the unit lower triangular
//! system `(I + T) U = β v`, `T[i][j] = β_i (k_i · k_j) exp(c_i - c_j)` for `j < i`; with `W`
//! the same solve of `β k exp(c)`, the chunk's new values are `U - W S`, its outputs
//! `q_i exp(c_i) S + Σ_{j ≤ i} (q_i · k_j) exp(c_i - c_j) new_j`, and its state
//! `S exp(c_last) + Σ_j k_j exp(c_last - c_j) ⊗ new_j`.

/// Positions per chunk of the chunked form (transformers' default).
pub const CHUNK: usize = 64;

/// One value head's inputs over `n` positions, each row contiguous.
pub struct HeadInputs<'a> {
    /// Queries `[n, k_dim]`, L2-normed and scaled.
    pub q: &'a [f32],
    /// Keys `[n, k_dim]`, L2-normed.
    pub k: &'a [f32],
    /// Values `[n, v_dim]`.
    pub v: &'a [f32],
    /// Log decay per position (`≤ 0`).
    pub g: &'a [f32],
    /// Write rate per position.
    pub beta: &'a [f32],
}

/// The widest value head [`step`] takes (its scratch lives on the stack).
pub const MAX_V_DIM: usize = 256;

/// One position: updates `s` (`[k_dim, v_dim]`) and writes `out` (`[v_dim]`).
pub fn step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, out: &mut [f32]) {
    let vd = v.len();
    let decay = g.exp();
    // delta = β (v - Sᵀk), over the decayed state.
    let mut delta = [0f32; MAX_V_DIM];
    let delta = &mut delta[..vd];
    delta.copy_from_slice(v);
    for (row, &ki) in s.chunks_exact_mut(vd).zip(k) {
        row.iter_mut().for_each(|x| *x *= decay);
        delta
            .iter_mut()
            .zip(row.iter())
            .for_each(|(d, x)| *d -= x * ki);
    }
    delta.iter_mut().for_each(|d| *d *= beta);
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(vd).zip(k).zip(q) {
        for ((x, d), o) in row.iter_mut().zip(delta.iter()).zip(out.iter_mut()) {
            *x += ki * d;
            *o += *x * qi;
        }
    }
}

/// `n` positions through the chunked form: updates `s`, writes `out` `[n, v_dim]`.
pub fn chunked(s: &mut [f32], x: &HeadInputs, out: &mut [f32]) {
    let n = x.g.len();
    let (kd, vd) = (x.q.len() / n, x.v.len() / n);
    let mut at = 0;
    while at < n {
        let m = CHUNK.min(n - at);
        let rows = |t: &[f32], w: usize| t[at * w..(at + m) * w].to_vec();
        let (q, k, v) = (rows(x.q, kd), rows(x.k, kd), rows(x.v, vd));
        let (g, beta) = (&x.g[at..at + m], &x.beta[at..at + m]);
        one_chunk(s, &q, &k, &v, g, beta, &mut out[at * vd..(at + m) * vd]);
        at += m;
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One chunk of `m` positions (see the module docs).
fn one_chunk(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    let m = g.len();
    let (kd, vd) = (k.len() / m, v.len() / m);
    let mut c = vec![0f32; m];
    let mut sum = 0.0;
    for (ci, gi) in c.iter_mut().zip(g) {
        sum += gi;
        *ci = sum;
    }
    let key = |i: usize| &k[i * kd..][..kd];
    // Forward substitution through (I + T): rows of U (from β v) and W (from β k exp(c)).
    let mut u = vec![0f32; m * vd];
    let mut w = vec![0f32; m * kd];
    for i in 0..m {
        let (done_u, rest_u) = u.split_at_mut(i * vd);
        let (done_w, rest_w) = w.split_at_mut(i * kd);
        let (ui, wi) = (&mut rest_u[..vd], &mut rest_w[..kd]);
        let scale = beta[i] * c[i].exp();
        ui.iter_mut()
            .zip(&v[i * vd..][..vd])
            .for_each(|(o, x)| *o = beta[i] * x);
        wi.iter_mut().zip(key(i)).for_each(|(o, x)| *o = scale * x);
        for j in 0..i {
            let t = beta[i] * dot(key(i), key(j)) * (c[i] - c[j]).exp();
            let (uj, wj) = (&done_u[j * vd..][..vd], &done_w[j * kd..][..kd]);
            ui.iter_mut().zip(uj).for_each(|(o, x)| *o -= t * x);
            wi.iter_mut().zip(wj).for_each(|(o, x)| *o -= t * x);
        }
    }
    // New values: U - W S.
    for (ui, wi) in u.chunks_exact_mut(vd).zip(w.chunks_exact(kd)) {
        for (row, &wij) in s.chunks_exact(vd).zip(wi) {
            ui.iter_mut().zip(row).for_each(|(o, x)| *o -= wij * x);
        }
    }
    // Outputs: the old state read by the decayed query, plus the chunk's own attention.
    for i in 0..m {
        let (qi, oi) = (&q[i * kd..][..kd], &mut out[i * vd..][..vd]);
        let decay = c[i].exp();
        oi.fill(0.0);
        for (row, &qv) in s.chunks_exact(vd).zip(qi) {
            let a = qv * decay;
            oi.iter_mut().zip(row).for_each(|(o, x)| *o += a * x);
        }
        for j in 0..=i {
            let a = dot(qi, key(j)) * (c[i] - c[j]).exp();
            oi.iter_mut()
                .zip(&u[j * vd..][..vd])
                .for_each(|(o, x)| *o += a * x);
        }
    }
    // The state after the chunk.
    let last = c[m - 1];
    s.iter_mut().for_each(|x| *x *= last.exp());
    for j in 0..m {
        let decay = (last - c[j]).exp();
        let uj = &u[j * vd..][..vd];
        for (row, &kv) in s.chunks_exact_mut(vd).zip(key(j)) {
            let a = kv * decay;
            row.iter_mut().zip(uj).for_each(|(o, x)| *o += a * x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Normalised random rows.
    fn rows(n: usize, d: usize, seed: &mut u64) -> Vec<f32> {
        let mut out: Vec<f32> = (0..n * d)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        for r in out.chunks_exact_mut(d) {
            let norm = dot(r, r).sqrt();
            r.iter_mut().for_each(|x| *x /= norm);
        }
        out
    }

    /// 150 positions (chunks of 64, 64 and 22) from a non-zero state: the chunked form's
    /// outputs and final state equal the recurrence's within 1e-5 (f32 summation order).
    #[test]
    fn chunked_equals_the_recurrence() {
        let (n, kd, vd, seed) = (150, 16, 8, &mut 3u64);
        let (q, k, v) = (rows(n, kd, seed), rows(n, kd, seed), rows(n, vd, seed));
        let g: Vec<f32> = (0..n).map(|i| -0.05 - 0.3 * (i % 7) as f32 / 7.0).collect();
        let beta: Vec<f32> = (0..n).map(|i| 0.2 + 0.7 * (i % 5) as f32 / 5.0).collect();
        let start = rows(kd, vd, seed);
        let (mut s1, mut s2) = (start.clone(), start);
        let mut want = vec![0f32; n * vd];
        for t in 0..n {
            let (qt, kt, vt) = (&q[t * kd..][..kd], &k[t * kd..][..kd], &v[t * vd..][..vd]);
            step(
                &mut s1,
                qt,
                kt,
                vt,
                g[t],
                beta[t],
                &mut want[t * vd..][..vd],
            );
        }
        let mut got = vec![0f32; n * vd];
        let x = HeadInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        chunked(&mut s2, &x, &mut got);
        let max = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(max(&got, &want) < 1e-5, "outputs {}", max(&got, &want));
        assert!(max(&s1, &s2) < 1e-5, "state {}", max(&s1, &s2));
        assert!(want.iter().any(|x| x.abs() > 0.1), "outputs not trivial");
    }
}
