//! Stop strings over streamed text.
//!
//! Text is held back while it could still be the start of a stop string, so a client never sees
//! a partial stop string that later completes. Generation stops at the first stop string to
//! *complete* (the earliest end in the stream; on a tie, the earliest start), which makes the
//! result independent of how the text was split into chunks.

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that can no longer be part of a stop string: safe to send.
    pub emit: String,
    /// A stop string completed: generation should end, and `emit` is the last text.
    pub stopped: bool,
}

/// Watches streamed text for any of a request's stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Received but not yet emitted: always a possible start of some stop string.
    pending: String,
    /// Index into `stops` of the one that ended generation.
    matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// Feeds newly decoded text. After a stop, further pushes emit nothing.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.matched.is_some() {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(text);
        if let Some((index, start)) = self.first_completed() {
            self.matched = Some(index);
            self.pending.truncate(start);
            return StopStep {
                emit: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let keep = self.held_suffix_len();
        let rest = self.pending.split_off(self.pending.len() - keep);
        StopStep {
            emit: std::mem::replace(&mut self.pending, rest),
            stopped: false,
        }
    }

    /// Releases text still held back at the end of generation (empty after a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended generation, if any (vLLM reports it as `stop_reason`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The stop string that completes first in `pending`, as (index, byte start).
    fn first_completed(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                self.pending
                    .find(s.as_str())
                    .map(|at| (i, at, at + s.len()))
            })
            .min_by_key(|&(_, start, end)| (end, start))
            .map(|(i, start, _)| (i, start))
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A held suffix is shorter than the longest stop string; skip starts before that.
        let min_start = (p.len() + 1).saturating_sub(longest);
        // Only char boundaries can start a match: stop strings are valid UTF-8 and never begin
        // with a continuation byte, so multi-byte characters are held back whole.
        p.char_indices()
            .skip_while(|&(at, _)| at < min_start)
            .map(|(at, _)| &p[at..])
            .find(|suffix| {
                self.stops
                    .iter()
                    .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .map_or(0, str::len)
    }
}
