//! attention_backward: FlashAttention-2's backward pass (docs/kernels.md, "Backward"). Twin of
//! `cpp/include/twinattn/flash_backward.hpp` and `cpp/src/flash_backward.cpp`.
//!
//! Shapes (strides in elements, problem.rs):
//!
//! ```text
//! q, dq (B, Hq, Lq, D)    k, dk (B, Hkv, Lk, D)    v, dv (B, Hkv, Lk, Dv)
//! out, dout (B, Hq, Lq, Dv)    lse (B, Hq, Lq)    dsinks (Hq,)
//! ```
//!
//! Query rows are packed as in the forward (flash_kernel.rs): packed row r of (b, kv_head) is
//! position i = r / G of query head h = kv_head * G + r % G, so one pass over a group's packed
//! rows sums dK and dV over its G query heads without copying K or V.
//!
//!   0. K, K^T and V^T of every (b, kv_head) in float32, packed once per call (the keys a
//!      pass reads: below kv_lens[b]), and the query side, Q, Q times the Q multiplier and dO of
//!      every packed row, in float32 once per call; shared read-only by every item of passes 2
//!      and 3.
//!   1. Drow = rowsum(dO * O) - dlse of every query row (float32, into a (B, Hq, Lq) buffer; O
//!      in float32 when the caller passes the forward's out32, dlse when given); dsinks.
//!   2. dK, dV: items (b, kv_head, key block of BACKWARD_KEY_BLOCK keys), each owning its dk and
//!      dv rows. For every query tile (Q_TILE_ROWS packed rows) that sees the block: S
//!      recomputed as the forward scores it (scale, softcap, ALiBi, mask, visibility: the
//!      forward's plan and mask_block), P = 2^(S - lse log2 e), dP = dO V^T, dS = P (dP - Drow)
//!      (softcap: times 1 - tanh^2), dV += P^T dO, dK += scale dS^T Q. Rounded once into dk, dv.
//!   3. dQ: items (b, kv_head, query tile), each owning its dq rows: for every key block the tile
//!      sees, P and dS recomputed as in 2, dQ += scale dS K. Rounded once into dq.
//!
//! Passes 2 and 3 fused (head_gradients, when fused_pass says it pays): items (b, kv_head), each
//! owning the head's dq, dk and dv: pass 2 over the head's key blocks in order, each tile's
//! dQ += scale dS K summed into the head's float32 dQ sums as it goes, so S and dP are computed
//! once.
//!
//! The bfloat16 tile path (amxbf16, bfloat16, D a multiple of 32: [`tile_path`]): always the
//! fused pass, query tiles of BACKWARD_TILE_ROWS rows, the five products on tiles of bfloat16
//! pairs with float32 sums (BackwardTiles, flash_amx.rs): S = Q K^T and dP = dO V^T from the
//! inputs' own bits (then S times the Q multiplier, as the forward's tiles), dQ += dS K, and per
//! group of tiles dV^T += dO^T P and dK^T += Q^T dS, with P and scale dS rounded to bfloat16.
//! Pass 0 packs bfloat16 pairs instead of float32 ([`PackedPairs`], Dv padded to a multiple of
//! 32 with zeros); the per-score float32 work is the same code as above. A tile and key block where a hidden key (P = 0) meets a non-finite Q, dO
//! or K row run the three accumulations in float32 on the kernels' gated accumulate instead
//! ([`exact_accumulations`]), so a value that is never visible is never read.
//!
//! Determinism: every gradient element is summed by the one item that owns it, in a fixed order
//! (query rows ascending for dK and dV, keys ascending for dQ), so the results depend neither on
//! num_threads nor on the schedule. The fused pass sums every element in the same order as passes
//! 2 and 3 (the same bits); it trades their finer items for five products instead of seven.
//! The inner products (S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K) are the
//! instruction set's backward kernels (backward_kernel.rs, through dispatch.rs's table): one fma
//! chain per element in a fixed order, so the results depend on the instruction set as the
//! forward's do, and match C++ bit for bit on the same one. The rest (Drow, dsinks, P and dS per
//! element, the softcap's tanh) is portable code over the scalar vector type (simd_scalar.rs),
//! the same on every instruction set and, operation for operation, in C++.

use std::alloc::{alloc, dealloc, Layout};
use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::backward_kernel::{
    Accumulation, BackwardKernels, PanelProduct, RowGradients, TileProduct, TileRounding,
};
use crate::constants::{
    BACKWARD_CHUNK_TILES, BACKWARD_KEY_BLOCK, BACKWARD_TILE_GROUP, BACKWARD_TILE_ROWS, KEY_BLOCK,
    KEY_PANEL, LOG2_E, Q_TILE_ROWS, SERIAL_WORK,
};
use crate::dispatch::current_kernels;
use crate::element::{bf16_to_f32, BFloat16, Element, Float16, Load};
use crate::flash_attention::{
    flash_plan, flash_row_key_range, problem_work, with_thread_buffers, Shared,
};
use crate::flash_kernel::{mask_block, tanh, FlashPlan, ThreadScratch, WorkItem};
use crate::problem::{
    check_backward, check_num_threads, try_filled, AttentionProblem, BackwardProblem, ElementType,
    MutTensorView4, ProblemError,
};
use crate::simd::Vector;
use crate::simd_scalar::{exp2_lane, VecScalar};
use crate::thread_pool::parallel_for;

type V = VecScalar;
const W: usize = V::WIDTH;

/// Storage whose data starts a 64-byte line, grown on demand and kept for its owner's life (C++'s
/// LineVector), for every buffer of the backward that the kernels read a vector or a tile row at
/// a time: no vector load of a panel straddles two lines, and on the tile path, where the
/// operands and float32 sums are read and written a tile row (64 bytes) at a time, a row that
/// straddles two lines costs a tile load about 3.5 times as much (a Vec's storage is only as
/// aligned as its element). Dereferences to its elements.
struct LineVec<T: Copy + Default> {
    data: NonNull<T>,
    len: usize,
}

impl<T: Copy + Default> Default for LineVec<T> {
    fn default() -> Self {
        LineVec {
            data: NonNull::dangling(),
            len: 0,
        }
    }
}

impl<T: Copy + Default> LineVec<T> {
    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len.checked_mul(std::mem::size_of::<T>())?.max(64), 64).ok()
    }

    fn release(&mut self) {
        if let Some(layout) = Self::layout(self.len).filter(|_| self.len > 0) {
            // SAFETY: data was allocated by Grow::grown with this very layout.
            unsafe { dealloc(self.data.as_ptr().cast::<u8>(), layout) };
        }
        self.data = NonNull::dangling();
        self.len = 0;
    }
}

impl<T: Copy + Default> Drop for LineVec<T> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<T: Copy + Default> std::ops::Deref for LineVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: data holds len initialised elements (dangling and aligned for T when len is 0).
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
}

impl<T: Copy + Default> std::ops::DerefMut for LineVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as deref; &mut self is the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }
}

/// A buffer grown to at least count elements (T::default() when it grows), its data.
trait Grow<T> {
    fn grown(&mut self, count: usize) -> Result<*mut T, ProblemError>;
}

impl<T: Copy + Default> Grow<T> for Vec<T> {
    fn grown(&mut self, count: usize) -> Result<*mut T, ProblemError> {
        if self.len() < count {
            *self = try_filled(count, T::default())?;
        }
        Ok(self.as_mut_ptr())
    }
}

impl<T: Copy + Default> Grow<T> for LineVec<T> {
    fn grown(&mut self, count: usize) -> Result<*mut T, ProblemError> {
        if self.len < count {
            let layout = Self::layout(count).ok_or_else(ProblemError::out_of_memory)?;
            // SAFETY: the layout has a non-zero size.
            let data = NonNull::new(unsafe { alloc(layout) }.cast::<T>())
                .ok_or_else(ProblemError::out_of_memory)?;
            for i in 0..count {
                // SAFETY: the allocation holds count elements of T, 64-byte aligned.
                unsafe { data.as_ptr().add(i).write(T::default()) };
            }
            self.release();
            self.data = data;
            self.len = count;
        }
        Ok(self.data.as_ptr())
    }
}

/// Pass 0's packed keys of one call, for (b, kv_head) head = b * Hkv + kv_head and its key block
/// kb (BACKWARD_KEY_BLOCK keys from kb * BACKWARD_KEY_BLOCK), block = head * key_blocks + kb:
///
/// ```text
/// keys         (BACKWARD_KEY_BLOCK, D) at block * BACKWARD_KEY_BLOCK * D     K rows (dQ += dS K)
/// key_panels   (D, BACKWARD_KEY_BLOCK) at block * D * BACKWARD_KEY_BLOCK     K^T (S = Q K^T)
/// value_panels (Dv, BACKWARD_KEY_BLOCK) at block * Dv * BACKWARD_KEY_BLOCK   V^T (dP = dO V^T)
/// ```
///
/// Keys at or past kv_lens[b] are 0 (never read from k or v). The fused float32 pass packs one
/// head at a time into its thread's scratch: there head counts from first_head (0 for the call's).
#[derive(Clone, Copy)]
struct PackedKeys {
    keys: *mut f32,
    key_panels: *mut f32,
    value_panels: *mut f32,
    /// per head: Lk / BACKWARD_KEY_BLOCK rounded up
    key_blocks: usize,
    first_head: usize,
}

/// Pass 0's packed query side of one call, for (b, kv_head) head = b * Hkv + kv_head and its
/// packed row r, row = head * rows_per_group + r:
///
/// ```text
/// query_rows   (rows, D) at row * D     Q (dK += dS^T Q)
/// query_scaled (rows, D) at row * D     Q times the Q multiplier (S = Q K^T)
/// dout_rows    (rows, Dv) at row * Dv   dO (dP = dO V^T, dV += P^T dO)
/// ```
///
/// The fused float32 pass packs a chunk of a head's rows at a time into its thread's scratch:
/// there row counts from first_row (0 for the call's).
#[derive(Clone, Copy)]
struct PackedQueries {
    query_rows: *mut f32,
    query_scaled: *mut f32,
    dout_rows: *mut f32,
    first_row: usize,
}

/// Pass 0's bfloat16 pairs on the tile path, as 16-bit elements (a pair: two consecutive ones),
/// packed by each head's item into its thread's scratch ([`head_tiles`]): the head's keys as the
/// item starts, the rows of each chunk (BACKWARD_TILE_GROUP query tiles from packed row
/// first_row) as the chunk starts. Per key block kb of the head:
///
/// ```text
/// key_panels   at kb * BACKWARD_KEY_BLOCK * D: BACKWARD_KEY_BLOCK / KEY_PANEL panels of
///              (D / 2, KEY_PANEL) pairs (d, key)       S = Q K^T, B
/// value_panels at kb * BACKWARD_KEY_BLOCK * Dv: the same of V   dP = dO V^T, B
/// key_rows     at kb * BACKWARD_KEY_BLOCK * D: (BACKWARD_KEY_BLOCK / 2, D) pairs (key, d)
///                                                      dQ += dS K, B
/// key_finite   at kb * BACKWARD_KEY_BLOCK: 1 where the key's K row is finite
/// ```
///
/// Per packed row r of the chunk, row = r - first_row (up to the chunk's end rounded up to 32;
/// the pad rows, past rows_per_group, are 0):
///
/// ```text
/// query_pairs at row * D, dout_pairs at row * Dv: the rows themselves (pairs (d))   S, dP: A
/// row_finite at row: 1 where the row's Q and dO are finite
/// ```
///
/// The chunk's rows transposed, PAIR_CHUNK_ROWS columns (0 past rows_per_group), each of
/// PAIR_ROW_STRIDE elements (that plus 32: no two rows 4096 bytes apart, where the L1 cache would
/// put a tile load's rows in one set):
///
/// ```text
/// query_t: Q^T, (D, PAIR_ROW_STRIDE), so pairs (d, rows 2 i and 2 i + 1)   dK^T += Q^T dS: A
/// dout_t: dO^T, (Dv, PAIR_ROW_STRIDE), the same        dV^T += dO^T P: A
/// ```
///
/// Keys at or past kv_lens[b] are 0 (never read from k or v), finite. Every width Dv above is
/// value_width (Dv rounded up to 32; the columns past Dv are 0).
#[derive(Clone, Copy)]
struct PackedPairs {
    key_panels: *mut u16,
    value_panels: *mut u16,
    key_rows: *mut u16,
    key_finite: *mut u8,
    query_pairs: *mut u16,
    dout_pairs: *mut u16,
    row_finite: *mut u8,
    query_t: *mut u16,
    dout_t: *mut u16,
    /// Dv rounded up to 32: the V and dO pairs' width (0 past Dv)
    value_width: usize,
    /// the chunk's first packed row
    first_row: usize,
}

/// Packed query rows per chunk of the tile path, and the row stride of its transposes.
const PAIR_CHUNK_ROWS: usize = BACKWARD_TILE_GROUP * BACKWARD_TILE_ROWS;
const PAIR_ROW_STRIDE: usize = PAIR_CHUNK_ROWS + 32;

/// No packed keys (the tile path, and the fused float32 pass, whose items pack their own), of
/// key_blocks blocks per head.
fn no_keys(key_blocks: usize) -> PackedKeys {
    let null = std::ptr::null_mut();
    PackedKeys {
        keys: null,
        key_panels: null,
        value_panels: null,
        key_blocks,
        first_head: 0,
    }
}

/// No packed query side (the tile path, and the fused float32 pass).
fn no_queries() -> PackedQueries {
    let null = std::ptr::null_mut();
    PackedQueries {
        query_rows: null,
        query_scaled: null,
        dout_rows: null,
        first_row: 0,
    }
}

/// No pairs (the float32 path; on the tile path each head's item packs its own, of value_width).
fn no_pairs(value_width: usize) -> PackedPairs {
    let null = std::ptr::null_mut();
    PackedPairs {
        key_panels: null,
        value_panels: null,
        key_rows: null,
        key_finite: std::ptr::null_mut(),
        query_pairs: null,
        dout_pairs: null,
        row_finite: std::ptr::null_mut(),
        query_t: null,
        dout_t: null,
        value_width,
        first_row: 0,
    }
}

/// What the items of one call share.
#[derive(Clone, Copy)]
struct BackwardPlan<'p, 'a> {
    problem: &'p BackwardProblem<'a>,
    /// the forward's plan: group, shapes, Q multiplier, variants' flags
    flash: FlashPlan<'p, 'a>,
    /// Drow of every query row, (B, Hq, Lq) contiguous
    row_delta: *const f32,
    /// the inner products, of the instruction set in use (backward_kernel.rs)
    kernels: BackwardKernels,
    /// pass 0's keys
    packed: PackedKeys,
    /// pass 0's query side
    queries: PackedQueries,
    /// passes 2 and 3 run as one, per head ([`fused_pass`])
    fused: bool,
    /// the bfloat16 tile path ([`tile_path`]); then pairs, not packed and queries
    tiled: bool,
    /// pass 0's pairs (the tile path)
    pairs: PackedPairs,
}

// SAFETY: the plan is read-only while the items run; they write disjoint gradient rows (and
// pass 0 disjoint heads of the packed keys). (Raw pointers are neither Send nor Sync in Rust;
// C++ has no such rule.)
unsafe impl Sync for BackwardPlan<'_, '_> {}

/// One key block of the packed keys: its K rows, K^T and V^T.
struct KeyBlock {
    keys: *mut f32,
    key_panel: *mut f32,
    value_panel: *mut f32,
}

/// Key block key_block (a multiple of BACKWARD_KEY_BLOCK) of (b, kv_head) in the packed keys.
///
/// # Safety
/// (b, kv_head, key_block) is a key block of the plan's packed keys.
#[inline(always)]
unsafe fn key_block_at(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    key_block: usize,
) -> KeyBlock {
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let kv_heads = plan.problem.forward.k.shape[1] as usize;
    let block = (b * kv_heads + kv_head - plan.packed.first_head) * plan.packed.key_blocks
        + key_block / BACKWARD_KEY_BLOCK;
    // SAFETY: forwarded; the packed keys hold every block of every head.
    unsafe {
        KeyBlock {
            keys: plan.packed.keys.add(block * BACKWARD_KEY_BLOCK * head_dim),
            key_panel: plan
                .packed
                .key_panels
                .add(block * head_dim * BACKWARD_KEY_BLOCK),
            value_panel: plan
                .packed
                .value_panels
                .add(block * value_dim * BACKWARD_KEY_BLOCK),
        }
    }
}

/// The tile's rows in the packed query side: Q, Q times the multiplier, dO (rows of D, D, Dv).
struct QueryRows {
    rows: *mut f32,
    scaled: *mut f32,
    dout: *mut f32,
}

/// The rows of `tile` in the plan's packed query side.
///
/// # Safety
/// The tile's rows are packed rows of the plan.
#[inline(always)]
unsafe fn query_rows_at(plan: &BackwardPlan, tile: &WorkItem) -> QueryRows {
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let kv_heads = plan.problem.forward.k.shape[1] as usize;
    let row = (tile.b * kv_heads + tile.kv_head) * plan.flash.rows_per_group + tile.row_begin
        - plan.queries.first_row;
    // SAFETY: forwarded; the packed query side holds every packed row of every head.
    unsafe {
        QueryRows {
            rows: plan.queries.query_rows.add(row * head_dim),
            scaled: plan.queries.query_scaled.add(row * head_dim),
            dout: plan.queries.dout_rows.add(row * value_dim),
        }
    }
}

/// The calling thread's packed keys and query side (thread-local: concurrent callers never share
/// them), reused across calls so that a call does not fault their pages in again.
#[derive(Default)]
struct CallerBuffers {
    keys: LineVec<f32>,
    key_panels: LineVec<f32>,
    value_panels: LineVec<f32>,
    query_rows: LineVec<f32>,
    query_scaled: LineVec<f32>,
    dout_rows: LineVec<f32>,
}

/// buffer grown to at least count elements, its data.
fn grown<T>(buffer: &mut impl Grow<T>, count: usize) -> Result<*mut T, ProblemError> {
    buffer.grown(count)
}

thread_local! {
    static CALLER_BUFFERS: RefCell<CallerBuffers> = RefCell::new(CallerBuffers::default());
}

/// One thread's tiles (grown on demand, kept for the thread's life):
///
/// ```text
/// row_buffer (2 Dv)                  one row of out and of dO (pass 1)
/// row_delta, row_lse (Q_TILE_ROWS)   Drow and lse * log2(e) of the tile's rows
/// row_key_begin, row_key_end         each row's visible key range
/// scores, capped, grads (Q_TILE_ROWS, KEY_BLOCK): S then P; tanh of the softcap; scale * dS
/// key_grad, value_grad (BACKWARD_KEY_BLOCK, D / Dv) per key block (one, or in the fused pass
/// each of the head's), query_grad (query_grad_rows, D): float32 sums (ScratchShape)
/// ```
///
/// and in the fused float32 pass (packs), pass 0's copies of one head's keys and one chunk's rows
/// ([`PackedKeys`], [`PackedQueries`], from first_head and first_row):
///
/// ```text
/// head_keys, head_key_panels, head_value_panels   the head's K rows, K^T, V^T
/// chunk_rows, chunk_scaled, chunk_dout            the chunk's Q, Q times the multiplier, dO
/// ```
///
/// and on the tile path (tiles of BACKWARD_TILE_ROWS rows, so the rows above are that many;
/// key_grad and value_grad hold dK^T and dV^T, (D / Dv, BACKWARD_KEY_BLOCK)), pass 0's pairs of
/// one head's keys and one chunk's rows ([`PackedPairs`]):
///
/// ```text
/// pair_key_panels, pair_value_panels, pair_key_rows, key_finite     the head's keys
/// pair_query_pairs, pair_dout_pairs, row_finite, pair_query_t, pair_dout_t   the chunk's rows
/// ```
///
/// and
///
/// ```text
/// probs_pairs, grads_pairs (BACKWARD_TILE_GROUP BACKWARD_TILE_ROWS / 2, BACKWARD_KEY_BLOCK)
/// pairs of rows: P and scale dS of a group of tiles rounded to bfloat16 (B of dV^T and dK^T);
/// grads_rows (BACKWARD_TILE_ROWS, BACKWARD_KEY_BLOCK) bfloat16: scale dS of a tile (A of dQ);
/// key_sums (BACKWARD_KEY_BLOCK, max(D, Dv)): dK or dV sums key by key (stores,
/// exact_accumulations);
/// exact_queries, exact_dout (BACKWARD_TILE_ROWS, D / Dv), exact_keys (BACKWARD_KEY_BLOCK, D):
/// float32 operands of exact_accumulations
/// ```
#[derive(Default)]
struct BackwardScratch {
    row_buffer: LineVec<f32>,
    row_delta: LineVec<f32>,
    row_lse: LineVec<f32>,
    scores: LineVec<f32>,
    capped: LineVec<f32>,
    grads: LineVec<f32>,
    key_grad: LineVec<f32>,
    value_grad: LineVec<f32>,
    query_grad: LineVec<f32>,
    row_key_begin: Vec<usize>,
    row_key_end: Vec<usize>,
    probs_pairs: LineVec<u32>,
    grads_pairs: LineVec<u32>,
    grads_rows: LineVec<u16>,
    key_sums: LineVec<f32>,
    exact_queries: LineVec<f32>,
    exact_dout: LineVec<f32>,
    exact_keys: LineVec<f32>,
    head_keys: LineVec<f32>,
    head_key_panels: LineVec<f32>,
    head_value_panels: LineVec<f32>,
    chunk_rows: LineVec<f32>,
    chunk_scaled: LineVec<f32>,
    chunk_dout: LineVec<f32>,
    pair_key_panels: LineVec<u16>,
    pair_value_panels: LineVec<u16>,
    pair_key_rows: LineVec<u16>,
    key_finite: Vec<u8>,
    pair_query_pairs: LineVec<u16>,
    pair_dout_pairs: LineVec<u16>,
    row_finite: Vec<u8>,
    pair_query_t: LineVec<u16>,
    pair_dout_t: LineVec<u16>,
}

/// What one thread's scratch is sized for: D, Dv, the rows of dQ sums (a tile's Q_TILE_ROWS; in
/// the fused pass a chunk's BACKWARD_CHUNK_TILES Q_TILE_ROWS, or on the tile path
/// PAIR_CHUNK_ROWS), and whether the tile path runs (its rows per tile are BACKWARD_TILE_ROWS;
/// Dv is then the pairs' value_width).
#[derive(Clone, Copy)]
struct ScratchShape {
    head_dim: usize,
    value_dim: usize,
    query_grad_rows: usize,
    tiled: bool,
    /// the fused pass: a head's key blocks (key_grad, value_grad hold each's sums)
    key_blocks: usize,
    /// the fused pass: the thread packs its head's keys and a chunk's rows
    packs: bool,
}

impl BackwardScratch {
    fn ensure(&mut self, shape: ScratchShape) -> Result<(), ProblemError> {
        let ScratchShape {
            head_dim,
            value_dim,
            query_grad_rows,
            tiled,
            key_blocks,
            packs,
        } = shape;
        let tile_rows = if tiled {
            BACKWARD_TILE_ROWS
        } else {
            Q_TILE_ROWS
        };
        fn grow<T>(buffer: &mut impl Grow<T>, count: usize) -> Result<(), ProblemError> {
            buffer.grown(count).map(|_| ())
        }
        grow(&mut self.row_buffer, 2 * value_dim)?;
        grow(&mut self.row_delta, tile_rows)?;
        grow(&mut self.row_lse, tile_rows)?;
        grow(&mut self.scores, tile_rows * KEY_BLOCK)?;
        grow(&mut self.capped, tile_rows * KEY_BLOCK)?;
        grow(&mut self.grads, tile_rows * KEY_BLOCK)?;
        grow(
            &mut self.key_grad,
            key_blocks * BACKWARD_KEY_BLOCK * head_dim,
        )?;
        grow(
            &mut self.value_grad,
            key_blocks * BACKWARD_KEY_BLOCK * value_dim,
        )?;
        grow(&mut self.query_grad, query_grad_rows * head_dim)?;
        grow(&mut self.row_key_begin, tile_rows)?;
        grow(&mut self.row_key_end, tile_rows)?;
        if packs && !tiled {
            let keys = key_blocks * BACKWARD_KEY_BLOCK;
            grow(&mut self.head_keys, keys * head_dim)?;
            grow(&mut self.head_key_panels, keys * head_dim)?;
            grow(&mut self.head_value_panels, keys * value_dim)?;
            grow(&mut self.chunk_rows, query_grad_rows * head_dim)?;
            grow(&mut self.chunk_scaled, query_grad_rows * head_dim)?;
            grow(&mut self.chunk_dout, query_grad_rows * value_dim)?;
        }
        if !tiled {
            return Ok(());
        }
        let group_pairs = BACKWARD_TILE_GROUP * BACKWARD_TILE_ROWS / 2;
        grow(&mut self.probs_pairs, group_pairs * BACKWARD_KEY_BLOCK)?;
        grow(&mut self.grads_pairs, group_pairs * BACKWARD_KEY_BLOCK)?;
        grow(
            &mut self.grads_rows,
            BACKWARD_TILE_ROWS * BACKWARD_KEY_BLOCK,
        )?;
        grow(
            &mut self.key_sums,
            BACKWARD_KEY_BLOCK * head_dim.max(value_dim),
        )?;
        grow(&mut self.exact_queries, BACKWARD_TILE_ROWS * head_dim)?;
        grow(&mut self.exact_dout, BACKWARD_TILE_ROWS * value_dim)?;
        grow(&mut self.exact_keys, BACKWARD_KEY_BLOCK * head_dim)?;
        if !packs {
            return Ok(());
        }
        let keys = key_blocks * BACKWARD_KEY_BLOCK;
        grow(&mut self.pair_key_panels, keys * head_dim)?;
        grow(&mut self.pair_value_panels, keys * value_dim)?;
        grow(&mut self.pair_key_rows, keys * head_dim)?;
        grow(&mut self.key_finite, keys)?;
        grow(&mut self.pair_query_pairs, PAIR_CHUNK_ROWS * head_dim)?;
        grow(&mut self.pair_dout_pairs, PAIR_CHUNK_ROWS * value_dim)?;
        grow(&mut self.row_finite, PAIR_CHUNK_ROWS)?;
        grow(&mut self.pair_query_t, head_dim * PAIR_ROW_STRIDE)?;
        grow(&mut self.pair_dout_t, value_dim * PAIR_ROW_STRIDE)
    }

    /// Pass 0's pairs in this scratch (the tile path), of value_width, for the chunk from
    /// first_row.
    fn pairs(&mut self, value_width: usize, first_row: usize) -> PackedPairs {
        PackedPairs {
            key_panels: self.pair_key_panels.as_mut_ptr(),
            value_panels: self.pair_value_panels.as_mut_ptr(),
            key_rows: self.pair_key_rows.as_mut_ptr(),
            key_finite: self.key_finite.as_mut_ptr(),
            query_pairs: self.pair_query_pairs.as_mut_ptr(),
            dout_pairs: self.pair_dout_pairs.as_mut_ptr(),
            row_finite: self.row_finite.as_mut_ptr(),
            query_t: self.pair_query_t.as_mut_ptr(),
            dout_t: self.pair_dout_t.as_mut_ptr(),
            value_width,
            first_row,
        }
    }
}

thread_local! {
    static BACKWARD_SCRATCH: RefCell<BackwardScratch> = RefCell::new(BackwardScratch::default());
}

/// parallel_for over `items` (thread_pool.rs), each run as f(index, scratch) with the calling
/// thread's scratch, sized for `shape`; the out-of-memory error when a scratch cannot grow.
fn for_each_item(
    items: usize,
    threads: usize,
    shape: ScratchShape,
    f: impl Fn(usize, &mut BackwardScratch) + Sync,
) -> Result<(), ProblemError> {
    // C++ rethrows a worker's std::bad_alloc on the caller; here the failed item sets this flag.
    let out_of_memory = AtomicBool::new(false);
    parallel_for(items, threads, &|index, _| {
        let done = with_thread_buffers(&BACKWARD_SCRATCH, |s: &mut BackwardScratch| {
            s.ensure(shape)?;
            f(index, s);
            Ok::<(), ProblemError>(())
        });
        if done.is_err() {
            out_of_memory.store(true, Ordering::Relaxed);
        }
    });
    match out_of_memory.load(Ordering::Relaxed) {
        true => Err(ProblemError::out_of_memory()),
        false => Ok(()),
    }
}

/// sum_d a[d] b[d] over n floats: SCALAR_WIDTH partial sums (lane d % width, V::fma), folded as
/// V::reduce_sum folds them.
#[inline(always)]
fn dot(a: &[f32], b: &[f32], n: usize) -> f32 {
    let (a, b) = (&a[..n], &b[..n]);
    // SAFETY: the scalar type needs no instruction set; every load lies inside a and b.
    unsafe {
        let mut acc = V::zero();
        let mut d = 0;
        while d + W <= n {
            acc = V::fma(V::load(a.as_ptr().add(d)), V::load(b.as_ptr().add(d)), acc);
            d += W;
        }
        if d < n {
            acc = V::fma(
                V::load_tail(a.as_ptr().add(d), n - d),
                V::load_tail(b.as_ptr().add(d), n - d),
                acc,
            );
        }
        V::reduce_sum(acc)
    }
}

/// Row i of head h of sequence b of a (B, H, L, n) view with data `data` and strides `stride`,
/// as T.
///
/// # Safety
/// The index is inside the view.
#[inline(always)]
unsafe fn view_row<T>(data: *const u8, stride: &[i64; 4], b: usize, h: usize, i: usize) -> *mut T {
    let offset = b as i64 * stride[0] + h as i64 * stride[1] + i as i64 * stride[2];
    // SAFETY: forwarded.
    unsafe { data.cast::<T>().cast_mut().offset(offset as isize) }
}

/// Rounds n float32 sums from src into row i of head h of sequence b of a gradient.
///
/// # Safety
/// The row is inside the (checked) gradient view, whose rows hold n elements.
#[inline(always)]
unsafe fn store_row<T: Element>(
    gradient: &MutTensorView4,
    b: usize,
    h: usize,
    i: usize,
    src: &[f32],
    n: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        let dst = view_row::<T>(gradient.data.cast_const(), &gradient.stride, b, h, i);
        for (d, &value) in src[..n].iter().enumerate() {
            *dst.add(d) = T::from_f32(value);
        }
    }
}

/// lse[b, h, i] of the problem.
///
/// # Safety
/// The index is inside the (checked) lse view.
#[inline(always)]
unsafe fn lse_at(bp: &BackwardProblem, b: usize, h: usize, i: usize) -> f32 {
    let lse = &bp.forward.lse;
    let offset = b as i64 * lse.stride[0] + h as i64 * lse.stride[1] + i as i64 * lse.stride[2];
    // SAFETY: forwarded.
    unsafe { *lse.data.offset(offset as isize) }
}

/// Pass 1: Drow of the Lq rows of (b, h) into delta, from out of storage type O (T, or float32
/// when bp.out_float32), minus dlse when given; row_buffer holds 2 Dv floats.
///
/// # Safety
/// The problem is checked and its memory valid (attention_backward's contract).
unsafe fn row_deltas<T: Element, O: Load>(
    bp: &BackwardProblem,
    b: usize,
    h: usize,
    delta: &mut [f32],
    row_buffer: &mut [f32],
) {
    let p = &bp.forward;
    let dlse = &bp.dlse;
    let value_dim = p.v.shape[3] as usize;
    let (out_row, dout_row) = row_buffer[..2 * value_dim].split_at_mut(value_dim);
    for (i, delta_i) in delta.iter_mut().enumerate() {
        // SAFETY: (b, h, i) is inside out and dout, whose rows hold Dv elements.
        unsafe {
            let out = view_row::<O>(p.out.data.cast_const(), &p.out.stride, b, h, i);
            let dout = view_row::<T>(bp.dout.data, &bp.dout.stride, b, h, i);
            for c in 0..value_dim {
                out_row[c] = (*out.add(c)).to_f32();
                dout_row[c] = (*dout.add(c)).to_f32();
            }
        }
        *delta_i = dot(dout_row, out_row, value_dim);
        if !dlse.data.is_null() {
            let at =
                b as i64 * dlse.stride[0] + h as i64 * dlse.stride[1] + i as i64 * dlse.stride[2];
            // SAFETY: (b, h, i) is inside dlse (checked shape).
            *delta_i -= unsafe { *dlse.data.offset(at as isize) };
        }
    }
}

/// Pass 1: dsinks[h] = -sum over b, i (in that order) of 2^(sink log2 e - lse log2 e) Drow.
///
/// # Safety
/// As [`row_deltas`]; dsinks and sinks are given.
unsafe fn sink_gradients(bp: &BackwardProblem, delta: &[f32]) {
    let p = &bp.forward;
    let [batch, q_heads, q_len, _] = p.q.shape.map(|n| n as usize);
    // SAFETY: h < Hq indexes sinks and dsinks, (b, h, i) lse (checked shapes).
    unsafe {
        for h in 0..q_heads {
            let sink = *p.sinks.data.offset(h as isize * p.sinks.stride[0] as isize) * LOG2_E;
            let mut sum = 0.0f32;
            for b in 0..batch {
                for i in 0..q_len {
                    let lse = lse_at(bp, b, h, i);
                    sum += exp2_lane(sink - lse * LOG2_E) * delta[(b * q_heads + h) * q_len + i];
                }
            }
            *bp.dsinks
                .data
                .offset(h as isize * bp.dsinks.stride[0] as isize) = 0.0 - sum;
        }
    }
}

/// The tile's rows (packed rows tile.row_begin + r, r < rows): Drow, lse * log2(e) and the
/// visible key range (Q and dO are pass 0's packed query side).
///
/// # Safety
/// As [`row_deltas`]; the tile's rows are packed rows of the plan.
unsafe fn load_tile(plan: &BackwardPlan, tile: &WorkItem, rows: usize, s: &mut BackwardScratch) {
    let bp = plan.problem;
    let p = &bp.forward;
    let group = plan.flash.group;
    let (q_heads, q_len, b) = (p.q.shape[1] as usize, p.q.shape[2] as usize, tile.b);
    for r in 0..rows {
        let packed = tile.row_begin + r;
        let (h, i) = (tile.kv_head * group + packed % group, packed / group);
        // SAFETY: (b, h, i) is a query row (h < Hq, i < Lq); row_delta holds B * Hq * Lq floats.
        unsafe {
            s.row_delta[r] = *plan.row_delta.add((b * q_heads + h) * q_len + i);
            s.row_lse[r] = lse_at(bp, b, h, i) * LOG2_E;
        }
        let (key_begin, key_end) = flash_row_key_range(p, b, group, packed);
        s.row_key_begin[r] = key_begin;
        s.row_key_end[r] = key_end;
    }
}

/// Pass 0: the keys of (b, kv_head) into the packed keys ([`PackedKeys`]): keys below
/// kv_lens[b] converted to float32, the rest of the head's blocks 0.
///
/// # Safety
/// As [`row_deltas`]; no other thread touches this head's packed keys meanwhile.
unsafe fn pack_keys<T: Element>(plan: &BackwardPlan, b: usize, kv_head: usize) {
    let p = &plan.problem.forward;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    const KB: usize = BACKWARD_KEY_BLOCK;
    for key_block in (0..plan.packed.key_blocks * KB).step_by(KB) {
        // SAFETY: forwarded; the block's parts hold KB * D, D * KB and Dv * KB floats, and the
        // keys below kv_lens[b] <= Lk are inside k and v, whose rows hold D and Dv elements.
        unsafe {
            let block = key_block_at(plan, b, kv_head, key_block);
            let keys = std::slice::from_raw_parts_mut(block.keys, KB * head_dim);
            let key_panel = std::slice::from_raw_parts_mut(block.key_panel, head_dim * KB);
            let value_panel = std::slice::from_raw_parts_mut(block.value_panel, value_dim * KB);
            let n = (p.kv_lens[b] as usize).saturating_sub(key_block).min(KB);
            for j in 0..n {
                let k = view_row::<T>(p.k.data, &p.k.stride, b, kv_head, key_block + j);
                for d in 0..head_dim {
                    let x = (*k.add(d)).to_f32();
                    keys[j * head_dim + d] = x;
                    key_panel[d * KB + j] = x;
                }
                let v = view_row::<T>(p.v.data, &p.v.stride, b, kv_head, key_block + j);
                for c in 0..value_dim {
                    value_panel[c * KB + j] = (*v.add(c)).to_f32();
                }
            }
            keys[n * head_dim..].fill(0.0);
            for d in 0..head_dim {
                key_panel[d * KB + n..(d + 1) * KB].fill(0.0);
            }
            for c in 0..value_dim {
                value_panel[c * KB + n..(c + 1) * KB].fill(0.0);
            }
        }
    }
}

/// The work item of packed rows [row_begin, row_end) of (b, kv_head).
fn rows_item(b: usize, kv_head: usize, row_begin: usize, row_end: usize) -> WorkItem {
    WorkItem {
        b,
        kv_head,
        row_begin,
        row_end,
        key_begin: 0,
        key_end: 0,
        partial_slot: None,
    }
}

/// Pass 0: the query side of packed rows [row_begin, row_end) of (b, kv_head) into the packed
/// query side ([`PackedQueries`]): Q, Q times the Q multiplier and dO of each, converted to
/// float32.
///
/// # Safety
/// As [`row_deltas`]; no other thread touches these rows of the packed query side meanwhile.
unsafe fn pack_queries<T: Element>(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    row_begin: usize,
    row_end: usize,
) {
    let bp = plan.problem;
    let p = &bp.forward;
    let (group, head_dim, value_dim) =
        (plan.flash.group, plan.flash.head_dim, plan.flash.value_dim);
    let count = row_end - row_begin;
    let first = rows_item(b, kv_head, row_begin, row_end);
    // SAFETY: forwarded; the rows' count packed rows of D, D and Dv floats, and every (b, h, i)
    // below is a query row, whose q and dout rows hold D and Dv elements.
    unsafe {
        let rows = query_rows_at(plan, &first);
        let query_rows = std::slice::from_raw_parts_mut(rows.rows, count * head_dim);
        let query_scaled = std::slice::from_raw_parts_mut(rows.scaled, count * head_dim);
        let dout_rows = std::slice::from_raw_parts_mut(rows.dout, count * value_dim);
        for packed in row_begin..row_end {
            let (h, i, r) = (
                kv_head * group + packed % group,
                packed / group,
                packed - row_begin,
            );
            let q = view_row::<T>(p.q.data, &p.q.stride, b, h, i);
            for d in 0..head_dim {
                let x = (*q.add(d)).to_f32();
                query_rows[r * head_dim + d] = x;
                query_scaled[r * head_dim + d] = x * plan.flash.q_multiplier;
            }
            let dout = view_row::<T>(bp.dout.data, &bp.dout.stride, b, h, i);
            for c in 0..value_dim {
                dout_rows[r * value_dim + c] = (*dout.add(c)).to_f32();
            }
        }
    }
}

// ---- The bfloat16 tile path (amxbf16) -------------------------------------------------------

/// Whether the call takes the tile path: the instruction set has the backward's tile products
/// (amxbf16), the dtype is bfloat16, and D fills whole tiles (a multiple of 32; Dv is padded to
/// one with zeros: the Python layer's backward adds a column to V).
fn tile_path(kernels: &BackwardKernels, p: &AttentionProblem) -> bool {
    let (head_dim, value_dim) = (p.q.shape[3], p.v.shape[3]);
    kernels.tiles.is_some()
        && p.dtype == ElementType::BFloat16
        && head_dim > 0
        && head_dim % 32 == 0
        && value_dim > 0
}

/// A bfloat16's bits are finite unless its exponent is all ones.
#[inline(always)]
fn finite_bits(bits: u16) -> bool {
    bits & 0x7f80 != 0x7f80
}

/// Row i of head h of sequence b of a bfloat16 (B, H, L, n) view with data `data` and strides
/// `stride`, as its bits.
///
/// # Safety
/// The index is inside the view.
#[inline(always)]
unsafe fn bf16_row(data: *const u8, stride: &[i64; 4], b: usize, h: usize, i: usize) -> *const u16 {
    // SAFETY: forwarded.
    unsafe { view_row::<u16>(data, stride, b, h, i).cast_const() }
}

/// Pass 0 (tile path): the keys of (b, kv_head) into the pairs ([`PackedPairs`]).
///
/// # Safety
/// As [`row_deltas`], on the tile path (bfloat16 k and v); no other thread touches this head's
/// pairs meanwhile.
unsafe fn pack_key_pairs(plan: &BackwardPlan, b: usize, kv_head: usize) {
    let p = &plan.problem.forward;
    let pairs = &plan.pairs;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let value_width = pairs.value_width;
    const KB: usize = BACKWARD_KEY_BLOCK;
    for kb in 0..plan.packed.key_blocks {
        let block = kb;
        let key_block = kb * KB;
        let n = (p.kv_lens[b] as usize).saturating_sub(key_block).min(KB);
        // SAFETY: forwarded; the block's parts hold KB * D, KB * value_width, KB * D and KB
        // elements, and the keys below kv_lens[b] <= Lk are inside k and v, whose rows hold D and
        // Dv elements.
        unsafe {
            let key_panels = std::slice::from_raw_parts_mut(
                pairs.key_panels.add(block * KB * head_dim),
                KB * head_dim,
            );
            let value_panels = std::slice::from_raw_parts_mut(
                pairs.value_panels.add(block * KB * value_width),
                KB * value_width,
            );
            let key_rows = std::slice::from_raw_parts_mut(
                pairs.key_rows.add(block * KB * head_dim),
                KB * head_dim,
            );
            let key_finite = std::slice::from_raw_parts_mut(pairs.key_finite.add(block * KB), KB);
            for j in 0..KB {
                let (k, v) = match j < n {
                    true => (
                        bf16_row(p.k.data, &p.k.stride, b, kv_head, key_block + j),
                        bf16_row(p.v.data, &p.v.stride, b, kv_head, key_block + j),
                    ),
                    false => (std::ptr::null(), std::ptr::null()),
                };
                // pair (d / 2, j) of panel j / KEY_PANEL, element d % 2; pair (j / 2, d), element j % 2
                let (panel, column) = (j / KEY_PANEL, j % KEY_PANEL);
                let mut finite = true;
                for d in 0..head_dim {
                    let bits = if k.is_null() { 0 } else { *k.add(d) };
                    finite = finite && finite_bits(bits);
                    key_panels[((panel * head_dim / 2 + d / 2) * KEY_PANEL + column) * 2 + d % 2] =
                        bits;
                    key_rows[(j / 2 * head_dim + d) * 2 + j % 2] = bits;
                }
                for c in 0..value_width {
                    value_panels
                        [((panel * value_width / 2 + c / 2) * KEY_PANEL + column) * 2 + c % 2] =
                        if v.is_null() || c >= value_dim {
                            0
                        } else {
                            *v.add(c)
                        };
                }
                key_finite[j] = u8::from(finite);
            }
        }
    }
}

/// n bfloat16 bits from src (0 when src is null) to dst; returns how many are not finite
/// (counted, not tested: the loops vectorise).
///
/// # Safety
/// src (when not null) holds n elements, dst n writable ones.
unsafe fn copy_row(src: *const u16, n: usize, dst: *mut u16) -> usize {
    // SAFETY: forwarded.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst, n) };
    if src.is_null() {
        dst.fill(0);
        return 0;
    }
    // SAFETY: forwarded.
    let src = unsafe { std::slice::from_raw_parts(src, n) };
    let non_finite = src
        .iter()
        .map(|&bits| usize::from(!finite_bits(bits)))
        .sum();
    dst.copy_from_slice(src);
    non_finite
}

/// Pass 0 (tile path): the query side of (b, kv_head) into the pairs ([`PackedPairs`]), the
/// chunk of packed rows from pairs.first_row to chunk_end: row by row, then transposed a tile of
/// rows at a time (their rows stay in L1 while every column is written).
///
/// # Safety
/// As [`pack_key_pairs`] (bfloat16 q and dout); the pairs hold a chunk's rows.
unsafe fn pack_query_pairs(plan: &BackwardPlan, b: usize, kv_head: usize, chunk_end: usize) {
    let bp = plan.problem;
    let p = &bp.forward;
    let pairs = &plan.pairs;
    let (group, head_dim, value_dim) =
        (plan.flash.group, plan.flash.head_dim, plan.flash.value_dim);
    let rows_per_group = plan.flash.rows_per_group;
    let head_rows = rows_per_group.div_ceil(32) * 32;
    let mut q_rows = [std::ptr::null::<u16>(); BACKWARD_TILE_ROWS];
    let mut dout_rows = [std::ptr::null::<u16>(); BACKWARD_TILE_ROWS];
    let zeros = vec![0u16; head_dim.max(value_dim)];
    for tile_begin in (pairs.first_row..chunk_end).step_by(BACKWARD_TILE_ROWS) {
        for local in 0..BACKWARD_TILE_ROWS {
            let packed = tile_begin + local;
            let row = packed - pairs.first_row;
            let (h, i) = (kv_head * group + packed % group, packed / group);
            // SAFETY: forwarded; (b, h, i) is a query row for packed < rows_per_group, whose q
            // and dout rows hold D and Dv elements; the pairs hold the chunk's rows up to
            // head_rows.
            unsafe {
                (q_rows[local], dout_rows[local]) = match packed < rows_per_group {
                    true => (
                        bf16_row(p.q.data, &p.q.stride, b, h, i),
                        bf16_row(bp.dout.data, &bp.dout.stride, b, h, i),
                    ),
                    false => (std::ptr::null(), std::ptr::null()),
                };
                if packed >= head_rows {
                    continue;
                }
                let dout = pairs.dout_pairs.add(row * pairs.value_width);
                let non_finite = copy_row(
                    q_rows[local],
                    head_dim,
                    pairs.query_pairs.add(row * head_dim),
                ) + copy_row(dout_rows[local], value_dim, dout);
                std::slice::from_raw_parts_mut(dout, pairs.value_width)[value_dim..].fill(0);
                *pairs.row_finite.add(row) = u8::from(non_finite == 0);
            }
        }
        // (width rows of the transpose, the first `real` from the rows, the rest 0; a missing row
        // read as `zeros`, so the inner loop has no test)
        let transpose_tile =
            |rows: &[*const u16; BACKWARD_TILE_ROWS], real: usize, width: usize, dst: *mut u16| {
                let sources = rows.map(|row| match row.is_null() {
                    true => zeros.as_ptr(),
                    false => row,
                });
                for d in 0..width {
                    // SAFETY: forwarded; the chunk's transposed rows hold PAIR_CHUNK_ROWS <=
                    // PAIR_ROW_STRIDE elements each.
                    let column = unsafe {
                        std::slice::from_raw_parts_mut(
                            dst.add(d * PAIR_ROW_STRIDE + tile_begin - pairs.first_row),
                            BACKWARD_TILE_ROWS,
                        )
                    };
                    if d >= real {
                        column.fill(0);
                        continue;
                    }
                    for (element, &source) in column.iter_mut().zip(&sources) {
                        // SAFETY: a row holds real elements (zeros: D and Dv).
                        *element = unsafe { *source.add(d) };
                    }
                }
            };
        // the chunk's D and value_width transposed rows
        transpose_tile(&q_rows, head_dim, head_dim, pairs.query_t);
        transpose_tile(&dout_rows, value_dim, pairs.value_width, pairs.dout_t);
    }
}

/// The tile's first row in the chunk's pairs (even: tiles start at multiples of
/// BACKWARD_TILE_ROWS).
fn pair_row_at(plan: &BackwardPlan, tile: &WorkItem) -> usize {
    tile.row_begin - plan.pairs.first_row
}

/// The key block's index in the head's pairs.
fn pair_block_at(key_block: usize) -> usize {
    key_block / BACKWARD_KEY_BLOCK
}

/// The tile path's products.
///
/// # Safety
/// On the tile path, between the tiles' begin and end on this thread; every tile read or written
/// lies in its buffer.
#[inline(always)]
unsafe fn tile_product(plan: &BackwardPlan, product: &TileProduct) {
    // SAFETY: forwarded; the tile path runs only where the table has the tiles.
    unsafe { (plan.kernels.tiles.unwrap_unchecked().product)(product) };
}

/// (a) of tile_gradients on tiles: S into s.scores and dP into s.grads, over n_padded keys
/// (whole panels) and the tile's rows rounded up to 16 (the pad rows' pairs are 0; their scores
/// are scratch). S times the Q multiplier (as the forward's tiles) when `scaled`; else
/// row_gradients multiplies (the same product, after mask_block's -inf, which it keeps).
///
/// # Safety
/// As [`tile_gradients`], on the tile path.
unsafe fn tile_scores(
    plan: &BackwardPlan,
    tile: &WorkItem,
    rows: usize,
    key_block: usize,
    n_padded: usize,
    scaled: bool,
    s: &mut BackwardScratch,
) {
    let pairs = &plan.pairs;
    let (head_dim, value_dim) = (plan.flash.head_dim, pairs.value_width);
    let (row, block) = (pair_row_at(plan, tile), pair_block_at(key_block));
    let product = |a: *const u16, depth: usize, panels: *const u16, out: &mut [f32]| {
        for panel in 0..n_padded / KEY_PANEL {
            // SAFETY: forwarded; the tile's rows (rounded up to 16, within the head's rows) of
            // depth elements, the block's panels, rows of out of KEY_BLOCK floats (the scratch
            // holds BACKWARD_TILE_ROWS).
            unsafe {
                let product = TileProduct {
                    a: a.add(row * depth).cast(),
                    a_stride: depth * 2,
                    rows,
                    b: panels
                        .add(block * BACKWARD_KEY_BLOCK * depth + panel * depth * KEY_PANEL)
                        .cast(),
                    b_stride: KEY_PANEL * 4,
                    columns: KEY_PANEL / 16,
                    chunks: depth / 32,
                    c: out.as_mut_ptr().add(panel * KEY_PANEL).cast(),
                    c_stride: KEY_BLOCK * 4,
                    accumulate: false,
                };
                tile_product(plan, &product);
            }
        }
    };
    product(pairs.query_pairs, head_dim, pairs.key_panels, &mut s.scores);
    product(
        pairs.dout_pairs,
        value_dim,
        pairs.value_panels,
        &mut s.grads,
    );
    if !scaled {
        return;
    }
    for r in 0..rows {
        for score in &mut s.scores[r * KEY_BLOCK..r * KEY_BLOCK + n_padded] {
            *score *= plan.flash.q_multiplier;
        }
    }
}

/// Whether a hidden key can meet a non-finite value in the tile's accumulations: some P of the
/// tile's rows x its keys [key_begin, key_end) is 0 (gate not null) and a Q or dO row of the tile
/// or a K row of those keys is not finite (a tile product would multiply it by 0).
///
/// # Safety
/// As [`tile_scores`].
unsafe fn tile_needs_exact(
    plan: &BackwardPlan,
    tile: &WorkItem,
    rows: usize,
    gate: *const f32,
) -> bool {
    if gate.is_null() {
        return false;
    }
    // SAFETY: forwarded; the tile's rows and the block's keys have flags.
    unsafe {
        let row_finite =
            std::slice::from_raw_parts(plan.pairs.row_finite.add(pair_row_at(plan, tile)), rows);
        let block = pair_block_at(tile.key_begin);
        let n = tile.key_end - tile.key_begin;
        let key_finite =
            std::slice::from_raw_parts(plan.pairs.key_finite.add(block * BACKWARD_KEY_BLOCK), n);
        row_finite.contains(&0) || key_finite.contains(&0)
    }
}

/// to[c * rows + r] = from[r * columns + c] for r < rows, c < columns.
fn transpose(from: &[f32], rows: usize, columns: usize, to: &mut [f32]) {
    for r in 0..rows {
        for c in 0..columns {
            to[c * rows + r] = from[r * columns + c];
        }
    }
}

/// A key block's dK^T and dV^T sums on the tile path: where they start in s.key_grad (D rows of
/// BACKWARD_KEY_BLOCK floats) and s.value_grad (value_width rows of them).
#[derive(Clone, Copy)]
struct KeyBlockSums {
    key_grad_t: usize,
    value_grad_t: usize,
}

/// The tile path's three accumulations in float32 with the kernels' gated accumulate (as the
/// float32 path's, from P and scale dS unrounded), for a tile where [`tile_needs_exact`]: Q and
/// dO of the tile's rows and K of its n keys from key_begin widened from the pairs; dK and dV
/// summed key by key (their sums transposed there and back).
///
/// # Safety
/// As [`tile_scores`], after tile_gradients; query_grads holds the tile's rows of D floats.
#[allow(clippy::too_many_arguments)]
unsafe fn exact_accumulations(
    plan: &BackwardPlan,
    tile: &WorkItem,
    rows: usize,
    gate: *const f32,
    sums: KeyBlockSums,
    s: &mut BackwardScratch,
    query_grads: *mut f32,
) {
    let (key_block, n) = (tile.key_begin, tile.key_end - tile.key_begin);
    let pairs = &plan.pairs;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let (row, block) = (pair_row_at(plan, tile), pair_block_at(key_block));
    // SAFETY: forwarded; the pairs hold the tile's rows and the block's keys.
    unsafe {
        for r in 0..rows {
            for d in 0..head_dim {
                s.exact_queries[r * head_dim + d] =
                    bf16_to_f32(*pairs.query_pairs.add((row + r) * head_dim + d));
            }
            for c in 0..value_dim {
                s.exact_dout[r * value_dim + c] =
                    bf16_to_f32(*pairs.dout_pairs.add((row + r) * pairs.value_width + c));
            }
        }
        let key_rows = pairs.key_rows.add(block * BACKWARD_KEY_BLOCK * head_dim);
        for j in 0..n {
            for d in 0..head_dim {
                s.exact_keys[j * head_dim + d] =
                    bf16_to_f32(*key_rows.add((j / 2 * head_dim + d) * 2 + j % 2));
            }
        }
    }
    // dV and dK key by key (s.key_sums, rows of `rows_t` floats, the first `width` summed), from
    // and back to dV^T and dK^T.
    let sum_key_rows = |y_t: &mut [f32],
                        rows_t: usize,
                        width: usize,
                        coef: &[f32],
                        x: &[f32],
                        sums: &mut [f32]| {
        transpose(y_t, rows_t, BACKWARD_KEY_BLOCK, sums);
        let key_rows = Accumulation {
            y: sums.as_mut_ptr(),
            y_stride: rows_t,
            outputs: n,
            n: width,
            coef: coef.as_ptr(),
            gate,
            coef_stride: KEY_BLOCK,
            output_stride: 1,
            x: x.as_ptr(),
            x_stride: width,
            terms: rows,
        };
        // SAFETY: the scratch's rows x n of P or dS (stride KEY_BLOCK), n key rows of sums, rows
        // rows of the float32 operand; the dispatcher hands out only kernels this CPU runs.
        unsafe { (plan.kernels.accumulate)(&key_rows) };
        transpose(sums, BACKWARD_KEY_BLOCK, rows_t, y_t);
    };
    let value_width = pairs.value_width;
    sum_key_rows(
        &mut s.value_grad[sums.value_grad_t..sums.value_grad_t + BACKWARD_KEY_BLOCK * value_width],
        value_width,
        value_dim,
        &s.scores,
        &s.exact_dout,
        &mut s.key_sums,
    );
    sum_key_rows(
        &mut s.key_grad[sums.key_grad_t..sums.key_grad_t + BACKWARD_KEY_BLOCK * head_dim],
        head_dim,
        head_dim,
        &s.grads,
        &s.exact_queries,
        &mut s.key_sums,
    );
    // SAFETY: forwarded; the scratch's n K rows.
    unsafe { accumulate_query_keys(plan, rows, n, gate, s, s.exact_keys.as_ptr(), query_grads) };
}

/// The tile path's accumulations of one tile on tiles: P and scale dS of the tile's rows against
/// the block's n_padded keys rounded to bfloat16 (rows rounded up to 32 with zeros;
/// [`TileRounding`]) into the group's pairs from row pair group_pairs, and dQ += dS K into
/// query_grads (the tile's rows rounded up to 16; the pad rows are scratch). dV and dK wait for
/// the group ([`group_sums`]).
///
/// # Safety
/// As [`tile_scores`], after tile_gradients; query_grads holds the tile's rows rounded up to 16
/// of D floats; the group's pairs hold group_pairs + the tile's pairs rows.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_accumulations(
    plan: &BackwardPlan,
    rows: usize,
    key_block: usize,
    n_padded: usize,
    group_pairs: usize,
    s: &mut BackwardScratch,
    query_grads: *mut f32,
) {
    // SAFETY: the tile path runs only where the table has the tiles.
    let tiles = unsafe { plan.kernels.tiles.unwrap_unchecked() };
    let head_dim = plan.flash.head_dim;
    let rows_padded = rows.div_ceil(32) * 32;
    let block = pair_block_at(key_block);
    let rounding = |src: &[f32], pairs: &mut [u32], rows_out: *mut u16| TileRounding {
        src: src.as_ptr(),
        src_stride: KEY_BLOCK,
        rows,
        rows_padded,
        n: n_padded,
        pairs: pairs[group_pairs * BACKWARD_KEY_BLOCK..].as_mut_ptr(),
        rows_out,
        stride: BACKWARD_KEY_BLOCK,
    };
    let probs = rounding(&s.scores, &mut s.probs_pairs, std::ptr::null_mut());
    let grads = rounding(&s.grads, &mut s.grads_pairs, s.grads_rows.as_mut_ptr());
    // SAFETY: forwarded; the scores hold rows_padded <= BACKWARD_TILE_ROWS rows of n_padded <=
    // BACKWARD_KEY_BLOCK floats, the group's pairs and grads_rows the rounded rows; dQ as above.
    unsafe {
        (tiles.round)(&probs);
        (tiles.round)(&grads);
        let query_rows = TileProduct {
            a: s.grads_rows.as_ptr().cast(),
            a_stride: BACKWARD_KEY_BLOCK * 2,
            rows,
            b: plan
                .pairs
                .key_rows
                .add(block * BACKWARD_KEY_BLOCK * head_dim)
                .cast(),
            b_stride: head_dim * 4,
            columns: head_dim / 16,
            chunks: n_padded / 32,
            c: query_grads.cast(),
            c_stride: head_dim * 4,
            accumulate: true,
        };
        tile_product(plan, &query_rows);
    }
}

/// A group's dV^T += dO^T P and dK^T += Q^T dS on tiles: the packed rows [row_begin, row_begin +
/// 2 pairs) of the chunk in the pairs (pairs: the group's row pairs, a multiple of 16) against
/// n_padded keys, into the block's sums.
///
/// # Safety
/// As [`tile_scores`], after the group's tile_accumulations.
unsafe fn group_sums(
    plan: &BackwardPlan,
    row_begin: usize,
    pairs: usize,
    n_padded: usize,
    sums: KeyBlockSums,
    s: &mut BackwardScratch,
) {
    let packed = &plan.pairs;
    let transposed_sums =
        |y: &mut [f32], width: usize, x_t: *const u16, coef: &[u32]| TileProduct {
            // SAFETY: the chunk's transposed rows hold the group's rows.
            a: unsafe { x_t.add(row_begin - packed.first_row) }.cast(),
            a_stride: PAIR_ROW_STRIDE * 2,
            rows: width,
            b: coef.as_ptr().cast(),
            b_stride: BACKWARD_KEY_BLOCK * 4,
            columns: n_padded / 16,
            chunks: pairs / 16,
            c: y.as_mut_ptr().cast(),
            c_stride: BACKWARD_KEY_BLOCK * 4,
            accumulate: true,
        };
    let (head_dim, value_width) = (plan.flash.head_dim, packed.value_width);
    let value_rows = transposed_sums(
        &mut s.value_grad[sums.value_grad_t..],
        value_width,
        packed.dout_t,
        &s.probs_pairs,
    );
    let key_rows = transposed_sums(
        &mut s.key_grad[sums.key_grad_t..],
        head_dim,
        packed.query_t,
        &s.grads_pairs,
    );
    // SAFETY: forwarded; dV^T and dK^T hold Dv and D rows of BACKWARD_KEY_BLOCK floats.
    unsafe {
        tile_product(plan, &value_rows);
        tile_product(plan, &key_rows);
    }
}

/// Pass 2 fused with 3 on the tile path, for the query rows [rows_begin, rows_end) of a head (a
/// chunk: rows_begin is the pairs' first_row) against a key block (keys.key_begin of (keys.b,
/// keys.kv_head), those below keys.key_end visible): query tiles of BACKWARD_TILE_ROWS rows, the
/// products on tiles ([`tile_scores`], [`tile_accumulations`], and [`group_sums`] over up to
/// BACKWARD_TILE_GROUP consecutive tiles) unless [`tile_needs_exact`]; dK^T and dV^T summed into
/// the block's sums, dQ into query_grads (the chunk's, rows of D from rows_begin).
///
/// # Safety
/// As [`row_deltas`], on the tile path, between the tiles' begin and end, with the chunk's pairs
/// packed; query_grads holds PAIR_CHUNK_ROWS rows of dQ sums.
#[allow(clippy::too_many_arguments)]
unsafe fn key_block_tiles(
    plan: &BackwardPlan,
    keys: &WorkItem,
    rows_begin: usize,
    rows_end: usize,
    sums: KeyBlockSums,
    s: &mut BackwardScratch,
    query_grads: *mut f32,
) {
    let key_block = keys.key_begin;
    let visible = keys.key_end - key_block;
    let head_dim = plan.flash.head_dim;
    let visible_padded = visible.div_ceil(KEY_PANEL) * KEY_PANEL;
    // SAFETY: forwarded.
    unsafe {
        // The group: tiles in order from group_begin, their P and dS pairs from row pair 0 on,
        // summed into dV^T and dK^T when it is full, before an exact tile, and at the end.
        let (mut group_begin, mut group_pairs) = (0, 0);
        let flush = |s: &mut BackwardScratch, group_begin: usize, group_pairs: &mut usize| {
            if *group_pairs > 0 {
                group_sums(plan, group_begin, *group_pairs, visible_padded, sums, s);
            }
            *group_pairs = 0;
        };
        let mut row_begin = rows_begin;
        while visible > 0 && row_begin < rows_end {
            let tile_begin = row_begin;
            row_begin = (row_begin + BACKWARD_TILE_ROWS).min(rows_end);
            let Some(tile) = block_tile(plan, keys, tile_begin, BACKWARD_TILE_ROWS) else {
                flush(s, group_begin, &mut group_pairs);
                continue;
            };
            let rows = tile.row_end - tile_begin;
            load_tile(plan, &tile, rows, s);
            let gate = tile_gradients(plan, &tile, rows, key_block, visible, s);
            let y = query_grads.add((tile_begin - plan.pairs.first_row) * head_dim);
            if tile_needs_exact(plan, &tile, rows, gate) {
                flush(s, group_begin, &mut group_pairs);
                exact_accumulations(plan, &tile, rows, gate, sums, s, y);
                continue;
            }
            if group_pairs == 0 {
                group_begin = tile_begin;
            }
            tile_accumulations(plan, rows, key_block, visible_padded, group_pairs, s, y);
            group_pairs += rows.div_ceil(32) * 16;
            if group_pairs == BACKWARD_TILE_GROUP * BACKWARD_TILE_ROWS / 2 {
                flush(s, group_begin, &mut group_pairs);
            }
        }
        flush(s, group_begin, &mut group_pairs);
    }
}

/// The key block from key_block of (b, kv_head) as a work item (its keys below kv_lens[b]:
/// key_end; the query rows to come), and its keys (BACKWARD_KEY_BLOCK, fewer at the end).
fn block_keys(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    key_block: usize,
) -> (WorkItem, usize) {
    let n = BACKWARD_KEY_BLOCK.min(p.k.shape[2] as usize - key_block);
    let visible = (p.kv_lens[b] as usize).saturating_sub(key_block).min(n);
    let keys = WorkItem {
        b,
        kv_head,
        row_begin: 0,
        row_end: 0,
        key_begin: key_block,
        key_end: key_block + visible,
        partial_slot: None,
    };
    (keys, n)
}

/// The fused pass on the tile path ([`head_gradients`]): the head's rows a chunk of
/// BACKWARD_TILE_GROUP query tiles at a time, each chunk against every key block in order, so
/// that the chunk's query side (Q, dO, their transposes, its dQ sums) stays in the L2 cache while
/// the key blocks stream past, instead of the whole head's rows streaming past each key block.
/// dK^T and dV^T are summed per key block across the chunks (s.key_grad, s.value_grad: every
/// block's), then stored key by key; keys past kv_lens[b] get 0. Each element's sum runs in the
/// same order as key block by key block (a block's tiles in row order, a tile's blocks in key
/// order), so the bits are the same.
/// Pass 0 runs here, into the thread's scratch (as [`head_blocks`]'): the head's key pairs once,
/// each chunk's row pairs and transposes as the chunk starts, whose dQ is whole, and stored, once
/// the chunk has met every key block. So the path keeps, per thread, one head's keys and dK, dV
/// sums and one chunk's rows, not the call's every K, V, Q and dO in pairs (at N = 8192, 32 query
/// heads on 8 KV heads, D = 128: about 14 MB a thread against 350 MB a call).
///
/// # Safety
/// As [`key_block_tiles`], for every key block of the head; this item owns the head's dq, dk and
/// dv rows; the scratch is sized for the tile path (packs).
unsafe fn head_tiles<T: Element>(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    s: &mut BackwardScratch,
) {
    let bp = plan.problem;
    let p = &bp.forward;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let (width, blocks) = (plan.pairs.value_width, plan.packed.key_blocks);
    let rows_per_group = plan.flash.rows_per_group;
    // this head's pairs: the thread's scratch, which the calls below reach only through the
    // plan's pointers
    let mut own = BackwardPlan {
        pairs: s.pairs(width, 0),
        ..*plan
    };
    // SAFETY: forwarded; the scratch holds the head's key pairs.
    unsafe { pack_key_pairs(&own, b, kv_head) };
    s.key_grad[..blocks * BACKWARD_KEY_BLOCK * head_dim].fill(0.0);
    s.value_grad[..blocks * BACKWARD_KEY_BLOCK * width].fill(0.0);
    let sums_of = |kb: usize| KeyBlockSums {
        key_grad_t: kb * BACKWARD_KEY_BLOCK * head_dim,
        value_grad_t: kb * BACKWARD_KEY_BLOCK * width,
    };
    // the chunk's dQ sums, reached below only through this pointer
    let query_grads = s.query_grad.as_mut_ptr();
    for chunk in (0..rows_per_group).step_by(PAIR_CHUNK_ROWS) {
        let chunk_end = (chunk + PAIR_CHUNK_ROWS).min(rows_per_group);
        own.pairs.first_row = chunk;
        // SAFETY: forwarded; the scratch holds a chunk's pairs and dQ sums.
        unsafe {
            pack_query_pairs(&own, b, kv_head, chunk_end);
            std::slice::from_raw_parts_mut(query_grads, PAIR_CHUNK_ROWS * head_dim).fill(0.0);
        }
        for kb in 0..blocks {
            let (keys, _) = block_keys(p, b, kv_head, kb * BACKWARD_KEY_BLOCK);
            // SAFETY: forwarded.
            unsafe { key_block_tiles(&own, &keys, chunk, chunk_end, sums_of(kb), s, query_grads) };
        }
        let rows = rows_item(b, kv_head, chunk, chunk_end);
        // SAFETY: forwarded; this item owns the chunk's dq rows.
        unsafe { store_query_rows::<T>(&own, &rows, &s.query_grad) };
    }
    // Key by key; keys past visible: 0 (the tile products' columns there are scratch: 0 times a
    // Q or dO row). (sums_t: rows_t rows, the first `columns` stored)
    for kb in 0..blocks {
        let (keys, n) = block_keys(p, b, kv_head, kb * BACKWARD_KEY_BLOCK);
        let visible = keys.key_end - keys.key_begin;
        let store_keys = |sums_t: &[f32],
                          rows_t: usize,
                          columns: usize,
                          gradient: &MutTensorView4,
                          sums: &mut [f32]| {
            transpose(sums_t, rows_t, BACKWARD_KEY_BLOCK, sums);
            sums[visible * rows_t..n * rows_t].fill(0.0);
            for j in 0..n {
                // SAFETY: forwarded; key keys.key_begin + j of (b, kv_head) is this item's.
                unsafe {
                    store_row::<T>(
                        gradient,
                        b,
                        kv_head,
                        keys.key_begin + j,
                        &sums[j * rows_t..],
                        columns,
                    )
                };
            }
        };
        let sums = sums_of(kb);
        store_keys(
            &s.key_grad[sums.key_grad_t..],
            head_dim,
            head_dim,
            &bp.dk,
            &mut s.key_sums,
        );
        store_keys(
            &s.value_grad[sums.value_grad_t..],
            width,
            value_dim,
            &bp.dv,
            &mut s.key_sums,
        );
    }
}

/// P and scale * dS of the tile's rows against the n keys of the packed block from key_block:
/// s.scores (P) and s.grads, rows of stride KEY_BLOCK (as the forward's mask_block reads them),
/// S and dP by the kernels' panel products over n rounded up to KEY_PANEL keys. A hidden key has
/// P = 0 and dS = 0, and its dP is never used (no 0 * NaN from it); a row with no legal key
/// (lse = -inf) is all zeros. Returns the gate of the accumulations: null when no P of the rows
/// x n is 0 (every term then counts: the kernels' ungated blocks), else s.scores.
///
/// # Safety
/// As [`load_tile`], after load_tile of these rows and pass 0.
unsafe fn tile_gradients(
    plan: &BackwardPlan,
    tile: &WorkItem,
    rows: usize,
    key_block: usize,
    n: usize,
    s: &mut BackwardScratch,
) -> *const f32 {
    let fp = &plan.flash;
    let (head_dim, value_dim) = (fp.head_dim, fp.value_dim);
    let n_padded = n.div_ceil(KEY_PANEL) * KEY_PANEL;
    // (a) S = (Q times the multiplier) K^T, in base 2; softcap: t = tanh(S) kept, S = t softcap log2 e.
    // dP = dO V^T into s.grads. (The tile path: tile_scores, which leaves the multiplier to
    // row_gradients unless the softcap, ALiBi or a mask needs S scaled before P.)
    let scaled = !plan.tiled || fp.has_softcap || fp.has_alibi || fp.has_mask;
    if plan.tiled {
        // SAFETY: forwarded.
        unsafe { tile_scores(plan, tile, rows, key_block, n_padded, scaled, s) };
    } else {
        // SAFETY: forwarded.
        let (block, queries) = unsafe {
            (
                key_block_at(plan, tile.b, tile.kv_head, key_block),
                query_rows_at(plan, tile),
            )
        };
        let product = |a: *const f32, depth: usize, panel: *const f32, out: &mut [f32]| {
            let product = PanelProduct {
                a,
                rows,
                depth,
                panel,
                panel_stride: BACKWARD_KEY_BLOCK,
                n: n_padded,
                out: out.as_mut_ptr(),
                out_stride: KEY_BLOCK,
            };
            // SAFETY: the tile's rows x depth floats of a, depth panel rows of BACKWARD_KEY_BLOCK
            // >= n_padded floats, rows out rows of KEY_BLOCK floats; the dispatcher hands out
            // only kernels this CPU runs.
            unsafe { (plan.kernels.panel_product)(&product) };
        };
        product(queries.scaled, head_dim, block.key_panel, &mut s.scores);
        product(queries.dout, value_dim, block.value_panel, &mut s.grads);
    }
    for r in 0..rows {
        let row = &mut s.scores[r * KEY_BLOCK..(r + 1) * KEY_BLOCK];
        row[n..n_padded].fill(0.0);
        if !fp.has_softcap {
            continue;
        }
        let capped = &mut s.capped[r * KEY_BLOCK..];
        for j in (0..n_padded).step_by(W) {
            // SAFETY: j + W <= n_padded <= KEY_BLOCK floats of both rows; no instruction set needed.
            unsafe {
                let t = tanh::<V>(V::load(row.as_ptr().add(j)));
                t.store(capped.as_mut_ptr().add(j));
                V::mul(t, V::broadcast(fp.softcap_multiplier)).store(row.as_mut_ptr().add(j));
            }
        }
    }
    // (b) Visibility, ALiBi and the mask: the forward's own code.
    let view = ThreadScratch {
        q_tile: std::ptr::null_mut(),
        scores: s.scores.as_mut_ptr(),
        out_acc: std::ptr::null_mut(),
        row_max: std::ptr::null_mut(),
        row_sum: std::ptr::null_mut(),
        rescale: std::ptr::null_mut(),
        row_key_begin: s.row_key_begin.as_mut_ptr(),
        row_key_end: s.row_key_end.as_mut_ptr(),
        key_panels: std::ptr::null_mut(),
        probs_pairs: std::ptr::null_mut(),
        out_acc_lo: std::ptr::null_mut(),
        key_scales: std::ptr::null_mut(),
        value_scales: std::ptr::null_mut(),
        key_rows: std::ptr::null_mut(),
        value_rows: std::ptr::null_mut(),
    };
    // SAFETY: forwarded; mask_block reads only scores (rows x n of stride KEY_BLOCK) and the
    // rows' key ranges of the view.
    unsafe { mask_block(fp, tile, &view, rows, key_block, n) };
    // The padding keys [n, n_padded): S = -inf, so P = 0 there too (row_gradients runs over them).
    for r in 0..rows {
        s.scores[r * KEY_BLOCK + n..r * KEY_BLOCK + n_padded].fill(f32::NEG_INFINITY);
    }
    // (c) P = 2^(S - lse log2 e); dS = P (dP - Drow), softcap: times 1 - t^2; times scale (the
    // kernels' row_gradients, over the n_padded keys).
    let scale = plan.problem.forward.scale;
    let multiplier = if scaled { 1.0 } else { fp.q_multiplier };
    // P of the rows x n that are 0 (counted by row_gradients, not tested)
    let mut zeros = 0usize;
    for r in 0..rows {
        let row = r * KEY_BLOCK..r * KEY_BLOCK + n_padded;
        if s.row_lse[r] == f32::NEG_INFINITY {
            // no legal key: P = 0 and dS = 0
            s.scores[row.clone()].fill(0.0);
            s.grads[row].fill(0.0);
            zeros += n;
            continue;
        }
        let capped = match fp.has_softcap {
            true => s.capped[row.start..].as_ptr(),
            false => std::ptr::null(),
        };
        let gradients = RowGradients {
            probs: s.scores[row.start..].as_mut_ptr(),
            grads: s.grads[row.start..].as_mut_ptr(),
            capped,
            n: n_padded,
            lse: s.row_lse[r],
            delta: s.row_delta[r],
            scale,
            multiplier,
            counted: n,
        };
        // SAFETY: n <= n_padded <= KEY_BLOCK floats of the row in scores, grads and capped; the
        // dispatcher hands out only kernels this CPU runs.
        zeros += unsafe { (plan.kernels.row_gradients)(&gradients) };
    }
    match zeros {
        0 => std::ptr::null(),
        _ => s.scores.as_ptr(),
    }
}

/// The query tile of packed rows [row_begin, row_begin + tile_rows) (up to rows_per_group) of
/// `keys`' (b, kv_head) against its keys [key_begin, key_end); None when none of its rows sees
/// one of them (rows are ordered by position, and so are their visible ranges: a tile whose first
/// row starts past the keys or whose last row ends before them sees none).
fn block_tile(
    plan: &BackwardPlan,
    keys: &WorkItem,
    row_begin: usize,
    tile_rows: usize,
) -> Option<WorkItem> {
    let (p, group) = (&plan.problem.forward, plan.flash.group);
    let row_end = (row_begin + tile_rows).min(plan.flash.rows_per_group);
    let (first_key, _) = flash_row_key_range(p, keys.b, group, row_begin);
    let (_, last_key) = flash_row_key_range(p, keys.b, group, row_end - 1);
    let tile = WorkItem {
        row_begin,
        row_end,
        ..*keys
    };
    (first_key < keys.key_end && last_key > keys.key_begin).then_some(tile)
}

/// Row r of the tile: query_grads[r] += dS[r, .] K, over the n keys of the block from key_block
/// in order (dS in s.grads, gated as [`tile_gradients`] returned).
///
/// # Safety
/// As [`tile_gradients`], after it for these rows and keys; query_grads holds rows rows of D
/// floats.
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_query_rows(
    plan: &BackwardPlan,
    tile: &WorkItem,
    rows: usize,
    key_block: usize,
    n: usize,
    gate: *const f32,
    s: &BackwardScratch,
    query_grads: *mut f32,
) {
    // SAFETY: forwarded; the block's n K rows of D floats.
    unsafe {
        let keys = key_block_at(plan, tile.b, tile.kv_head, key_block).keys;
        accumulate_query_keys(plan, rows, n, gate, s, keys, query_grads);
    }
}

/// query_grads[r] += dS[r, .] K for the tile's rows r, over n K rows of D floats from keys in
/// order (dS in s.grads, gated as [`tile_gradients`] returned).
///
/// # Safety
/// As [`accumulate_query_rows`]; keys holds n rows of D floats.
unsafe fn accumulate_query_keys(
    plan: &BackwardPlan,
    rows: usize,
    n: usize,
    gate: *const f32,
    s: &BackwardScratch,
    keys: *const f32,
    query_grads: *mut f32,
) {
    let head_dim = plan.flash.head_dim;
    let query_rows = Accumulation {
        y: query_grads,
        y_stride: head_dim,
        outputs: rows,
        n: head_dim,
        coef: s.grads.as_ptr(),
        gate,
        coef_stride: 1,
        output_stride: KEY_BLOCK,
        x: keys,
        x_stride: head_dim,
        terms: n,
    };
    // SAFETY: forwarded; rows rows of dS of stride KEY_BLOCK; the dispatcher hands out only
    // kernels this CPU runs.
    unsafe { (plan.kernels.accumulate)(&query_rows) };
}

/// Rounds the float32 dQ sums of the tile's rows (rows of D from query_grads) into dq.
///
/// # Safety
/// As [`row_deltas`]; the caller owns the tile's dq rows; query_grads holds its rows.
unsafe fn store_query_rows<T: Element>(plan: &BackwardPlan, tile: &WorkItem, query_grads: &[f32]) {
    let (group, head_dim) = (plan.flash.group, plan.flash.head_dim);
    for packed in tile.row_begin..tile.row_end {
        let h = tile.kv_head * group + packed % group;
        let src = &query_grads[(packed - tile.row_begin) * head_dim..];
        // SAFETY: forwarded.
        unsafe { store_row::<T>(&plan.problem.dq, tile.b, h, packed / group, src, head_dim) };
    }
}

/// dV += P^T dO and dK += scale dS^T Q of the key block `keys` ([`block_keys`], from key_block:
/// its visible keys) over the query tiles of packed rows [rows_begin, rows_end) that see them
/// (rows_begin a multiple of Q_TILE_ROWS: the tiles are those of the whole head's rows), in row
/// order, into the block's float32 sums key_grad (rows of D) and value_grad (rows of Dv). With
/// query_grads (the fused pass: the dQ sums of packed rows from rows_base, rows of D), also
/// dQ += dS K of every such tile's rows, over the block's keys in order. Not on the tile path
/// ([`key_block_tiles`]).
///
/// # Safety
/// As [`row_deltas`]; this item owns these keys' sums (key_grad and value_grad: the block's n
/// rows, which the scratch's own slices do not reach meanwhile) and, with query_grads, the dQ
/// sums of rows [rows_base, rows_end).
#[allow(clippy::too_many_arguments)]
unsafe fn key_block_rows(
    plan: &BackwardPlan,
    keys: &WorkItem,
    key_block: usize,
    rows_begin: usize,
    rows_end: usize,
    key_grad: *mut f32,
    value_grad: *mut f32,
    s: &mut BackwardScratch,
    query_grads: *mut f32,
    rows_base: usize,
) {
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let visible = keys.key_end - keys.key_begin;
    // SAFETY: forwarded.
    unsafe {
        let mut row_begin = rows_begin;
        while visible > 0 && row_begin < rows_end {
            let tile_begin = row_begin;
            row_begin += Q_TILE_ROWS;
            let Some(tile) = block_tile(plan, keys, tile_begin, Q_TILE_ROWS) else {
                continue;
            };
            let rows = tile.row_end - tile_begin;
            load_tile(plan, &tile, rows, s);
            let gate = tile_gradients(plan, &tile, rows, key_block, visible, s);
            // Key j's rows: dV += P[., j]^T dO, dK += dS[., j]^T Q, over the tile's rows in order.
            let queries = query_rows_at(plan, &tile);
            let key_rows = |y: *mut f32, width: usize, coef: &[f32], x: *const f32| Accumulation {
                y,
                y_stride: width,
                outputs: visible,
                n: width,
                coef: coef.as_ptr(),
                gate,
                coef_stride: KEY_BLOCK,
                output_stride: 1,
                x,
                x_stride: width,
                terms: rows,
            };
            (plan.kernels.accumulate)(&key_rows(value_grad, value_dim, &s.scores, queries.dout));
            (plan.kernels.accumulate)(&key_rows(key_grad, head_dim, &s.grads, queries.rows));
            if !query_grads.is_null() {
                let y = query_grads.add((tile_begin - rows_base) * head_dim);
                accumulate_query_rows(plan, &tile, rows, key_block, visible, gate, s, y);
            }
        }
    }
}

/// Rounds the dK and dV sums of the n keys of the block `keys` ([`block_keys`]; rows of D and Dv
/// from key_grad and value_grad, 0 past its visible keys) into dk and dv.
///
/// # Safety
/// As [`row_deltas`]; this item owns these keys' dk and dv rows.
unsafe fn store_key_block<T: Element>(
    plan: &BackwardPlan,
    keys: &WorkItem,
    n: usize,
    key_grad: &[f32],
    value_grad: &[f32],
) {
    let bp = plan.problem;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    for j in 0..n {
        let key = keys.key_begin + j;
        let (dk, dv) = (&key_grad[j * head_dim..], &value_grad[j * value_dim..]);
        // SAFETY: forwarded.
        unsafe {
            store_row::<T>(&bp.dk, keys.b, keys.kv_head, key, dk, head_dim);
            store_row::<T>(&bp.dv, keys.b, keys.kv_head, key, dv, value_dim);
        }
    }
}

/// Pass 2: dK and dV of keys [key_block, key_block + BACKWARD_KEY_BLOCK) of (b, kv_head), every query
/// tile that sees them summed in row order; keys past kv_lens[b] get 0. Not on the tile path.
///
/// # Safety
/// As [`row_deltas`]; this item owns these keys' dk and dv rows.
unsafe fn key_block_gradients<T: Element>(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    key_block: usize,
    s: &mut BackwardScratch,
) {
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let (keys, n) = block_keys(&plan.problem.forward, b, kv_head, key_block);
    s.key_grad[..n * head_dim].fill(0.0);
    s.value_grad[..n * value_dim].fill(0.0);
    let (key_grad, value_grad) = (s.key_grad.as_mut_ptr(), s.value_grad.as_mut_ptr());
    let rows_per_group = plan.flash.rows_per_group;
    // SAFETY: forwarded; the sums are the scratch's own buffers, which key_block_rows reaches only
    // through these pointers.
    unsafe {
        let null = std::ptr::null_mut();
        key_block_rows(
            plan,
            &keys,
            key_block,
            0,
            rows_per_group,
            key_grad,
            value_grad,
            s,
            null,
            0,
        );
        store_key_block::<T>(plan, &keys, n, &s.key_grad, &s.value_grad);
    }
}

/// The fused pass off the tile path ([`head_gradients`]), as [`head_tiles`]: the head's rows a
/// chunk of BACKWARD_CHUNK_TILES query tiles at a time, each chunk against every key block in
/// order, so that the chunk's query side (Q, Q times the multiplier, dO and their dQ sums: 2 KB
/// per packed row at D = Dv = 128) stays in the L2 cache while the key blocks stream past, instead
/// of the whole head's rows streaming past each key block (at N = 2048, 8192 packed rows: 16 MB
/// per head, from the L3 cache or memory for every key block). dK and dV are summed per key
/// block across the chunks (s.key_grad, s.value_grad: every block's), then stored. Each element's
/// sum runs in the same order as key block by key block (a block's tiles in row order, a tile's
/// blocks in key order), so the bits are the same.
///
/// Pass 0 runs here, into the thread's scratch: the head's keys once, and each chunk's query
/// side as the chunk starts, whose dQ is whole once the chunk has met every key block (stored
/// then). So the pass keeps, per thread, one head's keys and dK, dV sums and one chunk's rows,
/// not float32 copies of the call's every K, V, Q and dO (at N = 8192, 32 query heads on 8 KV
/// heads, D = 128: about 20 MB a thread against 480 MB a call).
///
/// # Safety
/// As [`row_deltas`]; this item owns the head's dq, dk and dv rows; the scratch is sized for the
/// fused float32 pass (packs).
unsafe fn head_blocks<T: Element>(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    s: &mut BackwardScratch,
) {
    let p = &plan.problem.forward;
    let (head_dim, value_dim) = (plan.flash.head_dim, plan.flash.value_dim);
    let (blocks, rows_per_group) = (plan.packed.key_blocks, plan.flash.rows_per_group);
    let head = b * p.k.shape[1] as usize + kv_head;
    // this head's packed keys and chunk: the thread's scratch, which the calls below reach only
    // through the plan's pointers
    let mut own = BackwardPlan {
        packed: PackedKeys {
            keys: s.head_keys.as_mut_ptr(),
            key_panels: s.head_key_panels.as_mut_ptr(),
            value_panels: s.head_value_panels.as_mut_ptr(),
            key_blocks: blocks,
            first_head: head,
        },
        ..*plan
    };
    // SAFETY: forwarded; the scratch holds the head's packed keys.
    unsafe { pack_keys::<T>(&own, b, kv_head) };
    s.key_grad[..blocks * BACKWARD_KEY_BLOCK * head_dim].fill(0.0);
    s.value_grad[..blocks * BACKWARD_KEY_BLOCK * value_dim].fill(0.0);
    let query_grads = s.query_grad.as_mut_ptr();
    let chunk_rows = BACKWARD_CHUNK_TILES * Q_TILE_ROWS;
    for chunk in (0..rows_per_group).step_by(chunk_rows) {
        let chunk_end = (chunk + chunk_rows).min(rows_per_group);
        own.queries = PackedQueries {
            query_rows: s.chunk_rows.as_mut_ptr(),
            query_scaled: s.chunk_scaled.as_mut_ptr(),
            dout_rows: s.chunk_dout.as_mut_ptr(),
            first_row: head * rows_per_group + chunk,
        };
        // SAFETY: forwarded; the scratch holds a chunk's packed rows and dQ sums.
        unsafe {
            pack_queries::<T>(&own, b, kv_head, chunk, chunk_end);
            std::slice::from_raw_parts_mut(query_grads, (chunk_end - chunk) * head_dim).fill(0.0);
        }
        for kb in 0..blocks {
            let (keys, _) = block_keys(p, b, kv_head, kb * BACKWARD_KEY_BLOCK);
            // SAFETY: forwarded; block kb's sums lie in the scratch's sums for every block, which
            // key_block_rows reaches only through these pointers.
            unsafe {
                let key_grad = s
                    .key_grad
                    .as_mut_ptr()
                    .add(kb * BACKWARD_KEY_BLOCK * head_dim);
                let value_grad = s
                    .value_grad
                    .as_mut_ptr()
                    .add(kb * BACKWARD_KEY_BLOCK * value_dim);
                key_block_rows(
                    &own,
                    &keys,
                    kb * BACKWARD_KEY_BLOCK,
                    chunk,
                    chunk_end,
                    key_grad,
                    value_grad,
                    s,
                    query_grads,
                    chunk,
                );
            }
        }
        let rows = rows_item(b, kv_head, chunk, chunk_end);
        // SAFETY: forwarded; this item owns the chunk's dq rows.
        unsafe { store_query_rows::<T>(&own, &rows, &s.query_grad) };
    }
    for kb in 0..blocks {
        let (keys, n) = block_keys(p, b, kv_head, kb * BACKWARD_KEY_BLOCK);
        let key_grad = &s.key_grad[kb * BACKWARD_KEY_BLOCK * head_dim..];
        let value_grad = &s.value_grad[kb * BACKWARD_KEY_BLOCK * value_dim..];
        // SAFETY: forwarded.
        unsafe { store_key_block::<T>(&own, &keys, n, key_grad, value_grad) };
    }
}

/// Pass 3: dQ of the tile's rows, key blocks in order from the first row's window start to the last
/// row's visible end; rows that see no key get 0.
///
/// # Safety
/// As [`row_deltas`]; this item owns the tile's dq rows.
unsafe fn query_tile_gradients<T: Element>(
    plan: &BackwardPlan,
    tile: &WorkItem,
    s: &mut BackwardScratch,
) {
    let p = &plan.problem.forward;
    let (group, head_dim) = (plan.flash.group, plan.flash.head_dim);
    let rows = tile.row_end - tile.row_begin;
    // SAFETY: forwarded.
    unsafe {
        load_tile(plan, tile, rows, s);
        s.query_grad[..rows * head_dim].fill(0.0);
        let (first_key, _) = flash_row_key_range(p, tile.b, group, tile.row_begin);
        let (_, last_key) = flash_row_key_range(p, tile.b, group, tile.row_end - 1);
        let mut key_block = first_key / BACKWARD_KEY_BLOCK * BACKWARD_KEY_BLOCK;
        while key_block < last_key {
            let n = BACKWARD_KEY_BLOCK.min(last_key - key_block);
            let gate = tile_gradients(plan, tile, rows, key_block, n, s);
            let query_grads = s.query_grad.as_mut_ptr();
            accumulate_query_rows(plan, tile, rows, key_block, n, gate, s, query_grads);
            key_block += BACKWARD_KEY_BLOCK;
        }
        store_query_rows::<T>(plan, tile, &s.query_grad);
    }
}

/// The fused pass (2 and 3 in one item): dK and dV of every key block of (b, kv_head), blocks in
/// order ([`head_blocks`], [`head_tiles`]: by chunks of rows), each tile's dQ summed into float32
/// dQ sums (s.query_grad) as it goes. Every
/// element is the same fma chain as in passes 2 and 3 (keys ascending for dQ: blocks in order,
/// each block's keys in order), so the results are the same bits; S and dP are computed once
/// instead of twice. On the tile path, between the tile configuration's begin and end.
///
/// # Safety
/// As [`row_deltas`]; this item owns the head's dq, dk and dv rows and its dQ sums.
unsafe fn head_gradients<T: Element>(
    plan: &BackwardPlan,
    b: usize,
    kv_head: usize,
    s: &mut BackwardScratch,
) {
    let Some(tiles) = plan.kernels.tiles.filter(|_| plan.tiled) else {
        // SAFETY: forwarded.
        return unsafe { head_blocks::<T>(plan, b, kv_head, s) };
    };
    // SAFETY: forwarded; the scratch is sized for the tile path (the fused pass's for_each_item).
    unsafe {
        (tiles.begin)();
        head_tiles::<T>(plan, b, kv_head, s);
        (tiles.end)();
    }
}

/// Whether the fused pass runs: its items are the B * Hkv heads, of five (Lq Lk D)-sized products
/// per head where passes 2 and 3 run seven, over finer items. It runs unless its busiest thread
/// (ceil(heads / threads) heads) would do more than the two passes' share (heads / threads x 7/5).
fn fused_pass(heads: usize, threads: usize) -> bool {
    5 * heads.div_ceil(threads) * threads <= 7 * heads
}

/// Passes 1-3 with q, k, v, out, dout and the gradients of storage type T.
///
/// # Safety
/// As [`attention_backward`], after check_backward.
unsafe fn backward_passes<T: Element>(
    bp: &BackwardProblem,
    threads: usize,
) -> Result<(), ProblemError> {
    let p = &bp.forward;
    let kernels = current_kernels().map_err(ProblemError)?.backward;
    let [batch, q_heads, q_len, head_dim] = p.q.shape.map(|n| n as usize);
    let (kv_heads, k_len, value_dim) = (
        p.k.shape[1] as usize,
        p.k.shape[2] as usize,
        p.v.shape[3] as usize,
    );

    // 1. Drow, then dsinks.
    let mut delta = try_filled(batch * q_heads * q_len, 0.0f32)?;
    let (problem, delta_rows) = (Shared(bp), Shared(delta.as_mut_ptr()));
    let tiles = ScratchShape {
        head_dim,
        value_dim,
        query_grad_rows: Q_TILE_ROWS,
        tiled: false,
        key_blocks: 1,
        packs: false,
    };
    for_each_item(batch * q_heads, threads, tiles, |head, s| {
        // SAFETY: item `head` writes only its own Lq floats of delta; the problem is checked.
        unsafe {
            let delta = std::slice::from_raw_parts_mut(delta_rows.get().add(head * q_len), q_len);
            let (bp, b, h) = (problem.get(), head / q_heads, head % q_heads);
            if bp.out_float32 {
                row_deltas::<T, f32>(bp, b, h, delta, &mut s.row_buffer);
            } else {
                row_deltas::<T, T>(bp, b, h, delta, &mut s.row_buffer);
            }
        }
    })?;
    if !bp.dsinks.data.is_null() {
        // SAFETY: the problem is checked; dsinks comes with sinks.
        unsafe { sink_gradients(bp, &delta) };
    }
    if kv_heads == 0 {
        return Ok(()); // then Hq = 0 too (check_problem): no gradient left to write
    }

    // 0. The packed keys and query side (the tile path: their pairs).
    let key_blocks = k_len.div_ceil(BACKWARD_KEY_BLOCK);
    let packed_keys = batch * kv_heads * key_blocks * BACKWARD_KEY_BLOCK;
    with_thread_buffers(&CALLER_BUFFERS, |buffers: &mut CallerBuffers| {
        if tile_path(&kernels, p) {
            // pass 0 inside each head's item (head_tiles)
            let plan = BackwardPlan {
                problem: bp,
                flash: flash_plan(p),
                row_delta: delta.as_ptr(),
                kernels,
                packed: no_keys(key_blocks),
                queries: no_queries(),
                fused: true,
                tiled: true,
                pairs: no_pairs(value_dim.div_ceil(32) * 32),
            };
            // SAFETY: forwarded.
            return unsafe { gradient_passes::<T>(&plan, threads) };
        }
        if fused_pass(batch * kv_heads, threads) {
            // pass 0 inside each head's item (head_blocks)
            let plan = BackwardPlan {
                problem: bp,
                flash: flash_plan(p),
                row_delta: delta.as_ptr(),
                kernels,
                packed: no_keys(key_blocks),
                queries: no_queries(),
                fused: true,
                tiled: false,
                pairs: no_pairs(0),
            };
            // SAFETY: forwarded.
            return unsafe { gradient_passes::<T>(&plan, threads) };
        }
        let packed = PackedKeys {
            keys: grown(&mut buffers.keys, packed_keys * head_dim)?,
            key_panels: grown(&mut buffers.key_panels, packed_keys * head_dim)?,
            value_panels: grown(&mut buffers.value_panels, packed_keys * value_dim)?,
            key_blocks,
            first_head: 0,
        };
        // B * Hkv heads of rows_per_group packed rows
        let packed_rows = batch * q_heads * q_len;
        let queries = PackedQueries {
            query_rows: grown(&mut buffers.query_rows, packed_rows * head_dim)?,
            query_scaled: grown(&mut buffers.query_scaled, packed_rows * head_dim)?,
            dout_rows: grown(&mut buffers.dout_rows, packed_rows * value_dim)?,
            first_row: 0,
        };
        let plan = BackwardPlan {
            problem: bp,
            flash: flash_plan(p),
            row_delta: delta.as_ptr(),
            kernels,
            packed,
            queries,
            fused: false,
            tiled: false,
            pairs: no_pairs(0),
        };
        let rows_per_group = q_heads / kv_heads * q_len;
        for_each_item(batch * kv_heads, threads, tiles, |head, _| {
            // SAFETY: item `head` packs only its own head's blocks and rows; the problem is
            // checked.
            unsafe {
                pack_keys::<T>(&plan, head / kv_heads, head % kv_heads);
                pack_queries::<T>(&plan, head / kv_heads, head % kv_heads, 0, rows_per_group);
            }
        })?;
        // SAFETY: forwarded.
        unsafe { gradient_passes::<T>(&plan, threads) }
    })
}

/// Passes 2 and 3, after passes 0 and 1.
///
/// # Safety
/// As [`backward_passes`], with the plan's packed keys written.
unsafe fn gradient_passes<T: Element>(
    plan: &BackwardPlan,
    threads: usize,
) -> Result<(), ProblemError> {
    let p = &plan.problem.forward;
    let [batch, _, _, head_dim] = p.q.shape.map(|n| n as usize);
    let (kv_heads, value_dim) = (p.k.shape[1] as usize, p.v.shape[3] as usize);
    let (key_blocks, rows_per_group) = (plan.packed.key_blocks, plan.flash.rows_per_group);
    let tiles = ScratchShape {
        head_dim,
        value_dim,
        query_grad_rows: Q_TILE_ROWS,
        tiled: false,
        key_blocks: 1,
        packs: false,
    };
    if plan.fused {
        // 2 and 3 in one, per head
        let heads = match plan.tiled {
            true => ScratchShape {
                value_dim: plan.pairs.value_width,
                query_grad_rows: PAIR_CHUNK_ROWS,
                tiled: true,
                key_blocks,
                packs: true,
                ..tiles
            },
            false => ScratchShape {
                query_grad_rows: BACKWARD_CHUNK_TILES * Q_TILE_ROWS,
                key_blocks,
                packs: true,
                ..tiles
            },
        };
        return for_each_item(batch * kv_heads, threads, heads, |head, s| {
            // SAFETY: item (b, kv_head) owns the head's dq, dk and dv rows and its dQ sums.
            unsafe { head_gradients::<T>(plan, head / kv_heads, head % kv_heads, s) };
        });
    }
    // 2. dK, dV.
    for_each_item(batch * kv_heads * key_blocks, threads, tiles, |index, s| {
        let head = index / key_blocks;
        let key_block = index % key_blocks * BACKWARD_KEY_BLOCK;
        // SAFETY: item (b, kv_head, key block) owns its keys' dk and dv rows.
        unsafe {
            let (b, kv_head) = (head / kv_heads, head % kv_heads);
            key_block_gradients::<T>(plan, b, kv_head, key_block, s)
        };
    })?;
    // 3. dQ.
    let query_tiles = rows_per_group.div_ceil(Q_TILE_ROWS);
    for_each_item(
        batch * kv_heads * query_tiles,
        threads,
        tiles,
        |index, s| {
            let (head, row_begin) = (index / query_tiles, index % query_tiles * Q_TILE_ROWS);
            let tile = WorkItem {
                b: head / kv_heads,
                kv_head: head % kv_heads,
                row_begin,
                row_end: (row_begin + Q_TILE_ROWS).min(rows_per_group),
                key_begin: 0,
                key_end: 0,
                partial_slot: None,
            };
            // SAFETY: item (b, kv_head, tile) owns the tile's dq rows.
            unsafe { query_tile_gradients::<T>(plan, &tile, s) };
        },
    )
}

/// Writes dq, dk and dv (every element: 0 for keys past kv_lens, keys no row sees and rows that
/// see no key) and dsinks when requested, after [`check_backward`] and [`check_num_threads`]. A
/// buffer that cannot be allocated gives [`ProblemError::out_of_memory`] (the gradients are then
/// unspecified); an error naming the instruction sets when TWINATTN_ISA names one this CPU
/// cannot run (as attention_forward). float32 arithmetic on the instruction set in use (dispatch.rs);
/// the results do not depend on num_threads (each gradient element is summed by one thread in a
/// fixed order). On amxbf16, bfloat16 with D a multiple of 32 multiplies on AMX tiles, P and dS
/// rounded to bfloat16 (the tile path, above).
///
/// # Safety
/// As [`crate::flash_attention::attention_forward`]: every view describes memory valid for its
/// whole shape; nobody else writes the inputs or touches the gradients meanwhile.
pub unsafe fn attention_backward(
    bp: &BackwardProblem,
    num_threads: usize,
) -> Result<(), ProblemError> {
    check_backward(bp)?;
    let threads = check_num_threads(i64::try_from(num_threads).unwrap_or(i64::MAX))?;
    let p = &bp.forward;
    // A call below SERIAL_WORK multiply-adds runs on the calling thread, as the forward's (the
    // results do not depend on it).
    let threads = if problem_work(p) < SERIAL_WORK as f64 {
        1
    } else {
        threads
    };
    // SAFETY: forwarded; the problem is checked.
    unsafe {
        match p.dtype {
            ElementType::Float32 => backward_passes::<f32>(bp, threads),
            ElementType::Float16 => backward_passes::<Float16>(bp, threads),
            ElementType::BFloat16 => backward_passes::<BFloat16>(bp, threads),
        }
    }
}
