//! Mamba 2's selective scan for one head in its two forms: the recurrence (one position at a
//! time: decode, and the positions a rollback may return to) and the chunked form (state-space
//! duality: a span of positions through products per chunk, the bulk of a prompt). Both leave
//! the same state and give the same outputs up to f32 summation order.
//!
//! The state `S` is `[head_dim, state]`. Per position, with `a = dt · A ≤ 0`:
//! `S = exp(a) S + dt · x ⊗ B`, `y = S C` (the caller adds `D x`). Within a chunk, with `c` the
//! running sum of `a`: `y_i = exp(c_i) S C_i + Σ_{j ≤ i} exp(c_i - c_j) (C_i · B_j) dt_j x_j`,
//! and the state after it `exp(c_last) S + Σ_j exp(c_last - c_j) dt_j x_j ⊗ B_j`
//! (transformers' `torch_forward` chunk scan).

/// Positions per chunk of the chunked form.
pub const CHUNK: usize = 64;

/// One head's inputs over `n` positions, rows contiguous.
pub struct HeadInputs<'a> {
    /// The head's `x` `[n, head_dim]`.
    pub x: &'a [f32],
    /// Its group's `B` `[n, state]`.
    pub b: &'a [f32],
    /// Its group's `C` `[n, state]`.
    pub c: &'a [f32],
    /// `softplus(dt + dt_bias)` `[n]`.
    pub dt: &'a [f32],
    /// `A = -exp(A_log)`.
    pub a: f32,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One position: updates `s` and writes `out` `[head_dim]` (`S C`).
pub fn step(s: &mut [f32], x: &[f32], b: &[f32], c: &[f32], dt: f32, a: f32, out: &mut [f32]) {
    let decay = (dt * a).exp();
    for ((row, &xv), o) in s.chunks_exact_mut(b.len()).zip(x).zip(out.iter_mut()) {
        let mut acc = 0f32;
        for ((sn, bn), cn) in row.iter_mut().zip(b).zip(c) {
            *sn = *sn * decay + dt * bn * xv;
            acc += *sn * cn;
        }
        *o = acc;
    }
}

/// `n` positions through the chunked form: updates `s`, writes `out` `[n, head_dim]`.
pub fn chunked(s: &mut [f32], h: &HeadInputs, out: &mut [f32]) {
    let n = h.dt.len();
    let (p, ns) = (h.x.len() / n, h.b.len() / n);
    let mut at = 0;
    while at < n {
        let m = CHUNK.min(n - at);
        let x = &h.x[at * p..(at + m) * p];
        let (b, c) = (&h.b[at * ns..(at + m) * ns], &h.c[at * ns..(at + m) * ns]);
        let dt = &h.dt[at..at + m];
        one_chunk(s, x, b, c, dt, h.a, &mut out[at * p..(at + m) * p]);
        at += m;
    }
}

fn one_chunk(s: &mut [f32], x: &[f32], b: &[f32], c: &[f32], dt: &[f32], a: f32, out: &mut [f32]) {
    let m = dt.len();
    let (p, ns) = (x.len() / m, b.len() / m);
    let mut cum = vec![0f32; m];
    let mut sum = 0.0;
    for (ci, d) in cum.iter_mut().zip(dt) {
        sum += d * a;
        *ci = sum;
    }
    let (row_b, row_c) = (|j: usize| &b[j * ns..][..ns], |i: usize| &c[i * ns..][..ns]);
    for i in 0..m {
        let oi = &mut out[i * p..][..p];
        // The state before the chunk, decayed to position i and read by C_i.
        let decay = cum[i].exp();
        for (o, row) in oi.iter_mut().zip(s.chunks_exact(ns)) {
            *o = decay * dot(row, row_c(i));
        }
        // The chunk's own positions up to i.
        for j in 0..=i {
            let w = (cum[i] - cum[j]).exp() * dot(row_c(i), row_b(j)) * dt[j];
            oi.iter_mut()
                .zip(&x[j * p..][..p])
                .for_each(|(o, xv)| *o += w * xv);
        }
    }
    let last = cum[m - 1];
    s.iter_mut().for_each(|v| *v *= last.exp());
    for j in 0..m {
        let w = (last - cum[j]).exp() * dt[j];
        for (row, &xv) in s.chunks_exact_mut(ns).zip(&x[j * p..][..p]) {
            let wx = w * xv;
            row.iter_mut()
                .zip(row_b(j))
                .for_each(|(sn, bn)| *sn += wx * bn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// 150 positions (chunks of 64, 64 and 22) from a non-zero state: the chunked form's
    /// outputs and final state equal the recurrence's within 1e-5 (f32 summation order).
    #[test]
    fn chunked_equals_the_recurrence() {
        let (n, p, ns, seed) = (150, 8, 16, &mut 5u64);
        let (x, b, c) = (
            values(n * p, seed),
            values(n * ns, seed),
            values(n * ns, seed),
        );
        let dt: Vec<f32> = (0..n).map(|i| 0.05 + 0.4 * (i % 7) as f32 / 7.0).collect();
        let a = -0.8;
        let start = values(p * ns, seed);
        let (mut s1, mut s2) = (start.clone(), start);
        let mut want = vec![0f32; n * p];
        for t in 0..n {
            let (xt, bt, ct) = (&x[t * p..][..p], &b[t * ns..][..ns], &c[t * ns..][..ns]);
            step(&mut s1, xt, bt, ct, dt[t], a, &mut want[t * p..][..p]);
        }
        let mut got = vec![0f32; n * p];
        let h = HeadInputs {
            x: &x,
            b: &b,
            c: &c,
            dt: &dt,
            a,
        };
        chunked(&mut s2, &h, &mut got);
        let max = |u: &[f32], v: &[f32]| {
            (u.iter().zip(v))
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        assert!(max(&got, &want) < 1e-5, "outputs {}", max(&got, &want));
        assert!(max(&s1, &s2) < 1e-5, "state {}", max(&s1, &s2));
        assert!(want.iter().any(|v| v.abs() > 0.1), "outputs not trivial");
    }
}
