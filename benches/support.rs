//! What the benches share: timing helpers.

use std::time::Instant;

/// The middle of `xs` (the upper one of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Seconds `f` takes, median of `repeat` runs, and its last result.
pub fn timed<T>(repeat: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut times = Vec::with_capacity(repeat);
    let mut out = None;
    for _ in 0..repeat {
        let start = Instant::now();
        out = Some(f());
        times.push(start.elapsed().as_secs_f64());
    }
    (median(times), out.expect("at least one run"))
}
