//! Prompt lookup (n-gram) drafting: when the context's last few tokens occurred before, the
//! tokens that followed them then are proposed now. Free to compute, and right often on edits,
//! code and quoting, where the output repeats the input.

use std::sync::Arc;

use peregrine_models::{CausalLm, KvOptions};
use peregrine_sampling::SamplingParams;

use super::{DraftContext, DraftSource, Drafter, Proposal};
use crate::error::EngineError;

/// Drafts by prompt lookup (`--spec-ngram`): the longest suffix of the context, from `max_ngram`
/// down to `min_ngram` tokens, that also occurs earlier; its latest earlier occurrence's
/// continuation is the proposal.
#[derive(Debug, Clone, Copy)]
pub struct PromptLookup {
    /// Shortest suffix matched (1 proposes after any repeated token).
    pub min_ngram: usize,
    /// Longest suffix tried first.
    pub max_ngram: usize,
}

impl Default for PromptLookup {
    /// Suffixes of 3 down to 2 tokens, as vLLM's and llama.cpp's lookups default to roughly.
    fn default() -> Self {
        Self {
            min_ngram: 2,
            max_ngram: 3,
        }
    }
}

impl DraftSource for PromptLookup {
    fn name(&self) -> &str {
        "prompt-lookup"
    }

    fn start(&self, _: &Arc<dyn CausalLm>, _: &SamplingParams, _: &KvOptions) -> Box<dyn Drafter> {
        Box::new(Lookup {
            params: *self,
            context: Vec::new(),
        })
    }
}

struct Lookup {
    params: PromptLookup,
    context: Vec<u32>,
}

impl Drafter for Lookup {
    fn propose(
        &mut self,
        context: DraftContext,
        max: usize,
        out: &mut Proposal,
    ) -> Result<(), EngineError> {
        let (prompt, generated) = (context.prompt, context.generated);
        out.clear();
        self.context.clear();
        self.context.extend_from_slice(prompt);
        self.context.extend_from_slice(generated);
        let (min, max_n) = (self.params.min_ngram.max(1), self.params.max_ngram);
        if let Some(at) = (min..=max_n)
            .rev()
            .find_map(|n| continuation(&self.context, n))
        {
            let end = (at + max).min(self.context.len());
            out.tokens.extend_from_slice(&self.context[at..end]);
        }
        Ok(())
    }
}

/// Where the tokens after the latest earlier occurrence of `context`'s last `n` tokens start.
fn continuation(context: &[u32], n: usize) -> Option<usize> {
    let len = context.len();
    if n == 0 || len <= n {
        return None;
    }
    let suffix = &context[len - n..];
    // Latest first: recent text predicts the next tokens best.
    (0..len - n)
        .rev()
        .find(|&start| &context[start..start + n] == suffix)
        .map(|start| start + n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(context: &[u32], max: usize) -> Vec<u32> {
        let source = PromptLookup::default();
        let (model, kv) = (
            super::super::tests::fixture_model("llama", false),
            KvOptions::default(),
        );
        let mut d = source.start(&model, &SamplingParams::greedy(), &kv);
        let mut out = Proposal::default();
        let context = DraftContext {
            prompt: &context[..2],
            generated: &context[2..],
            target: &mut peregrine_models::SequenceCache::new(&[], &kv),
        };
        d.propose(context, max, &mut out).unwrap();
        assert!(out.dists.is_empty(), "prompt lookup is deterministic");
        out.tokens
    }

    #[test]
    fn proposes_what_followed_the_last_occurrence_of_the_suffix() {
        // "7 8" occurred twice before; the latest one was followed by 9 5 1.
        assert_eq!(propose(&[7, 8, 3, 4, 7, 8, 9, 5, 1, 7, 8], 3), [9, 5, 1]);
        // At most `max`, and never past the end of the context.
        assert_eq!(propose(&[7, 8, 3, 4, 7, 8, 9, 5, 1, 7, 8], 2), [9, 5]);
        assert_eq!(propose(&[1, 2, 3, 1, 2], 8), [3, 1, 2]);
    }

    #[test]
    fn the_longest_matching_suffix_wins() {
        // "5 6" last followed by 1; "4 5 6" (longer) by 2.
        assert_eq!(propose(&[4, 5, 6, 2, 9, 5, 6, 1, 4, 5, 6], 1), [2]);
    }

    #[test]
    fn nothing_repeated_proposes_nothing() {
        assert!(propose(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        // A single repeated token is shorter than the default shortest suffix of 2.
        assert!(propose(&[1, 2, 3, 4, 5, 1], 4).is_empty());
    }
}
