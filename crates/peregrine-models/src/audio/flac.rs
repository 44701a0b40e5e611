//! FLAC decoding (through the `claxon` crate): any bit depth and channel count, channels
//! averaged to mono and integers scaled by `1 / 2^(bits-1)`, as [`decode_wav`](super::decode_wav)
//! gives PCM WAV (so a lossless copy of a WAV decodes to the same samples).

use std::io::Cursor;

use super::wav::AudioClip;
use crate::vision::MediaError;

/// Decodes a FLAC file's bytes; at most `max_seconds` of audio are accepted, checked from the
/// stream header before any frame is decoded.
pub fn decode_flac(bytes: &[u8], max_seconds: f64) -> Result<AudioClip, MediaError> {
    let err = |m: String| MediaError(m);
    let mut reader = claxon::FlacReader::new(Cursor::new(bytes))
        .map_err(|e| err(format!("not a FLAC file this reader takes: {e}")))?;
    let info = reader.streaminfo();
    let (rate, channels, bits) = (
        info.sample_rate,
        info.channels as usize,
        info.bits_per_sample,
    );
    if rate == 0 || channels == 0 || !(4..=32).contains(&bits) {
        return Err(err(format!(
            "FLAC stream of {rate} Hz, {channels} channels, {bits} bits"
        )));
    }
    let limit = (max_seconds * f64::from(rate)) as u64;
    if info.samples.is_some_and(|n| n > limit) {
        return Err(err(format!("the clip is longer than {max_seconds} s")));
    }
    // As decode_wav: each value over 2^(bits-1) in f32, the channels' sum over their count.
    let full = (1u64 << (bits - 1)) as f32;
    let (mut samples, mut sum, mut k) = (Vec::new(), 0.0f32, 0);
    for s in reader.samples() {
        let s = s.map_err(|e| err(format!("the FLAC data is corrupt: {e}")))?;
        sum += s as f32 / full;
        k += 1;
        if k == channels {
            samples.push(sum / channels as f32);
            (sum, k) = (0.0, 0);
            if samples.len() as u64 > limit {
                return Err(err(format!("the clip is longer than {max_seconds} s")));
            }
        }
    }
    Ok(AudioClip { samples, rate })
}
