//! Surviving a mapped file cut short while its pages are read. Touching a page past the new end
//! of a file raises SIGBUS, which ends the process; a streamed expert's range is checked before
//! each use, but the file may still be cut between that check and the kernel's reads. A
//! [`Guard`] registers a mapping with a process-wide SIGBUS handler: a fault inside it maps a
//! page of zeros over the lost page (so the read goes on) and records the damage, which the
//! owner turns into an error after the use ([`Guard::damaged`]) and mends by mapping the file
//! again once it is whole ([`Guard::repair`]). A fault anywhere else goes to the handler that
//! was there before (Rust's own, which reports stack overflows), then to the default action.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Mappings guarded at once (one per mapped checkpoint file).
const SLOTS: usize = 64;

/// A guarded mapping's address range, and the span of pages replaced by zeros since its last
/// repair (`lo == usize::MAX`: none).
struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    lo: AtomicUsize,
    hi: AtomicUsize,
}

impl Slot {
    const fn empty() -> Self {
        Self {
            start: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            lo: AtomicUsize::new(usize::MAX),
            hi: AtomicUsize::new(0),
        }
    }
}

static GUARDED: [Slot; SLOTS] = [const { Slot::empty() }; SLOTS];

/// The page size, and the SIGBUS action before ours (read by the handler, set before it is).
static INSTALLED: OnceLock<(usize, libc::sigaction)> = OnceLock::new();

/// A mapping registered with the SIGBUS handler; unregistered when dropped (before the mapping
/// is unmapped: the owner holds the guard beside it).
#[derive(Debug)]
pub(crate) struct Guard {
    slot: usize,
    start: usize,
}

impl Guard {
    /// Guards `len` bytes mapped at `start` (page-aligned); `None` when every slot is taken or
    /// the handler cannot be installed (a fault then ends the process, as before).
    pub(crate) fn new(start: *const u8, len: usize) -> Option<Self> {
        install()?;
        let start = start as usize;
        for (slot, s) in GUARDED.iter().enumerate() {
            if s.end
                .compare_exchange(0, start + len, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                s.lo.store(usize::MAX, Ordering::Relaxed);
                s.hi.store(0, Ordering::Relaxed);
                s.start.store(start, Ordering::Release);
                return Some(Self { slot, start });
            }
        }
        None
    }

    /// The bytes (offsets into the mapping) whose pages read as zeros since the last repair:
    /// the file was cut short under a read of them.
    pub(crate) fn damaged(&self) -> Option<std::ops::Range<usize>> {
        let s = &GUARDED[self.slot];
        let (lo, hi) = (s.lo.load(Ordering::Acquire), s.hi.load(Ordering::Acquire));
        (lo < hi).then(|| lo - self.start..hi - self.start)
    }

    /// Maps `file`'s pages again over the damaged span (call once the file is whole again).
    pub(crate) fn repair(&self, file: &File) -> io::Result<()> {
        let s = &GUARDED[self.slot];
        // Taken before remapping: a fault meanwhile records itself afresh.
        let (lo, hi) = (
            s.lo.swap(usize::MAX, Ordering::AcqRel),
            s.hi.swap(0, Ordering::AcqRel),
        );
        if lo >= hi {
            return Ok(());
        }
        let flags = libc::MAP_SHARED | libc::MAP_FIXED;
        let offset = (lo - self.start) as libc::off_t;
        // SAFETY: the span lies inside this guard's mapping (the handler records only pages
        // there), which its owner keeps mapped; the same file at the same offsets, read-only,
        // as `Mmap::map` made it.
        let at = unsafe {
            libc::mmap(
                lo as *mut libc::c_void,
                hi - lo,
                libc::PROT_READ,
                flags,
                file.as_raw_fd(),
                offset,
            )
        };
        if at == libc::MAP_FAILED {
            s.lo.fetch_min(lo, Ordering::AcqRel);
            s.hi.fetch_max(hi, Ordering::AcqRel);
            return Err(io::Error::last_os_error());
        }
        // As the rest of the mapping (`MappedFile::new`): no 2 MB huge mappings. A failure only
        // means they stay allowed here.
        // SAFETY: advice on the span just mapped.
        let _ = unsafe { libc::madvise(at, hi - lo, libc::MADV_NOHUGEPAGE) };
        Ok(())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &GUARDED[self.slot];
        s.start.store(0, Ordering::Release);
        s.end.store(0, Ordering::Release);
    }
}

/// Installs the handler once; `None` if it could not be.
fn install() -> Option<()> {
    let installed = INSTALLED.get_or_init(|| {
        // SAFETY: plain libc calls on zeroed structs; the handler only reads `INSTALLED` after
        // this initialiser has stored it (it is installed here, but `GUARDED` is empty until a
        // guard registers, and a fault before then chains through the zeroed action below).
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE).max(4096) as usize;
            let mut previous: libc::sigaction = std::mem::zeroed();
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) != 0 {
                previous.sa_sigaction = usize::MAX; // not installed
            }
            (page, previous)
        }
    });
    (installed.1.sa_sigaction != usize::MAX).then_some(())
}

/// The SIGBUS handler: async-signal-safe (atomics, `mmap`, `sigaction`).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid `siginfo_t` to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some((page, _)) = INSTALLED.get() {
        for s in &GUARDED {
            let (start, end) = (
                s.start.load(Ordering::Acquire),
                s.end.load(Ordering::Acquire),
            );
            if start != 0 && (start..end).contains(&addr) {
                let at = addr / page * page;
                let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
                // SAFETY: replaces one page of a guarded read-only mapping, which nothing
                // writes, with zeros; the faulting read then completes.
                let zeros =
                    unsafe { libc::mmap(at as *mut _, *page, libc::PROT_READ, flags, -1, 0) };
                if zeros != libc::MAP_FAILED {
                    s.lo.fetch_min(at, Ordering::AcqRel);
                    s.hi.fetch_max(at + page, Ordering::AcqRel);
                    return;
                }
            }
        }
    }
    chain(sig, info, context);
}

/// Hands a fault that is not ours to the action before ours; with none, restores the default
/// action, so that the faulting instruction, run again, ends the process as it would have.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = INSTALLED.get().map(|(_, p)| *p);
    match previous {
        Some(p)
            if p.sa_sigaction != libc::SIG_DFL
                && p.sa_sigaction != libc::SIG_IGN
                && p.sa_sigaction != usize::MAX =>
        {
            // SAFETY: the previous handler, called as it was installed to be.
            unsafe {
                if p.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(p.sa_sigaction);
                    f(sig, info, context);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => {
            // SAFETY: `sigaction` is async-signal-safe; a zeroed action is SIG_DFL.
            unsafe {
                let default: libc::sigaction = std::mem::zeroed();
                libc::sigaction(sig, &default, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use memmap2::Mmap;

    use super::*;

    /// The mapping's bytes, each read as the kernel would (never folded with an earlier read).
    fn read(map: &Mmap) -> Vec<u8> {
        // SAFETY: every index lies within the mapping.
        (0..map.len())
            .map(|i| unsafe { std::ptr::read_volatile(map.as_ptr().add(i)) })
            .collect()
    }

    #[test]
    fn a_file_cut_short_under_a_read_reads_zeros_is_reported_and_mended_once_whole() {
        let path = std::env::temp_dir().join(format!("peregrine-sigbus-{}", std::process::id()));
        let whole = vec![7u8; 64 << 10];
        std::fs::write(&path, &whole).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a read-only mapping; the test cuts the file under it on purpose.
        let map = unsafe { Mmap::map(&file) }.unwrap();
        let guard = Guard::new(map.as_ptr(), map.len()).expect("the handler installs");
        assert_eq!(read(&map), whole);
        assert_eq!(guard.damaged(), None);

        let cut = 8 << 10;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut as u64)
            .unwrap();
        // Without the guard this read ends the process with SIGBUS.
        let bytes = read(&map);
        assert!(bytes[..cut].iter().all(|&b| b == 7));
        assert!(
            bytes[cut..].iter().all(|&b| b == 0),
            "lost pages read as zeros"
        );
        assert_eq!(guard.damaged(), Some(cut..map.len()));

        std::fs::File::create(&path)
            .unwrap()
            .write_all(&whole)
            .unwrap();
        guard.repair(&file).unwrap();
        assert_eq!(guard.damaged(), None);
        assert_eq!(read(&map), whole, "the file's bytes again");
        drop(guard);
        drop(map);
        std::fs::remove_file(&path).unwrap();
    }
}
