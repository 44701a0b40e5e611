//! Which CPU kernels run: detected once, shared by every kernel family (GGUF, MLX, attention).

use std::sync::OnceLock;

/// A CPU kernel implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust: the reference, and the path on other CPUs.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU runs; `PEREGRINE_CPU_KERNEL=scalar` forces the portable one.
    pub fn best() -> Self {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let forced = std::env::var("PEREGRINE_CPU_KERNEL").is_ok_and(|k| k == "scalar");
            match Self::available().last() {
                Some(&k) if !forced => k,
                _ => Self::Scalar,
            }
        })
    }

    /// Every kernel this CPU runs, portable first.
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![Self::Scalar];
        if avx2() {
            kernels.push(Self::Avx2);
        }
        kernels
    }

    /// Whether this CPU runs this kernel.
    pub fn runs_here(self) -> bool {
        match self {
            Self::Scalar => true,
            Self::Avx2 => avx2(),
        }
    }
}

/// AVX2, FMA and F16C, detected at run time (cached by std).
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    false
}
