//! Experts read from disk on each use ([`StreamedExperts`]), many reads in flight on a shared
//! pool of reader threads ([`ReadPool`]).
//!
//! Nothing is cached: an expert is read when the router picks it and dropped when the layer is
//! done with it, so the OS page cache, not the process, decides what stays in memory (an
//! application-level cache steals the page cache's memory and made the system we replace
//! slower). [`ExpertStore::prefetch`] starts the reads of the experts a layer is about to run,
//! so they overlap one another and, when prefetched early, the compute before them.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

use crate::ExpertStore;

type Job = Box<dyn FnOnce() + Send>;

/// Reader threads shared by every streamed layer of a model: `depth` reads in flight at most
/// (the queue depth), each a positioned read into its own buffer.
pub struct ReadPool {
    jobs: Mutex<Option<SyncSender<Job>>>,
    depth: usize,
    guess: bool,
    hot_bytes: usize,
    mapped_bytes: usize,
    stats: StreamStats,
}

/// What the streamed stores of one model have read.
#[derive(Default)]
pub struct StreamStats {
    /// Experts read.
    reads: AtomicU64,
    /// Of those, reads started by a prefetch before the expert was asked for.
    prefetched: AtomicU64,
    /// Experts served from a store's hot set instead of read.
    hot: AtomicU64,
    /// Bytes the streamed experts would hold if they were loaded.
    expert_bytes: AtomicU64,
    /// Experts guessed for a layer before its router ran, and of those, how many it chose.
    speculated: AtomicU64,
    speculated_hits: AtomicU64,
}

impl StreamStats {
    /// Counts `bytes` more of expert weights that stay on disk.
    pub fn add_expert_bytes(&self, bytes: usize) {
        self.expert_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `(experts guessed ahead of their layer's routing, of which routed to)` so far.
    pub fn speculation(&self) -> (u64, u64) {
        (
            self.speculated.load(Ordering::Relaxed),
            self.speculated_hits.load(Ordering::Relaxed),
        )
    }

    /// Bytes the streamed experts would hold in memory if they were loaded.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes.load(Ordering::Relaxed)
    }

    /// `(experts asked for, of which read ahead by a prefetch)` so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.prefetched.load(Ordering::Relaxed),
        )
    }

    /// Experts served from the hot sets (`--expert-cache-mb`) instead of read.
    pub fn hot_hits(&self) -> u64 {
        self.hot.load(Ordering::Relaxed)
    }
}

impl ReadPool {
    /// Starts `depth` reader threads; with none, nothing is prefetched and each expert is read
    /// when it is asked for, on the computing thread. Stores on it take no guesses
    /// ([`ReadPool::configured`]).
    pub fn new(depth: usize) -> io::Result<Arc<Self>> {
        Self::configured(depth, false, 0, 0)
    }

    /// [`new`](Self::new), with `guess`: stores also start reading experts guessed ahead of
    /// their layer's routing ([`ExpertStore::speculate`]; a wrong guess costs a read: worth it
    /// where reads wait on the disk, not where they are bound by the CPU copying them); and
    /// `hot_bytes` of recently used experts kept, over all the stores on the pool
    /// ([`StreamedExperts::with_hot_set`]); and `mapped_bytes` of recently used experts kept
    /// in the same way where an expert is the file's mapped pages, not a copy of them (keeping
    /// one costs no memory the page cache does not already hold; it saves mapping its pages in
    /// and out of the process on each use).
    pub fn configured(
        depth: usize,
        guess: bool,
        hot_bytes: usize,
        mapped_bytes: usize,
    ) -> io::Result<Arc<Self>> {
        let (tx, rx) = sync_channel::<Job>(depth);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..depth {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("peregrine-read-{i}"))
                .spawn(move || {
                    loop {
                        // The lock is held only while taking the next job.
                        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return, // the pool was dropped
                        }
                    }
                })?;
        }
        Ok(Arc::new(Self {
            jobs: Mutex::new((depth > 0).then_some(tx)),
            depth,
            guess,
            hot_bytes,
            mapped_bytes,
            stats: StreamStats::default(),
        }))
    }

    /// Reads in flight at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Bytes of recently used experts the stores on this pool may keep together.
    pub fn hot_bytes(&self) -> usize {
        self.hot_bytes
    }

    /// Bytes of recently used experts that multiply mapped pages in place the stores on this
    /// pool keep mapped together.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }

    /// What has been read so far.
    pub fn stats(&self) -> &StreamStats {
        &self.stats
    }

    /// Runs `job` on a reader thread; `false` when the pool has shut down.
    fn submit(&self, job: Job) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        // Closing the queue ends every reader thread once it is idle.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// Reads expert `id` from its files and builds it.
pub type ExpertReader<E> = Arc<dyn Fn(usize) -> io::Result<E> + Send + Sync>;

/// Whether experts read earlier may still be used: an error when their files changed under
/// them (an expert that multiplies a mapped file's pages where they lie must not touch pages
/// the file no longer has).
pub type ExpertCheck = Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

/// One MoE layer's experts, none held: each is read by `read` when asked for (or when
/// prefetched), used, and dropped.
pub struct StreamedExperts<E> {
    len: usize,
    read: ExpertReader<E>,
    check: Option<ExpertCheck>,
    verify: Option<ExpertCheck>,
    pool: Arc<ReadPool>,
    window: Mutex<Window<E>>,
    hot: Mutex<HotSet<E>>,
}

/// The most recently used experts, kept (none by default): the resident hot set of
/// `--expert-cache-mb`, for where a read costs more than memory (host → device copies).
struct HotSet<E> {
    capacity: usize,
    /// Most recent last.
    experts: VecDeque<(usize, Arc<E>)>,
}

impl<E> HotSet<E> {
    fn get(&mut self, id: usize) -> Option<Arc<E>> {
        let at = self.experts.iter().position(|(e, _)| *e == id)?;
        let entry = self.experts.remove(at)?;
        let expert = entry.1.clone();
        self.experts.push_back(entry);
        Some(expert)
    }

    fn insert(&mut self, id: usize, expert: &Arc<E>) {
        if self.capacity == 0 {
            return;
        }
        if self.experts.len() == self.capacity {
            self.experts.pop_front();
        }
        self.experts.push_back((id, expert.clone()));
    }

    fn ids(&self) -> Vec<usize> {
        self.experts.iter().map(|(id, _)| *id).collect()
    }
}

/// Prefetched experts: the reads started (their results arrive on the receivers) and those
/// waiting for one of them to be used, so that at most the pool's depth of read experts wait
/// in memory however many a prefill routes to.
struct Window<E> {
    started: HashMap<usize, Receiver<io::Result<E>>>,
    waiting: VecDeque<usize>,
    /// Ids started or waiting on a guess ([`ExpertStore::speculate`]), not yet confirmed.
    guessed: Vec<usize>,
}

impl<E> StreamedExperts<E> {
    /// `len` experts, read by `read` on `pool`'s threads.
    pub fn new(len: usize, read: ExpertReader<E>, pool: Arc<ReadPool>) -> Self {
        Self {
            len,
            read,
            check: None,
            verify: None,
            pool,
            window: Mutex::new(Window {
                started: HashMap::new(),
                waiting: VecDeque::new(),
                guessed: Vec::new(),
            }),
            hot: Mutex::new(HotSet {
                capacity: 0,
                experts: VecDeque::new(),
            }),
        }
    }

    /// Keeps the `capacity` most recently used experts (served without a read).
    pub fn with_hot_set(self, capacity: usize) -> Self {
        self.hot.lock().unwrap_or_else(|e| e.into_inner()).capacity = capacity;
        self
    }

    /// Runs `check` before each expert is handed out (prefetched and kept ones included).
    pub fn with_check(mut self, check: ExpertCheck) -> Self {
        self.check = Some(check);
        self
    }

    /// Runs `verify` after each pass that used experts ([`ExpertStore::verify`]): an error
    /// when their bytes were lost while they were read.
    pub fn with_verify(mut self, verify: ExpertCheck) -> Self {
        self.verify = Some(verify);
        self
    }

    /// Ids of `ids` not in the hot set.
    fn not_hot(&self, ids: &[usize]) -> Vec<usize> {
        let hot = self.hot.lock().unwrap_or_else(|e| e.into_inner()).ids();
        ids.iter().copied().filter(|id| !hot.contains(id)).collect()
    }
}

impl<E: Send + 'static> StreamedExperts<E> {
    /// Expert `id` from the read a prefetch started, or read now.
    fn read_or_take(&self, id: usize) -> io::Result<Arc<E>> {
        let started = {
            let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
            w.waiting.retain(|&queued| queued != id);
            let started = w.started.remove(&id);
            self.fill(&mut w);
            started
        };
        // A prefetch that failed (perhaps for an earlier pass that then stopped at another
        // expert's error, its file since mended) is read again rather than trusted.
        if let Some(Ok(Ok(expert))) = started.map(|rx| rx.recv()) {
            self.pool.stats.prefetched.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::new(expert));
        }
        (self.read)(id).map(Arc::new)
    }

    /// Starts waiting reads while fewer than the pool's depth are started.
    fn fill(&self, w: &mut Window<E>) {
        while w.started.len() < self.pool.depth() {
            let Some(id) = w.waiting.pop_front() else {
                return;
            };
            let (tx, rx) = sync_channel(1);
            let read = self.read.clone();
            // A pool that has shut down leaves the expert to be read when asked for.
            if self.pool.submit(Box::new(move || {
                let _ = tx.send(read(id));
            })) {
                w.started.insert(id, rx);
            }
        }
    }
}

impl<E: Send + Sync + 'static> ExpertStore<E> for StreamedExperts<E> {
    fn len(&self) -> usize {
        self.len
    }

    fn expert(&self, id: usize) -> io::Result<Arc<E>> {
        if let Some(check) = &self.check {
            check()?;
        }
        let stats = &self.pool.stats;
        stats.reads.fetch_add(1, Ordering::Relaxed);
        let kept = self.hot.lock().unwrap_or_else(|e| e.into_inner()).get(id);
        if let Some(expert) = kept {
            stats.hot.fetch_add(1, Ordering::Relaxed);
            return Ok(expert);
        }
        let expert = self.read_or_take(id)?;
        (self.hot.lock().unwrap_or_else(|e| e.into_inner())).insert(id, &expert);
        Ok(expert)
    }

    fn prefetch(&self, ids: &[usize]) {
        let ids = &self.not_hot(ids)[..];
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        // The router has spoken: guesses it chose stay, the others are dropped (a read already
        // running completes into nothing).
        let guessed = std::mem::take(&mut w.guessed);
        let hits = guessed.iter().filter(|id| ids.contains(id)).count();
        let stats = &self.pool.stats;
        stats
            .speculated_hits
            .fetch_add(hits as u64, Ordering::Relaxed);
        for id in guessed.into_iter().filter(|id| !ids.contains(id)) {
            w.started.remove(&id);
            w.waiting.retain(|&queued| queued != id);
        }
        for &id in ids {
            if id < self.len && !w.started.contains_key(&id) && !w.waiting.contains(&id) {
                w.waiting.push_back(id);
            }
        }
        self.fill(&mut w);
    }

    fn speculate(&self, ids: &[usize]) {
        let ids = &self.not_hot(ids)[..];
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        for &id in ids {
            if id < self.len && !w.started.contains_key(&id) && !w.waiting.contains(&id) {
                w.waiting.push_back(id);
                w.guessed.push(id);
                self.pool.stats.speculated.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.fill(&mut w);
    }

    fn speculates(&self) -> bool {
        self.pool.guess && self.pool.depth() > 0
    }

    fn weight_bytes(&self) -> usize {
        0
    }

    fn verify(&self) -> io::Result<()> {
        self.verify.as_ref().map_or(Ok(()), |verify| verify())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Expert 3's reads fail until `mended`.
    fn store_with(reads: Arc<AtomicUsize>, mended: Arc<AtomicUsize>) -> StreamedExperts<Vec<u8>> {
        let read: ExpertReader<Vec<u8>> = Arc::new(move |id| {
            let result = match id {
                3 if mended.load(Ordering::SeqCst) == 0 => {
                    Err(io::Error::other("expert 3's file is gone"))
                }
                _ => Ok(vec![id as u8; 4]),
            };
            reads.fetch_add(1, Ordering::SeqCst);
            result
        });
        StreamedExperts::new(4, read, ReadPool::configured(2, true, 0, 0).unwrap())
    }

    fn store(reads: Arc<AtomicUsize>) -> StreamedExperts<Vec<u8>> {
        store_with(reads, Arc::new(AtomicUsize::new(0)))
    }

    #[test]
    fn every_use_reads_the_expert_again_and_prefetches_are_used_once() {
        let reads = Arc::new(AtomicUsize::new(0));
        let s = store(reads.clone());
        assert_eq!(*s.expert(1).unwrap(), vec![1; 4]);
        assert_eq!(*s.expert(1).unwrap(), vec![1; 4]);
        assert_eq!(reads.load(Ordering::SeqCst), 2, "nothing is cached");
        s.prefetch(&[0, 2, 2]);
        assert_eq!(*s.expert(2).unwrap(), vec![2; 4]);
        assert_eq!(*s.expert(0).unwrap(), vec![0; 4]);
        assert_eq!(reads.load(Ordering::SeqCst), 4, "a prefetch reads once");
        assert_eq!(s.pool.stats().counts(), (4, 2));
        assert_eq!(s.weight_bytes(), 0);
    }

    /// A prefetch of more experts than the pool's depth reads ahead by the depth: the rest
    /// start as the first are used.
    #[test]
    fn prefetched_experts_wait_in_memory_no_more_than_the_depth() {
        let reads = Arc::new(AtomicUsize::new(0));
        let s = store(reads.clone()); // depth 2
        s.prefetch(&[0, 1, 2]);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(reads.load(Ordering::SeqCst), 2, "two reads ahead");
        assert_eq!(*s.expert(0).unwrap(), vec![0; 4]);
        assert_eq!(*s.expert(1).unwrap(), vec![1; 4]);
        assert_eq!(*s.expert(2).unwrap(), vec![2; 4]);
        assert_eq!(reads.load(Ordering::SeqCst), 3);
        assert_eq!(s.pool.stats().counts(), (3, 3));
    }

    #[test]
    fn without_readers_experts_are_read_when_asked_for() {
        let reads = Arc::new(AtomicUsize::new(0));
        let read: ExpertReader<usize> = {
            let reads = reads.clone();
            Arc::new(move |id| {
                reads.fetch_add(1, Ordering::SeqCst);
                Ok(id)
            })
        };
        let s = StreamedExperts::new(4, read, ReadPool::new(0).unwrap());
        s.prefetch(&[1, 2]);
        assert_eq!(reads.load(Ordering::SeqCst), 0, "nothing read ahead");
        assert_eq!(*s.expert(2).unwrap(), 2);
        assert_eq!(s.pool.stats().counts(), (1, 0));
    }

    /// Guesses the routing confirms are used as prefetched reads; the others are dropped
    /// from the window, and counted.
    #[test]
    fn guesses_are_kept_where_the_router_agrees() {
        let reads = Arc::new(AtomicUsize::new(0));
        let s = store(reads.clone()); // depth 2
        s.speculate(&[0, 1]);
        s.prefetch(&[1, 2]);
        assert_eq!(s.pool.stats().speculation(), (2, 1));
        assert_eq!(*s.expert(1).unwrap(), vec![1; 4]);
        assert_eq!(*s.expert(2).unwrap(), vec![2; 4]);
        assert_eq!(
            s.pool.stats().counts(),
            (2, 2),
            "both came from reads started ahead"
        );
        let window = s.window.lock().unwrap();
        assert!(
            window.started.is_empty() && window.waiting.is_empty() && window.guessed.is_empty()
        );
    }

    /// A hot set of two keeps the two most recently used experts: they are served without a
    /// read (and not prefetched), the least recent is dropped for a new one.
    #[test]
    fn a_hot_set_serves_its_recent_experts_without_reads() {
        let reads = Arc::new(AtomicUsize::new(0));
        let s = store(reads.clone()).with_hot_set(2);
        for id in [0, 1, 0, 1] {
            assert_eq!(*s.expert(id).unwrap(), vec![id as u8; 4]);
        }
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        s.prefetch(&[0, 1]);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            reads.load(Ordering::SeqCst),
            2,
            "kept experts are not prefetched"
        );
        s.expert(2).unwrap(); // drops 0, the least recently used
        s.expert(1).unwrap();
        s.expert(0).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        assert_eq!(s.pool.stats().hot_hits(), 3);
    }

    #[test]
    fn a_failed_read_is_the_callers_error_prefetched_or_not() {
        let s = store(Arc::new(AtomicUsize::new(0)));
        assert!(
            s.expert(3)
                .unwrap_err()
                .to_string()
                .contains("file is gone")
        );
        s.prefetch(&[3]);
        assert!(
            s.expert(3)
                .unwrap_err()
                .to_string()
                .contains("file is gone")
        );
        assert_eq!(*s.expert(0).unwrap(), vec![0; 4], "the store still serves");
    }

    /// A failing check fails every use, prefetched and kept experts included, until it passes.
    #[test]
    fn a_failing_check_stops_every_use() {
        let (reads, broken) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let check: ExpertCheck = {
            let broken = broken.clone();
            Arc::new(move || match broken.load(Ordering::SeqCst) {
                0 => Ok(()),
                _ => Err(io::Error::other("the file was cut short")),
            })
        };
        let s = store(reads.clone()).with_hot_set(1).with_check(check);
        s.expert(0).unwrap();
        s.prefetch(&[1]);
        broken.store(1, Ordering::SeqCst);
        for id in [0, 1, 2] {
            let err = s.expert(id).unwrap_err().to_string();
            assert!(err.contains("cut short"), "{id}: {err}");
        }
        broken.store(0, Ordering::SeqCst);
        assert_eq!(*s.expert(1).unwrap(), vec![1; 4]);
    }

    /// The check after a pass reports what its closure finds; without one there is nothing to
    /// find.
    #[test]
    fn verify_runs_the_check_after_use() {
        let s = store(Arc::new(AtomicUsize::new(0)));
        s.verify().unwrap();
        let s = s.with_verify(Arc::new(|| {
            Err(io::Error::other("bytes were gone when read"))
        }));
        s.expert(0).unwrap();
        assert!(s.verify().unwrap_err().to_string().contains("were gone"));
    }

    #[test]
    fn a_failed_prefetch_left_behind_is_read_again() {
        let (reads, mended) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let s = store_with(reads.clone(), mended.clone());
        s.prefetch(&[3]);
        while reads.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now(); // the prefetch's read has failed once it counted
        }
        mended.store(1, Ordering::SeqCst);
        assert_eq!(*s.expert(3).unwrap(), vec![3; 4]);
    }
}
