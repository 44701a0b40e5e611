//! Whisper's log-mel features (`WhisperFeatureExtractor`, the torch path transformers takes):
//! the clip zero-padded to the window (`chunk_length` seconds), a centred STFT with a periodic
//! Hann window and reflected edges, power spectra without the last frame, Slaney-normalised
//! triangular mel filters on the Slaney scale up to 8 kHz, `log10` clamped at `1e-10`, floored
//! at the clip's maximum minus 8, then `(x + 4) / 4`. Computed in f64 (transformers: f32).

use std::f64::consts::PI;

use rayon::prelude::*;

use super::fft::Fft;
use crate::Result;
use crate::config::Fields;

/// The feature extractor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct MelSettings {
    /// Mel bins (`feature_size`).
    pub mels: usize,
    /// Samples per second the model takes (`sampling_rate`).
    pub rate: u32,
    /// Samples between frames (`hop_length`).
    pub hop: usize,
    /// FFT size (`n_fft`).
    pub n_fft: usize,
    /// Samples in one window of input (`chunk_length` seconds).
    pub window_samples: usize,
}

impl MelSettings {
    /// Reads the keys above (Whisper's defaults where absent); `dither` other than 0 and
    /// `do_normalize` are refused.
    pub fn read(f: &Fields) -> Result<Self> {
        if f.opt_f64("dither")?.is_some_and(|d| d != 0.0)
            || f.opt_bool("do_normalize")? == Some(true)
        {
            return Err(f.err("fields `dither` and `do_normalize` are not supported".into()));
        }
        let rate = f.opt_usize("sampling_rate")?.unwrap_or(16000);
        let s = Self {
            mels: f.opt_usize("feature_size")?.unwrap_or(80),
            rate: rate as u32,
            hop: f.opt_usize("hop_length")?.unwrap_or(160),
            n_fft: f.opt_usize("n_fft")?.unwrap_or(400),
            window_samples: f.opt_usize("chunk_length")?.unwrap_or(30) * rate,
        };
        if s.mels == 0 || s.hop == 0 || s.n_fft < 2 || s.window_samples < s.n_fft || rate < 16000 {
            return Err(f.err(format!("unusable audio feature settings {s:?}")));
        }
        Ok(s)
    }

    /// Frames in one window.
    pub fn frames(&self) -> usize {
        self.window_samples / self.hop
    }

    /// Frames that hold a clip of `samples` samples (its attention mask's ones).
    pub fn valid_frames(&self, samples: usize) -> usize {
        samples.min(self.window_samples).div_ceil(self.hop)
    }

    /// The filter bank `[n_fft / 2 + 1][mels]` (transformers' `mel_filter_bank` with Slaney
    /// norm and scale, 0 to 8 kHz).
    pub fn filters(&self) -> Vec<f64> {
        mel_filters(
            self.n_fft / 2 + 1,
            self.mels,
            self.rate,
            8000.0,
            MelScale::Slaney,
        )
    }

    /// The features `[mels][frames]` (row-major) of `samples` (at [`MelSettings::rate`]),
    /// padded or cut to one window; frames past [`valid_frames`](Self::valid_frames) + 2 hold
    /// only padding, and get its value without a transform.
    pub fn features(&self, samples: &[f32]) -> Vec<f32> {
        let (frames, half) = (self.frames(), self.n_fft / 2);
        let n = samples.len().min(self.window_samples);
        let at = |i: isize| -> f64 {
            // The window's samples with torch's reflected edges; zeros past the clip.
            let len = self.window_samples as isize;
            let i = if i < 0 {
                -i
            } else if i >= len {
                2 * (len - 1) - i
            } else {
                i
            };
            samples
                .get(i as usize)
                .filter(|_| (i as usize) < n)
                .map_or(0.0, |&s| f64::from(s))
        };
        let window: Vec<f64> = (0..self.n_fft)
            .map(|i| 0.5 - 0.5 * (2.0 * PI * i as f64 / self.n_fft as f64).cos())
            .collect();
        let bins = half + 1;
        let fft = Fft::new(self.n_fft);
        let filters = self.filters();
        let computed = frames.min(self.valid_frames(n) + 2);
        // Frames in parallel, each its mels' logarithms.
        let rows: Vec<Vec<f64>> = (0..computed)
            .into_par_iter()
            .map(|t| {
                let start = (t * self.hop) as isize - half as isize;
                let x: Vec<f64> = (0..self.n_fft)
                    .map(|i| at(start + i as isize) * window[i])
                    .collect();
                let power: Vec<f64> = fft
                    .real(&x)
                    .iter()
                    .map(|(re, im)| re * re + im * im)
                    .collect();
                (0..self.mels)
                    .map(|m| {
                        let e: f64 = (0..bins)
                            .map(|b| filters[b * self.mels + m] * power[b])
                            .sum();
                        e.max(1e-10).log10()
                    })
                    .collect()
            })
            .collect();
        let mut logs = vec![(1e-10f64).log10(); self.mels * frames];
        for (t, row) in rows.iter().enumerate() {
            for (m, &l) in row.iter().enumerate() {
                logs[m * frames + t] = l;
            }
        }
        let floor = logs.iter().copied().fold(f64::MIN, f64::max) - 8.0;
        logs.iter()
            .map(|&l| ((l.max(floor) + 4.0) / 4.0) as f32)
            .collect()
    }
}

/// The mel scale and filter normalisation of a filter bank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MelScale {
    /// Slaney's scale (linear below 1 kHz, logarithmic above), filters normalised to equal
    /// area (Whisper).
    Slaney,
    /// HTK's `2595 · log10(1 + f / 700)`, unnormalised triangles (Gemma 4's audio).
    Htk,
}

/// transformers' `mel_filter_bank`: `mels` triangles from 0 Hz to `max_hz` over `bins`
/// frequency bins from 0 to half of `rate`, row-major `[bins][mels]`, in f64.
pub fn mel_filters(bins: usize, mels: usize, rate: u32, max_hz: f64, scale: MelScale) -> Vec<f64> {
    type Map = fn(f64) -> f64;
    let (to_mel, to_hz): (Map, Map) = match scale {
        MelScale::Slaney => (slaney_mel, slaney_hertz),
        MelScale::Htk => (
            |f| 2595.0 * (1.0 + f / 700.0).log10(),
            |m| 700.0 * (10f64.powf(m / 2595.0) - 1.0),
        ),
    };
    let (lo, hi) = (to_mel(0.0), to_mel(max_hz));
    let n = mels + 2;
    // As numpy's `linspace`: the start plus the index times the step.
    let step = (hi - lo) / (n - 1) as f64;
    let edges: Vec<f64> = (0..n).map(|i| to_hz(lo + i as f64 * step)).collect();
    let bin_step = f64::from(rate / 2) / (bins - 1) as f64;
    let mut out = vec![0.0; bins * mels];
    for b in 0..bins {
        let freq = b as f64 * bin_step;
        for m in 0..mels {
            let down = (freq - edges[m]) / (edges[m + 1] - edges[m]);
            let up = (edges[m + 2] - freq) / (edges[m + 2] - edges[m + 1]);
            let norm = match scale {
                MelScale::Slaney => 2.0 / (edges[m + 2] - edges[m]),
                MelScale::Htk => 1.0,
            };
            out[b * mels + m] = down.min(up).max(0.0) * norm;
        }
    }
    out
}

/// Slaney's mel scale: linear below 1 kHz, logarithmic above.
fn slaney_mel(f: f64) -> f64 {
    if f < 1000.0 {
        3.0 * f / 200.0
    } else {
        15.0 + (f / 1000.0).ln() * 27.0 / 6.4f64.ln()
    }
}

fn slaney_hertz(m: f64) -> f64 {
    if m < 15.0 {
        200.0 * m / 3.0
    } else {
        1000.0 * (6.4f64.ln() / 27.0 * (m - 15.0)).exp()
    }
}
