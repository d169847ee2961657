//! The fast kernel's planning (docs/kernels.md, steps 1, 2, 5, 6 and 7): prefill tiles vs split-key
//! decode, K packing, work items, merging partials. Twin of `cpp/src/flash_attention.cpp`.
//!
//! Shapes (see problem.rs): q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) ->
//! out (B, Hq, Lq, Dv), lse (B, Hq, Lq). G = Hq / Hkv query heads share each KV head and are
//! packed into one set of rows_per_group = Lq * G rows per (b, kv_head) (flash_kernel.rs).
//!
//!   1. Plan: rows_per_group > Q_TILE_ROWS -> prefill (tiles of packed rows), else split-key.
//!   2. Prefill: in waves of (b, kv_head) groups whose panels fit in PREFILL_PACK_BYTES (at
//!      least one group), pack the wave's K^T (and V) panels once (parallel), then its tiles
//!      (b, kv_head, tile) most expensive first, each against all of its visible keys.
//!   6. Split-key: items (b, kv_head, chunk of SPLIT_KEY_CHUNK keys) write partial (m, l, O);
//!      a second parallel pass merges each group's partials by log-sum-exp (merge_partials). A
//!      group with one chunk writes out directly.
//!
//! Buffers: per-thread scratch (thread-local, grown on demand, reused across calls) and, on the
//! calling thread, one wave's packed K and V and the partials (thread-local too, so concurrent callers on
//! different threads never share them).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::LocalKey;

use crate::constants::{
    KEY_BLOCK, KEY_PANEL, LN2, LOG2_E, PREFILL_PACK_BYTES, Q_TILE_ROWS, SERIAL_WORK,
    SPLIT_KEY_CHUNK, VALUE_PANEL,
};
use crate::dispatch::current_kernels;
use crate::element::{BFloat16, Element, Float16};
use crate::flash_kernel::{max_nan, FlashKernels, FlashPlan, PackPairsFn, ThreadScratch, WorkItem};
use crate::problem::{
    check_num_threads, check_problem, paged_sequences, try_filled, varlen_sequences,
    AttentionProblem, ElementType, MaskKind, PagedProblem, ProblemError, VarlenProblem,
};
use crate::thread_pool::parallel_for;

/// The keys packed row r of sequence b may see by length, causality and window:
/// (begin, end), both in [0, kv_len]; empty when end <= begin.
pub fn flash_row_key_range(
    p: &AttentionProblem,
    b: usize,
    group: usize,
    r: usize,
) -> (usize, usize) {
    let kv_len = p.kv_lens[b];
    if !p.causal && p.window_left < 0 && p.window_right < 0 {
        return (0, kv_len as usize);
    }
    let position = i128::from(p.q_offset[b]) + (r / group) as i128;
    let mut last = i128::from(kv_len) - 1; // the last key the row may see, then the first
    if p.causal {
        last = last.min(position);
    }
    if p.window_right >= 0 {
        last = last.min(position + i128::from(p.window_right));
    }
    let first = if p.window_left >= 0 {
        (position - i128::from(p.window_left)).max(0)
    } else {
        0
    };
    let end = (last + 1).max(0) as usize;
    let begin = first.min(i128::from(kv_len)) as usize;
    (begin, end)
}

/// The absolute position q_offset[b] + r / group of packed row r, clamped to +-2^62 so that
/// position - j cannot overflow (ALiBi; beyond 2^24 a float distance is inexact anyway).
pub fn flash_row_position(p: &AttentionProblem, b: usize, group: usize, r: usize) -> i64 {
    let bound = 1i128 << 62;
    let position = i128::from(p.q_offset[b]) + (r / group) as i128;
    position.clamp(-bound, bound) as i64
}

/// Key rows (docs/kernels.md, "Key rows"): for keys [key_begin, key_begin + n) of (b, kv_head),
/// the address of each key's K row in key_rows[j] and V row in value_rows[j], and its int8 scales
/// in key_scales[j], value_scales[j]; each output may be null (not wanted). Dense problems give
/// base + j * stride; paged ones ([`crate::problem::KeyPages`]) walk the block table page by
/// page, with no division per key. The kernel reads K and V only through these rows.
///
/// # Safety
/// `p` is a checked problem (or a sequence of one) whose views are valid; b < B, kv_head < Hkv,
/// key_begin + n <= kv_lens[b]; each non-null output holds n entries.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_key_rows(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    key_begin: usize,
    n: usize,
    key_rows: *mut *const u8,
    value_rows: *mut *const u8,
    key_scales: *mut f32,
    value_scales: *mut f32,
) {
    if n == 0 {
        return;
    }
    let item = if p.kv_int8 { 1 } else { p.dtype.size() as i64 };
    let kv_head = kv_head as i64;
    // A run of count keys from output j0 on: consecutive slots from `slot` of page `page` (the
    // sequence b when dense). Entry offsets are page * stride[0] + kv_head * stride[1] + slot *
    // stride[2], in elements; within a run each output steps by its own stride[2] from the first
    // key's entry, one loop per output, with no multiply per key.
    // SAFETY: forwarded from this function's contract.
    let fill_run = |j0: usize, page: i64, slot: i64, count: usize| unsafe {
        let first = |stride: &[i64]| page * stride[0] + kv_head * stride[1] + slot * stride[2];
        let rows = |dst: *mut *const u8, data: *const u8, stride: &[i64]| {
            let first = data.offset((first(stride) * item) as isize);
            let step = (stride[2] * item) as isize;
            for t in 0..count {
                *dst.add(j0 + t) = first.offset(t as isize * step);
            }
        };
        let scales = |dst: *mut f32, data: *const f32, stride: &[i64]| {
            let first = data.offset(first(stride) as isize);
            let step = stride[2] as isize;
            for t in 0..count {
                *dst.add(j0 + t) = *first.offset(t as isize * step);
            }
        };
        if !key_rows.is_null() {
            rows(key_rows, p.k.data, &p.k.stride);
        }
        if !value_rows.is_null() {
            rows(value_rows, p.v.data, &p.v.stride);
        }
        if !key_scales.is_null() {
            scales(key_scales, p.k_scale.data, &p.k_scale.stride);
        }
        if !value_scales.is_null() {
            scales(value_scales, p.v_scale.data, &p.v_scale.stride);
        }
    };
    if p.pages.data.is_null() {
        fill_run(0, b as i64, key_begin as i64, n);
        return;
    }
    // Paged: one run per page, the first from key_begin's slot.
    let block_size = p.pages.block_size as usize;
    let (mut entry, mut slot) = (key_begin / block_size, key_begin % block_size);
    let mut j = 0;
    while j < n {
        // SAFETY: entries of keys < kv_lens[0] are inside the block table (paged_sequences).
        let page = i64::from(unsafe {
            *p.pages
                .data
                .offset(entry as isize * p.pages.stride as isize)
        });
        let count = (block_size - slot).min(n - j);
        fill_run(j, page, slot as i64, count);
        j += count;
        entry += 1;
        slot = 0;
    }
}

/// lse = ln 2 (m + log2 l): -inf for a row that saw no key (l = 0), +inf for a row whose largest
/// score is +inf (l is NaN there, inf - inf), NaN for a row that saw a NaN score.
#[inline(always)]
pub fn flash_row_lse(m: f32, l: f32) -> f32 {
    if l == 0.0 {
        f32::NEG_INFINITY
    } else if m == f32::INFINITY {
        m
    } else {
        LN2 * (m + l.log2())
    }
}

/// Step 1's plan of a checked problem with Hkv > 0: the shapes, the Q multiplier and the
/// variants' flags; no buffers. The backward pass (flash_backward.rs) scores with the same plan.
pub fn flash_plan<'p, 'a>(p: &'p AttentionProblem<'a>) -> FlashPlan<'p, 'a> {
    let [_, q_heads, q_len, head_dim] = p.q.shape.map(|n| n as usize);
    let group = q_heads / p.k.shape[1] as usize;
    let value_dim = p.v.shape[3] as usize;
    FlashPlan {
        problem: p,
        group,
        rows_per_group: q_len * group,
        head_dim,
        value_dim,
        value_stride: value_dim.div_ceil(16) * 16,
        // Softcap: Q times scale / softcap, then tanh(S) times softcap * log2(e) (flash_kernel.rs).
        // A denormal softcap can make scale / softcap overflow: the largest float instead, so
        // that a zero in q stays 0 (not 0 * inf = NaN); every score that matters saturates tanh
        // either way.
        q_multiplier: if p.softcap > 0.0 {
            (p.scale / p.softcap).clamp(-f32::MAX, f32::MAX)
        } else {
            p.scale * LOG2_E
        },
        has_mask: p.mask.kind != MaskKind::None,
        has_softcap: p.softcap > 0.0,
        softcap_multiplier: p.softcap * LOG2_E,
        has_alibi: !p.alibi_slopes.data.is_null(),
        has_sinks: !p.sinks.data.is_null(),
        packed_keys: std::ptr::null(),
        panels_per_head: 0,
        first_packed_head: 0,
        value_panels: std::ptr::null(),
        value_head_floats: 0,
        packed_values: std::ptr::null(),
        value_finite: std::ptr::null(),
        partial_out: std::ptr::null_mut(),
        partial_max: std::ptr::null_mut(),
        partial_sum: std::ptr::null_mut(),
    }
}

/// A float buffer whose data starts on a 64-byte boundary, grown on demand and reused: the
/// pages stay mapped across calls, so no call pays page faults twice. Allocation is fallible
/// (C++'s AlignedBuffer throws std::bad_alloc; this returns the out-of-memory error).
struct AlignedBuffer {
    data: *mut f32,
    capacity: usize,
}

impl Default for AlignedBuffer {
    fn default() -> Self {
        AlignedBuffer {
            data: std::ptr::null_mut(),
            capacity: 0,
        }
    }
}

impl AlignedBuffer {
    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len.checked_mul(4)?.max(64), 64).ok()
    }

    /// A pointer to at least `len` zero-initialised or previously written floats, 64-byte aligned.
    fn ensure(&mut self, len: usize) -> Result<*mut f32, ProblemError> {
        if len > self.capacity || self.data.is_null() {
            let layout = Self::layout(len).ok_or_else(ProblemError::out_of_memory)?;
            // SAFETY: the layout has a non-zero size.
            let grown = unsafe { alloc_zeroed(layout) }.cast::<f32>();
            if grown.is_null() {
                return Err(ProblemError::out_of_memory());
            }
            self.release();
            self.data = grown;
            self.capacity = len;
        }
        Ok(self.data)
    }

    fn release(&mut self) {
        if let Some(layout) = Self::layout(self.capacity).filter(|_| !self.data.is_null()) {
            // SAFETY: data was allocated by ensure with this very layout.
            unsafe { dealloc(self.data.cast::<u8>(), layout) };
        }
        self.data = std::ptr::null_mut();
        self.capacity = 0;
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        self.release();
    }
}

/// The scratch of one thread (flash_kernel.rs, ThreadScratch), kept for the thread's life.
#[derive(Default)]
struct ScratchBuffers {
    q_tile: AlignedBuffer,
    scores: AlignedBuffer,
    out_acc: AlignedBuffer,
    rows: AlignedBuffer,
    row_key_begin: Vec<usize>,
    row_key_end: Vec<usize>,
    key_panels: AlignedBuffer,
    probs_pairs: AlignedBuffer,
    out_acc_lo: AlignedBuffer,
    key_scales: AlignedBuffer,
    value_scales: AlignedBuffer,
    /// the key rows of a block: KEY_BLOCK K rows, KEY_BLOCK V rows
    key_rows: Vec<*const u8>,
    value_rows: Vec<*const u8>,
}

impl ScratchBuffers {
    fn view(
        &mut self,
        head_dim: usize,
        value_stride: usize,
        split_key: bool,
        bf16_pairs: bool,
        out32: bool,
    ) -> Result<ThreadScratch, ProblemError> {
        let rows = self.rows.ensure(3 * Q_TILE_ROWS)?;
        if self.row_key_end.len() < Q_TILE_ROWS {
            self.row_key_begin = try_filled(Q_TILE_ROWS, 0)?;
            self.row_key_end = try_filled(Q_TILE_ROWS, 0)?;
        }
        if self.key_rows.len() < 2 * KEY_BLOCK {
            // key_rows: the block's, then the next block's (the direct path's read-ahead)
            self.key_rows = try_filled(2 * KEY_BLOCK, std::ptr::null())?;
            self.value_rows = try_filled(KEY_BLOCK, std::ptr::null())?;
        }
        Ok(ThreadScratch {
            q_tile: self.q_tile.ensure(Q_TILE_ROWS * head_dim)?,
            scores: self.scores.ensure(Q_TILE_ROWS * KEY_BLOCK)?,
            out_acc: self.out_acc.ensure(Q_TILE_ROWS * value_stride)?,
            row_max: rows,
            // SAFETY: rows holds 3 * Q_TILE_ROWS floats.
            row_sum: unsafe { rows.add(Q_TILE_ROWS) },
            // SAFETY: as above.
            rescale: unsafe { rows.add(2 * Q_TILE_ROWS) },
            row_key_begin: self.row_key_begin.as_mut_ptr(),
            row_key_end: self.row_key_end.as_mut_ptr(),
            key_panels: if split_key {
                self.key_panels.ensure(KEY_BLOCK * head_dim)?
            } else {
                std::ptr::null_mut()
            },
            // a pair fills a float's slot
            probs_pairs: if bf16_pairs {
                self.probs_pairs
                    .ensure(Q_TILE_ROWS * KEY_BLOCK / 2)?
                    .cast::<u32>()
            } else {
                std::ptr::null_mut()
            },
            out_acc_lo: if bf16_pairs && out32 {
                self.out_acc_lo.ensure(Q_TILE_ROWS * value_stride)?
            } else {
                std::ptr::null_mut()
            },
            key_scales: self.key_scales.ensure(KEY_BLOCK)?,
            value_scales: self.value_scales.ensure(KEY_BLOCK)?,
            key_rows: self.key_rows.as_mut_ptr(),
            value_rows: self.value_rows.as_mut_ptr(),
        })
    }
}

thread_local! {
    static SCRATCH: RefCell<ScratchBuffers> = RefCell::new(ScratchBuffers::default());
}

/// Buffers owned by the calling thread for the length of one call (packed K, partials);
/// thread-local, so concurrent callers on different threads never share them.
#[derive(Default)]
struct CallerBuffers {
    packed_keys: AlignedBuffer,
    partials: AlignedBuffer,
    /// the float32 V panels of the prefill plans (not the pair path)
    value_panels: AlignedBuffer,
    /// the bfloat16 dot-product path: V pair rows (a pair in a float's slot), finite flags
    packed_values: AlignedBuffer,
    value_finite: Vec<u8>,
}

thread_local! {
    static CALLER_BUFFERS: RefCell<CallerBuffers> = RefCell::new(CallerBuffers::default());
}

/// Raw pointers shared by the items of one call. Rust needs this wrapper to send them to the
/// pool's threads; C++ does not.
pub(crate) struct Shared<T>(pub(crate) T);
// SAFETY: the items of one call write disjoint parts of the buffers behind these pointers
// (distinct groups, rows or partial slots) and read only what no item writes during that pass.
unsafe impl<T> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    /// The pointer (a method, so closures capture the Sync wrapper, not the raw field).
    pub(crate) fn get(&self) -> T {
        self.0
    }
}

/// Runs `item` with this thread's scratch, or returns the error of its allocation.
fn with_scratch(
    head_dim: usize,
    value_stride: usize,
    split_key: bool,
    bf16_pairs: bool,
    out32: bool,
    f: impl FnOnce(&ThreadScratch),
) -> Result<(), ProblemError> {
    with_thread_buffers(&SCRATCH, |buffers| {
        f(&buffers.view(head_dim, value_stride, split_key, bf16_pairs, out32)?);
        Ok(())
    })
}

/// Runs `f` with this thread's buffers in `key`, or with fresh ones when they are already
/// borrowed (not reachable: calls and work items never nest; correct regardless).
pub(crate) fn with_thread_buffers<B: Default, R>(
    key: &'static LocalKey<RefCell<B>>,
    f: impl FnOnce(&mut B) -> R,
) -> R {
    key.with(|cell| {
        let mut owned = B::default();
        let mut borrowed = cell.try_borrow_mut();
        let buffers = match borrowed.as_deref_mut() {
            Ok(buffers) => buffers,
            Err(_) => &mut owned,
        };
        f(buffers)
    })
}

/// Computes out (and lse when requested) for the whole problem with the current instruction
/// set and `num_threads` threads, after [`check_problem`] and [`check_num_threads`]. A scratch
/// buffer that cannot be allocated gives [`ProblemError::out_of_memory`] (out is then
/// unspecified).
///
/// # Safety
/// As [`crate::reference_kernel::attention_reference`]: every view in `p` describes memory
/// valid for its whole shape, nobody else writes the inputs or touches the outputs meanwhile.
pub unsafe fn attention_forward(
    p: &AttentionProblem,
    num_threads: usize,
) -> Result<(), ProblemError> {
    let kernels = current_kernels().map_err(ProblemError)?;
    // SAFETY: forwarded.
    unsafe { attention_forward_with(p, num_threads, kernels) }
}

/// The vectorised tanh of softcap (docs/kernels.md, "Variants") with the current instruction set:
/// tanh of every value, the kernel's own code, exposed so that tests can check it alone. An
/// error when TWINATTN_ISA named an instruction set that cannot run, or the buffer cannot be
/// allocated (as attention_forward). Twin of C++'s softcap_tanh.
pub fn softcap_tanh(x: impl ExactSizeIterator<Item = f32>) -> Result<Vec<f32>, ProblemError> {
    let kernels = current_kernels().map_err(ProblemError)?;
    let n = x.len();
    // Whole vectors only: the values padded with zeros to a multiple of the vector width.
    let mut values = try_filled(n.div_ceil(kernels.width) * kernels.width, 0.0f32)?;
    for (slot, value) in values.iter_mut().zip(x) {
        *slot = value;
    }
    // SAFETY: current_kernels hands out only the kernels of an instruction set this CPU runs.
    unsafe { (kernels.tanh_values)(&mut values) };
    values.truncate(n);
    Ok(values)
}

/// [`attention_forward`] with the kernels of a given instruction set (tests use every one).
///
/// # Safety
/// As [`attention_forward`], and the CPU supports `kernels`' instruction set (take them from
/// [`crate::dispatch::kernels_for`]).
pub unsafe fn attention_forward_with(
    p: &AttentionProblem,
    num_threads: usize,
    kernels: FlashKernels,
) -> Result<(), ProblemError> {
    check_problem(p)?;
    let threads = check_num_threads(i64::try_from(num_threads).unwrap_or(i64::MAX))?;
    let [batch, q_heads, q_len, _] = p.q.shape.map(|n| n as usize);
    if batch == 0 || q_heads == 0 || q_len == 0 {
        return Ok(());
    }
    // SAFETY: forwarded.
    unsafe { run_problems(std::slice::from_ref(p), &[], kernels, threads) }
}

/// Packed (varlen) and paged batches (problem.rs): the checks of [`varlen_sequences`] /
/// [`paged_sequences`], then every sequence as a dense problem through the same kernel, all their
/// work items in one parallel pass (docs/kernels.md, "Packed and paged batches"). Errors as
/// [`attention_forward`].
///
/// # Safety
/// As [`attention_forward`], for every view of `p`.
pub unsafe fn attention_varlen(p: &VarlenProblem, num_threads: usize) -> Result<(), ProblemError> {
    let mut positions = Vec::new();
    let sequences = varlen_sequences(p, &mut positions)?;
    // SAFETY: forwarded.
    unsafe { run_sequences(&sequences, &[], p.q.shape[1], num_threads) }
}

/// As [`attention_varlen`], for keys in pages.
///
/// # Safety
/// As [`attention_forward`], for every view of `p`.
pub unsafe fn attention_paged(p: &PagedProblem, num_threads: usize) -> Result<(), ProblemError> {
    let (mut positions, mut shared_positions) = (Vec::new(), Vec::new());
    let mut sequences = paged_sequences(p, &mut positions)?;
    let cascade = plan_cascade(p, &mut sequences, &mut shared_positions)?;
    // SAFETY: forwarded.
    unsafe { run_sequences(&sequences, &cascade, p.q.shape[1], num_threads) }
}

/// The checked sequences of a packed call (none empty), after num_threads and the kernels.
///
/// # Safety
/// As [`attention_forward`].
unsafe fn run_sequences(
    sequences: &[AttentionProblem],
    cascade: &[CascadePart],
    q_heads: i64,
    num_threads: usize,
) -> Result<(), ProblemError> {
    let threads = check_num_threads(i64::try_from(num_threads).unwrap_or(i64::MAX))?;
    let kernels = current_kernels().map_err(ProblemError)?;
    if sequences.is_empty() || q_heads == 0 {
        return Ok(());
    }
    // SAFETY: forwarded.
    unsafe { run_problems(sequences, cascade, kernels, threads) }
}

/// Step 8, cascade: runs of consecutive sequences (each with query rows) whose block tables start with
/// the same block ids share their first `shared` keys, shared = min(common blocks * block_size,
/// the shortest sequence's keys); a shared part of at least KEY_BLOCK keys that every query row
/// of the run sees whole (each sequence's first row sees up to it, its last row from key 0:
/// causal with the prefix before the rows, no left window) and no ALiBi (its bias differs per
/// sequence), each sequence split-key (at most Q_TILE_ROWS packed rows), becomes one more
/// problem: all the run's rows (contiguous in q) against the shared keys, not causal. Appends
/// those problems to `sequences` (their q_offset and kv_len in `positions`) and returns every
/// problem's part.
fn plan_cascade<'a>(
    p: &PagedProblem,
    sequences: &mut Vec<AttentionProblem<'a>>,
    positions: &'a mut Vec<i64>,
) -> Result<Vec<CascadePart>, ProblemError> {
    let mut parts = try_filled(sequences.len(), CascadePart::default())?;
    if !p.options.alibi_slopes.data.is_null() || p.q.shape[1] == 0 {
        return Ok(parts);
    }
    let batch = p.block_table.shape[0] as usize;
    let block_size = p.k_cache.shape[1] as usize;
    let table = &p.block_table;
    // SAFETY: checked by paged_sequences: every entry of a used block is inside the table.
    let entry = |b: usize, e: usize| unsafe {
        *table
            .data
            .offset(b as isize * table.stride[0] as isize + e as isize * table.stride[1] as isize)
    };
    let cu_q = p.cu_seqlens_q;
    let mut index = try_filled(batch, None)?; // each sequence's problem
    let mut n = 0;
    for (b, slot) in index.iter_mut().enumerate() {
        if cu_q[b + 1] > cu_q[b] {
            *slot = Some(n);
            n += 1;
        }
    }
    let member = |b: usize| index[b].is_some() && p.seq_lens[b] > 0;
    let mut runs = Vec::new(); // (first, last, shared)
    let mut first = 0;
    while first < batch {
        let mut last = first;
        if member(first) {
            while last + 1 < batch && member(last + 1) && entry(last + 1, 0) == entry(first, 0) {
                last += 1;
            }
        }
        if last > first {
            let shortest = (first..=last)
                .map(|b| p.seq_lens[b] as usize)
                .min()
                .unwrap_or(0);
            let mut common = 0;
            while common < shortest.div_ceil(block_size)
                && (first + 1..=last).all(|b| entry(b, common) == entry(first, common))
            {
                common += 1;
            }
            let shared = (common * block_size).min(shortest);
            let whole = shared >= KEY_BLOCK
                && (first..=last).all(|b| {
                    let s = &sequences[index[b].unwrap_or(0)];
                    let group = (s.q.shape[1] / s.k.shape[1]) as usize;
                    let rows = s.q.shape[2] as usize * group;
                    let (_, end) = flash_row_key_range(s, 0, group, 0);
                    let (begin, _) = flash_row_key_range(s, 0, group, rows - 1);
                    rows <= Q_TILE_ROWS && end >= shared && begin == 0
                });
            if whole {
                runs.push((first, last, shared));
            }
        }
        first = last + 1;
    }
    positions.clear();
    for &(_, _, shared) in &runs {
        positions.extend([0, shared as i64]);
    }
    let positions: &'a [i64] = positions;
    for (r, &(first, last, shared)) in runs.iter().enumerate() {
        let mut problem = sequences[index[first].unwrap_or(0)];
        let group = (problem.q.shape[1] / problem.k.shape[1]) as usize;
        let rows = cu_q[last + 1] - cu_q[first];
        problem.q.shape[2] = rows;
        problem.out.shape[2] = rows;
        problem.lse.data = std::ptr::null_mut();
        problem.k.shape[2] = shared as i64;
        problem.v.shape[2] = shared as i64;
        if problem.kv_int8 {
            problem.k_scale.shape[2] = shared as i64;
            problem.v_scale.shape[2] = shared as i64;
        }
        problem.causal = false;
        problem.window_left = -1;
        problem.window_right = -1;
        problem.sinks = crate::problem::ParamView1::NONE;
        problem.q_offset = &positions[2 * r..2 * r + 1];
        problem.kv_lens = &positions[2 * r + 1..2 * r + 2];
        for b in first..=last {
            let part = &mut parts[index[b].unwrap_or(0)];
            part.key_begin = shared;
            part.shared_plan = Some(sequences.len());
            part.shared_row = (cu_q[b] - cu_q[first]) as usize * group;
        }
        sequences.push(problem);
        parts.push(CascadePart {
            shared: true,
            ..CascadePart::default()
        });
    }
    Ok(parts)
}

/// The multiply-adds of a problem (B Hq Lq Lk (D + Dv)), in f64 (the product of five extents may
/// overflow): the forward's and the backward's measure of a call against SERIAL_WORK.
pub(crate) fn problem_work(p: &AttentionProblem) -> f64 {
    let extents = [
        p.q.shape[0],
        p.q.shape[1],
        p.q.shape[2],
        p.k.shape[2],
        p.q.shape[3] + p.v.shape[3],
    ];
    extents.iter().map(|&n| n as f64).product()
}

/// A work item of one of the call's plans and its cost. Items are taken in the order of their
/// run's cost (run_cost), most expensive first, a run's items one after another, most expensive
/// first. A run is the tiles of one (sequence, KV head) of a prefill plan, which read the same K
/// and V panels: taken in a row, each core finds the panels of its last tile still in its L2
/// (docs/kernels.md, "What bounds prefill"). A split-key item is a run of its own.
struct CostedItem {
    plan: usize,
    item: WorkItem,
    /// visible keys times rows
    cost: usize,
    /// the cost of its run's most expensive item
    run_cost: usize,
}

/// Step 8, a problem's part in a cascade (attention_paged's shared prefixes): a shared prefix
/// (`shared`: every row of the sequences that share it against the shared keys, in row tiles and
/// key chunks, all written as partials), or a sequence that shares one (its own keys from
/// key_begin on, as partials; the merge adds the shared plan's partials, its rows from
/// shared_row on). Default: no cascade.
#[derive(Clone, Copy, Default)]
struct CascadePart {
    shared: bool,
    key_begin: usize,
    shared_plan: Option<usize>,
    shared_row: usize,
}

/// What one plan takes of the caller's buffers (C++: PlanLayout).
struct PlanLayout {
    prefill: bool,
    /// prefill by bfloat16 dot products (avx512bf16)
    pairs: Option<PackPairsFn>,
    /// floats (or pairs) per K panel
    panel_size: usize,
    /// panels_per_head * KEY_PANEL
    keys_per_head: usize,
    /// What one head takes of the wave buffers (step 2): K^T panel floats (or pairs); the pair
    /// path's V pairs and finite flags (0 elsewhere; the float32 V panels: value_head_floats).
    head_floats: usize,
    head_value_pairs: usize,
    head_flags: usize,
    /// The plan's part of the current wave's buffers (the plan's packed_keys etc., writeable):
    /// its heads in the wave from the plan's first_packed_head on.
    packed: *mut f32,
    /// the float32 V panels (not the pair path)
    value_panels: *mut f32,
    packed_values: *mut u32,
    value_finite: *mut u8,
    /// split-key: first slot of (b, kv_head 0), B + 1 entries
    slot_base: Vec<usize>,
    /// its first partial row among the call's
    partial_at: usize,
    /// its part in a cascade (step 8), if any
    cascade: CascadePart,
}

/// One (plan, b, kv_head) of a call: a group to pack (prefill) or to merge (split-key).
#[derive(Clone, Copy)]
struct Group {
    plan: usize,
    b: usize,
    kv_head: usize,
}

// SAFETY: while the packing pass runs, each group writes only its own part of the buffers behind
// these pointers (as FlashPlan's); the layouts are read-only then.
unsafe impl Sync for PlanLayout {}

fn run_items(
    plans: &[FlashPlan],
    kernels: FlashKernels,
    items: &mut [CostedItem],
    threads: usize,
) -> Result<(), ProblemError> {
    // stable, as in C++ (plans in call order)
    items.sort_by_key(|costed| {
        (
            std::cmp::Reverse(costed.run_cost),
            costed.plan,
            costed.item.b,
            costed.item.kv_head,
            std::cmp::Reverse(costed.cost),
        )
    });
    let items = &*items;
    // C++ rethrows a worker's std::bad_alloc on the caller; here the failed item sets this flag.
    let out_of_memory = AtomicBool::new(false);
    parallel_for(items.len(), threads, &|index, _| {
        let costed = &items[index];
        let plan = &plans[costed.plan];
        let attend = if plan.problem.kv_int8 {
            kernels.attend_rows_int8[plan.problem.dtype as usize]
        } else {
            kernels.attend_rows[plan.problem.dtype as usize]
        };
        let attended = with_scratch(
            plan.head_dim,
            plan.value_stride,
            plan.packed_keys.is_null(),
            !plan.packed_values.is_null(),
            !plan.problem.out32.data.is_null(),
            |scratch| {
                // SAFETY: the plan was built from a checked problem whose memory is valid
                // (attention_forward's contract), the item is one of its own, the scratch is this
                // thread's and sized for the plan, and the kernels' ISA is available.
                unsafe { attend(plan, &costed.item, scratch) };
            },
        );
        if attended.is_err() {
            out_of_memory.store(true, Ordering::Relaxed);
        }
    });
    match out_of_memory.load(Ordering::Relaxed) {
        true => Err(ProblemError::out_of_memory()),
        false => Ok(()),
    }
}

/// 2. Prefill: what the plan's K^T panels take (the layout).
fn layout_prefill(plan: &mut FlashPlan, kernels: FlashKernels, layout: &mut PlanLayout) {
    let p = plan.problem;
    plan.panels_per_head = (p.k.shape[2] as usize).div_ceil(KEY_PANEL);
    // bfloat16 with dot products (avx512bf16): K and V pair panels (a pair fills a float's slot)
    // (Not with int8 K/V: those take the convert path.)
    layout.pairs = kernels
        .pack_pairs
        .filter(|_| p.dtype == ElementType::BFloat16 && !p.kv_int8);
    layout.panel_size = if layout.pairs.is_some() {
        plan.head_dim.div_ceil(2)
    } else {
        plan.head_dim
    } * KEY_PANEL;
    layout.keys_per_head = plan.panels_per_head * KEY_PANEL;
    plan.value_head_floats = match layout.pairs {
        Some(_) => 0,
        None => plan.value_dim.div_ceil(VALUE_PANEL) * layout.keys_per_head * VALUE_PANEL,
    };
    layout.head_floats = plan.panels_per_head * layout.panel_size;
    (layout.head_value_pairs, layout.head_flags) = match layout.pairs {
        Some(_) => (
            layout.keys_per_head / 2 * plan.value_stride,
            layout.keys_per_head,
        ),
        None => (0, 0),
    };
}

/// The bytes one head of a prefill plan takes of the wave buffers.
fn head_bytes(plan: &FlashPlan, layout: &PlanLayout) -> usize {
    std::mem::size_of::<f32>() * (layout.head_floats + plan.value_head_floats)
        + std::mem::size_of::<u32>() * layout.head_value_pairs
        + layout.head_flags
}

/// Packs the panels of (b, kv_head) that some row may see: from the first row's window start
/// (rounded down to a panel) to the last row's visible end. Its wave holds the head.
///
/// # Safety
/// The plan's problem is checked and valid; the layout's buffers are sized for the plan; no
/// other thread writes this group's part of them.
unsafe fn pack_head(
    plan: &FlashPlan,
    kernels: FlashKernels,
    layout: &PlanLayout,
    b: usize,
    kv_head: usize,
) {
    let p = plan.problem;
    let head = b * p.k.shape[1] as usize + kv_head - plan.first_packed_head;
    let (key_begin, _) = flash_row_key_range(p, b, plan.group, 0);
    let (_, key_end) = flash_row_key_range(p, b, plan.group, plan.rows_per_group - 1);
    let first_panel = key_begin / KEY_PANEL;
    if key_end <= first_panel * KEY_PANEL {
        return;
    }
    let first_key = first_panel * KEY_PANEL;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let key_dst = layout
            .packed
            .add((head * plan.panels_per_head + first_panel) * layout.panel_size);
        match layout.pairs {
            Some(pack_pairs) => pack_pairs(
                p,
                b,
                kv_head,
                first_key,
                key_end,
                key_dst.cast::<u32>(),
                layout
                    .packed_values
                    .add((head * layout.keys_per_head + first_key) / 2 * plan.value_stride),
                layout
                    .value_finite
                    .add(head * layout.keys_per_head + first_key),
                plan.value_stride,
            ),
            None if p.kv_int8 => {
                (kernels.pack_keys_int8)(p, b, kv_head, first_key, key_end, key_dst)
            }
            None => {
                (kernels.pack_keys[p.dtype as usize])(p, b, kv_head, first_key, key_end, key_dst)
            }
        }
        if layout.pairs.is_none() {
            let pack_values = if p.kv_int8 {
                kernels.pack_values_int8
            } else {
                kernels.pack_values[p.dtype as usize]
            };
            let value_dst = layout
                .value_panels
                .add(head * plan.value_head_floats + first_key * VALUE_PANEL);
            let panel_floats = layout.keys_per_head * VALUE_PANEL;
            pack_values(p, b, kv_head, first_key..key_end, value_dst, panel_floats);
        }
    }
}

fn prefill_items(
    plans: &[FlashPlan],
    index: usize,
    items: &mut Vec<CostedItem>,
) -> Result<(), ProblemError> {
    let plan = &plans[index];
    let p = plan.problem;
    let (batch, kv_heads) = (p.q.shape[0] as usize, p.k.shape[1] as usize);
    let tiles = plan.rows_per_group.div_ceil(Q_TILE_ROWS);
    items
        .try_reserve(batch * kv_heads * tiles)
        .map_err(|_| ProblemError::out_of_memory())?;
    for b in 0..batch {
        for kv_head in 0..kv_heads {
            let run_begin = items.len();
            for tile in 0..tiles {
                let row_begin = tile * Q_TILE_ROWS;
                let row_end = (row_begin + Q_TILE_ROWS).min(plan.rows_per_group);
                // Keys from the first row's window start (rounded down to a panel: blocks are
                // whole panels) to the last row's visible end; none when that is empty.
                let (first_key, _) = flash_row_key_range(p, b, plan.group, row_begin);
                let (_, last_key) = flash_row_key_range(p, b, plan.group, row_end - 1);
                let first_key = first_key / KEY_PANEL * KEY_PANEL;
                let last_key = last_key.max(first_key);
                let cost = (last_key - first_key + KEY_BLOCK) * (row_end - row_begin);
                items.push(CostedItem {
                    plan: index,
                    item: WorkItem {
                        b,
                        kv_head,
                        row_begin,
                        row_end,
                        key_begin: first_key,
                        key_end: last_key,
                        partial_slot: None,
                    },
                    cost,
                    run_cost: cost,
                });
            }
            let run = &mut items[run_begin..];
            let run_cost = run.iter().map(|costed| costed.cost).max().unwrap_or(0);
            for costed in run {
                costed.run_cost = run_cost;
            }
        }
    }
    Ok(())
}

/// Step 6, split-key: chunks of every group's visible keys (slots numbered from 0 in each plan;
/// the merge then combines each group's partials by log-sum-exp). A cascade's parts (step 8)
/// always write partials, a shared plan in row tiles of at most Q_TILE_ROWS rows, a sequence that
/// shares a prefix from its key_begin on (no chunk when the prefix holds all its keys). No items:
/// counting slots only.
fn split_key_items(
    plans: &[FlashPlan],
    index: usize,
    layout: &mut PlanLayout,
    mut items: Option<&mut Vec<CostedItem>>,
) -> Result<(), ProblemError> {
    let plan = &plans[index];
    let p = plan.problem;
    let (batch, kv_heads) = (p.q.shape[0] as usize, p.k.shape[1] as usize);
    let rows = plan.rows_per_group;
    let cascade = layout.cascade.shared || layout.cascade.shared_plan.is_some();
    layout.slot_base = try_filled(batch + 1, 0usize)?;
    for b in 0..batch {
        // Only the group's visible range is split: the first row's window start to the last
        // row's visible end.
        let (key_begin0, _) = flash_row_key_range(p, b, plan.group, 0);
        let (_, key_end) = flash_row_key_range(p, b, plan.group, rows - 1);
        let key_begin0 = key_begin0.max(layout.cascade.key_begin);
        let key_end = key_end.max(key_begin0);
        let chunks = (key_end - key_begin0).div_ceil(SPLIT_KEY_CHUNK);
        let chunks = if cascade { chunks } else { chunks.max(1) };
        let partial = cascade || chunks > 1;
        layout.slot_base[b + 1] = layout.slot_base[b] + if partial { chunks * kv_heads } else { 0 };
        let Some(items) = items.as_deref_mut() else {
            continue;
        };
        items
            .try_reserve(chunks * kv_heads * rows.div_ceil(Q_TILE_ROWS))
            .map_err(|_| ProblemError::out_of_memory())?;
        for kv_head in 0..kv_heads {
            for chunk in 0..chunks {
                for row_begin in (0..rows).step_by(Q_TILE_ROWS) {
                    let row_end = (row_begin + Q_TILE_ROWS).min(rows);
                    let key_begin = key_begin0 + chunk * SPLIT_KEY_CHUNK;
                    let chunk_end = (key_begin + SPLIT_KEY_CHUNK).min(key_end);
                    let cost =
                        (chunk_end.saturating_sub(key_begin) + KEY_BLOCK) * (row_end - row_begin);
                    items.push(CostedItem {
                        plan: index,
                        item: WorkItem {
                            b,
                            kv_head,
                            row_begin,
                            row_end,
                            key_begin,
                            key_end: if partial { chunk_end } else { key_end },
                            partial_slot: partial
                                .then(|| layout.slot_base[b] + kv_head * chunks + chunk),
                        },
                        cost,
                        run_cost: cost,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Runs every problem of a call (none empty): the prefill plans' (b, kv_head) groups in waves
/// (step 2: a wave's K^T and V panels packed in one parallel pass, then its tiles in another; the
/// split-key items run with the first wave), then the merge of every split group (one parallel
/// pass).
///
/// # Safety
/// As [`attention_forward_with`], for every problem (each checked).
unsafe fn run_problems(
    problems: &[AttentionProblem],
    cascade: &[CascadePart],
    kernels: FlashKernels,
    threads: usize,
) -> Result<(), ProblemError> {
    let work: f64 = problems.iter().map(problem_work).sum();
    let threads = if work < SERIAL_WORK as f64 {
        1
    } else {
        threads
    };
    let mut plans: Vec<FlashPlan> = Vec::new();
    plans
        .try_reserve_exact(problems.len())
        .map_err(|_| ProblemError::out_of_memory())?;
    plans.extend(problems.iter().map(flash_plan));
    let mut layouts = Vec::new();
    layouts
        .try_reserve_exact(problems.len())
        .map_err(|_| ProblemError::out_of_memory())?;

    // The prefill groups to pack, in call order, and every split plan's part of the partials.
    let mut pack_groups = Vec::new();
    // a prefill plan's first in pack_groups
    let mut first_group = try_filled(plans.len(), 0usize)?;
    let (mut partial_rows, mut partial_floats) = (0usize, 0usize);
    for index in 0..plans.len() {
        let (batch, kv_heads) = (
            plans[index].problem.q.shape[0] as usize,
            plans[index].problem.k.shape[1] as usize,
        );
        let part = cascade.get(index).copied().unwrap_or_default();
        let mut layout = PlanLayout {
            prefill: plans[index].rows_per_group > Q_TILE_ROWS && !part.shared,
            pairs: None,
            panel_size: 0,
            keys_per_head: 0,
            head_floats: 0,
            head_value_pairs: 0,
            head_flags: 0,
            packed: std::ptr::null_mut(),
            value_panels: std::ptr::null_mut(),
            packed_values: std::ptr::null_mut(),
            value_finite: std::ptr::null_mut(),
            slot_base: Vec::new(),
            partial_at: 0,
            cascade: part,
        };
        if layout.prefill {
            layout_prefill(&mut plans[index], kernels, &mut layout);
            first_group[index] = pack_groups.len();
            pack_groups
                .try_reserve(batch * kv_heads)
                .map_err(|_| ProblemError::out_of_memory())?;
            for b in 0..batch {
                for kv_head in 0..kv_heads {
                    pack_groups.push(Group {
                        plan: index,
                        b,
                        kv_head,
                    });
                }
            }
        } else {
            split_key_items(&plans, index, &mut layout, None)?;
            let plan = &plans[index];
            let slot_rows = layout.slot_base[layout.slot_base.len() - 1] * plan.rows_per_group;
            layout.partial_at = partial_rows;
            partial_rows += slot_rows;
            partial_floats += slot_rows * plan.value_dim;
        }
        layouts.push(layout);
    }

    // 2. Waves: consecutive groups, as many as fit in PREFILL_PACK_BYTES (at least one), groups
    // wave_begin[w]..wave_begin[w + 1]; the buffers hold the largest. With no prefill group, one
    // empty wave (the split-key items').
    let mut wave_begin = vec![0usize];
    let mut wave_of_group = try_filled(pack_groups.len(), 0usize)?;
    let (mut packed_floats, mut value_panel_floats) = (0usize, 0usize);
    let (mut value_pairs, mut finite_flags) = (0usize, 0usize);
    {
        let (mut bytes, mut floats, mut panel_floats, mut pairs, mut flags) = (0, 0, 0, 0, 0);
        for (g, group) in pack_groups.iter().enumerate() {
            let (plan, layout) = (&plans[group.plan], &layouts[group.plan]);
            let head = head_bytes(plan, layout);
            if g > wave_begin[wave_begin.len() - 1] && bytes + head > PREFILL_PACK_BYTES {
                wave_begin.push(g);
                (bytes, floats, panel_floats, pairs, flags) = (0, 0, 0, 0, 0);
            }
            bytes += head;
            floats += layout.head_floats;
            panel_floats += plan.value_head_floats;
            pairs += layout.head_value_pairs;
            flags += layout.head_flags;
            packed_floats = packed_floats.max(floats);
            value_panel_floats = value_panel_floats.max(panel_floats);
            value_pairs = value_pairs.max(pairs);
            finite_flags = finite_flags.max(flags);
            wave_of_group[g] = wave_begin.len() - 1;
        }
        wave_begin.push(pack_groups.len());
    }
    let waves = wave_begin.len() - 1;

    let max_value_dim = plans.iter().map(|plan| plan.value_dim).max().unwrap_or(0);
    with_thread_buffers(&CALLER_BUFFERS, |buffers| {
        // (at least one element each: a prefill plan's packed_keys is never null, even with
        // Lk = 0)
        let packed = buffers.packed_keys.ensure(packed_floats.max(1))?;
        let value_panels = buffers.value_panels.ensure(value_panel_floats.max(1))?;
        let packed_values = buffers
            .packed_values
            .ensure(value_pairs.max(1))?
            .cast::<u32>();
        if buffers.value_finite.len() < finite_flags.max(1) {
            buffers.value_finite = try_filled(finite_flags.max(1), 0u8)?;
        }
        let value_finite = buffers.value_finite.as_mut_ptr();
        // partial out, m, l, then one float32 row per thread for the merge of a half out
        // (merge_partials)
        let mut merge_rows = std::ptr::null_mut();
        let mut partials = std::ptr::null_mut();
        if partial_rows > 0 {
            partials = buffers
                .partials
                .ensure(partial_floats + 2 * partial_rows + threads * max_value_dim)?;
            // SAFETY: the buffer holds that many floats.
            merge_rows = partials.wrapping_add(partial_floats + 2 * partial_rows);
        }
        let mut merge_groups = Vec::new();
        let mut partial_floats_at = 0;
        for (index, (plan, layout)) in plans.iter_mut().zip(layouts.iter_mut()).enumerate() {
            let (batch, kv_heads) = (
                plan.problem.q.shape[0] as usize,
                plan.problem.k.shape[1] as usize,
            );
            // (every offset below lies inside the buffers sized above)
            if !layout.prefill && layout.slot_base[batch] > 0 {
                let slot_rows = layout.slot_base[batch] * plan.rows_per_group;
                plan.partial_out = partials.wrapping_add(partial_floats_at);
                plan.partial_max = partials.wrapping_add(partial_floats + layout.partial_at);
                plan.partial_sum =
                    partials.wrapping_add(partial_floats + partial_rows + layout.partial_at);
                partial_floats_at += slot_rows * plan.value_dim;
            }
            if layout.prefill || layout.cascade.shared {
                continue;
            }
            // a sequence that shares a prefix merges even with no chunk of its own
            for b in 0..batch {
                for kv_head in 0..kv_heads {
                    if layout.slot_base[b + 1] > layout.slot_base[b]
                        || layout.cascade.shared_plan.is_some()
                    {
                        merge_groups.push(Group {
                            plan: index,
                            b,
                            kv_head,
                        });
                    }
                }
            }
        }
        // 2 and 6. Every plan's work items, each prefill tile in its group's wave (listed before
        // the passes start: listing rewrites each split plan's slot_base, the same values as
        // above).
        let mut wave_items: Vec<Vec<CostedItem>> = Vec::new();
        wave_items
            .try_reserve_exact(waves)
            .map_err(|_| ProblemError::out_of_memory())?;
        wave_items.resize_with(waves, Vec::new);
        for (index, layout) in layouts.iter_mut().enumerate() {
            if !layout.prefill {
                split_key_items(&plans, index, layout, Some(&mut wave_items[0]))?;
                continue;
            }
            let mut items = Vec::new();
            prefill_items(&plans, index, &mut items)?;
            let kv_heads = plans[index].problem.k.shape[1] as usize;
            for costed in items {
                let wave = wave_of_group
                    [first_group[index] + costed.item.b * kv_heads + costed.item.kv_head];
                wave_items[wave]
                    .try_reserve(1)
                    .map_err(|_| ProblemError::out_of_memory())?;
                wave_items[wave].push(costed);
            }
        }
        for (wave, items) in wave_items.iter_mut().enumerate() {
            // The wave's groups laid out in order: each plan's heads in it are consecutive, from
            // the first one's b * Hkv + kv_head (the plan's first_packed_head).
            let groups = wave_begin[wave]..wave_begin[wave + 1];
            let (mut floats_at, mut panel_floats_at, mut pairs_at, mut flags_at) = (0, 0, 0, 0);
            for g in groups.clone() {
                let group = pack_groups[g];
                let (plan, layout) = (&mut plans[group.plan], &mut layouts[group.plan]);
                if g == groups.start || pack_groups[g - 1].plan != group.plan {
                    plan.first_packed_head =
                        group.b * plan.problem.k.shape[1] as usize + group.kv_head;
                    // (every offset lies inside the buffers sized above)
                    layout.packed = packed.wrapping_add(floats_at);
                    plan.packed_keys = layout.packed;
                    if layout.pairs.is_some() {
                        layout.packed_values = packed_values.wrapping_add(pairs_at);
                        layout.value_finite = value_finite.wrapping_add(flags_at);
                        plan.packed_values = layout.packed_values;
                        plan.value_finite = layout.value_finite;
                    } else {
                        layout.value_panels = value_panels.wrapping_add(panel_floats_at);
                        plan.value_panels = layout.value_panels;
                    }
                }
                floats_at += layout.head_floats;
                panel_floats_at += plan.value_head_floats;
                pairs_at += layout.head_value_pairs;
                flags_at += layout.head_flags;
            }
            let (plans, layouts) = (&plans, &layouts);
            // 2. The wave's K^T (and V) panels, then its tiles (and, in the first, every
            // split-key item).
            if !groups.is_empty() {
                let wave_groups = &pack_groups[groups];
                parallel_for(wave_groups.len(), threads, &|index, _| {
                    let Group { plan, b, kv_head } = wave_groups[index];
                    // SAFETY: the problems are checked and valid; group (plan, b, kv_head) is in
                    // this wave and writes only its own panels, pair rows and flags, inside the
                    // buffers sized above.
                    unsafe { pack_head(&plans[plan], kernels, &layouts[plan], b, kv_head) };
                });
            }
            run_items(plans, kernels, items, threads)?;
        }
        let (plans, layouts) = (&plans, &layouts);
        if merge_groups.is_empty() {
            return Ok(());
        }

        // 6. Merge, in chunk order.
        let merge_rows = Shared(merge_rows);
        let merge_groups = &merge_groups;
        parallel_for(merge_groups.len(), threads, &|index, thread| {
            let Group {
                plan: plan_index,
                b,
                kv_head,
            } = merge_groups[index];
            let plan = &plans[plan_index];
            let slot_base = &layouts[plan_index].slot_base;
            let kv_heads = plan.problem.k.shape[1] as usize;
            let chunks = (slot_base[b + 1] - slot_base[b]) / kv_heads;
            // The shared prefix's chunks (a cascade: its plan's b is 0), then the group's own.
            let own = PartialChunks {
                plan,
                first_slot: slot_base[b] + kv_head * chunks,
                chunks,
                first_row: 0,
            };
            let shared = layouts[plan_index].cascade.shared_plan.map(|shared| {
                let shared_chunks = layouts[shared].slot_base[1] / kv_heads;
                PartialChunks {
                    plan: &plans[shared],
                    first_slot: kv_head * shared_chunks,
                    chunks: shared_chunks,
                    first_row: layouts[plan_index].cascade.shared_row,
                }
            });
            let sources: &[PartialChunks] = match &shared {
                Some(shared) => &[*shared, own],
                None => &[own],
            };
            // SAFETY: the partials of these slots were written by the items above; this group's
            // out and lse rows are written by this item only.
            unsafe {
                let merge = match plan.problem.dtype {
                    ElementType::Float32 => merge_partials::<f32>,
                    ElementType::Float16 => merge_partials::<Float16>,
                    ElementType::BFloat16 => merge_partials::<BFloat16>,
                };
                merge(
                    plan,
                    b,
                    kv_head,
                    sources,
                    merge_rows.get().add(thread * max_value_dim),
                )
            };
        });
        Ok(())
    })
}

/// Chunks first_slot .. first_slot + chunks of a plan's partials, for the rows of a group that
/// start at packed row first_row there.
#[derive(Clone, Copy)]
struct PartialChunks<'x, 'p, 'a> {
    plan: &'x FlashPlan<'p, 'a>,
    first_slot: usize,
    chunks: usize,
    first_row: usize,
}

impl PartialChunks<'_, '_, '_> {
    fn slot_row(&self, chunk: usize, r: usize) -> usize {
        (self.first_slot + chunk) * self.plan.rows_per_group + self.first_row + r
    }
}

/// Step 6's merge: for every row of group (b, kv_head), chunks in order, `m* = max_c m_c`,
/// `l* = sum_c l_c 2^(m_c - m*)`, `out = sum_c O_c 2^(m_c - m*) / l*` and
/// `lse = ln 2 (m* + log2 l*)`. A chunk whose row saw a NaN or +inf score has m_c = NaN or
/// +inf and l_c = NaN (flash_kernel.rs, softmax_row), so m* (NaN-propagating) and the weights
/// carry it into out and lse ([`flash_row_lse`]); a chunk that saw nothing has l_c = 0. A sink s
/// (base 2) counts here once: m* starts at s and l* at 2^(s - m*). The row is summed in float32
/// (in out itself for float32, in a row buffer for the halves), then rounded to T once (and
/// copied into out32 when given). The chunks come from `sources` in order: a cascade's shared
/// prefix first (its plan's rows from first_row on), then the group's own.
///
/// # Safety
/// Each source's partial slots hold this group's rows; the views of the plan's problem are
/// valid; row_buffer holds Dv floats of this thread's (unused for float32).
unsafe fn merge_partials<T: Element>(
    plan: &FlashPlan,
    b: usize,
    kv_head: usize,
    sources: &[PartialChunks],
    row_buffer: *mut f32,
) {
    let p = plan.problem;
    let (group, value_dim, rows) = (plan.group, plan.value_dim, plan.rows_per_group);
    let stride = |axis: usize| p.out.stride[axis] as isize;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        for r in 0..rows {
            let (h, i) = (kv_head * group + r % group, r / group);
            let sink = if plan.has_sinks {
                *p.sinks.data.offset(h as isize * p.sinks.stride[0] as isize) * LOG2_E
            } else {
                f32::NEG_INFINITY
            };
            let mut m_star = sink;
            for chunks in sources {
                for c in 0..chunks.chunks {
                    m_star = max_nan(m_star, *chunks.plan.partial_max.add(chunks.slot_row(c, r)));
                }
            }
            let out_row =
                p.out.data.cast::<T>().offset(
                    b as isize * stride(0) + h as isize * stride(1) + i as isize * stride(2),
                );
            let dst = if T::DTYPE == ElementType::Float32 {
                out_row.cast::<f32>()
            } else {
                row_buffer
            };
            for d in 0..value_dim {
                *dst.add(d) = 0.0;
            }
            let mut l_star = if plan.has_sinks {
                (sink - m_star).exp2()
            } else {
                0.0f32
            };
            for chunks in sources.iter().take_while(|_| m_star != f32::NEG_INFINITY) {
                for c in 0..chunks.chunks {
                    let slot_row = chunks.slot_row(c, r);
                    let l_c = *chunks.plan.partial_sum.add(slot_row);
                    if l_c == 0.0 {
                        continue;
                    }
                    let weight = (*chunks.plan.partial_max.add(slot_row) - m_star).exp2();
                    l_star += l_c * weight;
                    let o_c = chunks.plan.partial_out.add(slot_row * value_dim);
                    for d in 0..value_dim {
                        *dst.add(d) += *o_c.add(d) * weight;
                    }
                }
            }
            if l_star != 0.0 {
                let inverse = 1.0 / l_star;
                for d in 0..value_dim {
                    *dst.add(d) *= inverse;
                }
            }
            if T::DTYPE != ElementType::Float32 {
                for d in 0..value_dim {
                    *out_row.add(d) = T::from_f32(*dst.add(d));
                }
            }
            if T::DTYPE != ElementType::Float32 && !p.out32.data.is_null() {
                let out32_row = p.out32.data.cast::<f32>().offset(
                    b as isize * p.out32.stride[0] as isize
                        + h as isize * p.out32.stride[1] as isize
                        + i as isize * p.out32.stride[2] as isize,
                );
                std::ptr::copy_nonoverlapping(dst, out32_row, value_dim);
            }
            if p.lse.is_requested() {
                let lse = p.lse.data.offset(
                    b as isize * p.lse.stride[0] as isize
                        + h as isize * p.lse.stride[1] as isize
                        + i as isize * p.lse.stride[2] as isize,
                );
                *lse = flash_row_lse(m_star, l_star);
            }
        }
    }
}
