//! WAV (RIFF) decoding: PCM of 8, 16, 24 or 32 bits and 32-bit float, mono or interleaved
//! channels averaged to mono, as the `soundfile`/`librosa` readers HF's examples use give it
//! (integers scaled by `1 / 2^(bits-1)`, 8-bit unsigned centred on 128).

use crate::vision::MediaError;

/// One clip of mono samples in `-1..1`.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioClip {
    /// The samples, one channel.
    pub samples: Vec<f32>,
    /// Samples per second.
    pub rate: u32,
}

impl AudioClip {
    /// The clip's length in seconds.
    pub fn seconds(&self) -> f64 {
        f64::from(self.samples.len() as u32) / f64::from(self.rate.max(1))
    }
}

fn err(msg: impl Into<String>) -> MediaError {
    MediaError(msg.into())
}

/// Decodes a WAV file's bytes; anything else (or a WAV this reader does not take) is an error
/// that says what was found. At most `max_seconds` of audio are accepted.
pub fn decode_wav(bytes: &[u8], max_seconds: f64) -> Result<AudioClip, MediaError> {
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return Err(err("not a WAV file (no RIFF/WAVE header)"));
    }
    let mut format = None;
    let mut at = 12;
    while at + 8 <= bytes.len() {
        let id = &bytes[at..at + 4];
        let size = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes")) as usize;
        let body = &bytes[at + 8..bytes.len().min(at + 8 + size)];
        match id {
            b"fmt " => format = Some(Format::read(body)?),
            b"data" => {
                let f = format.ok_or_else(|| err("WAV: `data` comes before `fmt `"))?;
                return f.samples(body, max_seconds);
            }
            _ => {}
        }
        at += 8 + size + size % 2;
    }
    Err(err("WAV: no `data` chunk"))
}

#[derive(Debug, Clone, Copy)]
struct Format {
    float: bool,
    channels: usize,
    rate: u32,
    bits: usize,
}

impl Format {
    fn read(body: &[u8]) -> Result<Self, MediaError> {
        if body.len() < 16 {
            return Err(err("WAV: `fmt ` chunk too short"));
        }
        let u16_at = |i: usize| u16::from_le_bytes([body[i], body[i + 1]]);
        let mut tag = u16_at(0);
        if tag == 0xFFFE && body.len() >= 26 {
            tag = u16_at(24); // WAVE_FORMAT_EXTENSIBLE: the sub-format's first two bytes
        }
        let f = Self {
            float: tag == 3,
            channels: usize::from(u16_at(2)),
            rate: u32::from_le_bytes(body[4..8].try_into().expect("4 bytes")),
            bits: usize::from(u16_at(14)),
        };
        let known = matches!((tag, f.bits), (1, 8 | 16 | 24 | 32) | (3, 32));
        if !known || f.channels == 0 || f.rate == 0 {
            return Err(err(format!(
                "WAV: format {tag} with {} bits, {} channels at {} Hz is not supported (PCM of \
                 8, 16, 24 or 32 bits, or 32-bit float)",
                f.bits, f.channels, f.rate
            )));
        }
        Ok(f)
    }

    fn samples(self, data: &[u8], max_seconds: f64) -> Result<AudioClip, MediaError> {
        let width = self.bits / 8;
        let frames = data.len() / (width * self.channels);
        if frames as f64 > max_seconds * f64::from(self.rate) {
            return Err(err(format!(
                "the clip is {:.1} s long; at most {max_seconds} s are accepted",
                frames as f64 / f64::from(self.rate)
            )));
        }
        let value = |b: &[u8]| -> f32 {
            match (self.float, width) {
                (true, _) => f32::from_le_bytes(b.try_into().expect("4 bytes")),
                (false, 1) => (f32::from(b[0]) - 128.0) / 128.0,
                (false, 2) => f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0,
                (false, 3) => (i32::from_le_bytes([0, b[0], b[1], b[2]]) >> 8) as f32 / 8_388_608.0,
                _ => i32::from_le_bytes(b.try_into().expect("4 bytes")) as f32 / 2_147_483_648.0,
            }
        };
        let samples = data
            .chunks_exact(width * self.channels)
            .map(|frame| {
                let sum: f32 = frame.chunks_exact(width).map(value).sum();
                sum / self.channels as f32
            })
            .collect();
        Ok(AudioClip {
            samples,
            rate: self.rate,
        })
    }
}
