//! Gemma 4's log-mel features (`Gemma4AudioFeatureExtractor`): the clip cut at `max_length`
//! samples and zero-padded to a multiple of 128, 160 zeros before it (half a frame), frames of
//! 320 samples every 160 under a periodic Hann window (window and samples multiplied in f32, as
//! numpy does), a 512-point real FFT's magnitudes (not powers), HTK-scale triangles without
//! normalisation, `ln(x + 0.001)`, and the frames past the clip zeroed. A frame is the clip's
//! while its last sample is.

use std::f64::consts::PI;

use rayon::prelude::*;

use super::fft::Fft;
use super::mel::{MelScale, mel_filters};
use crate::Result;
use crate::config::Fields;

/// The feature extractor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4MelSettings {
    /// Mel bins (`feature_size`).
    pub mels: usize,
    /// Samples per second (`sampling_rate`).
    pub rate: u32,
    /// Samples per frame.
    pub frame: usize,
    /// Samples between frames.
    pub hop: usize,
    /// FFT size: the frame rounded up to a power of two.
    pub n_fft: usize,
    /// Highest filter frequency.
    pub max_hz: f64,
    /// Added before the logarithm.
    pub floor: f64,
    /// The longest clip, in samples (30 s).
    pub max_samples: usize,
}

impl Gemma4MelSettings {
    /// Reads the keys transformers' class takes; preemphasis, dither, input scaling and
    /// per-bin normalisation other than the defaults are refused.
    pub fn read(f: &Fields) -> Result<Self> {
        let off = |key: &str, default: f64| -> Result<()> {
            match f.opt_f64(key)? {
                Some(v) if v != default => {
                    Err(f.err(format!("field `{key}: {v}` is not supported")))
                }
                _ => Ok(()),
            }
        };
        off("preemphasis", 0.0)?;
        off("dither", 0.0)?;
        off("input_scale_factor", 1.0)?;
        off("min_frequency", 0.0)?;
        for key in ["per_bin_mean", "per_bin_stddev"] {
            if f.get(key).is_some_and(|v| !v.is_null()) {
                return Err(f.err(format!("field `{key}` is not supported")));
            }
        }
        if f.opt_bool("fft_overdrive")? == Some(true) {
            return Err(f.err("field `fft_overdrive: true` is not supported".into()));
        }
        let rate = f.opt_usize("sampling_rate")?.unwrap_or(16000);
        let ms = |key: &str, default: f64| -> Result<usize> {
            Ok((rate as f64 * f.opt_f64(key)?.unwrap_or(default) / 1000.0).round() as usize)
        };
        let frame = ms("frame_length_ms", 20.0)?;
        let s = Self {
            mels: f.opt_usize("feature_size")?.unwrap_or(128),
            rate: rate as u32,
            frame,
            hop: ms("hop_length_ms", 10.0)?,
            n_fft: frame.next_power_of_two(),
            max_hz: f.opt_f64("max_frequency")?.unwrap_or(8000.0),
            floor: f.opt_f64("mel_floor")?.unwrap_or(1e-3),
            max_samples: 480_000,
        };
        if s.mels == 0 || s.hop == 0 || s.frame < 2 {
            return Err(f.err(format!("unusable audio feature settings {s:?}")));
        }
        Ok(s)
    }

    /// The filter bank `[n_fft / 2 + 1][mels]`.
    pub fn filters(&self) -> Vec<f64> {
        mel_filters(
            self.n_fft / 2 + 1,
            self.mels,
            self.rate,
            self.max_hz,
            MelScale::Htk,
        )
    }

    /// Which frames of a clip of `samples` samples hold it (the feature extractor's mask): a
    /// frame is the clip's while its last sample, `t·hop + frame` of the half-frame-delayed
    /// clip, is.
    pub fn valid(&self, samples: usize) -> Vec<bool> {
        let n = samples.min(self.max_samples);
        let (half, padded) = (self.frame / 2, n.next_multiple_of(128));
        let frames = match (padded + half).checked_sub(self.frame + 1) {
            Some(span) => span / self.hop + 1,
            None => 0,
        };
        (0..frames)
            .map(|t| t * self.hop + self.frame - half < n)
            .collect()
    }

    /// The clip's features `[frames][mels]` (row-major) and which frames hold it.
    pub fn features(&self, samples: &[f32]) -> (Vec<f32>, Vec<bool>) {
        let n = samples.len().min(self.max_samples);
        let valid = self.valid(n);
        let (half, frames) = (self.frame / 2, valid.len());
        // Sample `i` of the half-frame-delayed clip; zeros before and after it.
        let at = |i: usize| {
            i.checked_sub(half)
                .and_then(|i| samples[..n].get(i))
                .copied()
                .unwrap_or(0.0)
        };
        let window: Vec<f32> = (0..self.frame)
            .map(|i| (0.5 - 0.5 * (2.0 * PI * i as f64 / self.frame as f64).cos()) as f32)
            .collect();
        let bins = self.n_fft / 2 + 1;
        let fft = Fft::new(self.n_fft);
        let filters = self.filters();
        let mut out = vec![0.0f32; frames * self.mels];
        // Frames in parallel; those past the clip stay zero.
        let rows = out
            .par_chunks_mut(self.mels)
            .enumerate()
            .filter(|(t, _)| valid[*t]);
        rows.for_each(|(t, row)| {
            let x: Vec<f64> = (0..self.frame)
                .map(|i| f64::from(at(t * self.hop + i) * window[i]))
                .collect();
            let magnitude: Vec<f64> = fft
                .real(&x)
                .iter()
                .map(|(re, im)| (re * re + im * im).sqrt())
                .collect();
            for (m, out) in row.iter_mut().enumerate() {
                let e: f64 = (0..bins)
                    .map(|b| magnitude[b] * filters[b * self.mels + m])
                    .sum();
                *out = (e + self.floor).ln() as f32;
            }
        });
        (out, valid)
    }
}
