//! Audio input: WAV and FLAC decoding ([`decode_wav`], [`decode_flac`]), the feature extractors (Whisper's log-mel,
//! [`MelSettings`]; Gemma 4's, [`Gemma4MelSettings`]) and the towers (Qwen2-Audio's Whisper
//! encoder, [`Qwen2AudioTower`]; Gemma 4's Conformer, [`Gemma4AudioTower`]). As with images, an
//! audio-language checkpoint loads its language model through the registry and its tower here
//! ([`load_audio`]); the tower's rows replace the prompt's audio tokens.

mod fft;
pub mod flac;
pub mod gemma4_audio;
pub mod gemma4_mel;
pub mod mel;
pub mod qwen2_audio;
pub mod wav;

use std::path::Path;

use peregrine_tensor::device::compute_dtype;
use peregrine_tensor::{Device, Tensor};

use crate::config::{Fields, read_json_object};
use crate::weights::{SafetensorsFiles, Source, Weights};
use crate::{ModelError, Result};
pub use flac::decode_flac;
pub use gemma4_audio::{Gemma4AudioConfig, Gemma4AudioTower};
pub use gemma4_mel::Gemma4MelSettings;
pub use mel::MelSettings;
pub use qwen2_audio::{AudioTowerConfig, Qwen2AudioTower};
pub use wav::{AudioClip, decode_wav};

/// A family's feature extractor and tower.
pub enum AudioTower {
    /// Qwen2-Audio: Whisper's features and encoder.
    Qwen2(MelSettings, Qwen2AudioTower),
    /// Gemma 4: its features and Conformer.
    Gemma4(Gemma4MelSettings, Gemma4AudioTower),
}

/// An audio tower with its feature extractor and prompt tokens.
pub struct AudioEncoder {
    /// The family's extractor and tower.
    pub tower: AudioTower,
    /// The token the chat template writes for a clip, which stands for each of its rows.
    pub audio_token: String,
    /// Tokens the expansion writes around a clip's run (Gemma 4: `<|audio>`, `<audio|>`);
    /// Qwen2-Audio's template writes its own.
    pub around: Option<(String, String)>,
    device: Device,
}

impl AudioEncoder {
    /// Samples per second the tower takes.
    pub fn rate(&self) -> u32 {
        match &self.tower {
            AudioTower::Qwen2(m, _) => m.rate,
            AudioTower::Gemma4(m, _) => m.rate,
        }
    }

    /// The longest clip, in seconds.
    pub fn max_seconds(&self) -> f64 {
        let samples = match &self.tower {
            AudioTower::Qwen2(m, _) => m.window_samples,
            AudioTower::Gemma4(m, _) => m.max_samples,
        };
        samples as f64 / f64::from(self.rate())
    }

    /// Width of the rows: the text model's hidden size.
    pub fn width(&self) -> usize {
        match &self.tower {
            AudioTower::Qwen2(_, t) => t.width(),
            AudioTower::Gemma4(_, t) => t.width(),
        }
    }

    /// How many audio tokens stand for `clip` (after checking its sample rate).
    pub fn tokens(&self, clip: &AudioClip) -> Result<usize> {
        if clip.rate != self.rate() {
            return Err(ModelError::Media(crate::vision::MediaError(format!(
                "the clip is sampled at {} Hz; this model takes {} Hz",
                clip.rate,
                self.rate()
            ))));
        }
        let n = clip.samples.len();
        Ok(match &self.tower {
            AudioTower::Qwen2(m, _) => Qwen2AudioTower::tokens(m.valid_frames(n)),
            AudioTower::Gemma4(m, _) => (Gemma4AudioTower::subsampled(&m.valid(n)).iter())
                .filter(|&&v| v)
                .count(),
        })
    }

    /// What stands for a clip of `tokens` rows in the prompt, in place of the template's
    /// audio token.
    pub fn expansion(&self, tokens: usize) -> String {
        let run = self.audio_token.repeat(tokens);
        match &self.around {
            Some((open, close)) => format!("{open}{run}{close}"),
            None => run,
        }
    }

    /// The clip's rows `[tokens, text hidden]`, its features through the tower.
    pub fn encode(&self, clip: &AudioClip) -> Result<Tensor> {
        self.tokens(clip)?;
        match &self.tower {
            AudioTower::Qwen2(mel, tower) => {
                let features = mel.features(&clip.samples);
                let valid = mel.valid_frames(clip.samples.len());
                tower.encode(&features, valid, &self.device)
            }
            AudioTower::Gemma4(mel, tower) => {
                let (features, valid) = mel.features(&clip.samples);
                tower.encode(&features, &valid, &self.device)
            }
        }
    }
}

/// The audio tower of the HF checkpoint folder `dir` when its `config.json` has an
/// `audio_config` (Qwen2-Audio, Gemma 4); `None` otherwise.
pub fn load_audio(dir: &Path, device: &Device) -> Result<Option<AudioEncoder>> {
    let config_path = dir.join("config.json");
    if !dir.is_dir() || !config_path.is_file() {
        return Ok(None);
    }
    let map = read_json_object(&config_path)?;
    let fields = Fields::new(&config_path, &map);
    let Some(audio) = fields.object("audio_config")? else {
        return Ok(None);
    };
    let model_type = fields.opt_str("model_type")?.unwrap_or_default();
    let text_width = match fields.object("text_config")? {
        Some(t) => t.opt_usize("hidden_size")?,
        None => fields.opt_usize("hidden_size")?,
    }
    .unwrap_or(4096);
    let processor_path = dir.join("preprocessor_config.json");
    let processor = read_json_object(&processor_path)?;
    let processor = Fields::new(&processor_path, &processor);
    let files = SafetensorsFiles::open_dir(dir)?;
    let weights = Weights::new(
        Source::Safetensors(files),
        device.clone(),
        compute_dtype(device),
    );
    let (tower, audio_token, around) = match model_type {
        "qwen2_audio" => {
            let config = AudioTowerConfig::from_fields(&audio)?;
            let mel = MelSettings::read(&processor)?;
            if mel.mels != config.mels || mel.frames() != 2 * config.positions {
                let why = format!(
                    "the features ({} bins, {} frames) do not fit the tower ({} bins, {} \
                     positions)",
                    mel.mels,
                    mel.frames(),
                    config.mels,
                    config.positions
                );
                return Err(ModelError::config(&processor_path, why));
            }
            let tower = Qwen2AudioTower::load(config, &weights, text_width)?;
            (AudioTower::Qwen2(mel, tower), "<|AUDIO|>".to_string(), None)
        }
        "gemma4" => {
            let config = Gemma4AudioConfig::from_fields(&audio)?;
            let mel = Gemma4MelSettings::read(&processor)?;
            if mel.mels != config.channels[0] {
                let why = format!(
                    "the features' {} bins are not the tower's {} input channels",
                    mel.mels, config.channels[0]
                );
                return Err(ModelError::config(&processor_path, why));
            }
            let keys = ["audio_token", "boa_token", "eoa_token"];
            let [token, boa, eoa] = crate::vision::token_names(dir, keys, "audio input")?;
            let tower = Gemma4AudioTower::load(config, &weights, text_width)?;
            (AudioTower::Gemma4(mel, tower), token, Some((boa, eoa)))
        }
        _ => {
            let why = format!(
                "`{model_type}` audio towers are not supported yet (Qwen2-Audio's and Gemma 4's \
                 are)"
            );
            return Err(ModelError::config(&config_path, why));
        }
    };
    Ok(Some(AudioEncoder {
        tower,
        audio_token,
        around,
        device: device.clone(),
    }))
}
