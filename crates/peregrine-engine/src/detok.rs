//! UTF-8-safe incremental detokenization.
//!
//! Decoding one token at a time is wrong for both common tokenizer families: byte-level BPE
//! splits one character over several tokens (an emoji is often four byte tokens), and
//! SentencePiece drops the leading space of whatever it decodes first. So, as TGI and vLLM do, we
//! decode a small window twice: `ids[prefix..read]` (text already sent) and `ids[prefix..]`, and
//! emit the difference, unless the window ends in U+FFFD, which means a character is still
//! incomplete. The window starts in the prompt's tail so the first generated token decodes with
//! its real left context.

/// Turns generated token ids into text deltas whose concatenation equals the decoding of all ids.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDetokenizer {
    /// Prompt tail followed by generated ids; trimmed to the live window as text is emitted.
    ids: Vec<u32>,
    /// Start of the decode window: left context for the text not yet sent.
    prefix: usize,
    /// Ids before this have been turned into sent text.
    read: usize,
}

/// How many prompt tokens of left context vLLM and TGI use.
pub const PROMPT_TAIL: usize = 5;

impl IncrementalDetokenizer {
    /// A detokenizer whose window starts with `prompt_tail` (the last [`PROMPT_TAIL`] or so
    /// prompt ids; empty for no context, which matches decoding the generated ids alone).
    pub fn new(prompt_tail: &[u32]) -> Self {
        Self {
            ids: prompt_tail.to_vec(),
            prefix: 0,
            read: prompt_tail.len(),
        }
    }

    /// Adds one generated id and returns the text it completes, possibly empty. `decode` is the
    /// tokenizer's batch decode (with whatever special-token policy the request uses).
    pub fn step<E>(
        &mut self,
        id: u32,
        mut decode: impl FnMut(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        self.ids.push(id);
        let sent = decode(&self.ids[self.prefix..self.read])?;
        let full = decode(&self.ids[self.prefix..])?;
        if full.len() <= sent.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            // Nothing new yet, or a character still split across tokens: wait for more ids.
            return Ok(String::new());
        }
        let delta = diff(&sent, &full);
        self.prefix = self.read;
        self.read = self.ids.len();
        self.compact();
        Ok(delta)
    }

    /// Returns whatever is still held back (an incomplete character decodes to U+FFFD, as it
    /// would in the full decode) and resets the window.
    pub fn finish<E>(
        &mut self,
        mut decode: impl FnMut(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        if self.read >= self.ids.len() {
            return Ok(String::new());
        }
        let sent = decode(&self.ids[self.prefix..self.read])?;
        let full = decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        self.compact();
        Ok(diff(&sent, &full))
    }

    /// Drops ids before the window so memory stays bounded over long generations.
    fn compact(&mut self) {
        self.ids.drain(..self.prefix);
        self.read -= self.prefix;
        self.prefix = 0;
    }
}

/// The part of `full` after `sent`. Decoders normally extend the text they already produced; if
/// one rewrote it (cleanup rules), cut at the nearest char boundary instead of panicking.
fn diff(sent: &str, full: &str) -> String {
    if let Some(rest) = full.strip_prefix(sent) {
        return rest.to_owned();
    }
    let mut at = sent.len().min(full.len());
    while !full.is_char_boundary(at) {
        at += 1;
    }
    full[at..].to_owned()
}
