//! Which CPU kernels run: detected once, shared by every kernel family (GGUF, MLX, attention).

use std::sync::OnceLock;

/// A CPU kernel implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust: the reference, and the path on other CPUs.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// The AVX2 kernels with AVX-512 VNNI's `vpdpbusd` (on 256-bit registers, AVX-512 VL) for
    /// the integer dot products.
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs. `PEREGRINE_CPU_KERNEL=scalar` (or `avx2`) forces a
    /// slower one, to compare them on one machine.
    pub fn best() -> Self {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let available = Self::available();
            let forced = std::env::var("PEREGRINE_CPU_KERNEL").ok().and_then(|name| {
                (available.iter()).find(|k| format!("{k:?}").eq_ignore_ascii_case(&name))
            });
            *forced.or(available.last()).unwrap_or(&Self::Scalar)
        })
    }

    /// Every kernel this CPU runs, portable first.
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![Self::Scalar];
        if avx2() {
            kernels.push(Self::Avx2);
        }
        if avx512_vnni() {
            kernels.push(Self::Avx512Vnni);
        }
        kernels
    }

    /// Whether this CPU runs this kernel.
    pub fn runs_here(self) -> bool {
        match self {
            Self::Scalar => true,
            Self::Avx2 => avx2(),
            Self::Avx512Vnni => avx512_vnni(),
        }
    }

    /// Whether this kernel includes the AVX2 paths (every kernel family has one).
    pub fn has_avx2(self) -> bool {
        matches!(self, Self::Avx2 | Self::Avx512Vnni)
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

/// AVX2 plus AVX-512 F/BW/VL and VNNI.
fn avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
    #[cfg(not(target_arch = "x86_64"))]
    false
}
