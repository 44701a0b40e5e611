//! glibc allocator settings for a process that runs forward passes and loads weights.

/// Keeps the allocator from returning activation-sized buffers to the system between forward
/// passes. glibc maps every block over its threshold (128 KiB until a large mapped block is
/// freed) afresh and unmaps it on free, so each prefill chunk's multi-megabyte buffers page-fault
/// and zero anew (measured: 20-40 % of a 512-token prefill, depending on what loading happened to
/// free). Blocks up to 32 MiB now come from the heap, and up to 64 MiB of free heap top stays.
/// Process-wide, as every glibc tuning is; weights (larger blocks) are still mapped on their own.
/// With `streaming_experts`, allocations also share [`STREAMING_ARENAS`] arenas: the expert
/// reads' threads (24 by default) would otherwise each take one of up to 8 per core, and every
/// arena keeps its freed multi-megabyte read buffers (measured on Qwen3-30B-A3B's shapes in bf16:
/// peak RSS 1.29 GB with the default arenas, 0.69 GB with 2, and decode faster).
pub(crate) fn tune(streaming_experts: bool) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        const M_ARENA_MAX: i32 = -8;
        // SAFETY: mallopt only changes glibc's thresholds; every value is within its limits.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 64 << 20);
            if streaming_experts {
                mallopt(M_ARENA_MAX, STREAMING_ARENAS);
            }
        }
    }
    let _ = streaming_experts;
}

/// glibc arenas a process streaming experts allocates from ([`tune`]).
const STREAMING_ARENAS: i32 = 2;

/// Hands the allocator's freed pages back to the system: loading frees the GGUF metadata and the
/// tokenizer's build tables (about 100 MB for a 262K vocabulary), which glibc would otherwise keep
/// resident.
pub(crate) fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim only returns free heap pages to the kernel.
        unsafe { malloc_trim(0) };
    }
}
