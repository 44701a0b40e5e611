//! Request-level sampling parameters and their validation.

/// Largest accepted temperature. OpenAI caps at 2; vLLM accepts any non-negative value. A finite
/// cap keeps `logit / temperature` well away from denormals while still allowing "almost uniform".
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Allowed range of `frequency_penalty` and `presence_penalty` (OpenAI's).
pub const PENALTY_RANGE: std::ops::RangeInclusive<f32> = -2.0..=2.0;

/// How one request turns logits into tokens.
///
/// Processors run in the order HF transformers and vLLM use: repetition, frequency and presence
/// penalties, then temperature, top-k, top-p, min-p, then the draw.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax). Default `1.0` (OpenAI's default).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` turns the filter off.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens whose probability mass reaches `top_p`;
    /// `1.0` turns it off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top token's; `0.0` turns it off.
    pub min_p: f32,
    /// HF repetition penalty over every token seen in prompt and output: positive logits are
    /// divided by it, negative ones multiplied; `1.0` turns it off.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty: subtracts `count * frequency_penalty` for each generated token.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty: subtracts `presence_penalty` once for each generated token.
    pub presence_penalty: f32,
    /// Seed of the request's generator; `None` draws a fresh seed from the clock and process
    /// entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// OpenAI's defaults: plain sampling at temperature 1 with every filter and penalty off.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }
}

/// A sampling parameter outside its allowed range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `field` holds `value`, which is not in `allowed`.
    #[error("invalid sampling parameter `{field}` = {value}: must be {allowed}")]
    OutOfRange {
        /// The parameter's name as the OpenAI API spells it.
        field: &'static str,
        /// The rejected value.
        value: f32,
        /// The allowed range, in words.
        allowed: &'static str,
    },
}

impl SamplingParams {
    /// Greedy decoding (temperature 0) with every other option at its default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether the draw is an argmax (temperature 0, or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks every field's range; the error names the first offending field.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let check = |field, value: f32, ok: bool, allowed| {
            // NaN fails every comparison, so `ok` is false for it too.
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange {
                    field,
                    value,
                    allowed,
                })
            }
        };
        let t = self.temperature;
        check(
            "temperature",
            t,
            (0.0..=MAX_TEMPERATURE).contains(&t),
            "in [0, 100]",
        )?;
        let p = self.top_p;
        check("top_p", p, p > 0.0 && p <= 1.0, "in (0, 1]")?;
        let m = self.min_p;
        check("min_p", m, (0.0..=1.0).contains(&m), "in [0, 1]")?;
        let r = self.repetition_penalty;
        check("repetition_penalty", r, r > 0.0, "greater than 0")?;
        let f = self.frequency_penalty;
        check(
            "frequency_penalty",
            f,
            PENALTY_RANGE.contains(&f),
            "in [-2, 2]",
        )?;
        let pp = self.presence_penalty;
        check(
            "presence_penalty",
            pp,
            PENALTY_RANGE.contains(&pp),
            "in [-2, 2]",
        )
    }
}
