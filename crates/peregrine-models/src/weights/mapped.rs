//! Byte ranges of a mapped checkpoint that a streamed expert multiplies where they lie
//! ([`MappedRange`]), and dropping a mapping's pages from the process once used ([`release`]).
//!
//! A streamed GGUF expert in a format the kernels take in place (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) is
//! neither copied out of the page cache nor repacked: its pages are mapped in by the reader
//! thread that prefetches it, multiplied, and dropped from the process with the expert (the OS
//! page cache keeps them for as long as it has room, the process's resident set does not).

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use peregrine_tensor::quant::SharedBytes;

/// A fault maps the cached pages around it as well as its own: Linux's fault-around, 64 KB
/// windows by default, and since 6.18 a large folio of the page cache whole (up to 2 MB, as a
/// file read sequentially comes to be held). So the pages around a range are dropped over the
/// aligned 2 MB regions it touches, but for those of other ranges in use ([`MappedFile`]).
/// Without that, a 256 MB window of kept experts held ~1 GB of resident set once the file had
/// been read sequentially into the page cache; dropping only the pages wholly inside each range
/// left the edges mapped.
const REGION: usize = 2 << 20;

/// A checkpoint file mapped read-only, and which ranges of it are in use ([`MappedRange`]), so
/// that dropping the pages around one never drops another's (which its next use would fault
/// in again, whole folios at a time, around it).
#[derive(Debug)]
pub(crate) struct MappedFile {
    map: Mmap,
    /// How many ranges in use span each `start..end`.
    live: Mutex<BTreeMap<(usize, usize), usize>>,
}

impl MappedFile {
    /// `map`, no range of it in use. Its pages map one at a time, never 2 MB at once: a large
    /// folio of the page cache mapped whole (a PMD) counts all of it in the resident set, and
    /// dropping part of it unmaps all of it, which the range's next use maps whole again (a
    /// 256 MB window of kept experts held ~0.9 GB of resident set that way).
    pub(crate) fn new(map: Mmap) -> Self {
        #[cfg(target_os = "linux")]
        // A failure only means huge mappings stay allowed.
        let _ = map.advise(memmap2::Advice::NoHugePage);
        Self {
            map,
            live: Mutex::default(),
        }
    }

    /// The ranges in use (a poisoned lock's map is still whole: every update is one call).
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(usize, usize), usize>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the pages of the aligned regions around `range` that no range in `live` uses.
    fn drop_unused(&self, live: &BTreeMap<(usize, usize), usize>, range: Range<usize>) {
        let page = page_size();
        let end = range.end.next_multiple_of(REGION).min(self.map.len());
        let mut at = range.start / REGION * REGION;
        for &(s, e) in live.keys().take_while(|&&(s, _)| s < end) {
            let (s, e) = (s / page * page, e.next_multiple_of(page));
            if e > at {
                if s > at {
                    release(&self.map, at..s);
                }
                at = e;
            }
        }
        if at < end {
            release(&self.map, at..end);
        }
    }
}

/// The system's page size.
fn page_size() -> usize {
    #[cfg(target_os = "linux")]
    // SAFETY: sysconf reads a constant of the system.
    if let Ok(page) = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) {
        return page;
    }
    4096
}

/// A range of a mapped file, its pages mapped in when made and dropped from the process when
/// it is.
#[derive(Debug)]
pub(crate) struct MappedRange {
    file: Arc<MappedFile>,
    start: usize,
    len: usize,
}

impl MappedRange {
    /// `len` bytes of `file`'s mapping (of `reader`, at `path`) from `start`, their pages
    /// mapped in now and those mapped around them dropped: a file cut short since it was mapped
    /// is an error here (never a fault later, so long as the file stays whole while the range
    /// is used: [`check_length`] again before use).
    pub(crate) fn new(
        file: &Arc<MappedFile>,
        reader: &File,
        path: &Path,
        start: usize,
        len: usize,
    ) -> std::io::Result<Self> {
        check_length(reader, path, (start + len) as u64)?;
        // In use before its pages map in, so that another range's dropping spares them.
        *file.lock().entry((start, start + len)).or_insert(0) += 1;
        let range = Self {
            file: file.clone(),
            start,
            len,
        };
        #[cfg(target_os = "linux")]
        {
            let populated = file
                .map
                .advise_range(memmap2::Advice::PopulateRead, start, len);
            populated
                .map_err(|e| std::io::Error::other(format!("mapping bytes {start}..: {e}")))?;
            file.drop_unused(&file.lock(), start..start + len);
        }
        Ok(range)
    }
}

impl SharedBytes for MappedRange {
    fn bytes(&self) -> &[u8] {
        &self.file.map[self.start..self.start + self.len]
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        let key = (self.start, self.start + self.len);
        let mut live = self.file.lock();
        if let Some(count) = live.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                live.remove(&key);
            }
        }
        self.file.drop_unused(&live, key.0..key.1);
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
    /// range, wherever its ends fall, but for another range's in use; a file since cut short is
    /// refused when a range is made.
    #[test]
    fn a_range_leaves_nothing_mapped_when_dropped() {
        // Written a page at a time the page cache holds the file in pages; written at once,
        // where the file system and kernel keep large folios, in folios a fault maps whole.
        ranges_in_a_file_written_in(4096, "pages");
        ranges_in_a_file_written_in(2 << 20, "folios");
    }

    fn ranges_in_a_file_written_in(chunk: usize, name: &str) {
        let file_name = format!("peregrine-mapped-{}-{name}", std::process::id());
        let path = std::env::temp_dir().join(file_name);
        let mut out = File::create(&path).unwrap();
        for _ in 0..(2 << 20) / chunk {
            std::io::Write::write_all(&mut out, &vec![7u8; chunk]).unwrap();
        }
        drop(out);
        let file = File::open(&path).unwrap();
        // SAFETY: a read-only mapping of a file nothing else writes.
        let map = Arc::new(MappedFile::new(unsafe { Mmap::map(&file) }.unwrap()));
        let addr = map.map.as_ptr() as usize;
        assert_eq!(resident_kb(addr), 0);
        let range = MappedRange::new(&map, &file, &path, 100_003, 700_001).unwrap();
        assert!(range.bytes().iter().all(|&b| b == 7));
        // Its own pages, none of those the OS mapped around them.
        let page = page_size();
        let own = (800_004usize.next_multiple_of(page) - 100_003 / page * page) / 1024;
        assert_eq!(resident_kb(addr), own);
        // A neighbour in the same 2 MB region keeps its pages when the first range goes.
        let neighbour = MappedRange::new(&map, &file, &path, 1_000_000, 400_000).unwrap();
        drop(range);
        let own = (1_400_000usize.next_multiple_of(page) - 1_000_000 / page * page) / 1024;
        assert_eq!(resident_kb(addr), own, "the neighbour's pages");
        drop(neighbour);
        assert_eq!(resident_kb(addr), 0, "pages left mapped");
        std::fs::write(&path, [7u8; 10]).unwrap();
        let err = MappedRange::new(&map, &file, &path, 0, 4096).unwrap_err();
        assert!(err.to_string().contains("too short"), "{err}");
        std::fs::remove_file(&path).ok();
    }
}
