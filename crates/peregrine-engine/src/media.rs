//! Images in prompts: the chat template marks each image part, the marker expands into the
//! family's run of image tokens, the vision tower encodes the picture, and prefill feeds the
//! tower's rows in place of those tokens' embeddings, a whole run in one pass (its tokens may
//! attend to each other both ways).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use peregrine_models::vision::{self, ImageEncoder, ImageInput, ImageRun, RgbImage};
use peregrine_models::{CausalLm, Media, ModelError};
use peregrine_tensor::device::in_compute_pool;
use peregrine_tensor::{Device, Tensor};
use sha2::{Digest, Sha256};

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::tokenizer::Tokenizer;

/// One image's rows and where its run of image tokens starts in the prompt.
pub(crate) struct ImageSpan {
    pub start: usize,
    pub rows: Tensor,
    pub both_ways: bool,
    /// M-RoPE models: the run's rows and columns.
    pub grid: Option<(usize, usize)>,
    /// The picture's content digest, which keys its run in the prompt cache.
    pub digest: [u8; 32],
}

/// A picture's content digest: SHA-256 of its size and pixels.
fn digest(image: &RgbImage) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((image.width as u64).to_le_bytes());
    h.update((image.height as u64).to_le_bytes());
    h.update(&image.data);
    h.finalize().into()
}

/// The most pictures whose encoded rows are kept for a follow-up turn.
const ENCODED_KEPT: usize = 16;

/// Recently encoded pictures by digest, so that a conversation's next turn about the same
/// picture does not run the vision tower again; with counters for `/metrics`.
#[derive(Default)]
pub(crate) struct EncodedImages {
    kept: Mutex<VecDeque<([u8; 32], Tensor)>>,
    /// Pictures run through the tower, and pictures whose rows were found here.
    pub encoded: AtomicU64,
    pub reused: AtomicU64,
}

impl EncodedImages {
    /// The rows of the picture `digest`, from here or from `encode` (then kept, the oldest
    /// dropped past [`ENCODED_KEPT`]).
    fn get_or_encode(
        &self,
        digest: [u8; 32],
        encode: impl FnOnce() -> peregrine_models::Result<Tensor>,
    ) -> peregrine_models::Result<Tensor> {
        let kept = |q: &mut VecDeque<([u8; 32], Tensor)>| {
            let i = q.iter().position(|(d, _)| *d == digest)?;
            let hit = q.remove(i)?;
            q.push_back(hit.clone());
            Some(hit.1)
        };
        let lock = || self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rows) = kept(&mut lock()) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(rows);
        }
        let rows = encode()?;
        self.encoded.fetch_add(1, Ordering::Relaxed);
        let mut q = lock();
        q.push_back((digest, rows.clone()));
        while q.len() > ENCODED_KEPT {
            q.pop_front();
        }
        Ok(rows)
    }
}

/// The ids the prompt cache keys a prompt by: each image token replaced by an id past any
/// vocabulary (bit 31 set) drawn from its picture's digest and its place in the run, so that
/// a cached prefix runs through an image only when the picture is the same (a run of 8 or
/// more tokens carries 248 bits of the digest). Empty for a prompt without images, which
/// its ids key.
pub(crate) fn cache_key(ids: &[u32], spans: &[ImageSpan]) -> Vec<u32> {
    if spans.is_empty() {
        return Vec::new();
    }
    let mut key = ids.to_vec();
    for s in spans {
        for (i, id) in key[s.start..s.end()].iter_mut().enumerate() {
            let word: [u8; 4] = s.digest[4 * (i % 8)..][..4].try_into().expect("4 bytes");
            *id = 1 << 31 | (u32::from_le_bytes(word) ^ i as u32) & 0x7fff_ffff;
        }
    }
    key
}

/// How much of a shared prefix of `n` ids may be reused: not into an image's run, which
/// prefill feeds whole (the run's start instead).
pub(crate) fn reusable(spans: &[ImageSpan], n: usize) -> usize {
    (spans.iter())
        .find(|s| s.start < n && n < s.end())
        .map_or(n, |s| s.start)
}

impl ImageSpan {
    fn end(&self) -> usize {
        self.start + self.rows.dim(0).unwrap_or(0)
    }
}

/// The error for a request whose images or audio cannot be used.
pub(crate) fn refuse(message: String) -> EngineError {
    EngineError::Unsupported {
        param: "messages",
        message,
    }
}

/// Each picture through the family's image processor.
pub(crate) fn preprocess(
    images: &[Arc<RgbImage>],
    vision: &dyn ImageEncoder,
) -> Result<Vec<ImageInput>, EngineError> {
    let input = |image: &Arc<RgbImage>| match vision.preprocess(image) {
        Err(ModelError::Media(e)) => Err(refuse(e.0)),
        other => Ok(other?),
    };
    images.iter().map(input).collect()
}

/// `text` (a rendered chat) with the k-th image marker expanded into the k-th image's tokens;
/// the template must have written one marker per image.
pub(crate) fn expand_markers(
    text: &str,
    images: &[ImageInput],
    vision: &dyn ImageEncoder,
) -> Result<String, EngineError> {
    let marker = &vision.prompt().marker;
    let found = text.matches(marker.as_str()).count();
    if found != images.len() {
        return Err(refuse(format!(
            "the request has {} image(s) but the chat template wrote {found} image marker(s) \
             (`{marker}`)",
            images.len()
        )));
    }
    let mut parts = text.split(marker.as_str());
    let mut out = parts.next().unwrap_or_default().to_string();
    for (part, image) in parts.zip(images) {
        out.push_str(&vision.expansion(image));
        out.push_str(part);
    }
    Ok(out)
}

/// Encodes each picture (or takes its rows from `kept`) and places its rows, run by run as
/// the encoder lays them out, at the runs of image tokens in `ids`, in order.
pub(crate) fn encode(
    ids: &[u32],
    (images, inputs): (&[Arc<RgbImage>], &[ImageInput]),
    (vision, kept): (&dyn ImageEncoder, &EncodedImages),
    tokenizer: &Tokenizer,
) -> Result<Vec<ImageSpan>, EngineError> {
    let prompt = vision.prompt();
    let token = tokenizer.token_to_id(&prompt.image_token).ok_or_else(|| {
        refuse(format!(
            "the tokenizer has no image token `{}`",
            prompt.image_token
        ))
    })?;
    let found = runs(ids, token);
    let layouts: Vec<Vec<ImageRun>> = inputs.iter().map(|i| vision.runs(i)).collect();
    let want: Vec<usize> = layouts.iter().flatten().map(|r| r.len).collect();
    if found.iter().map(|r| r.1).ne(want.iter().copied()) {
        return Err(refuse(format!(
            "the prompt holds runs of {:?} image tokens where the images take {want:?}: image \
             tokens typed into text are not allowed",
            found.iter().map(|r| r.1).collect::<Vec<_>>()
        )));
    }
    let mut found = found.into_iter();
    let mut spans = Vec::with_capacity(found.len());
    for ((image, input), layout) in images.iter().zip(inputs).zip(layouts) {
        let digest = digest(image);
        let rows = kept.get_or_encode(digest, || in_compute_pool(|| vision.encode(input)))?;
        let mut at = 0;
        for (run, (start, len)) in layout.iter().zip(found.by_ref()) {
            spans.push(ImageSpan {
                start,
                rows: rows.narrow(0, at, len).map_err(ModelError::from)?,
                both_ways: prompt.both_ways,
                grid: run.grid,
                digest,
            });
            at += len;
        }
    }
    Ok(spans)
}

/// Each maximal run of `token` in `ids`: where it starts and how long it is.
pub(crate) fn runs(ids: &[u32], token: u32) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != token {
            i += 1;
            continue;
        }
        let n = ids[i..].iter().take_while(|&&t| t == token).count();
        found.push((i, n));
        i += n;
    }
    found
}

/// The prompt chunk from `fed` that the scheduler offered (`k` tokens), fitted to the images:
/// a chunk never splits a run (it ends before a run it would cut, or takes a run it starts
/// with whole) and holds at most one.
pub(crate) fn fit_chunk(spans: &[ImageSpan], fed: usize, k: usize) -> usize {
    if k == 0 {
        return 0;
    }
    let mut end = fed + k;
    let mut held = false;
    for s in spans.iter().filter(|s| s.end() > fed) {
        if s.start >= end {
            break;
        }
        if held || s.start > fed && s.end() > end {
            // A second run, or one the chunk would cut: stop before it.
            end = s.start;
            break;
        }
        end = end.max(s.end());
        held = true;
    }
    end - fed
}

/// The image rows of the chunk `fed..fed + k` (at most one run, as [`fit_chunk`] makes them).
pub(crate) fn media_in(spans: &[ImageSpan], fed: usize, k: usize) -> Option<Media<'_>> {
    let s = spans
        .iter()
        .find(|s| s.start >= fed && s.end() <= fed + k)?;
    Some(Media {
        offset: s.start - fed,
        rows: &s.rows,
        both_ways: s.both_ways,
        grid: s.grid,
    })
}

/// The vision tower for the text model loaded from `path`: from `config.mmproj` when set (which
/// must load and fit), else the checkpoint's own; a VLM whose tower cannot load or fit serves
/// text alone with a warning, unless `config.require_vision`.
pub(crate) fn load_tower(
    path: &Path,
    device: &Device,
    (model, tokenizer): (&dyn CausalLm, &Tokenizer),
    config: &EngineConfig,
) -> Result<Option<Arc<dyn ImageEncoder>>, EngineError> {
    let vision = match &config.mmproj {
        Some(file) => vision::load_mmproj(file, device).map(Some),
        None => vision::load_vision(path, device),
    };
    match vision.and_then(|v| fits(v, model, tokenizer, path)) {
        Ok(Some(vision)) => {
            match vision.prompt().run {
                0 => tracing::info!("vision tower loaded"),
                run => tracing::info!("vision tower loaded: {run} image tokens per tile"),
            }
            Ok(Some(vision))
        }
        Err(e) if config.mmproj.is_some() || config.require_vision => Err(e.into()),
        Ok(None) if config.require_vision => {
            let why = "--vision: this checkpoint has no vision tower (`vision_config`)";
            Err(ModelError::config(path, why).into())
        }
        Ok(None) => Ok(None),
        Err(e) => {
            tracing::warn!("{e}; serving the text model only (--vision makes this an error)");
            Ok(None)
        }
    }
}

/// `vision` when it fits the text model loaded from `path`: rows of its hidden size, an image
/// token its tokenizer knows (a projector file of another model fails here, not mid-request).
fn fits(
    vision: Option<Arc<dyn ImageEncoder>>,
    model: &dyn CausalLm,
    tokenizer: &Tokenizer,
    path: &Path,
) -> peregrine_models::Result<Option<Arc<dyn ImageEncoder>>> {
    let Some(vision) = vision else {
        return Ok(None);
    };
    let hidden = model.config().hidden_size;
    if vision.width() != hidden {
        return Err(ModelError::config(
            path,
            format!(
                "the vision tower gives rows of {} values; the text model's hidden size is {hidden}",
                vision.width()
            ),
        ));
    }
    let token = &vision.prompt().image_token;
    if tokenizer.token_to_id(token).is_none() {
        return Err(ModelError::config(
            path,
            format!("the tokenizer has no image token `{token}`"),
        ));
    }
    Ok(Some(vision))
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_tensor::{DType, Device};

    fn span(start: usize, n: usize) -> ImageSpan {
        let rows = Tensor::zeros((n, 2), DType::F32, &Device::Cpu).unwrap();
        ImageSpan {
            start,
            rows,
            both_ways: true,
            grid: None,
            digest: [start as u8; 32],
        }
    }

    #[test]
    fn chunks_never_split_an_image_and_hold_one_at_most() {
        let spans = [span(10, 16), span(30, 16)];
        assert_eq!(fit_chunk(&spans, 0, 8), 8); // before the first image
        assert_eq!(fit_chunk(&spans, 0, 12), 10); // would cut it: stop before
        assert_eq!(fit_chunk(&spans, 10, 4), 16); // starts with it: takes it whole
        assert_eq!(fit_chunk(&spans, 0, 40), 30); // the first whole, not the second
        assert_eq!(fit_chunk(&spans, 26, 100), 100); // the second whole
        assert_eq!(fit_chunk(&spans, 46, 7), 7); // past both
        assert_eq!(fit_chunk(&spans, 0, 0), 0);
        assert_eq!(fit_chunk(&[], 0, 5), 5);
        let m = media_in(&spans, 5, 25).unwrap();
        assert_eq!((m.offset, m.rows.dim(0).unwrap()), (5, 16));
        assert!(media_in(&spans, 0, 8).is_none());
    }

    #[test]
    fn cache_keys_name_the_picture_and_reuse_stops_before_a_run() {
        let spans = [span(2, 3)];
        let ids = [5, 6, 7, 7, 7, 8];
        let key = cache_key(&ids, &spans);
        assert_eq!((key[..2].to_vec(), key[5]), (vec![5, 6], 8));
        assert!(key[2..5].iter().all(|&k| k >= 1 << 31));
        let other = cache_key(
            &ids,
            &[span(2, 3)].map(|mut s| {
                s.digest[0] ^= 1;
                s
            }),
        );
        assert_ne!(key[2], other[2]);
        assert_eq!(
            (
                reusable(&spans, 2),
                reusable(&spans, 4),
                reusable(&spans, 5)
            ),
            (2, 2, 5)
        );
    }

    #[test]
    fn runs_of_image_tokens_are_found() {
        assert_eq!(runs(&[1, 7, 7, 2, 7, 7, 7], 7), [(1, 2), (4, 3)]);
        assert_eq!(runs(&[7], 7), [(0, 1)]);
        assert!(runs(&[1, 2], 7).is_empty());
    }
}
