//! With the `cuda` feature: compiles the CUDA kernels (`cuda/*.cu`, links to the repository's
//! `kernels/cuda`) to PTX with nvcc, for `CUDA_COMPUTE_CAP` (default 80: the driver JIT-compiles
//! PTX for newer GPUs). nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else on `PATH`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("CUDA_HOME")
                .map(|home| Path::new(&home).join("bin/nvcc"))
                .filter(|p| p.exists())
                .unwrap_or_else(|| "nvcc".into())
        });
    let kernels = [
        "mlx_affine",
        "dense_gemv",
        "fused",
        "attn_decode",
        "kv_append",
        "gguf_gemv",
        "moe_gemv",
    ];
    for name in kernels {
        let src = Path::new("cuda").join(format!("{name}.cu"));
        println!("cargo::rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
                "-o",
            ])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e} (set NVCC or CUDA_HOME)", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
