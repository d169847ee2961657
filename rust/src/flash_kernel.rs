//! The tile kernel of the fast path (docs/kernels.md, steps 2-6), written once over a vector
//! type V (simd_scalar.rs, simd_avx2.rs, simd_avx512.rs, simd_neon.rs) and compiled once per
//! instruction set by flash_scalar.rs, flash_avx2.rs, flash_avx512.rs and flash_neon.rs, whose
//! `#[target_feature]` entry functions ([`make_kernels`]) call the `#[inline(always)]` generic
//! code (C++: one translation unit per instruction set with its own -m flags). Twin of
//! `cpp/src/flash_kernel.hpp`.
//!
//! One work item = a set of packed rows of one (sequence b, KV head) against a key range:
//!   packed row r is query position i = r / G of query head h = kv_head * G + r % G, at absolute
//!   position q_offset[b] + i (G = Hq / Hkv). Rows [row_begin, row_end), at most Q_TILE_ROWS.
//!   Keys [key_begin, key_end), visited in key blocks of KEY_BLOCK keys.
//! Shapes of the per-thread scratch (ThreadScratch), rows <= Q_TILE_ROWS (strips of MICRO_ROWS
//! rows, the last strip as many as remain: no padding rows):
//!   q_tile   (rows, D)            Q rows times scale * log2(e) (scale / softcap with softcap)
//!   scores   (rows, KEY_BLOCK)    S, then P, of one key block
//!   out_acc  (rows, value_stride) unnormalised O
//!   row_max, row_sum, rescale (rows)   m (base 2), l, and alpha of the current block
//!   row_key_begin, row_key_end (rows)  each row's visible key range (length, causal, window)
//!   key_panels (KEY_BLOCK / KEY_PANEL panels of (D, KEY_PANEL))   split-key path only
//!
//! Everything here works on raw pointers that the planner (flash_attention.rs) derived from a
//! checked problem; the functions are `unsafe` with that as their contract.

use crate::constants::{
    DECODE_NEAR_PREFETCH_BYTES, DECODE_PREFETCH_BYTES, DIRECT_SCORE_ROWS, KEY_BLOCK, KEY_PANEL,
    LOG2_E, MICRO_ROWS, SCORE_PREFETCH_BYTES, TANH_COEFFICIENTS, TANH_DEGREE, TANH_SMALL,
    VALUE_KEY_CHUNK, VALUE_PANEL,
};
use crate::element::{Element, Load};
use crate::flash_attention::{
    flash_key_rows, flash_row_key_range, flash_row_lse, flash_row_position,
};
use crate::problem::{AttentionProblem, ElementType, MaskKind};
use crate::simd::Vector;

/// What every work item of one call shares (built by flash_attention.rs).
#[derive(Clone, Copy)]
pub struct FlashPlan<'p, 'a> {
    pub problem: &'p AttentionProblem<'a>,
    /// G = Hq / Hkv
    pub group: usize,
    /// Lq * G packed rows per (b, kv_head)
    pub rows_per_group: usize,
    /// D
    pub head_dim: usize,
    /// Dv
    pub value_dim: usize,
    /// row stride of out_acc: Dv rounded up to a multiple of 16
    pub value_stride: usize,
    /// scale * log2(e); scale / softcap when softcap > 0
    pub q_multiplier: f32,
    pub has_mask: bool,
    /// softcap > 0: S (= scale q.k / softcap) becomes tanh(S) * softcap_multiplier (softcap *
    /// log2(e)), in base 2 like every score of the kernel
    pub has_softcap: bool,
    pub softcap_multiplier: f32,
    /// -slope[b, h] * log2(e) * |p - j| added by index arithmetic
    pub has_alibi: bool,
    /// the sink enters m and l once per row (docs/kernels.md, "Sinks")
    pub has_sinks: bool,
    /// Prefill: the K^T panels of the heads of one wave (flash_attention.rs, step 2), head
    /// (b, kv_head) at index head = b * Hkv + kv_head - first_packed_head of the packed buffers
    /// below, panels_per_head panels each, panel p at packed_keys + (head * panels_per_head + p) *
    /// D * KEY_PANEL. Null on the split-key path (each item packs its own blocks).
    pub packed_keys: *const f32,
    pub panels_per_head: usize,
    pub first_packed_head: usize,
    /// Prefill, except the pair path: the V panels of the wave's heads, float32 (converted
    /// exactly; int8 unscaled: v_scale multiplies P), ceil(Dv / VALUE_PANEL) panels of
    /// panels_per_head * KEY_PANEL keys x VALUE_PANEL columns each, key j, column c of
    /// head at value_panels + head * value_head_floats +
    /// (c / VALUE_PANEL) * panels_per_head * KEY_PANEL * VALUE_PANEL + j * VALUE_PANEL +
    /// c % VALUE_PANEL. Null elsewhere (P.V reads V rows in place).
    pub value_panels: *const f32,
    pub value_head_floats: usize,
    /// The bfloat16 dot-product path (avx512bf16, prefill; flash_avx512bf16.rs), else null:
    /// packed_keys then holds K pair panels, head at (head *
    /// panels_per_head) * ceil(D / 2) * KEY_PANEL pairs; packed_values the V pair rows, key pair
    /// kp of head at (head * panels_per_head * KEY_PANEL / 2 + kp) *
    /// value_stride pairs; value_finite one byte per key of each head
    /// (panels_per_head * KEY_PANEL), 1 when every value of that key's V row is finite.
    pub packed_values: *const u32,
    pub value_finite: *const u8,
    /// Split-key partials, slot s holding rows_per_group rows: out (Dv floats each), m, l.
    pub partial_out: *mut f32,
    pub partial_max: *mut f32,
    pub partial_sum: *mut f32,
}

// SAFETY: the plan is read-only while work items run; the memory behind its pointers is
// written by the items in disjoint parts (flash_attention.rs), so sharing it among the pool's
// threads is sound. (Raw pointers are neither Send nor Sync in Rust; C++ has no such rule.)
unsafe impl Sync for FlashPlan<'_, '_> {}

/// One work item.
#[derive(Clone, Copy, Debug)]
pub struct WorkItem {
    pub b: usize,
    pub kv_head: usize,
    /// packed rows [row_begin, row_end)
    pub row_begin: usize,
    pub row_end: usize,
    /// key range; each row also stops at its own visible end
    pub key_begin: usize,
    pub key_end: usize,
    /// None: write out and lse; Some(slot): the partials slot to write
    pub partial_slot: Option<usize>,
}

/// Per-thread scratch, sized by the planner (see the module documentation).
pub struct ThreadScratch {
    pub q_tile: *mut f32,
    pub scores: *mut f32,
    pub out_acc: *mut f32,
    pub row_max: *mut f32,
    pub row_sum: *mut f32,
    pub rescale: *mut f32,
    pub row_key_begin: *mut usize,
    pub row_key_end: *mut usize,
    pub key_panels: *mut f32,
    /// (rows, KEY_BLOCK / 2) bfloat16 pairs of P: the dot-product path only, else null
    pub probs_pairs: *mut u32,
    /// (rows, value_stride): the pair paths' P.V of P's low bfloat16 parts, only when out32 is
    /// requested (flash_avx512bf16.rs); else null
    pub out_acc_lo: *mut f32,
    /// int8 K/V: the current block's k_scale and v_scale (KEY_BLOCK each; 0 past the block's
    /// keys)
    pub key_scales: *mut f32,
    pub value_scales: *mut f32,
    /// The current block's K and V rows (KEY_BLOCK each, [`flash_key_rows`]): dense or paged
    /// alike; key_rows has room for KEY_BLOCK more, the next block's first rows (the direct
    /// path's prefetch, step 6).
    pub key_rows: *mut *const u8,
    pub value_rows: *mut *const u8,
}

/// Runs one work item. # Safety: see [`attend_rows`].
pub type AttendRowsFn = unsafe fn(&FlashPlan, &WorkItem, &ThreadScratch);
/// Packs keys [key_begin, key_end) of one (b, kv_head) into K^T panels at dst (the first panel
/// holds keys key_begin ...); the last panel's columns past key_end are zero.
/// # Safety: see [`pack_keys`].
pub type PackKeysFn = unsafe fn(&AttentionProblem, usize, usize, usize, usize, *mut f32);
/// The bfloat16 dot-product path: packs keys [key_begin, key_end) of one (b, kv_head) (key_begin
/// a multiple of KEY_PANEL) into K pair panels at key_dst (the panel of key_begin), V pair rows
/// at value_dst (the pair of key_begin) and the per-key finite flags at finite_dst (key_begin's);
/// the last argument is value_stride. # Safety: see flash_avx512bf16.rs, `pack_pairs`.
pub type PackPairsFn =
    unsafe fn(&AttentionProblem, usize, usize, usize, usize, *mut u32, *mut u32, *mut u8, usize);
/// Packs V of keys [key_begin, key_end) of one (b, kv_head) into V panels at dst (the row of
/// key_begin in the first panel), the last argument (panel_floats) apart
/// ([`FlashPlan::value_panels`]). (C++ passes the range as key_begin, key_end.)
/// # Safety: see [`pack_values`].
pub type PackValuesFn =
    unsafe fn(&AttentionProblem, usize, usize, std::ops::Range<usize>, *mut f32, usize);
/// values = tanh(values) with the vectorised tanh (constants.rs, "tanh"); the length a multiple
/// of the vector width (tests call it on whole vectors).
/// # Safety: the CPU supports the kernels' instruction set (as for every entry of FlashKernels).
pub type TanhFn = unsafe fn(&mut [f32]);

/// Indexed by ElementType: [Float32], [Float16], [BFloat16].
pub const ELEMENT_TYPES: usize = 3;

/// The kernels of one instruction set. `attend_rows` and `pack_keys` hold one entry per storage
/// type, indexed by `ElementType as usize` (float32, float16, bfloat16): the kernels generic over
/// [`Element`]. (pack_keys writes float32 panels whatever the storage: the convert path.)
#[derive(Clone, Copy)]
pub struct FlashKernels {
    pub isa: &'static str,
    pub attend_rows: [AttendRowsFn; ELEMENT_TYPES],
    pub pack_keys: [PackKeysFn; ELEMENT_TYPES],
    pub tanh_values: TanhFn,
    /// floats per vector
    pub width: usize,
    /// bfloat16 prefill by dot products (avx512bf16 only; None elsewhere): packs the pair
    /// panels that attend_rows[BFloat16] then reads.
    pub pack_pairs: Option<PackPairsFn>,
    /// int8 K/V, indexed by q's dtype; the K^T panels hold float32(k) * k_scale whatever q is.
    pub attend_rows_int8: [AttendRowsFn; ELEMENT_TYPES],
    pub pack_keys_int8: PackKeysFn,
    /// The backward pass's inner products (backward_kernel.rs).
    pub backward: crate::backward_kernel::BackwardKernels,
    /// The prefill's V panels, indexed by ElementType; int8 K/V.
    pub pack_values: [PackValuesFn; ELEMENT_TYPES],
    pub pack_values_int8: PackValuesFn,
}

pub(crate) fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// `a > b ? a : b`, and NaN when either is NaN (the row max keeps a NaN score).
#[inline(always)]
pub(crate) fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || a > b {
        a
    } else {
        b
    }
}

/// Element offset of an index in a strided view.
#[inline(always)]
pub(crate) fn at<const N: usize>(index: [usize; N], stride: &[i64; N]) -> isize {
    let mut offset = 0i64;
    for axis in 0..N {
        offset += index[axis] as i64 * stride[axis];
    }
    offset as isize
}

// ---- tanh (softcap; constants.rs, "tanh") ------------------------------------------------------

/// a = |x| (max(x, -x) keeps a NaN), both branches computed, the polynomial chosen unless
/// TANH_SMALL < a (so a NaN takes it and stays NaN), then the sign of x. Twin of C++'s
/// Kernel::tanh, operation for operation.
///
/// # Safety
/// V's instruction set is available.
#[inline(always)]
pub unsafe fn tanh<V: Vector>(x: V) -> V {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let zero = V::zero();
        let one = V::broadcast(1.0);
        let a = V::max(x, V::sub(zero, x));
        let u = V::mul(a, a);
        let mut poly = V::broadcast(TANH_COEFFICIENTS[TANH_DEGREE]);
        for c in (0..TANH_DEGREE).rev() {
            poly = V::fma(poly, u, V::broadcast(TANH_COEFFICIENTS[c]));
        }
        let small = V::fma(V::mul(a, u), poly, a);
        let e = V::exp2(V::mul(a, V::broadcast(-2.0 * LOG2_E)));
        let large = V::div(V::sub(one, e), V::add(one, e));
        let t = V::select_less(V::broadcast(TANH_SMALL), a, large, small);
        V::select_less(x, zero, V::sub(zero, t), t)
    }
}

/// # Safety
/// V's instruction set is available; values.len() is a multiple of V::WIDTH.
#[inline(always)]
pub(crate) unsafe fn tanh_values<V: Vector>(values: &mut [f32]) {
    let p = values.as_mut_ptr();
    // SAFETY: forwarded; every vector lies inside `values`.
    unsafe {
        for j in (0..values.len() / V::WIDTH * V::WIDTH).step_by(V::WIDTH) {
            tanh::<V>(V::load(p.add(j))).store(p.add(j));
        }
    }
}

/// 3a''. Softcap: S (= scale q.k / softcap) -> tanh(S) * softcap * log2(e), whole vectors (the
/// padding columns too; they are overwritten with -inf afterwards).
///
/// # Safety
/// As [`attend_rows`].
#[inline(always)]
pub(crate) unsafe fn softcap_block<V: Vector>(
    plan: &FlashPlan,
    s: &ThreadScratch,
    rows: usize,
    n_padded: usize,
) {
    // SAFETY: forwarded; rows x n_padded lies inside the scores scratch.
    unsafe {
        let multiplier = V::broadcast(plan.softcap_multiplier);
        for r in 0..rows {
            let row = s.scores.add(r * KEY_BLOCK);
            for j in (0..n_padded).step_by(V::WIDTH) {
                V::mul(tanh::<V>(V::load(row.add(j))), multiplier).store(row.add(j));
            }
        }
    }
}

// ---- 2. Packing ------------------------------------------------------------------------------

/// The rows of keys [first, first + keys) of (b, kv_head), keys <= KEY_PANEL ([`flash_key_rows`]):
/// their K rows, or their V rows when `values`, and the int8 scales of the same (k_scale or
/// v_scale) at `scales` unless it is null.
///
/// # Safety
/// As [`flash_key_rows`]; `scales` null or valid for writing `keys` floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn panel_rows(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    first: usize,
    keys: usize,
    values: bool,
    rows: &mut [*const u8; KEY_PANEL],
    scales: *mut f32,
) {
    let none = std::ptr::null_mut();
    let (k_rows, v_rows) = match values {
        true => (none, rows.as_mut_ptr()),
        false => (rows.as_mut_ptr(), none),
    };
    let (k_scales, v_scales) = match values {
        true => (std::ptr::null_mut(), scales),
        false => (scales, std::ptr::null_mut()),
    };
    // SAFETY: forwarded from this function's contract; rows holds KEY_PANEL >= keys pointers.
    unsafe {
        flash_key_rows(
            p, b, kv_head, first, keys, k_rows, v_rows, k_scales, v_scales,
        )
    }
}

/// # Safety
/// `p` is a checked problem whose views are valid; b < B, kv_head < Hkv, key_end <= kv_lens[b];
/// `dst` is valid for writing ceil((key_end - key_begin) / KEY_PANEL) * D * KEY_PANEL floats.
#[inline(always)]
pub unsafe fn pack_keys<V: Vector, T: Load>(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    key_begin: usize,
    key_end: usize,
    mut dst: *mut f32,
) {
    let d_len = p.k.shape[3] as usize;
    // SAFETY: forwarded from this function's contract: every key row read is < kv_lens[b], every
    // write lies inside dst's panels.
    unsafe {
        // The panel's K rows and (int8) k_scale: column j holds float32(k_j) * k_scale[j] (one
        // rounding), so the micro-kernels are the float32 ones.
        let mut k_rows = [std::ptr::null::<u8>(); KEY_PANEL];
        let mut k_scale = [0.0f32; KEY_PANEL];
        let w = V::WIDTH;
        let mut panel_begin = key_begin;
        while panel_begin < key_end {
            let keys = (key_end - panel_begin).min(KEY_PANEL);
            let scales = if T::SCALED {
                k_scale.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            };
            panel_rows(p, b, kv_head, panel_begin, keys, false, &mut k_rows, scales);
            let mut d_done = 0;
            if keys == KEY_PANEL {
                // whole panel: WIDTH x WIDTH blocks transposed in registers
                let mut block = [V::zero(); MAX_WIDTH];
                while d_done + w <= d_len {
                    for j in (0..KEY_PANEL).step_by(w) {
                        for (t, row) in block.iter_mut().enumerate().take(w) {
                            *row = T::load::<V>(k_rows[j + t].cast::<T>().add(d_done));
                            if T::SCALED {
                                *row = V::mul(*row, V::broadcast(k_scale[j + t]));
                            }
                        }
                        V::transpose(&mut block[..w]);
                        for (t, column) in block.iter().enumerate().take(w) {
                            column.store(dst.add((d_done + t) * KEY_PANEL + j));
                        }
                    }
                    d_done += w;
                }
            }
            for j in 0..keys {
                // the rest, element by element
                let k_row = k_rows[j].cast::<T>();
                if T::SCALED {
                    let scale = k_scale[j];
                    for d in d_done..d_len {
                        *dst.add(d * KEY_PANEL + j) = (*k_row.add(d)).to_f32() * scale;
                    }
                } else {
                    for d in d_done..d_len {
                        *dst.add(d * KEY_PANEL + j) = (*k_row.add(d)).to_f32();
                    }
                }
            }
            for j in keys..KEY_PANEL {
                for d in 0..d_len {
                    *dst.add(d * KEY_PANEL + j) = 0.0;
                }
            }
            dst = dst.add(d_len * KEY_PANEL);
            panel_begin += KEY_PANEL;
        }
    }
}

/// V rows converted to float32 (int8: unscaled), VALUE_PANEL columns per panel, the last panel's
/// columns past Dv zero ([`FlashPlan::value_panels`]).
///
/// # Safety
/// `p` is a checked problem whose views are valid; b < B, kv_head < Hkv, keys.end <= kv_lens[b];
/// `dst` is valid for writing keys.len() rows (rounded up to KEY_PANEL) of VALUE_PANEL floats in
/// each of the ceil(Dv / VALUE_PANEL) panels, `panel_floats` apart.
#[inline(always)]
pub unsafe fn pack_values<V: Vector, T: Load>(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    keys: std::ops::Range<usize>,
    mut dst: *mut f32,
    panel_floats: usize,
) {
    let value_dim = p.v.shape[3] as usize;
    let w = V::WIDTH;
    // SAFETY: forwarded from this function's contract: every V row read is < kv_lens[b], every
    // write lies inside dst's panels.
    unsafe {
        let mut v_rows = [std::ptr::null::<u8>(); KEY_PANEL];
        let none = std::ptr::null_mut();
        for first in keys.clone().step_by(KEY_PANEL) {
            let panel_keys = (keys.end - first).min(KEY_PANEL);
            panel_rows(p, b, kv_head, first, panel_keys, true, &mut v_rows, none);
            for (j, &row) in v_rows.iter().enumerate().take(panel_keys) {
                let v_row = row.cast::<T>();
                for column in (0..value_dim).step_by(VALUE_PANEL) {
                    let panel_row = dst.add(column / VALUE_PANEL * panel_floats + j * VALUE_PANEL);
                    let width = (value_dim - column).min(VALUE_PANEL);
                    let mut c = 0;
                    while c + w <= width {
                        T::load::<V>(v_row.add(column + c)).store(panel_row.add(c));
                        c += w;
                    }
                    if c < width {
                        T::load_tail::<V>(v_row.add(column + c), width - c)
                            .store_tail(panel_row.add(c), width - c);
                    }
                    for c in width..VALUE_PANEL {
                        *panel_row.add(c) = 0.0;
                    }
                }
            }
            dst = dst.add(KEY_PANEL * VALUE_PANEL);
        }
    }
}

/// `$body` for the strip height `$height` (1..=MICRO_ROWS; 6 above), with the const `$rows` set
/// to it, so that each height runs its own monomorphised micro-kernel (used here and by
/// flash_avx512bf16.rs).
macro_rules! match_strip_rows {
    ($height:expr, $rows:ident => $body:expr) => {
        match_strip_rows!(@arms $height, $rows, $body, [1 2 3 4 5], 6)
    };
    (@arms $height:expr, $rows:ident, $body:expr, [$($n:literal)*], $last:literal) => {{
        const {
            assert!(
                crate::constants::MICRO_ROWS == $last,
                "the match below lists the strip heights 1..MICRO_ROWS"
            )
        };
        match $height {
            $($n => {
                const $rows: usize = $n;
                $body
            })*
            _ => {
                const $rows: usize = $last;
                $body
            }
        }
    }};
}
pub(crate) use match_strip_rows;

// ---- 3a. S = Q K^T: R (<= MICRO_ROWS) rows x SCORE_VECTORS vectors of keys -------------------

/// Accumulator arrays are sized for the widest blocking; only the first SV / NV are used (the
/// loops have constant bounds after monomorphisation, so the compiler keeps them in registers).
/// (C++ sizes them with the template parameter; Rust cannot size an array by an associated
/// constant of a generic parameter on stable.)
const MAX_VECTORS: usize = 4;
/// The widest vector type's WIDTH (AVX-512: 16 floats): the transpose block of [`pack_keys`].
const MAX_WIDTH: usize = 16;

/// q: R rows of D; panel: (D, KEY_PANEL) already offset to the first key column; vector v of
/// the sv reads panel v / panel_vectors after it (D * KEY_PANEL floats apart: the micro-kernel
/// may span panels); scores: R rows of stride KEY_BLOCK. While it reads panel row d it
/// prefetches the same columns SCORE_PREFETCH_BYTES further on in each panel it reads (a strip
/// reads the panels as one stream, panel after panel; past the last panel the hint reads nothing
/// the program sees). sv is a constant after inlining (C++: a template parameter).
///
/// # Safety
/// V's instruction set is available; the pointers cover what is described above.
#[inline(always)]
unsafe fn score_micro<V: Vector, const R: usize>(
    q: *const f32,
    d_len: usize,
    panel: *const f32,
    scores: *mut f32,
    sv: usize,
) {
    let w = V::WIDTH;
    // vectors per panel read, and the panels read
    let panel_vectors = (KEY_PANEL / w).min(sv);
    let panels = sv / panel_vectors;
    let micro_lines = (panel_vectors * w * size_of::<f32>()).div_ceil(64);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[V::zero(); MAX_VECTORS]; R];
        for d in 0..d_len {
            for pp in 0..panels {
                // wrapping: the address may lie past the panels (a prefetch never faults)
                let ahead = panel
                    .add(pp * d_len * KEY_PANEL + d * KEY_PANEL)
                    .cast::<u8>()
                    .wrapping_add(SCORE_PREFETCH_BYTES);
                for line in 0..micro_lines {
                    prefetch_line(ahead.wrapping_add(line * 64));
                }
            }
            let mut keys = [V::zero(); MAX_VECTORS];
            for (v, key) in keys.iter_mut().enumerate().take(sv) {
                *key = V::load(panel.add(
                    v / panel_vectors * d_len * KEY_PANEL + d * KEY_PANEL + v % panel_vectors * w,
                ));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let q_rd = V::broadcast(*q.add(r * d_len + d));
                for v in 0..sv {
                    acc_r[v] = V::fma(q_rd, keys[v], acc_r[v]);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &a) in acc_r.iter().enumerate().take(sv) {
                a.store(scores.add(r * KEY_BLOCK + v * w));
            }
        }
    }
}

/// S for one strip of R rows against every panel of the block (n keys): micro-kernels of
/// SCORE_VECTORS vectors from key 0 on; where fewer keys than that remain in the block's panels
/// (SCORE_VECTORS * WIDTH > KEY_PANEL: the last panel), one panel's width, so no panel past the
/// block's is read.
///
/// # Safety
/// As [`score_micro`], for every micro tile of the strip.
#[inline(always)]
unsafe fn strip_scores<V: Vector, const R: usize>(
    q: *const f32,
    d_len: usize,
    panels: *const f32,
    n: usize,
    scores: *mut f32,
) {
    let sv = V::SCORE_VECTORS;
    let keys_per_micro = sv * V::WIDTH;
    let panel_vectors = (KEY_PANEL / V::WIDTH).min(sv);
    let panel_keys = round_up(n, KEY_PANEL);
    let mut j = 0;
    while j < n {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            let panel = panels.add(j / KEY_PANEL * d_len * KEY_PANEL + j % KEY_PANEL);
            if j + keys_per_micro <= panel_keys {
                score_micro::<V, R>(q, d_len, panel, scores.add(j), sv);
                j += keys_per_micro;
            } else {
                score_micro::<V, R>(q, d_len, panel, scores.add(j), panel_vectors);
                j += panel_vectors * V::WIDTH;
            }
        }
    }
}

/// S for all rows: strips of MICRO_ROWS rows, the last strip as many rows as remain (no padding
/// rows are computed). A strip streams the block's panels from L2 (prefetched in
/// [`score_micro`]) while its Q rows stay in L1.
///
/// # Safety
/// As [`score_micro`], for every micro tile.
#[inline(always)]
unsafe fn block_scores<V: Vector>(
    q_tile: *const f32,
    d_len: usize,
    rows: usize,
    panels: *const f32,
    n: usize,
    scores: *mut f32,
) {
    for r in (0..rows).step_by(MICRO_ROWS) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            let q = q_tile.add(r * d_len);
            let out = scores.add(r * KEY_BLOCK);
            match_strip_rows!((rows - r).min(MICRO_ROWS), R => {
                strip_scores::<V, R>(q, d_len, panels, n, out)
            });
        }
    }
}

// ---- Prefetch (the direct split-key path, docs/kernels.md step 6) ------------------------------

/// An item reads, per key block, its n K rows (scores), then its n V rows (P.V), then the next
/// block's K rows: one read order. Reading position m of it, the kernel prefetches position
/// m + far (DECODE_PREFETCH_BYTES of K rows ahead) into L2 and position m + near
/// (DECODE_NEAR_PREFETCH_BYTES) from there into L1, so that memory streams while the FMAs run:
/// the hardware prefetcher alone left the two taking turns.
pub struct ReadAhead {
    /// the block's n K rows, then the next block's, up to key_rows_end
    pub key_rows: *const *const u8,
    /// the block's n V rows
    pub value_rows: *const *const u8,
    /// keys in the block
    pub n: usize,
    /// key rows filled: n plus the next block's first ones
    pub key_rows_end: usize,
    /// positions between a read and its prefetch into L1, and into L2
    pub near: usize,
    pub far: usize,
    /// bytes of a K row and of a V row
    pub key_bytes: usize,
    pub value_bytes: usize,
}

/// One cache line into L1, or into L2 when L2 (the read-ahead's far hint). (C++ uses an asm
/// statement: GCC deletes its prefetch builtin in these inlined loops; LLVM keeps the intrinsic.)
#[inline(always)]
fn prefetch_line_into<const L2: bool>(line: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and reads nothing the program sees.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T2};
        if L2 {
            _mm_prefetch::<_MM_HINT_T2>(line.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(line.cast());
        }
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above; the instruction only hints the cache.
    unsafe {
        if L2 {
            std::arch::asm!("prfm pldl2keep, [{0}]", in(reg) line, options(nostack, readonly, preserves_flags));
        } else {
            std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) line, options(nostack, readonly, preserves_flags));
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = line;
}

#[inline(always)]
fn prefetch_line(line: *const u8) {
    prefetch_line_into::<false>(line);
}

#[inline(always)]
fn prefetch_row<const L2: bool>(row: *const u8, bytes: usize) {
    let end = row as usize + bytes;
    let mut line = row as usize & !63;
    while line < end {
        prefetch_line_into::<L2>(line as *const u8);
        line += 64;
    }
}

/// Every line of the item's Q rows into L1, before step 2 copies them: the rows lie in G heads'
/// runs of positions, and read one after another their lines came from memory a few at a time
/// (the copy took 20% of a float32 prefill tile's own time, 2% of the whole).
///
/// # Safety
/// `plan`'s problem views are valid and `item` is one of its work items.
#[inline(always)]
pub(crate) unsafe fn prefetch_q_tile<T: Element>(plan: &FlashPlan, item: &WorkItem) {
    let p = plan.problem;
    let strides = [p.q.stride[0], p.q.stride[1], p.q.stride[2]];
    for packed in item.row_begin..item.row_end {
        let (h, i) = (
            item.kv_head * plan.group + packed % plan.group,
            packed / plan.group,
        );
        // SAFETY: (item.b, h, i) indexes a row of the checked q view.
        let row = unsafe { p.q.data.cast::<T>().offset(at([item.b, h, i], &strides)) };
        prefetch_row::<false>(row.cast(), plan.head_dim * std::mem::size_of::<T>());
    }
}

/// Prefetches position m of the read order (nothing past the item's keys).
///
/// # Safety
/// `ahead`'s row pointers are valid for the indices its counts give.
#[inline(always)]
unsafe fn prefetch_position<const L2: bool>(ahead: &ReadAhead, m: usize) {
    // SAFETY: every index is checked against the counts filled.
    unsafe {
        if m < ahead.n {
            prefetch_row::<L2>(*ahead.key_rows.add(m), ahead.key_bytes);
        } else if m < 2 * ahead.n {
            prefetch_row::<L2>(*ahead.value_rows.add(m - ahead.n), ahead.value_bytes);
        } else if m - ahead.n < ahead.key_rows_end {
            prefetch_row::<L2>(*ahead.key_rows.add(m - ahead.n), ahead.key_bytes);
        }
    }
}

/// The read-ahead's distance of `bytes` bytes of K rows (key_bytes each) in rows: 1 to
/// KEY_BLOCK.
fn rows_ahead(bytes: usize, key_bytes: usize) -> usize {
    bytes.div_ceil(key_bytes.max(1)).clamp(1, KEY_BLOCK)
}

/// Reading position m of the read order: position m + near into L1, then m + far into L2.
///
/// # Safety
/// As prefetch_position.
#[inline(always)]
unsafe fn read_ahead(ahead: &ReadAhead, m: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        prefetch_position::<false>(ahead, m + ahead.near);
        prefetch_position::<true>(ahead, m + ahead.far);
    }
}

// ---- 3a'. Direct S (split-key groups of at most DIRECT_SCORE_ROWS rows, docs step 6) ------------

/// K is read in place (its rows are contiguous): no K^T panel. One batch of four keys k[0..3]
/// against R rows of q: one accumulator per (row, key), then each row's four accumulators
/// reduced to one vector by [`Vector::reduce4`], into y[r][batch]. D is walked WIDTH floats at a
/// time (the last chunk a masked tail load of q and k: lanes past D are 0 and never read), chunk
/// d of the four keys together, so each q chunk is loaded once for four keys; every accumulator
/// still sums over D in order. (With no software prefetch this interleaving stalled on memory,
/// 22 ms against 13.5-14 ms for whole rows one key after another at 32k keys on one thread; with
/// the read-ahead above it is the faster order.)
///
/// # Safety
/// V's instruction set is available; q: R rows of d_len floats; k: four rows of d_len floats.
#[inline(always)]
unsafe fn direct_batch<V: Vector, T: Load, const R: usize>(
    q: *const f32,
    d_len: usize,
    k: &[*const T; 4],
    y: &mut [[V; 4]; R],
    batch: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[V::zero(); 4]; R];
        let mut d = 0;
        while d + w <= d_len {
            let key_d: [V; 4] = std::array::from_fn(|t| T::load::<V>(k[t].add(d)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let q_rd = V::load(q.add(r * d_len + d));
                for t in 0..4 {
                    acc_r[t] = V::fma(q_rd, key_d[t], acc_r[t]);
                }
            }
            d += w;
        }
        if d < d_len {
            let tail = d_len - d;
            let key_d: [V; 4] = std::array::from_fn(|t| T::load_tail::<V>(k[t].add(d), tail));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let q_rd = V::load_tail(q.add(r * d_len + d), tail);
                for t in 0..4 {
                    acc_r[t] = V::fma(q_rd, key_d[t], acc_r[t]);
                }
            }
        }
        for (y_r, acc_r) in y.iter_mut().zip(acc.iter()) {
            y_r[batch] = V::reduce4(acc_r[0], acc_r[1], acc_r[2], acc_r[3]);
        }
    }
}

/// S of R rows for keys [j0, j0 + WIDTH) of the block: WIDTH / 4 batches of four keys, then per
/// row [`Vector::fold_groups`] into WIDTH scores. A key at or past n (past the block's end) is
/// never read: a batch wholly past n is 0, a key past n inside a batch reuses key n - 1; both
/// scores are overwritten with -inf before the softmax. int8: each score is then acc * k_scale
/// (one multiply per (row, key); key_scales holds the block's, 0 past n). ahead (the first strip
/// only, else None): each batch reads ahead of its four positions ([`read_ahead`]).
///
/// # Safety
/// V's instruction set is available; q: R rows of d_len floats; k_rows: n row pointers, d_len
/// elements each; scores: R rows of stride KEY_BLOCK, j0 + WIDTH <= KEY_BLOCK.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn direct_strip<V: Vector, T: Load, const R: usize>(
    q: *const f32,
    d_len: usize,
    k_rows: *const *const u8,
    j0: usize,
    n: usize,
    key_scales: *const f32,
    scores: *mut f32,
    ahead: Option<&ReadAhead>,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut y = [[V::zero(); 4]; R];
        for batch in 0..V::WIDTH / 4 {
            let first = j0 + 4 * batch;
            if first >= n {
                continue; // y stays 0
            }
            let k: [*const T; 4] =
                std::array::from_fn(|t| (*k_rows.add((first + t).min(n - 1))).cast::<T>());
            if let Some(ahead) = ahead {
                for t in 0..4 {
                    read_ahead(ahead, first + t);
                }
            }
            direct_batch::<V, T, R>(q, d_len, &k, &mut y, batch);
        }
        for (r, y_r) in y.iter().enumerate() {
            let mut scores_r = V::fold_groups(y_r);
            if T::SCALED {
                scores_r = V::mul(scores_r, V::load(key_scales.add(j0)));
            }
            scores_r.store(scores.add(r * KEY_BLOCK + j0));
        }
    }
}

/// S for all rows (<= DIRECT_SCORE_ROWS) against the block's n keys read in place: groups of
/// WIDTH keys, each in strips of V::DIRECT_STRIP_ROWS rows (the last strip as many as remain).
///
/// # Safety
/// As [`direct_strip`], for rows rows of q_tile and scores.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn direct_block_scores<V: Vector, T: Load>(
    q_tile: *const f32,
    d_len: usize,
    rows: usize,
    k_rows: *const *const u8,
    n: usize,
    key_scales: *const f32,
    scores: *mut f32,
    ahead: &ReadAhead,
) {
    let strip = V::DIRECT_STRIP_ROWS;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        for j0 in (0..n).step_by(V::WIDTH) {
            for r in (0..rows).step_by(strip) {
                let q = q_tile.add(r * d_len);
                let s = scores.add(r * KEY_BLOCK);
                let first_strip = if r == 0 { Some(ahead) } else { None };
                match_strip_rows!((rows - r).min(strip), R => {
                    direct_strip::<V, T, R>(q, d_len, k_rows, j0, n, key_scales, s, first_strip)
                });
            }
        }
    }
}

// ---- 3d. O = alpha O + P V: R (<= MICRO_ROWS) rows x NV vectors of value columns -------------

/// Where P.V reads V: `row(key)` is the key's value at the current column, for keys counted from
/// the current chunk's first key; `keys_from(j)` moves that first key on by j, `columns_from(c)`
/// the column by c (within one V panel: a column block never straddles two). (C++'s ValueRows
/// and ValuePanels are duck-typed; Rust states their operations as this trait.)
pub(crate) trait Values: Copy {
    /// The storage type of the values read.
    type Elem: Load;
    /// # Safety
    /// `key` is one of the keys this source covers.
    unsafe fn row(&self, key: usize) -> *const Self::Elem;
    /// # Safety
    /// The source covers the key `key`.
    unsafe fn keys_from(&self, key: usize) -> Self;
    /// # Safety
    /// The source covers the column `column`.
    unsafe fn columns_from(&self, column: usize) -> Self;
}

/// The rows in place, one pointer per key (split-key items, the pair path's fallback).
#[derive(Clone, Copy)]
pub struct ValueRows<T> {
    pub rows: *const *const u8,
    pub column: usize,
    /// The rows' storage type (a raw u8 pointer per row, as flash_key_rows gives them).
    pub element: std::marker::PhantomData<T>,
}

impl<T: Load> ValueRows<T> {
    pub(crate) fn new(rows: *const *const u8) -> Self {
        ValueRows {
            rows,
            column: 0,
            element: std::marker::PhantomData,
        }
    }
}

impl<T: Load> Values for ValueRows<T> {
    type Elem = T;
    #[inline(always)]
    unsafe fn row(&self, key: usize) -> *const T {
        // SAFETY: forwarded: rows holds the key's row pointer.
        unsafe { (*self.rows.add(key)).cast::<T>().add(self.column) }
    }
    #[inline(always)]
    unsafe fn keys_from(&self, key: usize) -> Self {
        // SAFETY: forwarded: rows holds the key's row pointer.
        let rows = unsafe { self.rows.add(key) };
        ValueRows { rows, ..*self }
    }
    #[inline(always)]
    unsafe fn columns_from(&self, column: usize) -> Self {
        ValueRows {
            column: self.column + column,
            ..*self
        }
    }
}

/// The prefill's packed V panels ([`FlashPlan::value_panels`]), float32, one VALUE_PANEL-float
/// row per key; panel_floats from one panel to the next.
#[derive(Clone, Copy)]
pub struct ValuePanels {
    pub first: *const f32,
    pub panel_floats: usize,
}

impl Values for ValuePanels {
    type Elem = f32;
    #[inline(always)]
    unsafe fn row(&self, key: usize) -> *const f32 {
        // SAFETY: forwarded: the key's row lies in the panel.
        unsafe { self.first.add(key * VALUE_PANEL) }
    }
    #[inline(always)]
    unsafe fn keys_from(&self, key: usize) -> Self {
        // SAFETY: forwarded: the key's row lies in the panel.
        let first = unsafe { self.first.add(key * VALUE_PANEL) };
        ValuePanels { first, ..*self }
    }
    #[inline(always)]
    unsafe fn columns_from(&self, column: usize) -> Self {
        let offset = column / VALUE_PANEL * self.panel_floats + column % VALUE_PANEL;
        // SAFETY: forwarded: the column lies in one of the panels.
        let first = unsafe { self.first.add(offset) };
        ValuePanels { first, ..*self }
    }
}

/// TAIL: the last vector holds only `tail` columns. SAFE: a row whose p is 0 (a hidden key)
/// skips the key, so a NaN in a hidden value never enters (0 * NaN = NaN). ahead (the direct
/// path's first strip and column block, else None): key j reads ahead of position n + j of the
/// read order ([`read_ahead`]).
///
/// # Safety
/// V's instruction set is available; probs: R rows of stride KEY_BLOCK, n keys;
/// values: n keys, each readable for the columns used; out: R rows of stride out_stride,
/// NV * WIDTH floats each; rescale: R floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_micro<
    V: Vector,
    S: Values,
    const R: usize,
    const NV: usize,
    const TAIL: bool,
    const SAFE: bool,
>(
    probs: *const f32,
    n: usize,
    values: S,
    out: *mut f32,
    out_stride: usize,
    rescale: *const f32,
    do_rescale: bool,
    tail: usize,
    ahead: Option<&ReadAhead>,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[V::zero(); NV]; R];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let alpha = V::broadcast(*rescale.add(r));
            for (v, a) in acc_r.iter_mut().enumerate() {
                *a = V::load(out.add(r * out_stride + v * w));
                if do_rescale {
                    *a = V::mul(*a, alpha);
                }
            }
        }
        for key in 0..n {
            if let Some(ahead) = ahead {
                read_ahead(ahead, ahead.n + key);
            }
            let v_row = values.row(key);
            let mut value = [V::zero(); NV];
            for (v, value_v) in value.iter_mut().enumerate() {
                *value_v = if TAIL && v == NV - 1 {
                    S::Elem::load_tail::<V>(v_row.add(v * w), tail)
                } else {
                    S::Elem::load::<V>(v_row.add(v * w))
                };
            }
            if SAFE {
                // Row by row (C++ first tests whether all R weights are nonzero and
                // then runs the plain loop; here that kept six weights in registers beside 24
                // accumulators, and the AVX-512 build spilled three accumulators to the stack).
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let p = *probs.add(r * KEY_BLOCK + key);
                    if p == 0.0 {
                        continue;
                    }
                    let p_r = V::broadcast(p);
                    for v in 0..NV {
                        acc_r[v] = V::fma(p_r, value[v], acc_r[v]);
                    }
                }
                continue;
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let p_r = V::broadcast(*probs.add(r * KEY_BLOCK + key));
                for v in 0..NV {
                    acc_r[v] = V::fma(p_r, value[v], acc_r[v]);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &a) in acc_r.iter().enumerate() {
                a.store(out.add(r * out_stride + v * w));
            }
        }
    }
}

/// O for one strip of R rows: column blocks of VALUE_VECTORS vectors, then single vectors,
/// then the masked tail.
///
/// # Safety
/// As [`value_micro`], for R rows and Dv columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn strip_values<V: Vector, S: Values, const R: usize, const SAFE: bool>(
    probs: *const f32,
    n: usize,
    values: S,
    out: *mut f32,
    out_stride: usize,
    value_dim: usize,
    rescale: *const f32,
    ahead: Option<&ReadAhead>,
) {
    let w = V::WIDTH;
    let nv = V::VALUE_VECTORS;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut do_rescale = false;
        for s in 0..R {
            do_rescale |= *rescale.add(s) != 1.0;
        }
        // value_micro with NV vectors (TAIL: the last one `tail` columns) from column c
        macro_rules! micro {
            ($nv:literal, $tail:literal, $c:expr, $tail_columns:expr) => {
                value_micro::<V, S, R, $nv, $tail, SAFE>(
                    probs,
                    n,
                    values.columns_from($c),
                    out.add($c),
                    out_stride,
                    rescale,
                    do_rescale,
                    $tail_columns,
                    if $c == 0 { ahead } else { None },
                )
            };
        }
        let mut c = 0;
        while c + nv * w <= value_dim {
            // a const argument cannot be an associated constant of a generic parameter on
            // stable Rust, hence the match on VALUE_VECTORS (C++ passes it directly)
            match nv {
                4 => micro!(4, false, c, 0),
                2 => micro!(2, false, c, 0),
                _ => unreachable!("VALUE_VECTORS is 2 or 4"),
            }
            c += nv * w;
        }
        while c + w <= value_dim {
            micro!(1, false, c, 0);
            c += w;
        }
        if c < value_dim {
            micro!(1, true, c, value_dim - c);
        }
    }
}

/// O for all rows: key chunks of VALUE_KEY_CHUNK keys, each through every strip of MICRO_ROWS
/// rows (the last strip as many rows as remain), so that the chunk's V rows stay in L1 while
/// every strip reads them; alpha is applied with the first chunk. Each O element still sums its
/// keys in key order, so the chunks change no bit. ahead: the direct path's read order (None
/// elsewhere), prefetched by the first strip; that path reads the block in one chunk.
///
/// # Safety
/// As [`value_micro`], for every strip: rows rows, Dv columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn block_values<V: Vector, S: Values, const SAFE: bool>(
    scores: *const f32,
    rows: usize,
    n: usize,
    values: S,
    out_acc: *mut f32,
    out_stride: usize,
    value_dim: usize,
    rescale: *const f32,
    ahead: Option<&ReadAhead>,
) {
    static NO_RESCALE: [f32; MICRO_ROWS] = [1.0; MICRO_ROWS];
    let chunk = if ahead.is_none() { VALUE_KEY_CHUNK } else { n };
    let mut chunk_begin = 0;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        loop {
            // at least once: n = 0 still rescales O
            let keys = (n - chunk_begin).min(chunk);
            let chunk_values = values.keys_from(chunk_begin);
            for r in (0..rows).step_by(MICRO_ROWS) {
                let probs = scores.add(r * KEY_BLOCK + chunk_begin);
                let out = out_acc.add(r * out_stride);
                let alpha = if chunk_begin == 0 {
                    rescale.add(r)
                } else {
                    NO_RESCALE.as_ptr()
                };
                let first_strip = if r == 0 { ahead } else { None };
                match_strip_rows!((rows - r).min(MICRO_ROWS), R => {
                    strip_values::<V, S, R, SAFE>(
                        probs, keys, chunk_values, out, out_stride, value_dim, alpha, first_strip,
                    )
                });
            }
            chunk_begin += chunk;
            if chunk_begin >= n {
                break;
            }
        }
    }
}

// ---- The work item: steps 1-4 of docs/kernels.md for rows x keys ------------------------------

/// # Safety
/// V's instruction set is available; `plan` was built by flash_attention.rs from a checked
/// problem whose views are valid; `item` is one of its work items; `s` points to scratch sized
/// for the plan and used by no other thread.
#[inline(always)]
pub unsafe fn attend_rows<V: Vector, T: Element, KV: Load>(
    plan: &FlashPlan,
    item: &WorkItem,
    s: &ThreadScratch,
) {
    let p = plan.problem;
    let w = V::WIDTH;
    let (group, d_len, value_dim) = (plan.group, plan.head_dim, plan.value_dim);
    let out_stride = plan.value_stride;
    let rows = item.row_end - item.row_begin;
    let b = item.b;
    // SAFETY: forwarded from this function's contract: every index below stays inside the
    // checked views (rows < Lq * G, keys < row_key_end <= kv_lens[b]) or the sized scratch.
    unsafe {
        // 2. The Q tile, times scale * log2(e); each row's visible end; m = -inf, l = 0, O = 0.
        prefetch_q_tile::<T>(plan, item);
        let multiplier = V::broadcast(plan.q_multiplier);
        for r in 0..rows {
            let q_dst = s.q_tile.add(r * d_len);
            let packed = item.row_begin + r;
            let (h, i) = (item.kv_head * group + packed % group, packed / group);
            let q_src = p.q.data.cast::<T>().offset(at(
                [b, h, i],
                &[p.q.stride[0], p.q.stride[1], p.q.stride[2]],
            ));
            let mut d = 0;
            while d + w <= d_len {
                V::mul(T::load::<V>(q_src.add(d)), multiplier).store(q_dst.add(d));
                d += w;
            }
            if d < d_len {
                V::mul(T::load_tail::<V>(q_src.add(d), d_len - d), multiplier)
                    .store_tail(q_dst.add(d), d_len - d);
            }
            start_row(plan, item, s, r);
        }

        // 3. Key blocks from item.key_begin (at or before the first row's window start) up to
        // the last key any row sees (rows are ordered by position, so are their ranges' ends).
        let key_stop = (*s.row_key_end.add(rows - 1)).min(item.key_end);
        let k_head_panels = if plan.packed_keys.is_null() {
            std::ptr::null()
        } else {
            plan.packed_keys.add(
                (b * p.k.shape[1] as usize + item.kv_head - plan.first_packed_head)
                    * plan.panels_per_head
                    * d_len
                    * KEY_PANEL,
            )
        };
        // Split-key groups of few rows read K in place (3a'); the others pack K^T panels.
        let direct = plan.packed_keys.is_null() && rows <= DIRECT_SCORE_ROWS;
        // The direct path's read-ahead: DECODE_NEAR_PREFETCH_BYTES and DECODE_PREFETCH_BYTES of
        // K rows.
        let key_bytes = d_len * size_of::<KV>();
        let near = rows_ahead(DECODE_NEAR_PREFETCH_BYTES, key_bytes);
        let far = rows_ahead(DECODE_PREFETCH_BYTES, key_bytes);
        let mut key_block = item.key_begin;
        while key_block < key_stop {
            let n = (key_stop - key_block).min(KEY_BLOCK);
            let n_padded = round_up(n, w);
            // The block's K rows (read in place by the direct path only), V rows and int8
            // scales, 0 past n (those scores become -inf below); the direct path also takes the
            // next block's first K rows, for its read-ahead (never past the item's last key).
            let scales = |buffer: *mut f32| {
                if KV::SCALED {
                    buffer
                } else {
                    std::ptr::null_mut()
                }
            };
            flash_key_rows(
                p,
                b,
                item.kv_head,
                key_block,
                n,
                if direct {
                    s.key_rows
                } else {
                    std::ptr::null_mut()
                },
                if plan.value_panels.is_null() {
                    s.value_rows
                } else {
                    std::ptr::null_mut()
                },
                scales(s.key_scales),
                scales(s.value_scales),
            );
            let ahead_end = (key_stop - key_block).min(n + far);
            if direct && ahead_end > n {
                flash_key_rows(
                    p,
                    b,
                    item.kv_head,
                    key_block + n,
                    ahead_end - n,
                    s.key_rows.add(n),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                );
            }
            let ahead = ReadAhead {
                key_rows: s.key_rows,
                value_rows: s.value_rows,
                n,
                key_rows_end: ahead_end,
                near,
                far,
                key_bytes,
                value_bytes: value_dim * size_of::<KV>(),
            };
            if KV::SCALED {
                for j in n..n_padded {
                    *s.key_scales.add(j) = 0.0;
                    *s.value_scales.add(j) = 0.0;
                }
            }
            // (a) S = Q K^T (int8: direct scores times k_scale there, panels already scaled).
            if direct {
                direct_block_scores::<V, KV>(
                    s.q_tile,
                    d_len,
                    rows,
                    s.key_rows,
                    n,
                    s.key_scales,
                    s.scores,
                    &ahead,
                );
            } else {
                let panels = if k_head_panels.is_null() {
                    pack_keys::<V, KV>(p, b, item.kv_head, key_block, key_block + n, s.key_panels);
                    s.key_panels.cast_const()
                } else {
                    k_head_panels.add((key_block / KEY_PANEL) * d_len * KEY_PANEL)
                };
                block_scores::<V>(s.q_tile, d_len, rows, panels, n, s.scores);
            }
            // (a') - (c) Softcap, mask, online softmax.
            let masked = block_probabilities::<V>(plan, item, s, rows, key_block, n, n_padded);
            // (c') int8: P times v_scale after l has summed the unscaled P; a P of 0 (a hidden
            // key) stays 0, so a hidden key's NaN scale never enters.
            if KV::SCALED {
                for r in 0..rows {
                    let probs = s.scores.add(r * KEY_BLOCK);
                    for j in 0..n {
                        let prob = *probs.add(j);
                        *probs.add(j) = if prob == 0.0 {
                            0.0
                        } else {
                            prob * *s.value_scales.add(j)
                        };
                    }
                }
            }
            // (d) O = alpha O + P V: from the V panels one panel of columns at a time (prefill),
            // else from the V rows in place; SAFE when the block was masked.
            macro_rules! value_block {
                ($values:expr, $out:expr, $value_dim:expr, $ahead:expr) => {
                    if masked {
                        block_values::<V, _, true>(
                            s.scores, rows, n, $values, $out, out_stride, $value_dim, s.rescale,
                            $ahead,
                        )
                    } else {
                        block_values::<V, _, false>(
                            s.scores, rows, n, $values, $out, out_stride, $value_dim, s.rescale,
                            $ahead,
                        )
                    }
                };
            }
            if !plan.value_panels.is_null() {
                let values = ValuePanels {
                    first: plan.value_panels.add(
                        (b * p.k.shape[1] as usize + item.kv_head - plan.first_packed_head)
                            * plan.value_head_floats
                            + key_block * VALUE_PANEL,
                    ),
                    panel_floats: plan.panels_per_head * KEY_PANEL * VALUE_PANEL,
                };
                for column in (0..value_dim).step_by(VALUE_PANEL) {
                    let width = (value_dim - column).min(VALUE_PANEL);
                    value_block!(
                        values.columns_from(column),
                        s.out_acc.add(column),
                        width,
                        None
                    );
                }
            } else {
                let ahead = if direct { Some(&ahead) } else { None };
                value_block!(
                    ValueRows::<KV>::new(s.value_rows),
                    s.out_acc,
                    value_dim,
                    ahead
                );
            }
            key_block += KEY_BLOCK;
        }

        // 4. Finish: out = O / l and lse, or the partial (m, l, O) of this key range.
        for r in 0..rows {
            let packed = item.row_begin + r;
            let o = s.out_acc.add(r * out_stride);
            if let Some(slot) = item.partial_slot {
                let slot_row = slot * plan.rows_per_group + packed;
                std::ptr::copy_nonoverlapping(
                    o,
                    plan.partial_out.add(slot_row * value_dim),
                    value_dim,
                );
                *plan.partial_max.add(slot_row) = *s.row_max.add(r);
                *plan.partial_sum.add(slot_row) = *s.row_sum.add(r);
                continue;
            }
            finish_row::<V, T>(plan, item, s, r);
        }
    }
}

/// 2, per row: row r's visible key range, m and l (the sink's when this item writes out, else
/// -inf and 0: the sink enters once per row, here or in the merge), and O = 0.
///
/// # Safety
/// As [`attend_rows`], for a row r of the item.
#[inline(always)]
pub(crate) unsafe fn start_row(plan: &FlashPlan, item: &WorkItem, s: &ThreadScratch, r: usize) {
    let p = plan.problem;
    let packed = item.row_begin + r;
    let h = item.kv_head * plan.group + packed % plan.group;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let (key_begin, key_end) = flash_row_key_range(p, item.b, plan.group, packed);
        *s.row_key_begin.add(r) = key_begin;
        *s.row_key_end.add(r) = key_end;
        if plan.has_sinks && item.partial_slot.is_none() {
            let sink = *p.sinks.data.offset(h as isize * p.sinks.stride[0] as isize);
            *s.row_max.add(r) = sink * LOG2_E;
            *s.row_sum.add(r) = 1.0;
        } else {
            *s.row_max.add(r) = f32::NEG_INFINITY;
            *s.row_sum.add(r) = 0.0;
        }
        for c in 0..plan.value_stride {
            *s.out_acc.add(r * plan.value_stride + c) = 0.0;
        }
    }
}

/// 3 (a') - (c) on the block's scores S (rows x n, padded to n_padded): softcap; the mask,
/// applied only to blocks that cross a row's visible range (its window start or its visible
/// end) or when a mask is given, ALiBi's term on every block; -inf on the padding; the online
/// softmax (S becomes P, m and l updated, rescale set). Returns whether the block was masked.
///
/// # Safety
/// As [`attend_rows`], for the item's rows and the block's keys.
#[inline(always)]
pub(crate) unsafe fn block_probabilities<V: Vector>(
    plan: &FlashPlan,
    item: &WorkItem,
    s: &ThreadScratch,
    rows: usize,
    key_block: usize,
    n: usize,
    n_padded: usize,
) -> bool {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        if plan.has_softcap {
            softcap_block::<V>(plan, s, rows, n_padded);
        }
        let masked = plan.has_mask
            || *s.row_key_end < key_block + n
            || *s.row_key_begin.add(rows - 1) > key_block;
        if masked || plan.has_alibi {
            mask_block(plan, item, s, rows, key_block, n);
        }
        for r in 0..rows {
            for j in n..n_padded {
                *s.scores.add(r * KEY_BLOCK + j) = f32::NEG_INFINITY;
            }
        }
        for r in 0..rows {
            softmax_row::<V>(s.scores.add(r * KEY_BLOCK), n_padded, s, r);
        }
        masked
    }
}

/// 4, per row of an item that writes out: out = O / l, rounded to T as it is stored, and lse.
///
/// # Safety
/// As [`attend_rows`], for a row r of the item.
#[inline(always)]
pub(crate) unsafe fn finish_row<V: Vector, T: Element>(
    plan: &FlashPlan,
    item: &WorkItem,
    s: &ThreadScratch,
    r: usize,
) {
    let p = plan.problem;
    let (w, group, value_dim) = (V::WIDTH, plan.group, plan.value_dim);
    let packed = item.row_begin + r;
    let (h, i) = (item.kv_head * group + packed % group, packed / group);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let o = s.out_acc.add(r * plan.value_stride);
        let dst = p.out.data.cast::<T>().offset(at(
            [item.b, h, i],
            &[p.out.stride[0], p.out.stride[1], p.out.stride[2]],
        ));
        let l = *s.row_sum.add(r);
        // l = 0: no legal key. O is 0 then, unless a visible key that scored -inf (inf in q or k)
        // brought 0 * NaN from its value in an unmasked block: the row is zeros, as in the reference.
        if l == 0.0 {
            std::ptr::write_bytes(o, 0, value_dim);
        }
        let inverse = V::broadcast(if l == 0.0 { 0.0 } else { 1.0 / l });
        let mut c = 0;
        while c + w <= value_dim {
            T::store(V::mul(V::load(o.add(c)), inverse), dst.add(c));
            c += w;
        }
        if c < value_dim {
            T::store_tail(
                V::mul(V::load(o.add(c)), inverse),
                dst.add(c),
                value_dim - c,
            );
        }
        if T::DTYPE != ElementType::Float32 && !p.out32.data.is_null() {
            store_out32::<V>(p, [item.b, h, i], o, inverse, value_dim);
        }
        if p.lse.is_requested() {
            let lse = p.lse.data.offset(at([item.b, h, i], &p.lse.stride));
            *lse = flash_row_lse(*s.row_max.add(r), l);
        }
    }
}

/// 4, out32 (float16 / bfloat16, when given): the same O / l as out, stored before rounding.
///
/// # Safety
/// p.out32 is a checked view holding row (b, h, i); o holds value_dim floats.
#[inline(always)]
unsafe fn store_out32<V: Vector>(
    p: &AttentionProblem,
    row: [usize; 3],
    o: *const f32,
    inverse: V,
    value_dim: usize,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let dst = p.out32.data.cast::<f32>().offset(at(
            row,
            &[p.out32.stride[0], p.out32.stride[1], p.out32.stride[2]],
        ));
        let mut c = 0;
        while c + V::WIDTH <= value_dim {
            V::mul(V::load(o.add(c)), inverse).store(dst.add(c));
            c += V::WIDTH;
        }
        if c < value_dim {
            V::mul(V::load(o.add(c)), inverse).store_tail(dst.add(c), value_dim - c);
        }
    }
}

/// 3b. -inf outside each row's visible range [begin, end) (index arithmetic: window start,
/// visible end); on the keys inside it, ALiBi's -slope * log2(e) * |p - j|, then the bool /
/// float mask, read through its strides.
///
/// # Safety
/// As [`attend_rows`].
#[inline(always)]
pub(crate) unsafe fn mask_block(
    plan: &FlashPlan,
    item: &WorkItem,
    s: &ThreadScratch,
    rows: usize,
    key_block: usize,
    n: usize,
) {
    let p = plan.problem;
    // SAFETY: forwarded from this function's contract; mask indices are in bounds (r < rows,
    // key_block + j < row_key_end <= Lk).
    unsafe {
        for r in 0..rows {
            let row = s.scores.add(r * KEY_BLOCK);
            // keys [begin, end) of the block may be seen
            let begin = (*s.row_key_begin.add(r)).saturating_sub(key_block).min(n);
            let end = (*s.row_key_end.add(r))
                .saturating_sub(key_block)
                .min(n)
                .max(begin);
            for j in 0..begin {
                *row.add(j) = f32::NEG_INFINITY;
            }
            for j in end..n {
                *row.add(j) = f32::NEG_INFINITY;
            }
            if !plan.has_mask && !plan.has_alibi {
                continue;
            }
            let packed = item.row_begin + r;
            let (h, i) = (
                item.kv_head * plan.group + packed % plan.group,
                packed / plan.group,
            );
            if plan.has_alibi {
                let slope = -*p
                    .alibi_slopes
                    .data
                    .offset(at([item.b, h], &p.alibi_slopes.stride))
                    * LOG2_E;
                // p - key_block: no overflow (|position| <= 2^62, key_block < 2^62)
                let distance0 =
                    flash_row_position(p, item.b, plan.group, packed) - key_block as i64;
                for j in begin..end {
                    let distance = distance0 - j as i64; // p - (key_block + j)
                    *row.add(j) += slope * distance.unsigned_abs() as f32;
                }
            }
            if !plan.has_mask {
                continue;
            }
            let mask_row = at(
                [item.b, h, i],
                &[p.mask.stride[0], p.mask.stride[1], p.mask.stride[2]],
            );
            let key_stride = p.mask.stride[3] as isize;
            if p.mask.kind == MaskKind::Bool {
                let mask = p.mask.data.offset(mask_row);
                for j in begin..end {
                    if *mask.offset((key_block + j) as isize * key_stride) == 0 {
                        *row.add(j) = f32::NEG_INFINITY;
                    }
                }
            } else {
                let bias = p.mask.data.cast::<f32>().offset(mask_row);
                for j in begin..end {
                    let bias_j = *bias.offset((key_block + j) as isize * key_stride);
                    *row.add(j) = if bias_j == f32::NEG_INFINITY {
                        f32::NEG_INFINITY
                    } else {
                        *row.add(j) + bias_j * LOG2_E
                    };
                }
            }
        }
    }
}

/// Whether any of the n floats at row is NaN: softmax_row's rare path, kept out of line so the
/// hot loop's code stays as it was.
///
/// # Safety
/// row is valid for reading n floats.
#[cold]
#[inline(never)]
unsafe fn any_nan(row: *const f32, n: usize) -> bool {
    // SAFETY: forwarded from this function's contract.
    unsafe { (0..n).any(|j| (*row.add(j)).is_nan()) }
}

/// 3c. m_new = max(m, rowmax S), alpha = 2^(m - m_new), P = 2^(S - m_new), l = l alpha + sum P.
/// Non-finite scores (scores of hidden keys are -inf by now, whatever K, V or the mask held
/// there), checked once per row and block, never per score: a row that sees a NaN score gets
/// m = NaN, a row whose largest score is +inf m = +inf (NaN wins). Both leave the softmax
/// undefined (NaN - NaN, inf - inf), as in the reference: alpha = NaN makes O and l NaN, and they
/// stay NaN through every later block (m = NaN sticks: [`max_nan`]). The vector max (maxps) may
/// drop a NaN score, but exp2 passes NaN on, so P and the block's sum carry it: a NaN sum under a
/// finite m can only come from a NaN score. Where the max alone decides (m = -inf: "nothing
/// visible yet", or m = +inf) the block is scanned for NaN; those rows are rare.
///
/// # Safety
/// V's instruction set is available; row holds n_padded (a multiple of WIDTH) floats; r indexes
/// the scratch rows.
#[inline(always)]
pub(crate) unsafe fn softmax_row<V: Vector>(
    row: *mut f32,
    n_padded: usize,
    s: &ThreadScratch,
    r: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut running = V::broadcast(f32::NEG_INFINITY);
        for j in (0..n_padded).step_by(w) {
            running = V::max(running, V::load(row.add(j)));
        }
        let block_max = V::reduce_max(running);
        let m_old = *s.row_max.add(r);
        let mut m_new = max_nan(m_old, block_max);
        if m_new.is_infinite() && any_nan(row, n_padded) {
            m_new = f32::NAN;
        }
        if m_new == f32::NEG_INFINITY {
            // nothing visible yet: P = 0, nothing to rescale
            for j in (0..n_padded).step_by(w) {
                V::zero().store(row.add(j));
            }
            *s.rescale.add(r) = 1.0;
            return;
        }
        let alpha = if m_new.is_nan() || m_new == f32::INFINITY {
            f32::NAN
        } else if m_old == m_new {
            1.0
        } else {
            (m_old - m_new).exp2() // m_old = -inf: 0
        };
        let shift = V::broadcast(m_new);
        let mut sum = V::zero();
        for j in (0..n_padded).step_by(w) {
            let prob = V::exp2(V::sub(V::load(row.add(j)), shift));
            prob.store(row.add(j));
            sum = V::add(sum, prob);
        }
        let l_new = *s.row_sum.add(r) * alpha + V::reduce_sum(sum);
        if l_new.is_nan() && m_new != f32::INFINITY {
            m_new = f32::NAN; // a NaN score the max missed
        }
        *s.rescale.add(r) = alpha;
        *s.row_sum.add(r) = l_new;
        *s.row_max.add(r) = m_new;
    }
}

// ---- The table of one instruction set (C++: flash::make_kernels) -------------------------------

/// Expands, in the per-ISA file that invokes it (flash_scalar.rs, flash_avx2.rs, flash_avx512.rs,
/// flash_neon.rs), the `#[target_feature]` entry functions over the generic code above and
/// `$table()`, the table of that instruction set: the kernel for each storage type. (C++
/// instantiates one template per translation unit, compiled with that unit's -m flags; Rust
/// needs the feature on each entry function, hence a macro.)
macro_rules! make_kernels {
    ($table:ident, $vector:ty, $name:literal, $($feature:literal)?) => {
        use $crate::element::{BFloat16, Element, Float16, Load};
        use $crate::flash_kernel::{FlashKernels, FlashPlan, ThreadScratch, WorkItem};
        use $crate::problem::AttentionProblem;

        /// # Safety
        /// The CPU supports this instruction set; otherwise as flash_kernel.rs's attend_rows.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn attend_rows<T: Element, KV: Load>(
            plan: &FlashPlan,
            item: &WorkItem,
            s: &ThreadScratch,
        ) {
            // SAFETY: forwarded; the dispatcher only hands this out after detection.
            unsafe { $crate::flash_kernel::attend_rows::<$vector, T, KV>(plan, item, s) }
        }

        /// # Safety
        /// The CPU supports this instruction set; otherwise as flash_kernel.rs's pack_keys.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn pack_keys<T: Load>(
            p: &AttentionProblem,
            b: usize,
            kv_head: usize,
            key_begin: usize,
            key_end: usize,
            dst: *mut f32,
        ) {
            // SAFETY: forwarded, as in attend_rows.
            unsafe {
                $crate::flash_kernel::pack_keys::<$vector, T>(p, b, kv_head, key_begin, key_end, dst)
            }
        }

        /// # Safety
        /// The CPU supports this instruction set; otherwise as flash_kernel.rs's pack_values.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn pack_values<T: Load>(
            p: &AttentionProblem,
            b: usize,
            kv_head: usize,
            keys: std::ops::Range<usize>,
            dst: *mut f32,
            panel_floats: usize,
        ) {
            // SAFETY: forwarded, as in attend_rows.
            unsafe {
                $crate::flash_kernel::pack_values::<$vector, T>(p, b, kv_head, keys, dst, panel_floats)
            }
        }

        /// The vectorised tanh on `values` (whole vectors; a tail past them is left alone).
        ///
        /// # Safety
        /// The CPU supports this instruction set.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn tanh_values(values: &mut [f32]) {
            // SAFETY: forwarded, as in attend_rows.
            unsafe { $crate::flash_kernel::tanh_values::<$vector>(values) }
        }

        /// backward_kernel.rs's panel_product.
        ///
        /// # Safety
        /// The CPU supports this instruction set; otherwise as backward_kernel.rs's.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn backward_panel_product(p: &$crate::backward_kernel::PanelProduct) {
            // SAFETY: forwarded, as in attend_rows.
            unsafe { $crate::backward_kernel::panel_product::<$vector>(p) }
        }

        /// backward_kernel.rs's accumulate.
        ///
        /// # Safety
        /// The CPU supports this instruction set; otherwise as backward_kernel.rs's.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn backward_accumulate(a: &$crate::backward_kernel::Accumulation) {
            // SAFETY: forwarded, as in attend_rows.
            unsafe { $crate::backward_kernel::accumulate::<$vector>(a) }
        }

        /// backward_kernel.rs's row_gradients.
        ///
        /// # Safety
        /// The CPU supports this instruction set; otherwise as backward_kernel.rs's.
        $(#[target_feature(enable = $feature)])?
        pub unsafe fn backward_row_gradients(g: &$crate::backward_kernel::RowGradients) -> usize {
            // SAFETY: forwarded, as in attend_rows.
            unsafe { $crate::backward_kernel::row_gradients::<$vector>(g) }
        }

        /// The table of this instruction set.
        pub const fn $table() -> FlashKernels {
            FlashKernels {
                isa: $name,
                attend_rows: [
                    attend_rows::<f32, f32>,
                    attend_rows::<Float16, Float16>,
                    attend_rows::<BFloat16, BFloat16>,
                ],
                pack_keys: [
                    pack_keys::<f32>,
                    pack_keys::<Float16>,
                    pack_keys::<BFloat16>,
                ],
                tanh_values,
                width: <$vector as $crate::simd::Vector>::WIDTH,
                pack_pairs: None,
                attend_rows_int8: [
                    attend_rows::<f32, i8>,
                    attend_rows::<Float16, i8>,
                    attend_rows::<BFloat16, i8>,
                ],
                pack_keys_int8: pack_keys::<i8>,
                backward: $crate::backward_kernel::BackwardKernels {
                    panel_product: backward_panel_product,
                    accumulate: backward_accumulate,
                    row_gradients: backward_row_gradients,
                    tiles: None,
                },
                pack_values: [
                    pack_values::<f32>,
                    pack_values::<Float16>,
                    pack_values::<BFloat16>,
                ],
                pack_values_int8: pack_values::<i8>,
            }
        }
    };
}
pub(crate) use make_kernels;
