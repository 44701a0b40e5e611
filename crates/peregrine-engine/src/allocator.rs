//! glibc allocator settings for a process that runs forward passes and loads weights.

/// Keeps the allocator from returning activation-sized buffers to the system between forward
/// passes. glibc maps every block over its threshold (128 KiB until a large mapped block is
/// freed) afresh and unmaps it on free, so each prefill chunk's multi-megabyte buffers page-fault
/// and zero anew (measured: 20-40 % of a 512-token prefill, depending on what loading happened to
/// free). Blocks up to 32 MiB now come from the heap, and up to 64 MiB of free heap top stays.
/// Process-wide, as every glibc tuning is; weights (larger blocks) are still mapped on their own.
pub(crate) fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes glibc's thresholds; both values are within its limits.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 64 << 20);
        }
    }
}

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
