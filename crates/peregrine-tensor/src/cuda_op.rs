//! What the crate's custom CUDA ops share.

/// The `name` and `cpu_fwd` of a candle custom op that runs on CUDA only (`CustomOp1`, `2` or
/// `3`, one identifier per input): on the CPU it refuses, naming itself.
macro_rules! cuda_only_op {
    ($name:literal, $($input:ident),+) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn cpu_fwd(
            &self,
            $($input: &candle_core::CpuStorage, _: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $(let _ = $input;)+
            candle_core::bail!(concat!($name, " runs on CUDA only"))
        }
    };
}
pub(crate) use cuda_only_op;

/// `n` as a kernel's 32-bit argument, or an error naming `op` where it does not fit.
pub(crate) fn int(op: &str, n: usize) -> candle_core::Result<i32> {
    i32::try_from(n).map_err(|_| {
        candle_core::Error::Msg(format!("{op}: {n} does not fit a 32-bit kernel argument"))
    })
}
