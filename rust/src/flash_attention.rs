//! The fast kernel's planning (docs/kernels.md, steps 1, 2, 5, 6 and 7): prefill tiles vs split-key
//! decode, K packing, work items, merging partials. Twin of `cpp/src/flash_attention.cpp`.
//!
//! Shapes (see problem.rs): q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) ->
//! out (B, Hq, Lq, Dv), lse (B, Hq, Lq). G = Hq / Hkv query heads share each KV head and are
//! packed into one set of rows_per_group = Lq * G rows per (b, kv_head) (flash_kernel.rs).
//!
//!   1. Plan: rows_per_group > Q_TILE_ROWS -> prefill (tiles of packed rows), else split-key.
//!   2. Prefill: pack K^T panels of every (b, kv_head) once (parallel), then the tiles
//!      (b, kv_head, tile) most expensive first, each against all of its visible keys.
//!   6. Split-key: items (b, kv_head, chunk of SPLIT_KEY_CHUNK keys) write partial (m, l, O);
//!      a second parallel pass merges each group's partials by log-sum-exp (merge_partials). A
//!      group with one chunk writes out directly.
//!
//! Buffers: per-thread scratch (thread-local, grown on demand, reused across calls) and, on the
//! calling thread, the packed K and the partials (thread-local too, so concurrent callers on
//! different threads never share them).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::LocalKey;

use crate::constants::{
    KEY_BLOCK, KEY_PANEL, LN2, LOG2_E, Q_TILE_ROWS, SERIAL_WORK, SPLIT_KEY_CHUNK,
};
use crate::dispatch::current_kernels;
use crate::element::{BFloat16, Element, Float16};
use crate::flash_kernel::{max_nan, FlashKernels, FlashPlan, ThreadScratch, WorkItem};
use crate::problem::{
    check_num_threads, check_problem, try_filled, AttentionProblem, ElementType, MaskKind,
    ProblemError,
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
    key_scales: AlignedBuffer,
    value_scales: AlignedBuffer,
}

impl ScratchBuffers {
    fn view(
        &mut self,
        head_dim: usize,
        value_stride: usize,
        split_key: bool,
        bf16_pairs: bool,
    ) -> Result<ThreadScratch, ProblemError> {
        let rows = self.rows.ensure(3 * Q_TILE_ROWS)?;
        if self.row_key_end.len() < Q_TILE_ROWS {
            self.row_key_begin = try_filled(Q_TILE_ROWS, 0)?;
            self.row_key_end = try_filled(Q_TILE_ROWS, 0)?;
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
            key_scales: self.key_scales.ensure(KEY_BLOCK)?,
            value_scales: self.value_scales.ensure(KEY_BLOCK)?,
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
    f: impl FnOnce(&ThreadScratch),
) -> Result<(), ProblemError> {
    with_thread_buffers(&SCRATCH, |buffers| {
        f(&buffers.view(head_dim, value_stride, split_key, bf16_pairs)?);
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
    let [batch, q_heads, q_len, head_dim] = p.q.shape.map(|n| n as usize);
    if batch == 0 || q_heads == 0 || q_len == 0 {
        return Ok(());
    }

    // 1. Plan.
    let mut plan = flash_plan(p);
    let value_dim = plan.value_dim;
    // Work in f64: the product of five extents may overflow.
    let extents = [
        batch,
        q_heads,
        q_len,
        p.k.shape[2] as usize,
        head_dim + value_dim,
    ];
    let work: f64 = extents.iter().map(|&n| n as f64).product();
    let threads = if work < SERIAL_WORK as f64 {
        1
    } else {
        threads
    };
    with_thread_buffers(&CALLER_BUFFERS, |buffers| {
        if plan.rows_per_group > Q_TILE_ROWS {
            run_prefill(&mut plan, kernels, threads, buffers)
        } else {
            run_split_key(&mut plan, kernels, threads, buffers)
        }
    })
}

/// A work item and its cost (visible keys times rows): items are taken most expensive first.
struct CostedItem {
    item: WorkItem,
    cost: usize,
}

fn run_items(
    plan: &FlashPlan,
    kernels: FlashKernels,
    items: &mut [CostedItem],
    threads: usize,
    split_key: bool,
) -> Result<(), ProblemError> {
    items.sort_by_key(|costed| std::cmp::Reverse(costed.cost)); // stable, as in C++
    let attend = if plan.problem.kv_int8 {
        kernels.attend_rows_int8[plan.problem.dtype as usize]
    } else {
        kernels.attend_rows[plan.problem.dtype as usize]
    };
    let items = &*items;
    // C++ rethrows a worker's std::bad_alloc on the caller; here the failed item sets this flag.
    let out_of_memory = AtomicBool::new(false);
    parallel_for(items.len(), threads, &|index, _| {
        let pairs = !plan.packed_values.is_null();
        let attended = with_scratch(
            plan.head_dim,
            plan.value_stride,
            split_key,
            pairs,
            |scratch| {
                // SAFETY: the plan was built from a checked problem whose memory is valid
                // (attention_forward's contract), the item is one of its own, the scratch is this
                // thread's and sized for the plan, and the kernels' ISA is available.
                unsafe { attend(plan, &items[index].item, scratch) };
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

/// 2. Prefill: K^T panels of every (b, kv_head), then the tiles.
fn run_prefill(
    plan: &mut FlashPlan,
    kernels: FlashKernels,
    threads: usize,
    buffers: &mut CallerBuffers,
) -> Result<(), ProblemError> {
    let p = plan.problem;
    let (batch, kv_heads, d_len) = (p.q.shape[0] as usize, p.k.shape[1] as usize, plan.head_dim);
    plan.panels_per_head = (p.k.shape[2] as usize).div_ceil(KEY_PANEL);
    // bfloat16 with dot products (avx512bf16): K and V pair panels (a pair fills a float's slot)
    // (Not with int8 K/V: those take the convert path.)
    let pairs = kernels
        .pack_pairs
        .filter(|_| p.dtype == ElementType::BFloat16 && !p.kv_int8);
    let panel_size = if pairs.is_some() {
        d_len.div_ceil(2)
    } else {
        d_len
    } * KEY_PANEL;
    let head_floats = plan.panels_per_head * panel_size;
    let keys_per_head = plan.panels_per_head * KEY_PANEL;
    let packed_floats = [batch, kv_heads, head_floats]
        .into_iter()
        .try_fold(1usize, usize::checked_mul)
        .ok_or_else(ProblemError::out_of_memory)?;
    let packed = Shared(buffers.packed_keys.ensure(packed_floats)?);
    plan.packed_keys = packed.get();
    let mut value_pairs = Shared((std::ptr::null_mut::<u32>(), std::ptr::null_mut::<u8>()));
    if pairs.is_some() {
        let heads = batch * kv_heads;
        let pair_floats = [heads, keys_per_head / 2, plan.value_stride]
            .into_iter()
            .try_fold(1usize, usize::checked_mul)
            .ok_or_else(ProblemError::out_of_memory)?;
        let values = buffers.packed_values.ensure(pair_floats)?.cast::<u32>();
        if buffers.value_finite.len() < heads * keys_per_head {
            buffers.value_finite = try_filled(heads * keys_per_head, 0u8)?;
        }
        value_pairs = Shared((values, buffers.value_finite.as_mut_ptr()));
        plan.packed_values = values;
        plan.value_finite = buffers.value_finite.as_ptr();
    }

    // Pack only the panels some row may see: from the first row's window start (rounded down to
    // a panel) to the last row's visible end.
    let plan_ref = &*plan;
    parallel_for(batch * kv_heads, threads, &|head, _| {
        let (b, kv_head) = (head / kv_heads, head % kv_heads);
        let p = plan_ref.problem;
        let (key_begin, _) = flash_row_key_range(p, b, plan_ref.group, 0);
        let (_, key_end) = flash_row_key_range(p, b, plan_ref.group, plan_ref.rows_per_group - 1);
        let first_panel = key_begin / KEY_PANEL;
        if key_end <= first_panel * KEY_PANEL {
            return;
        }
        let first_key = first_panel * KEY_PANEL;
        // SAFETY: the problem is checked and its memory valid (attention_forward's contract);
        // head `head` writes only its own panels, pair rows and flags, inside the buffers sized
        // above.
        unsafe {
            let key_dst = packed
                .get()
                .add(head * head_floats + first_panel * panel_size);
            match pairs {
                Some(pack_pairs) => {
                    let (values, finite) = value_pairs.get();
                    pack_pairs(
                        p,
                        b,
                        kv_head,
                        first_key,
                        key_end,
                        key_dst.cast::<u32>(),
                        values.add((head * keys_per_head + first_key) / 2 * plan_ref.value_stride),
                        finite.add(head * keys_per_head + first_key),
                        plan_ref.value_stride,
                    )
                }
                None if p.kv_int8 => {
                    (kernels.pack_keys_int8)(p, b, kv_head, first_key, key_end, key_dst)
                }
                None => (kernels.pack_keys[p.dtype as usize])(
                    p, b, kv_head, first_key, key_end, key_dst,
                ),
            }
        };
    });

    let tiles = plan.rows_per_group.div_ceil(Q_TILE_ROWS);
    let mut items = Vec::new();
    items
        .try_reserve_exact(batch * kv_heads * tiles)
        .map_err(|_| ProblemError::out_of_memory())?;
    for b in 0..batch {
        for kv_head in 0..kv_heads {
            for tile in 0..tiles {
                let row_begin = tile * Q_TILE_ROWS;
                let row_end = (row_begin + Q_TILE_ROWS).min(plan.rows_per_group);
                // Keys from the first row's window start (rounded down to a panel: blocks are
                // whole panels) to the last row's visible end; none when that is empty.
                let (first_key, _) = flash_row_key_range(p, b, plan.group, row_begin);
                let (_, last_key) = flash_row_key_range(p, b, plan.group, row_end - 1);
                let first_key = first_key / KEY_PANEL * KEY_PANEL;
                let last_key = last_key.max(first_key);
                items.push(CostedItem {
                    item: WorkItem {
                        b,
                        kv_head,
                        row_begin,
                        row_end,
                        key_begin: first_key,
                        key_end: last_key,
                        partial_slot: None,
                    },
                    cost: (last_key - first_key + KEY_BLOCK) * (row_end - row_begin),
                });
            }
        }
    }
    run_items(plan, kernels, &mut items, threads, false)
}

/// 6. Split-key: chunks of every group's visible keys, then the log-sum-exp merge.
fn run_split_key(
    plan: &mut FlashPlan,
    kernels: FlashKernels,
    threads: usize,
    buffers: &mut CallerBuffers,
) -> Result<(), ProblemError> {
    let p = plan.problem;
    let (batch, kv_heads, value_dim) =
        (p.q.shape[0] as usize, p.k.shape[1] as usize, plan.value_dim);
    let rows = plan.rows_per_group;

    let mut slot_base = try_filled(batch + 1, 0usize)?; // first slot of (b, kv_head 0)
    let mut items = Vec::new();
    for b in 0..batch {
        // Only the group's visible range is split: the first row's window start to the last
        // row's visible end.
        let (key_begin0, _) = flash_row_key_range(p, b, plan.group, 0);
        let (_, key_end) = flash_row_key_range(p, b, plan.group, rows - 1);
        let key_end = key_end.max(key_begin0);
        let chunks = (key_end - key_begin0).div_ceil(SPLIT_KEY_CHUNK).max(1);
        items
            .try_reserve(chunks * kv_heads)
            .map_err(|_| ProblemError::out_of_memory())?;
        slot_base[b + 1] = slot_base[b] + if chunks > 1 { chunks * kv_heads } else { 0 };
        for kv_head in 0..kv_heads {
            for chunk in 0..chunks {
                let key_begin = key_begin0 + chunk * SPLIT_KEY_CHUNK;
                let chunk_end = (key_begin + SPLIT_KEY_CHUNK).min(key_end);
                items.push(CostedItem {
                    item: WorkItem {
                        b,
                        kv_head,
                        row_begin: 0,
                        row_end: rows,
                        key_begin,
                        key_end: if chunks > 1 { chunk_end } else { key_end },
                        partial_slot: (chunks > 1).then(|| slot_base[b] + kv_head * chunks + chunk),
                    },
                    cost: (chunk_end.saturating_sub(key_begin) + KEY_BLOCK) * rows,
                });
            }
        }
    }
    let slots = slot_base[batch];
    let mut merge_rows = std::ptr::null_mut();
    if slots > 0 {
        let slot_rows = slots * rows;
        // then one float32 row per thread for the merge of a half out (merge_partials)
        let partials = buffers
            .partials
            .ensure(slot_rows * (value_dim + 2) + threads * value_dim)?;
        // SAFETY: the buffer holds slot_rows * (Dv + 2) + threads * Dv floats.
        merge_rows = unsafe { partials.add(slot_rows * (value_dim + 2)) };
        plan.partial_out = partials;
        // SAFETY: the buffer holds slot_rows * (Dv + 2) floats.
        plan.partial_max = unsafe { partials.add(slot_rows * value_dim) };
        // SAFETY: as above.
        plan.partial_sum = unsafe { partials.add(slot_rows * (value_dim + 1)) };
    }
    run_items(plan, kernels, &mut items, threads, true)?;
    if slots == 0 {
        return Ok(());
    }

    // Merge, in chunk order.
    let plan_ref = &*plan;
    let slot_base = &slot_base;
    let merge_rows = Shared(merge_rows);
    parallel_for(batch * kv_heads, threads, &|head, thread| {
        let (b, kv_head) = (head / kv_heads, head % kv_heads);
        let chunks = (slot_base[b + 1] - slot_base[b]) / kv_heads;
        if chunks == 0 {
            return; // one chunk: written directly
        }
        // SAFETY: the partials of these slots were written by the items above; this group's
        // out and lse rows are written by this item only.
        unsafe {
            let merge = match plan_ref.problem.dtype {
                ElementType::Float32 => merge_partials::<f32>,
                ElementType::Float16 => merge_partials::<Float16>,
                ElementType::BFloat16 => merge_partials::<BFloat16>,
            };
            merge(
                plan_ref,
                b,
                kv_head,
                slot_base[b] + kv_head * chunks,
                chunks,
                merge_rows.get().add(thread * value_dim),
            )
        };
    });
    Ok(())
}

/// Step 6's merge: for every row of group (b, kv_head), chunks in order, `m* = max_c m_c`,
/// `l* = sum_c l_c 2^(m_c - m*)`, `out = sum_c O_c 2^(m_c - m*) / l*` and
/// `lse = ln 2 (m* + log2 l*)`. A chunk whose row saw a NaN or +inf score has m_c = NaN or
/// +inf and l_c = NaN (flash_kernel.rs, softmax_row), so m* (NaN-propagating) and the weights
/// carry it into out and lse ([`flash_row_lse`]); a chunk that saw nothing has l_c = 0. A sink s
/// (base 2) counts here once: m* starts at s and l* at 2^(s - m*). The row is summed in float32
/// (in out itself for float32, in a row buffer for the halves), then rounded to T once.
///
/// # Safety
/// Partial slots first_slot..first_slot + chunks of the plan hold this group's rows; the views
/// of the plan's problem are valid; row_buffer holds Dv floats of this thread's (unused for
/// float32).
unsafe fn merge_partials<T: Element>(
    plan: &FlashPlan,
    b: usize,
    kv_head: usize,
    first_slot: usize,
    chunks: usize,
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
            for c in 0..chunks {
                m_star = max_nan(m_star, *plan.partial_max.add((first_slot + c) * rows + r));
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
            if m_star != f32::NEG_INFINITY {
                for c in 0..chunks {
                    let slot_row = (first_slot + c) * rows + r;
                    let l_c = *plan.partial_sum.add(slot_row);
                    if l_c == 0.0 {
                        continue;
                    }
                    let weight = (*plan.partial_max.add(slot_row) - m_star).exp2();
                    l_star += l_c * weight;
                    let o_c = plan.partial_out.add(slot_row * value_dim);
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
