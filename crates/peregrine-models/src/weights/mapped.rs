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

/// A fault maps the cached pages around it as well as its own (Linux's fault-around: 64 KB
/// windows by default), so a range's pages are dropped over the aligned windows it touches:
/// pages of a neighbouring range there go too, and map again from the page cache on their next
/// use (a read-only file mapping: the same bytes). Dropping only the pages wholly inside each
/// range left the edges mapped, which added up to half a gigabyte of resident set over a 3.5 GB
/// model whose file sat whole in the page cache.
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
        let start = self.start / RELEASE_ALIGN * RELEASE_ALIGN;
        let end = (self.start + self.len)
            .next_multiple_of(RELEASE_ALIGN)
            .min(self.map.len());
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Kilobytes of this process's resident set in the mapping that starts at `addr`.
    fn resident_kb(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        while let Some(line) = lines.next() {
            let start = line.split('-').next().unwrap_or("");
            if usize::from_str_radix(start, 16) == Ok(addr) {
                let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
                return rss.split_whitespace().nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    /// A range's pages, and those the OS mapped around them, leave the resident set with the
    /// range, wherever its ends fall; a file since cut short is refused when a range is made.
    #[test]
    fn a_range_leaves_nothing_mapped_when_dropped() {
        let path = std::env::temp_dir().join(format!("peregrine-mapped-{}", std::process::id()));
        // Written a page at a time, so that the page cache holds it in pages, not in larger
        // folios a fault would map whole (which hides the pages mapped around a range).
        let mut out = File::create(&path).unwrap();
        for _ in 0..512 {
            std::io::Write::write_all(&mut out, &[7u8; 4096]).unwrap();
        }
        drop(out);
        let file = File::open(&path).unwrap();
        // SAFETY: a read-only mapping of a file nothing else writes.
        let map = Arc::new(unsafe { Mmap::map(&file) }.unwrap());
        let addr = map.as_ptr() as usize;
        assert_eq!(resident_kb(addr), 0);
        let range = MappedRange::new(&map, &file, &path, 100_003, 700_001).unwrap();
        assert!(range.bytes().iter().all(|&b| b == 7));
        assert!(resident_kb(addr) >= 700, "{} kB", resident_kb(addr));
        drop(range);
        assert_eq!(resident_kb(addr), 0, "pages left mapped");
        std::fs::write(&path, [7u8; 10]).unwrap();
        let err = MappedRange::new(&map, &file, &path, 0, 4096).unwrap_err();
        assert!(err.to_string().contains("too short"), "{err}");
        std::fs::remove_file(&path).ok();
    }
}
