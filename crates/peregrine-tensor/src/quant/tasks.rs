//! How one [`GgufMatrix::matmul_group`](super::GgufMatrix::matmul_group) call's work runs:
//! each rayon task owns some output columns (weight rows) of one matrix and multiplies them
//! against every input with the kernel its layout and the batch size call for.

use super::act::{Q8Block, Q8Input, QK, TILE};
#[cfg(target_arch = "x86_64")]
use super::avx2_interleaved::{GroupLayout, Inputs, Run};
use super::format::Format;
use super::interleaved::{self, Interleaved};
use super::{Kernel, scalar};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx2_interleaved, avx2_panel, panel};
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

/// Input rows per pass over a tile of weight rows: their Q8 blocks (≈ 1.1 bytes per input)
/// stay in L2 while the tile's rows stay in L1.
const INPUT_TILE: usize = 64;

/// Batches from this size on use the panel GEMM ([`panel`]) where the kernel has one.
pub(super) const PANEL_MIN_ROWS: usize = 16;

/// `Σ w·x[r]` for one weight row and `R` input rows with `kernel`. (Tiles of two weight rows
/// measured slower: 20 % at decode, and 40 % for the K-quants in prefill.)
fn dot_rows<const R: usize>(
    kernel: Kernel,
    format: Format,
    w: &[u8],
    x: [&[Q8Block]; R],
) -> [f32; R] {
    match kernel {
        Kernel::Scalar => x.map(|x| scalar::dot_row(format, w, x)),
        // SAFETY: `GgufMatrix::matmul_group` only runs kernels that run on this CPU.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::dot_rows(format, w, x) },
        // SAFETY: as above. The K-quants' AVX2 build measured 5-10 % faster one row at a time.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe {
            match format {
                Format::Q4K | Format::Q5K | Format::Q6K => avx2::dot_rows(format, w, x),
                _ => avx2::dot_rows_vnni(format, w, x),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Avx2 | Kernel::Avx512Vnni => unreachable!("x86 kernels never run off x86-64"),
    }
}

/// One matrix of a [`GgufMatrix::matmul_group`](super::GgufMatrix::matmul_group) call: its
/// weight rows and their bytes in their layout.
pub(super) struct Part<'a> {
    pub(super) rows: usize,
    pub(super) bytes: PartBytes<'a>,
}

/// A [`Part`]'s bytes.
pub(super) enum PartBytes<'a> {
    /// GGUF's row layout.
    Rows(Format, std::borrow::Cow<'a, [u8]>),
    /// Rows interleaved 8 at a time (which knows its format).
    Interleaved(&'a Interleaved),
    /// GGUF's row layout, multiplied 8 rows at a time by the interleaved kernels (x86 with
    /// AVX2, formats [`fits`](super::avx2_row_group::fits) takes).
    RowGroups(Format, &'a [u8]),
}

/// Weight rows `r0..r1` of `data` (`format` rows of `row_bytes`) against every input, one or
/// four at a time.
///
/// # Safety
/// No other thread writes `out`'s columns `r0..r1`; `kernel` runs on this CPU.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_task(
    kernel: Kernel,
    format: Format,
    data: &[u8],
    row_bytes: usize,
    xq: &[Q8Block],
    m: usize,
    out: &Columns,
    r0: usize,
    r1: usize,
) {
    let blocks = xq.len() / m.max(1);
    let row = |r: usize| &data[r * row_bytes..][..row_bytes];
    let input = |i: usize| &xq[i * blocks..][..blocks];
    // SAFETY (every `out.set`): (i, r) with i < m and r0 ≤ r < r1 is this task's.
    for i0 in (0..m).step_by(INPUT_TILE) {
        let i1 = (i0 + INPUT_TILE).min(m);
        for r in r0..r1 {
            let mut i = i0;
            while i + 4 <= i1 {
                let x = [input(i), input(i + 1), input(i + 2), input(i + 3)];
                let y = dot_rows(kernel, format, row(r), x);
                for (t, y) in y.into_iter().enumerate() {
                    unsafe { out.set(i + t, r, y) };
                }
                i += 4;
            }
            for i in i..i1 {
                let y = dot_rows(kernel, format, row(r), [input(i)])[0];
                unsafe { out.set(i, r, y) };
            }
        }
    }
}

/// Interleaved rows `r0..r1` (whole groups of 8) against every input: the x86 kernels take a
/// group and up to 8 inputs per call (4 with AVX2), with the inputs' refinements; the portable path
/// multiplies each row as GGUF lays it out (and [`refine_task`] adds the refinements).
///
/// # Safety
/// No other thread writes `out`'s columns `r0..r1`; `kernel` runs on this CPU.
pub(super) unsafe fn interleaved_task(
    kernel: Kernel,
    w: &Interleaved,
    xq: &Q8Input,
    m: usize,
    out: &Columns,
    r0: usize,
    r1: usize,
) {
    // Activation blocks per input (32 values each; a Q4_K weight block spans 8).
    let (format, blocks) = (w.format, xq.blocks.len() / m.max(1));
    let input = |i: usize| &xq.blocks[i * blocks..][..blocks];
    if !kernel.has_avx2() {
        for r in r0..r1 {
            let row = w.row(r);
            for i in 0..m {
                // SAFETY: (i, r) is this task's.
                unsafe { out.set(i, r, scalar::dot_row(format, &row, input(i))) };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let w = Grouped {
            bytes: &w.bytes,
            format,
            shared: w.shared,
            layout: GroupLayout::Interleaved(w.group_bytes()),
        };
        // SAFETY: per this function's contract; the kernel has AVX2 (checked above).
        unsafe { group_task(kernel, w, xq, m, out, r0, r1) };
    }
}

/// Rows `r0..r1` (whole groups of 8) of `data`, `format` rows of `row_bytes` in GGUF's layout,
/// against every input, through the interleaved kernels ([`RowGroup`]: the same bits as
/// [`interleaved_task`] on the same rows), with the inputs' refinements.
///
/// # Safety
/// No other thread writes `out`'s columns `r0..r1`; `kernel` runs on this CPU and has AVX2;
/// `format` [`fits`].
///
/// [`RowGroup`]: super::avx2_row_group::RowGroup
/// [`fits`]: super::avx2_row_group::fits
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn row_groups_task(
    kernel: Kernel,
    format: Format,
    data: &[u8],
    row_bytes: usize,
    xq: &Q8Input,
    m: usize,
    out: &Columns,
    r0: usize,
    r1: usize,
) {
    let w = Grouped {
        bytes: data,
        format,
        shared: 1,
        layout: GroupLayout::Rows(row_bytes),
    };
    // SAFETY: per this function's contract.
    unsafe { group_task(kernel, w, xq, m, out, r0, r1) };
}

/// A matrix as the group kernels take it.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Grouped<'a> {
    bytes: &'a [u8],
    format: Format,
    /// Blocks that share one set of scales ([`Interleaved::shared`]).
    shared: usize,
    layout: GroupLayout,
}

/// Rows `r0..r1` (whole groups of 8) of `w` against every input, a tile of inputs per pass.
///
/// # Safety
/// No other thread writes `out`'s columns `r0..r1`; `kernel` runs on this CPU and has AVX2.
#[cfg(target_arch = "x86_64")]
unsafe fn group_task(
    kernel: Kernel,
    w: Grouped,
    xq: &Q8Input,
    m: usize,
    out: &Columns,
    r0: usize,
    r1: usize,
) {
    let (g0, g1) = (r0 / interleaved::ROWS, r1.div_ceil(interleaved::ROWS));
    let tiles = Tiles {
        kernel,
        w,
        xq,
        m,
        out,
    };
    for i0 in (0..m).step_by(INPUT_TILE) {
        let i1 = (i0 + INPUT_TILE).min(m);
        // SAFETY (each call below): the kernel runs here (contract); inputs < m, and the
        // groups' output columns are this task's.
        match i1 - i0 {
            // Up to 8 inputs (a decode step's one, a batch's few): one call over all the
            // task's groups, each group's weights unpacked once for all of them.
            n if n <= tiles.widest() => unsafe { tiles.run_inputs(i0, n, g0..g1) },
            // More: as many as a call takes at a time, group by group, so that each
            // group's weights come from memory once and stay in L1 for all the tile's inputs.
            _ => {
                let wide = tiles.widest();
                for g in g0..g1 {
                    for i in (i0..i1).step_by(wide) {
                        unsafe { tiles.run_inputs(i, (i1 - i).min(wide), g..g + 1) };
                    }
                }
            }
        }
    }
}

/// What [`interleaved_task`]'s kernel calls share: `xq` holds inputs of `blocks` blocks.
#[cfg(target_arch = "x86_64")]
struct Tiles<'a> {
    kernel: Kernel,
    w: Grouped<'a>,
    xq: &'a Q8Input,
    /// Input rows.
    m: usize,
    out: &'a Columns,
}

#[cfg(target_arch = "x86_64")]
impl Tiles<'_> {
    /// The most inputs one kernel call takes: 8 with AVX-512's 32 vector registers, which
    /// hold their 16 accumulators beside a block's 8 code vectors; 4 with AVX2's 16.
    fn widest(&self) -> usize {
        match self.kernel {
            Kernel::Avx512Vnni => TILE,
            _ => 4,
        }
    }

    /// Inputs `i..i + n` (1 to 8, within one tile of [`Q8Input::tile`]) over `groups`, into
    /// their outputs.
    ///
    /// # Safety
    /// `kernel` runs on this CPU and has AVX2; inputs `i..i + n` exist; no other thread writes
    /// the groups' output columns.
    unsafe fn run_inputs(&self, i: usize, n: usize, groups: std::ops::Range<usize>) {
        // SAFETY: per this function's contract, for inputs `i..i + n`.
        unsafe {
            match n {
                1 => self.run::<1>(i, groups),
                2 => self.run::<2>(i, groups),
                3 => self.run::<3>(i, groups),
                4 => self.run::<4>(i, groups),
                5 => self.run::<5>(i, groups),
                6 => self.run::<6>(i, groups),
                7 => self.run::<7>(i, groups),
                _ => self.run::<8>(i, groups),
            }
        }
    }

    /// Inputs `i..i + T` over `groups`, into their outputs.
    ///
    /// # Safety
    /// `kernel` runs on this CPU and has AVX2; inputs `i..i + T` exist; no other thread writes
    /// the groups' output columns.
    unsafe fn run<const T: usize>(&self, i: usize, groups: std::ops::Range<usize>) {
        let xq = self.xq;
        let run: Run<T> = Run {
            w: self.w.bytes,
            layout: self.w.layout,
            groups,
            x: {
                let (blocks, stride) = xq.tiled(i, self.m);
                debug_assert!(i % TILE + T <= stride, "inputs across a tile");
                Inputs { blocks, stride }
            },
            refined: std::array::from_fn(|t| xq.refined(i + t)),
            // SAFETY: row i + t < m of the output (contract).
            out: std::array::from_fn(|t| unsafe { self.out.row(i + t) }),
        };
        // SAFETY: the groups and inputs hold `blocks` blocks, refinements name them; the
        // outputs are the caller's (contract).
        unsafe { group_kernel(self.kernel, self.w, &run) };
    }
}

/// Adds the refinements of `xq` ([`Q8Input::refined`]) to outputs `r0..r1` of every input, for
/// formats that take them ([`Format::refines`]): each is one block, `at`, of every weight row
/// against the residual, through the same kernels as the row's blocks.
///
/// # Safety
/// No other thread writes `out`'s columns `r0..r1`; `kernel` runs on this CPU; `k` is the
/// weights' input width and `xq` holds `m` rows of it.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn refine_task(
    kernel: Kernel,
    bytes: &PartBytes,
    k: usize,
    xq: &Q8Input,
    m: usize,
    out: &Columns,
    r0: usize,
    r1: usize,
) {
    let format = match bytes {
        PartBytes::Rows(format, _) | PartBytes::RowGroups(format, _) => *format,
        PartBytes::Interleaved(w) => w.format,
    };
    // The interleaved x86 kernels add them within their own call ([`interleaved_task`]).
    let added = match bytes {
        PartBytes::Interleaved(_) => kernel.has_avx2(),
        PartBytes::RowGroups(..) => true,
        PartBytes::Rows(..) => false,
    };
    if !format.refines() || added || !xq.any_refined() {
        return;
    }
    let bb = format.block_bytes();
    for i in 0..m {
        for r in xq.refined(i) {
            let x: &[Q8Block] = std::slice::from_ref(&r.residual);
            match bytes {
                PartBytes::RowGroups(..) => unreachable!("added by the kernels"),
                PartBytes::Rows(_, data) => {
                    let row_bytes = k / QK * bb;
                    for row in r0..r1 {
                        let block = &data[row * row_bytes + r.at * bb..][..bb];
                        let [y] = dot_rows(kernel, format, block, [x]);
                        // SAFETY: (i, row) is this task's.
                        unsafe { out.add(i, row, y) };
                    }
                }
                PartBytes::Interleaved(w) => {
                    let mut block = [0u8; 34];
                    for row in r0..r1 {
                        w.row_block(row, r.at, &mut block[..bb]);
                        let y = scalar::dot_row(format, &block[..bb], x);
                        // SAFETY: (i, row) is this task's.
                        unsafe { out.add(i, row, y) };
                    }
                }
            }
        }
    }
}

/// A run of groups of `w` against `T` inputs with `kernel`'s build.
///
/// # Safety
/// `kernel` runs on this CPU and has AVX2; as [`avx2_interleaved::groups`] for the run.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn group_kernel<const T: usize>(kernel: Kernel, w: Grouped, run: &Run<T>) {
    // SAFETY: per this function's contract.
    unsafe {
        match kernel {
            Kernel::Avx512Vnni => avx2_interleaved::groups_vnni(w.format, w.shared, run),
            _ => avx2_interleaved::groups(w.format, w.shared, run),
        }
    }
}

/// `m` quantized input rows interleaved into `⌈m / 8⌉` panels.
#[cfg(target_arch = "x86_64")]
pub(super) fn panels(xq: &[Q8Block], m: usize, blocks: usize) -> Vec<panel::PanelBlock> {
    let mut xp = vec![panel::PanelBlock::default(); m.div_ceil(panel::LANES) * blocks];
    xp.par_chunks_mut(blocks)
        .zip(xq.par_chunks(panel::LANES * blocks))
        .for_each(|(out, x)| panel::interleave(x, blocks, out));
    xp
}

/// Panels interleaved per micro-kernel call (32 inputs per unpacked weight row).
#[cfg(target_arch = "x86_64")]
const PANELS_PER_CALL: usize = 4;

/// Weight rows per output tile: each input's outputs are written 16 columns (a cache line) at
/// a time rather than one by one down a column.
#[cfg(target_arch = "x86_64")]
const ROW_TILE: usize = 16;

/// Weight rows `w` (`row_bytes` each; output columns `c0..`) against every panel of `xp`,
/// into `out`'s rows `0..m`.
///
/// # Safety
/// No other thread writes `out`'s columns `c0..c0 + rows`; the kernel runs on this CPU and has
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn panel_gemm(
    kernel: Kernel,
    format: Format,
    w: &[u8],
    row_bytes: usize,
    xp: &[panel::PanelBlock],
    blocks: usize,
    m: usize,
    out: &Columns,
    c0: usize,
) {
    let (rows, panels) = (w.len() / row_bytes, xp.len() / blocks);
    let panel = |p: usize| &xp[p * blocks..][..blocks];
    let mut tile = [[0f32; ROW_TILE]; PANELS_PER_CALL * panel::LANES];
    for rb in (0..rows).step_by(ROW_TILE) {
        let re = (rb + ROW_TILE).min(rows);
        let mut p = 0;
        while p < panels {
            let g = if p + PANELS_PER_CALL <= panels {
                PANELS_PER_CALL
            } else {
                1
            };
            for r in rb..re {
                let row = &w[r * row_bytes..][..row_bytes];
                // SAFETY: per this function's contract; each panel holds the row's blocks.
                let ys = unsafe {
                    match (kernel, g) {
                        (Kernel::Avx512Vnni, 1) => {
                            let [y] = avx2_panel::panel_row_vnni(format, row, [panel(p)]);
                            [y; PANELS_PER_CALL]
                        }
                        (Kernel::Avx512Vnni, _) => avx2_panel::panel_row_vnni(
                            format,
                            row,
                            std::array::from_fn(|t| panel(p + t)),
                        ),
                        (_, 1) => {
                            let [y] = avx2_panel::panel_row(format, row, [panel(p)]);
                            [y; PANELS_PER_CALL]
                        }
                        _ => avx2_panel::panel_row(
                            format,
                            row,
                            std::array::from_fn(|t| panel(p + t)),
                        ),
                    }
                };
                for (t, y) in ys.iter().take(g).enumerate() {
                    for (l, &v) in y.iter().enumerate() {
                        tile[t * panel::LANES + l][r - rb] = v;
                    }
                }
            }
            for (t, outs) in tile.iter().take(g * panel::LANES).enumerate() {
                let i = p * panel::LANES + t;
                if i < m {
                    // SAFETY: i < m; columns c0 + rb..c0 + re are this task's.
                    unsafe { out.set_run(i, c0 + rb, &outs[..re - rb]) };
                }
            }
            p += g;
        }
    }
}

/// A row-major `[m][n]` output (pointer, n) that parallel tasks fill by disjoint columns.
pub(super) struct Columns(pub(super) *mut f32, pub(super) usize);

// SAFETY: tasks write disjoint elements; the buffer outlives them (see `matmul_group`).
unsafe impl Send for Columns {}
unsafe impl Sync for Columns {}

impl Columns {
    /// # Safety
    /// `i * n + r` must be in bounds and written by no other thread.
    unsafe fn set(&self, i: usize, r: usize, v: f32) {
        debug_assert!(r < self.1);
        unsafe { *self.0.add(i * self.1 + r) = v };
    }

    /// Row `i`'s first element.
    ///
    /// # Safety
    /// `i` must be a row of the output; writes through it follow [`Columns::set`]'s rule.
    unsafe fn row(&self, i: usize) -> *mut f32 {
        unsafe { self.0.add(i * self.1) }
    }

    /// Adds `v` to element `(i, r)`.
    ///
    /// # Safety
    /// As [`Columns::set`].
    unsafe fn add(&self, i: usize, r: usize, v: f32) {
        debug_assert!(r < self.1);
        unsafe { *self.0.add(i * self.1 + r) += v };
    }

    /// Row `i`, columns `r..r + vs.len()`.
    ///
    /// # Safety
    /// As [`Columns::set`], for each column.
    unsafe fn set_run(&self, i: usize, r: usize, vs: &[f32]) {
        debug_assert!(r + vs.len() <= self.1);
        unsafe { std::ptr::copy_nonoverlapping(vs.as_ptr(), self.0.add(i * self.1 + r), vs.len()) };
    }
}
