//! A model load's progress on stderr: a bar (bytes, rate, time left) when stderr is a terminal,
//! and one line when the load is done either way (a log file gets the line, not the redraws).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use peregrine_engine::LoadProgress;

/// Runs `load`, which reads the checkpoint at `path` counting into `progress`, showing how far it
/// has got; prints the bytes read, the time and the rate when it succeeds.
pub fn show<T, E>(
    path: &Path,
    progress: Arc<LoadProgress>,
    load: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let start = Instant::now();
    // Hidden by indicatif itself when stderr is not a terminal.
    let bar = ProgressBar::with_draw_target(
        Some(bytes_on_disk(path)),
        ProgressDrawTarget::stderr_with_hz(10),
    );
    let template = "loading [{bar:30}] {bytes} / {total_bytes}  {bytes_per_sec}  {eta} left";
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("#>-"));
    }
    let done = Arc::new(AtomicBool::new(false));
    let poll = {
        let (bar, done, progress) = (bar.clone(), done.clone(), progress.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                // Streamed experts may read past the files' size later: the bar stops full.
                bar.set_position(progress.bytes_read().min(bar.length().unwrap_or(0)));
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let loaded = load();
    done.store(true, Ordering::Relaxed);
    let _ = poll.join();
    bar.finish_and_clear();
    if loaded.is_ok() {
        let (read, secs) = (progress.bytes_read(), start.elapsed().as_secs_f64());
        eprintln!(
            "peregrine: loaded {} of weights from {} in {secs:.1} s ({}/s)",
            HumanBytes(read),
            path.display(),
            HumanBytes((read as f64 / secs.max(1e-3)) as u64)
        );
    }
    loaded
}

/// Bytes of the checkpoint's weight files: a GGUF file, or a folder's `model*.safetensors`.
fn bytes_on_disk(path: &Path) -> u64 {
    if path.is_file() {
        return path.metadata().map_or(0, |m| m.len());
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    let weights = |e: &std::fs::DirEntry| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        (name.starts_with("model") && name.ends_with(".safetensors")) || name.ends_with(".gguf")
    };
    (entries.flatten().filter(weights))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}
