//! Audio in prompts, as [`crate::media`] does images: the chat template writes the family's
//! audio token once per clip, it expands into the clip's run of them, the audio tower encodes
//! the clip, and prefill feeds the tower's rows in place of those tokens' embeddings (a run is
//! causal, as in the reference model, and is never split across prefill chunks).

use std::path::Path;
use std::sync::Arc;

use peregrine_models::audio::{AudioClip, AudioEncoder, load_audio};
use peregrine_models::{CausalLm, ModelError};
use peregrine_tensor::Device;
use peregrine_tensor::device::in_compute_pool;
use sha2::{Digest, Sha256};

use crate::error::EngineError;
use crate::media::{ImageSpan, refuse};
use crate::tokenizer::Tokenizer;

/// The audio tower of the checkpoint at `path`, when it has one that fits the text model (its
/// rows' width, a tokenizer that knows its token); one that does not load or fit is reported
/// and left out, and the text model serves alone.
pub(crate) fn load(
    path: &Path,
    device: &Device,
    (model, tokenizer): (&dyn CausalLm, &Tokenizer),
) -> Option<Arc<AudioEncoder>> {
    let fits = |a: AudioEncoder| -> peregrine_models::Result<AudioEncoder> {
        let hidden = model.config().hidden_size;
        if a.width() != hidden {
            let why = format!("the audio tower gives rows of {} values", a.width());
            return Err(ModelError::config(
                path,
                format!("{why}; the text model takes {hidden}"),
            ));
        }
        if tokenizer.token_to_id(&a.audio_token).is_none() {
            let why = format!("the tokenizer has no audio token `{}`", a.audio_token);
            return Err(ModelError::config(path, why));
        }
        Ok(a)
    };
    match load_audio(path, device).and_then(|a| a.map(fits).transpose()) {
        Ok(Some(audio)) => {
            let (seconds, rate) = (audio.max_seconds(), audio.rate());
            tracing::info!("audio tower loaded: clips of up to {seconds} s at {rate} Hz");
            Some(Arc::new(audio))
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!("{e}; serving without audio input");
            None
        }
    }
}

/// Checks each clip against the tower (sample rate, length) and gives its token count.
fn token_counts(clips: &[Arc<AudioClip>], audio: &AudioEncoder) -> Result<Vec<usize>, EngineError> {
    let max = audio.max_seconds();
    let count = |(i, clip): (usize, &Arc<AudioClip>)| {
        if clip.seconds() > max {
            let why = format!(
                "audio clip {i} is {:.1} s long; this model hears at most {max} s",
                clip.seconds()
            );
            return Err(refuse(why));
        }
        match audio.tokens(clip) {
            Ok(0) => Err(refuse(format!("audio clip {i} is too short"))),
            Ok(n) => Ok(n),
            Err(ModelError::Media(e)) => Err(refuse(format!("audio clip {i}: {}", e.0))),
            Err(e) => Err(e.into()),
        }
    };
    clips.iter().enumerate().map(count).collect()
}

/// `text` (a rendered chat) with the k-th audio token expanded into the k-th clip's run; the
/// template must have written one per clip.
pub(crate) fn expand(
    text: &str,
    clips: &[Arc<AudioClip>],
    audio: Option<&AudioEncoder>,
) -> Result<String, EngineError> {
    if clips.is_empty() {
        return Ok(text.to_owned());
    }
    let Some(audio) = audio else {
        return Err(refuse(
            "this model takes no audio input (it has no audio tower)".into(),
        ));
    };
    let token = audio.audio_token.as_str();
    let found = text.matches(token).count();
    if found != clips.len() {
        return Err(refuse(format!(
            "the request has {} audio clip(s) but the chat template wrote {found} audio \
             token(s) (`{token}`)",
            clips.len()
        )));
    }
    let mut parts = text.split(token);
    let mut out = parts.next().unwrap_or_default().to_string();
    for (part, n) in parts.zip(token_counts(clips, audio)?) {
        out.push_str(&audio.expansion(n));
        out.push_str(part);
    }
    Ok(out)
}

/// A clip's content digest: SHA-256 of its rate and samples.
fn digest(clip: &AudioClip) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(clip.rate.to_le_bytes());
    for s in &clip.samples {
        h.update(s.to_le_bytes());
    }
    h.finalize().into()
}

/// Encodes each clip and places its rows at the runs of audio tokens in `ids`, in order.
pub(crate) fn encode(
    ids: &[u32],
    clips: &[Arc<AudioClip>],
    audio: Option<&AudioEncoder>,
    tokenizer: &Tokenizer,
) -> Result<Vec<ImageSpan>, EngineError> {
    let Some(audio) = audio.filter(|_| !clips.is_empty()) else {
        return Ok(Vec::new());
    };
    let token = (tokenizer.token_to_id(&audio.audio_token)).ok_or_else(|| {
        refuse(format!(
            "the tokenizer has no token `{}`",
            audio.audio_token
        ))
    })?;
    let found = crate::media::runs(ids, token);
    let want = token_counts(clips, audio)?;
    if found.iter().map(|r| r.1).ne(want.iter().copied()) {
        return Err(refuse(format!(
            "the prompt holds runs of {:?} audio tokens where the clips take {want:?}: audio \
             tokens typed into text are not allowed",
            found.iter().map(|r| r.1).collect::<Vec<_>>()
        )));
    }
    let spans = clips
        .iter()
        .zip(found)
        .map(|(clip, (start, _))| -> Result<_, EngineError> {
            let rows = in_compute_pool(|| audio.encode(clip))?;
            Ok(ImageSpan {
                start,
                rows,
                both_ways: false,
                grid: None,
                digest: digest(clip),
            })
        });
    spans.collect()
}
