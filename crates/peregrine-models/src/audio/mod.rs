//! Audio input: WAV decoding ([`decode_wav`]), Whisper's log-mel features ([`MelSettings`]) and
//! Qwen2-Audio's tower ([`Qwen2AudioTower`]). As with images, an audio-language checkpoint
//! loads its language model through the registry and its tower here ([`load_audio`]); the
//! tower's rows replace the prompt's audio tokens.

pub mod mel;
pub mod qwen2_audio;
pub mod wav;

use std::path::Path;

use peregrine_tensor::device::compute_dtype;
use peregrine_tensor::{Device, Tensor};

use crate::config::{Fields, read_json_object};
use crate::weights::{SafetensorsFiles, Source, Weights};
use crate::{ModelError, Result};
pub use mel::MelSettings;
pub use qwen2_audio::{AudioTowerConfig, Qwen2AudioTower};
pub use wav::{AudioClip, decode_wav};

/// An audio tower with its feature extractor and prompt tokens.
pub struct AudioEncoder {
    /// The feature extractor's settings.
    pub mel: MelSettings,
    /// The tower and projector.
    pub tower: Qwen2AudioTower,
    /// The token that stands for each of a clip's rows (`<|AUDIO|>`).
    pub audio_token: String,
    device: Device,
}

impl AudioEncoder {
    /// How many audio tokens stand for `clip` (after checking its sample rate).
    pub fn tokens(&self, clip: &AudioClip) -> Result<usize> {
        if clip.rate != self.mel.rate {
            return Err(ModelError::Media(crate::vision::MediaError(format!(
                "the clip is sampled at {} Hz; this model takes {} Hz",
                clip.rate, self.mel.rate
            ))));
        }
        Ok(Qwen2AudioTower::tokens(
            self.mel.valid_frames(clip.samples.len()),
        ))
    }

    /// The clip's rows `[tokens, text hidden]`, its log-mel features through the tower.
    pub fn encode(&self, clip: &AudioClip) -> Result<Tensor> {
        self.tokens(clip)?;
        let features = self.mel.features(&clip.samples);
        let valid = self.mel.valid_frames(clip.samples.len());
        self.tower.encode(&features, valid, &self.device)
    }
}

/// The audio tower of the HF checkpoint folder `dir` when its `config.json` has an
/// `audio_config` (Qwen2-Audio); `None` otherwise.
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
    if model_type != "qwen2_audio" {
        let why = format!("`{model_type}` audio towers are not supported yet (Qwen2-Audio is)");
        return Err(ModelError::config(&config_path, why));
    }
    let config = AudioTowerConfig::from_fields(&audio)?;
    let text = fields.object("text_config")?;
    let text_width = match &text {
        Some(t) => t.opt_usize("hidden_size")?,
        None => fields.opt_usize("hidden_size")?,
    }
    .unwrap_or(4096);
    let processor_path = dir.join("preprocessor_config.json");
    let processor = read_json_object(&processor_path)?;
    let mel = MelSettings::read(&Fields::new(&processor_path, &processor))?;
    if mel.mels != config.mels || mel.frames() != 2 * config.positions {
        let why = format!(
            "the features ({} bins, {} frames) do not fit the tower ({} bins, {} positions)",
            mel.mels,
            mel.frames(),
            config.mels,
            config.positions
        );
        return Err(ModelError::config(&processor_path, why));
    }
    let files = SafetensorsFiles::open_dir(dir)?;
    let weights = Weights::new(
        Source::Safetensors(files),
        device.clone(),
        compute_dtype(device),
    );
    Ok(Some(AudioEncoder {
        mel,
        tower: Qwen2AudioTower::load(config, &weights, text_width)?,
        audio_token: "<|AUDIO|>".into(),
        device: device.clone(),
    }))
}
