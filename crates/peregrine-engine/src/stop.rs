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
///
/// Each stop string has a Knuth–Morris–Pratt automaton whose state is the longest suffix of the
/// text so far that is a prefix of it, so every byte costs amortized O(1) per stop string and
/// matching is linear in the generated text, however long the stop strings are.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Automaton>,
    /// Received but not yet emitted: always a possible start of some stop string.
    pending: String,
    /// Index into `stops` of the one that ended generation.
    matched: Option<usize>,
}

/// A stop string, its failure function and how much of it the text now ends with.
#[derive(Debug, Clone)]
struct Automaton {
    text: String,
    /// `fail[k]`: the longest proper prefix of `text[..k + 1]` that is also its suffix.
    fail: Vec<usize>,
    /// Bytes of `text` the streamed text now ends with.
    state: usize,
}

impl Automaton {
    fn new(text: &str) -> Self {
        let p = text.as_bytes();
        let mut fail = vec![0; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            text: text.to_string(),
            fail,
            state: 0,
        }
    }

    /// Advances over one byte; true when the stop string just completed.
    fn step(&mut self, b: u8) -> bool {
        let p = self.text.as_bytes();
        if self.state == p.len() {
            self.state = self.fail[self.state - 1];
        }
        while self.state > 0 && p[self.state] != b {
            self.state = self.fail[self.state - 1];
        }
        if p[self.state] == b {
            self.state += 1;
        }
        self.state == p.len()
    }
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: (stops.iter().filter(|s| !s.is_empty()))
                .map(|s| Automaton::new(s))
                .collect(),
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
        for (at, &b) in text.as_bytes().iter().enumerate() {
            // Of the stop strings ending at this byte, the longest starts earliest.
            let mut completed: Option<(usize, usize)> = None;
            for (i, stop) in self.stops.iter_mut().enumerate() {
                if stop.step(b) && completed.is_none_or(|(_, len)| stop.text.len() > len) {
                    completed = Some((i, stop.text.len()));
                }
            }
            if let Some((index, len)) = completed {
                self.matched = Some(index);
                self.pending.push_str(&text[..=at]);
                self.pending.truncate(self.pending.len() - len);
                return StopStep {
                    emit: std::mem::take(&mut self.pending),
                    stopped: true,
                };
            }
        }
        self.pending.push_str(text);
        // The held suffix starts with a stop string's first byte, so on a char boundary.
        let keep = self.stops.iter().map(|s| s.state).max().unwrap_or(0);
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
        self.matched.map(|i| self.stops[i].text.as_str())
    }
}
