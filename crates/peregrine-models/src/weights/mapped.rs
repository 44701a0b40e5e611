//! Byte ranges of a mapped checkpoint that a streamed expert multiplies where they lie
//! ([`MappedRange`]), and dropping a mapping's pages from the process once used ([`release`]).
//!
//! A streamed GGUF expert in a format the kernels take in place (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) is
//! neither copied out of the page cache nor repacked: its pages are mapped in by the reader
//! thread that prefetches it, multiplied, and dropped from the process with the expert (the OS
//! page cache keeps them for as long as it has room, the process's resident set does not).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use peregrine_tensor::quant::SharedBytes;

/// Pages are dropped only where wholly inside a range, at this granularity (any page size up
/// to it): an edge page another range may be using stays mapped.
const RELEASE_ALIGN: usize = 64 << 10;

/// A range of a mapped file, its pages mapped in when made and dropped from the process when
/// it is.
#[derive(Debug)]
pub(crate) struct MappedRange {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl MappedRange {
    /// `len` bytes of `map` (of `file`, at `path`) from `start`, their pages mapped in now:
    /// a file cut short since it was mapped is an error here (never a fault later, so long as
    /// the file stays whole while the range is used: [`check_length`] again before use).
    pub(crate) fn new(
        map: &Arc<Mmap>,
        file: &File,
        path: &Path,
        start: usize,
        len: usize,
    ) -> std::io::Result<Self> {
        check_length(file, path, (start + len) as u64)?;
        #[cfg(target_os = "linux")]
        map.advise_range(memmap2::Advice::PopulateRead, start, len)
            .map_err(|e| std::io::Error::other(format!("mapping bytes {start}..: {e}")))?;
        Ok(Self {
            map: map.clone(),
            start,
            len,
        })
    }
}

impl SharedBytes for MappedRange {
    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        let start = self.start.next_multiple_of(RELEASE_ALIGN);
        let end = (self.start + self.len) / RELEASE_ALIGN * RELEASE_ALIGN;
        if end > start {
            release(&self.map, start..end);
        }
    }
}

/// An error unless `file` (at `path`) still holds `end` bytes: a mapping's pages past the end
/// of a file cut short fault when touched.
pub(crate) fn check_length(file: &File, path: &Path, end: u64) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if len < end {
        return Err(std::io::Error::other(format!(
            "{} is {len} bytes, too short for bytes up to {end} (cut short since it was opened?)",
            path.display()
        )));
    }
    Ok(())
}

/// Drops the mapped pages of `range` from this process's memory once a tensor has been read out
/// of them: the mapping is read-only and file-backed, so a later read maps them again from the
/// file (a neighbour sharing an edge page included).
pub(crate) fn release(mmap: &Mmap, range: std::ops::Range<usize>) {
    #[cfg(unix)]
    // SAFETY: `DontNeed` on a read-only shared file mapping keeps its contents (they are read
    // back from the unchanged file on the next access); no memory is freed under a reference.
    // A failure only means the pages stay resident.
    let _ = unsafe {
        mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len())
    };
    #[cfg(not(unix))]
    let _ = (mmap, range);
}
