//! The "avx512bf16" instruction set (docs/kernels.md, "Reduced precision"): AVX-512F plus
//! AVX512_BF16's VDPBF16PS for bfloat16 prefill. Twin of `cpp/src/flash_avx512bf16.cpp`, step for
//! step (the same layouts, the same order of every dot product: the same bits).
//!
//! float32 and float16 problems run the avx512 kernels themselves (dispatch.rs copies their
//! table entries), and so do the bfloat16 split-key items: the convert path (flash_kernel.rs
//! with the VecAvx512 vector type, compiled here with the wider feature set; same results).
//! bfloat16 prefill (plan.packed_values non-null) computes S = Q K^T and O += P V by dot products
//! of bfloat16 pairs, accumulated in float32:
//!   K pair panels, per panel of KEY_PANEL keys: [D2][KEY_PANEL] 32-bit pairs, D2 = ceil(D / 2);
//!     pair (d2, key) = (K[key][2 d2], K[key][2 d2 + 1]), low half the even d; an odd D pads the
//!     last pair's high half with 0; keys past the end are 0.
//!   Q tile: each row's raw bfloat16 q as D2 pairs (padded like K), not scaled.
//!   S micro-kernel (6 rows x 2 vectors of 16 keys): acc = 0; for d2 in order:
//!     acc = vdpbf16ps(acc, broadcast(q pair (r, d2)), panel vector at d2); S = acc * q_multiplier.
//!   softcap, mask, online softmax: the float32 kernel's (P float32; l sums the float32 P).
//!   P rounded to bfloat16 pairs (vcvtne2ps2bf16, nearest even) into probs_pairs (rows,
//!     KEY_BLOCK / 2): pair kp = (P[2 kp], P[2 kp + 1]); the pad key of an odd n has P = 0.
//!   V pair rows, per key pair kp: value_stride (Dv rounded up to 16) pairs, pair (kp, c) =
//!     (V[2 kp][c], V[2 kp + 1][c]); columns past Dv and keys past the end are 0.
//!   P.V micro-kernel (6 rows x 4 vectors of 16 columns, then single vectors up to
//!     value_stride): acc = O (times alpha when a row of the strip rescales); for kp in order:
//!     acc = vdpbf16ps(acc, broadcast(P pair (r, kp)), V vector at kp).
//!   A dot product adds 0 * NaN for a key that P weights 0, so a block takes the convert path's
//!   value_micro<SAFE = true> for its P.V instead (V read in place, converted; float32 P) when
//!   (a) it is masked (crosses a row's visible range, or a mask is given: SAFE in the float32
//!       kernel) or n is odd (its last pair's second key, key_block + n, is outside the block:
//!       not visible, or the zero pad past the packed keys), and
//!   (b) a V value of the keys [key_block, key_block + n rounded up to even) is non-finite,
//!       decided from value_finite (one flag per key, recorded while packing; the zero pad key
//!       of an odd packed range counts as finite).
//! With out32 requested, P.V runs twice: P's bfloat16 pairs into out_acc (out's bits unchanged),
//! then the pairs of P's remainder, P - bfloat16(P) rounded, into out_acc_lo, which out32 adds
//! (P rounded once costs out32 up to 2^-9 of each term, which the backward's D would carry into
//! the few-key rows' dq and dk; the remainder's pairs leave about 2^-17).
//! VDPBF16PS treats bfloat16 subnormal inputs as zero and flushes subnormal results to zero (the
//! instruction's fixed behaviour, MXCSR notwithstanding): accepted, and the same in both ports.

use std::arch::x86_64::*;

use crate::backward_kernel::{BackwardTiles, TileProduct, TileRounding};
use crate::constants::{AVX512_VALUE_VECTORS, KEY_BLOCK, KEY_PANEL, MICRO_ROWS};
use crate::element::BFloat16;
use crate::flash_attention::flash_key_rows;
use crate::flash_kernel::{
    at, block_probabilities, block_values, finish_row, match_strip_rows, prefetch_q_tile, round_up,
    start_row, FlashKernels, FlashPlan, ThreadScratch, ValueRows, WorkItem,
};
use crate::measure_peak::run_peak_loop;
use crate::problem::AttentionProblem;
use crate::simd_avx512::VecAvx512;

pub(crate) const PAIRS_PER_BLOCK: usize = KEY_BLOCK / 2;

#[inline(always)]
fn as_pairs(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain bits.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

// ---- Packing (once per (b, kv_head)) ---------------------------------------------------------

/// # Safety
/// The problem is checked and bfloat16, its views valid; b < B, kv_head < Hkv, key_begin a
/// multiple of KEY_PANEL, key_end <= kv_lens[b]; key_dst holds the panels of the keys, value_dst
/// ceil((key_end - key_begin) / 2) rows of value_stride pairs, finite_dst the keys' flags (one
/// more for an odd range).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn pack_pairs<P: PairProducts>(
    p: &AttentionProblem,
    b: usize,
    kv_head: usize,
    key_begin: usize,
    key_end: usize,
    mut key_dst: *mut u32,
    value_dst: *mut u32,
    finite_dst: *mut u8,
    value_stride: usize,
) {
    let d_len = p.k.shape[3] as usize;
    let d2_len = d_len.div_ceil(2);
    let value_dim = p.v.shape[3] as usize;
    // SAFETY: forwarded from this function's contract: rows read are < key_end <= kv_lens[b].
    unsafe {
        // K pair panels: pair (d2, key) from K rows read in place (flash_key_rows, a panel at a
        // time; V rows two keys at a time).
        let mut rows = [std::ptr::null::<u8>(); KEY_PANEL];
        let none = std::ptr::null_mut();
        let mut panel_begin = key_begin;
        while panel_begin < key_end {
            let keys = (key_end - panel_begin).min(KEY_PANEL);
            flash_key_rows(
                p,
                b,
                kv_head,
                panel_begin,
                keys,
                rows.as_mut_ptr(),
                none,
                none.cast(),
                none.cast(),
            );
            for (j, row) in rows.iter().enumerate() {
                let k_row = row.cast::<u16>();
                for d2 in 0..d2_len {
                    let mut pair = 0u32;
                    if j < keys {
                        let low = u32::from(*k_row.add(2 * d2));
                        let high = if 2 * d2 + 1 < d_len {
                            u32::from(*k_row.add(2 * d2 + 1))
                        } else {
                            0
                        };
                        pair = low | (high << 16);
                    }
                    *key_dst.add(d2 * KEY_PANEL + j) = pair;
                }
            }
            key_dst = key_dst.add(d2_len * KEY_PANEL);
            panel_begin += KEY_PANEL;
        }
        // V pair rows and the finite flags (a bfloat16 is finite unless its exponent is all ones).
        // Keys from key_end to padded_end (key_begin + a multiple of P::KEY_GRANULE) are zero pad
        // keys, finite.
        let padded_end = key_begin + round_up(key_end - key_begin, P::KEY_GRANULE);
        let mut key = key_begin;
        while key < padded_end {
            if key >= key_end {
                let dst = value_dst.add((key - key_begin) / 2 * value_stride);
                for c in 0..value_stride {
                    *dst.add(c) = 0;
                }
                *finite_dst.add(key - key_begin) = 1;
                *finite_dst.add(key + 1 - key_begin) = 1;
                key += 2;
                continue;
            }
            let pair_keys = if key + 1 < key_end { 2 } else { 1 };
            flash_key_rows(
                p,
                b,
                kv_head,
                key,
                pair_keys,
                none,
                rows.as_mut_ptr(),
                none.cast(),
                none.cast(),
            );
            let even = rows[0].cast::<u16>();
            let odd = (key + 1 < key_end).then(|| rows[1].cast::<u16>());
            let dst = value_dst.add((key - key_begin) / 2 * value_stride);
            let (mut even_finite, mut odd_finite) = (true, true);
            for c in 0..value_dim {
                let low = *even.add(c);
                let high = odd.map_or(0, |row| *row.add(c));
                *dst.add(c) = u32::from(low) | (u32::from(high) << 16);
                even_finite &= (low & 0x7f80) != 0x7f80;
                odd_finite &= (high & 0x7f80) != 0x7f80;
            }
            for c in value_dim..value_stride {
                *dst.add(c) = 0;
            }
            *finite_dst.add(key - key_begin) = u8::from(even_finite);
            *finite_dst.add(key + 1 - key_begin) = u8::from(odd_finite); // the zero pad: finite
            key += 2;
        }
    }
}

// ---- 3a. S = Q K^T by bfloat16 pair dot products: R rows x SV vectors of 16 keys ------------
// SV / 2 consecutive panels of 32 keys (d2_len * KEY_PANEL pairs apart), two vectors each: with
// SV = 4, 6 rows hold 24 accumulators, and each pair step reads 4 key vectors and 6 Q pairs for
// 24 dot products (one panel: 2 and 6 for 12, in 12 accumulators, which VDPBF16PS's latency on
// two pipes leaves no slack: 5% of a bfloat16 prefill).

/// # Safety
/// AVX512_BF16; q: R rows of d2_len pairs; panel: SV / 2 consecutive (d2_len, KEY_PANEL) panels
/// of pairs; scores: R rows of stride KEY_BLOCK, 16 SV floats each.
#[inline(always)]
unsafe fn score_micro<const R: usize, const SV: usize>(
    q: *const u32,
    d2_len: usize,
    panel: *const u32,
    scores: *mut f32,
    multiplier: __m512,
) {
    const {
        assert!(
            KEY_PANEL == 32 && (SV == 2 || SV == 4),
            "a panel is two vectors of 16 keys"
        )
    };
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); SV]; R];
        for d2 in 0..d2_len {
            let keys: [__m512bh; SV] = std::array::from_fn(|v| {
                as_pairs(_mm512_loadu_si512(
                    panel
                        .add(v / 2 * d2_len * KEY_PANEL + d2 * KEY_PANEL + v % 2 * 16)
                        .cast(),
                ))
            });
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let q_pair = as_pairs(_mm512_set1_epi32(*q.add(r * d2_len + d2) as i32));
                for (acc_rv, keys_v) in acc_r.iter_mut().zip(keys) {
                    *acc_rv = _mm512_dpbf16_ps(*acc_rv, q_pair, keys_v);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, acc_rv) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(
                    scores.add(r * KEY_BLOCK + v * 16),
                    _mm512_mul_ps(*acc_rv, multiplier),
                );
            }
        }
    }
}

/// S for one strip of R rows against every panel holding the block's n keys: two panels at a
/// time, the last one alone where their count is odd.
///
/// # Safety
/// As [`score_micro`], for every panel holding the block's n keys.
#[inline(always)]
unsafe fn strip_scores<const R: usize>(
    q: *const u32,
    d2_len: usize,
    panels: *const u32,
    n: usize,
    scores: *mut f32,
    multiplier: __m512,
) {
    let panel_count = n.div_ceil(KEY_PANEL);
    let mut panel = 0;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        while panel + 2 <= panel_count {
            score_micro::<R, 4>(
                q,
                d2_len,
                panels.add(panel * d2_len * KEY_PANEL),
                scores.add(panel * KEY_PANEL),
                multiplier,
            );
            panel += 2;
        }
        if panel < panel_count {
            score_micro::<R, 2>(
                q,
                d2_len,
                panels.add(panel * d2_len * KEY_PANEL),
                scores.add(panel * KEY_PANEL),
                multiplier,
            );
        }
    }
}

// ---- 3d. O = alpha O + P V by bfloat16 pair dot products -------------------------------------

/// P of each row (n_padded floats, 0 past n) rounded to bfloat16 pairs, 32 keys at a time; with
/// REMAINDER, P - bfloat16(P) instead, bfloat16(P) read from the pairs that `pairs` holds (P's own,
/// rounded before): out32's remainder pairs.
///
/// # Safety
/// AVX512_BF16; scores: rows rows of stride KEY_BLOCK; pairs: rows rows of PAIRS_PER_BLOCK.
#[inline(always)]
unsafe fn round_probs<const REMAINDER: bool>(
    scores: *const f32,
    rows: usize,
    n_padded: usize,
    pairs: *mut u32,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        for r in 0..rows {
            let row = scores.add(r * KEY_BLOCK);
            let dst = pairs.add(r * PAIRS_PER_BLOCK);
            for j in (0..n_padded).step_by(32) {
                let mut low = _mm512_loadu_ps(row.add(j));
                let mut high = if j + 16 < n_padded {
                    _mm512_loadu_ps(row.add(j + 16))
                } else {
                    _mm512_setzero_ps()
                };
                if REMAINDER {
                    let rounded = _mm512_loadu_si512(dst.add(j / 2).cast());
                    low = _mm512_sub_ps(low, widen_bf16(_mm512_castsi512_si256(rounded)));
                    high = _mm512_sub_ps(high, widen_bf16(_mm512_extracti64x4_epi64::<1>(rounded)));
                }
                // keys j .. j + 31 in order (the second operand gives the low half)
                let rounded = _mm512_cvtne2ps_pbh(high, low);
                _mm512_storeu_si512(
                    dst.add(j / 2).cast(),
                    std::mem::transmute::<__m512bh, __m512i>(rounded),
                );
            }
        }
    }
}

/// 16 bfloat16 values as float32, exactly (their bits in a float's high half).
///
/// # Safety
/// AVX-512F.
#[inline(always)]
unsafe fn widen_bf16(half: __m256i) -> __m512 {
    // SAFETY: forwarded from this function's contract.
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half))) }
}

/// out32 += out_acc_lo / l for row r (after finish_row: out32 holds out_acc / l).
///
/// # Safety
/// As [`attend_rows`], for a row r of the item, with out32 requested.
#[inline(always)]
unsafe fn add_remainders(plan: &FlashPlan, item: &WorkItem, s: &ThreadScratch, r: usize) {
    let p = plan.problem;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let l = *s.row_sum.add(r);
        if l == 0.0 {
            return; // no legal key: out32 stays 0
        }
        let packed = item.row_begin + r;
        let (h, i) = (
            item.kv_head * plan.group + packed % plan.group,
            packed / plan.group,
        );
        let dst = p.out32.data.cast::<f32>().offset(at(
            [item.b, h, i],
            &[p.out32.stride[0], p.out32.stride[1], p.out32.stride[2]],
        ));
        let inverse = 1.0 / l;
        let lo = s.out_acc_lo.add(r * plan.value_stride);
        for c in 0..plan.value_dim {
            *dst.add(c) += *lo.add(c) * inverse;
        }
    }
}

/// R rows x NV vectors of value columns: acc = O (times alpha), then the pairs in order.
///
/// # Safety
/// AVX512_BF16; probs: R rows of PAIRS_PER_BLOCK pairs (pairs used); v_pairs: pairs rows of
/// value_stride pairs, NV * 16 from the column; out: R rows of stride out_stride; rescale: R.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_micro<const R: usize, const NV: usize>(
    probs: *const u32,
    pairs: usize,
    v_pairs: *const u32,
    value_stride: usize,
    out: *mut f32,
    out_stride: usize,
    rescale: *const f32,
    do_rescale: bool,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let alpha = _mm512_set1_ps(*rescale.add(r));
            for (v, a) in acc_r.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(out.add(r * out_stride + v * 16));
                if do_rescale {
                    *a = _mm512_mul_ps(*a, alpha);
                }
            }
        }
        for kp in 0..pairs {
            let mut values = [as_pairs(_mm512_setzero_si512()); NV];
            for (v, value) in values.iter_mut().enumerate() {
                *value = as_pairs(_mm512_loadu_si512(
                    v_pairs.add(kp * value_stride + v * 16).cast(),
                ));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let p_pair = as_pairs(_mm512_set1_epi32(
                    *probs.add(r * PAIRS_PER_BLOCK + kp) as i32
                ));
                for v in 0..NV {
                    acc_r[v] = _mm512_dpbf16_ps(acc_r[v], p_pair, values[v]);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * out_stride + v * 16), a);
            }
        }
    }
}

/// # Safety
/// As [`value_micro`], for value_stride columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn strip_values<const R: usize>(
    probs: *const u32,
    pairs: usize,
    v_pairs: *const u32,
    value_stride: usize,
    out: *mut f32,
    out_stride: usize,
    rescale: *const f32,
) {
    const NV: usize = AVX512_VALUE_VECTORS;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut do_rescale = false;
        for s in 0..R {
            do_rescale |= *rescale.add(s) != 1.0;
        }
        let mut c = 0;
        while c + NV * 16 <= value_stride {
            value_micro::<R, NV>(
                probs,
                pairs,
                v_pairs.add(c),
                value_stride,
                out.add(c),
                out_stride,
                rescale,
                do_rescale,
            );
            c += NV * 16;
        }
        while c < value_stride {
            value_micro::<R, 1>(
                probs,
                pairs,
                v_pairs.add(c),
                value_stride,
                out.add(c),
                out_stride,
                rescale,
                do_rescale,
            );
            c += 16;
        }
    }
}

// ---- The two products of a pair path ---------------------------------------------------------

/// The products a bfloat16 pair path supplies to [`pack_pairs`] and [`attend_rows`] (twin of
/// `cpp/src/flash_bf16_pairs.hpp`'s `Products`): this unit's dot products, or the tiles of
/// flash_amx.rs.
pub(crate) trait PairProducts {
    /// P.V reads the keys [key_block, key_block + n rounded up to this): the packing zero-fills
    /// V pairs up to it (finite pad keys), and a block checks those keys' flags.
    const KEY_GRANULE: usize;
    /// Q pair rows up to `rows` rounded up to this are written (zero past rows).
    const ROW_GRANULE: usize;
    /// # Safety
    /// The unit's instruction set available; around a work item's key blocks.
    unsafe fn begin_item();
    /// # Safety
    /// After [`PairProducts::begin_item`].
    unsafe fn end_item();
    /// S of whole K panels holding the block's n keys, times q_multiplier.
    ///
    /// # Safety
    /// The unit's instruction set available; q_pairs: rows rows of d2_len pairs (rounded up to
    /// ROW_GRANULE rows); panels: the K pair panels of the block's n keys; scores: those rows of
    /// stride KEY_BLOCK.
    unsafe fn block_scores(
        q_pairs: *const u32,
        d2_len: usize,
        rows: usize,
        panels: *const u32,
        n: usize,
        scores: *mut f32,
        q_multiplier: f32,
    );
    /// O = alpha O + P V over `pairs` key pairs.
    ///
    /// # Safety
    /// The unit's instruction set available; probs_pairs: rows rows (rounded up to ROW_GRANULE)
    /// of PAIRS_PER_BLOCK pairs; v_pairs: `pairs` rows of value_stride pairs; out_acc: those rows
    /// of stride value_stride; rescale: rows.
    unsafe fn block_values(
        probs_pairs: *const u32,
        rows: usize,
        pairs: usize,
        v_pairs: *const u32,
        value_stride: usize,
        out_acc: *mut f32,
        rescale: *const f32,
    );
}

/// The dot path's products: VDPBF16PS on AVX-512 registers.
pub(crate) struct DotProducts;

impl PairProducts for DotProducts {
    const KEY_GRANULE: usize = 2;
    const ROW_GRANULE: usize = 1;
    #[inline(always)]
    unsafe fn begin_item() {}
    #[inline(always)]
    unsafe fn end_item() {}
    #[inline(always)]
    unsafe fn block_scores(
        q_pairs: *const u32,
        d2_len: usize,
        rows: usize,
        panels: *const u32,
        n: usize,
        scores: *mut f32,
        q_multiplier: f32,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            let multiplier = _mm512_set1_ps(q_multiplier);
            for r in (0..rows).step_by(MICRO_ROWS) {
                let q = q_pairs.add(r * d2_len);
                let s = scores.add(r * KEY_BLOCK);
                match_strip_rows!((rows - r).min(MICRO_ROWS), R => {
                    strip_scores::<R>(q, d2_len, panels, n, s, multiplier)
                });
            }
        }
    }
    #[inline(always)]
    unsafe fn block_values(
        probs_pairs: *const u32,
        rows: usize,
        pairs: usize,
        v_pairs: *const u32,
        value_stride: usize,
        out_acc: *mut f32,
        rescale: *const f32,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            for r in (0..rows).step_by(MICRO_ROWS) {
                let probs = probs_pairs.add(r * PAIRS_PER_BLOCK);
                let out = out_acc.add(r * value_stride);
                let alpha = rescale.add(r);
                match_strip_rows!((rows - r).min(MICRO_ROWS), R => {
                    strip_values::<R>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha)
                });
            }
        }
    }
}

// ---- The work item (steps 2-4 of flash_kernel.rs's attend_rows, with the pair layouts) ------

/// # Safety
/// AVX512_BF16 (and AVX-512F/BW/VL) available; otherwise as flash_kernel.rs's attend_rows, for
/// a bfloat16 problem.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn attend_rows<P: PairProducts>(
    plan: &FlashPlan,
    item: &WorkItem,
    s: &ThreadScratch,
) {
    if plan.packed_values.is_null() {
        // split-key: the convert path
        // SAFETY: forwarded.
        return unsafe {
            crate::flash_kernel::attend_rows::<VecAvx512, BFloat16, BFloat16>(plan, item, s)
        };
    }
    let p = plan.problem;
    let (group, d_len, value_dim) = (plan.group, plan.head_dim, plan.value_dim);
    let d2_len = d_len.div_ceil(2);
    let value_stride = plan.value_stride;
    let rows = item.row_end - item.row_begin;
    let b = item.b;
    // SAFETY: as flash_kernel.rs's attend_rows: every index stays inside the checked views, the
    // packed buffers (flash_attention.rs) or the sized scratch.
    unsafe {
        // 2. The Q tile as raw bfloat16 pairs; each row's visible end; m, l, O as float32.
        let q_pairs = s.q_tile.cast::<u32>();
        prefetch_q_tile::<BFloat16>(plan, item);
        for r in 0..rows {
            let packed = item.row_begin + r;
            let (h, i) = (item.kv_head * group + packed % group, packed / group);
            let q_src = p.q.data.cast::<u16>().offset(at(
                [b, h, i],
                &[p.q.stride[0], p.q.stride[1], p.q.stride[2]],
            ));
            // pair d2 = (q[2 d2], q[2 d2 + 1]), the low half the even d: q's row as it lies in
            // memory (x86 is little-endian), the last pair's high half 0 for an odd D
            std::ptr::copy_nonoverlapping(q_src, q_pairs.add(r * d2_len).cast::<u16>(), d_len);
            if d_len % 2 != 0 {
                *q_pairs.add(r * d2_len + d2_len - 1) = u32::from(*q_src.add(d_len - 1));
            }
            start_row(plan, item, s, r);
        }
        let lo = s.out_acc_lo; // out32's remainders (module documentation), when requested
        if !lo.is_null() {
            std::ptr::write_bytes(lo, 0, rows * value_stride);
        }
        // (pad rows up to a multiple of P::ROW_GRANULE: zero, read by whole-tile products)
        for r in rows..round_up(rows, P::ROW_GRANULE) {
            for d2 in 0..d2_len {
                *q_pairs.add(r * d2_len + d2) = 0;
            }
        }
        P::begin_item();

        // 3. Key blocks, as the float32 kernel.
        let key_stop = (*s.row_key_end.add(rows - 1)).min(item.key_end);
        let head = b * p.k.shape[1] as usize + item.kv_head - plan.first_packed_head; // in the wave
        let keys_per_head = plan.panels_per_head * KEY_PANEL;
        let k_head_panels = plan
            .packed_keys
            .cast::<u32>()
            .add(head * plan.panels_per_head * d2_len * KEY_PANEL);
        let v_head_pairs = plan
            .packed_values
            .add(head * keys_per_head / 2 * value_stride);
        let v_head_finite = plan.value_finite.add(head * keys_per_head);
        let mut key_block = item.key_begin;
        while key_block < key_stop {
            let n = (key_stop - key_block).min(KEY_BLOCK);
            let n_padded = round_up(n, 16);
            // (a) S = Q K^T (key_block is a multiple of KEY_PANEL: item.key_begin is).
            P::block_scores(
                q_pairs,
                d2_len,
                rows,
                k_head_panels.add((key_block / KEY_PANEL) * d2_len * KEY_PANEL),
                n,
                s.scores,
                plan.q_multiplier,
            );
            // (a') - (c) as the float32 kernel.
            let masked =
                block_probabilities::<VecAvx512>(plan, item, s, rows, key_block, n, n_padded);
            // (d) O = alpha O + P V: by pairs, unless P's zeros meet a non-finite V (module
            // documentation).
            let mut values_finite = true;
            let n_read = round_up(n, P::KEY_GRANULE); // the keys P.V reads
            if masked || n != n_read {
                for j in 0..n_read {
                    values_finite &= *v_head_finite.add(key_block + j) != 0;
                }
            }
            if !values_finite {
                let none = std::ptr::null_mut();
                flash_key_rows(
                    p,
                    b,
                    item.kv_head,
                    key_block,
                    n,
                    none,
                    s.value_rows,
                    none.cast(),
                    none.cast(),
                );
                block_values::<VecAvx512, _, true>(
                    s.scores,
                    rows,
                    n,
                    ValueRows::<BFloat16>::new(s.value_rows),
                    s.out_acc,
                    value_stride,
                    value_dim,
                    s.rescale,
                    None,
                );
                // P exact here: the remainders only rescale
                for r in (0..rows).filter(|_| !lo.is_null()) {
                    for c in 0..value_stride {
                        *lo.add(r * value_stride + c) *= *s.rescale.add(r);
                    }
                }
            } else {
                // P's pairs into out_acc; with out32, the remainder's into lo (module documentation)
                let v_block = v_head_pairs.add(key_block / 2 * value_stride);
                for (pass, acc) in [s.out_acc, lo].into_iter().enumerate() {
                    if acc.is_null() {
                        break;
                    }
                    if pass == 0 {
                        round_probs::<false>(s.scores, rows, n_padded, s.probs_pairs);
                    } else {
                        round_probs::<true>(s.scores, rows, n_padded, s.probs_pairs);
                    }
                    P::block_values(
                        s.probs_pairs,
                        rows,
                        n_read / 2,
                        v_block,
                        value_stride,
                        acc,
                        s.rescale,
                    );
                }
            }
            key_block += KEY_BLOCK;
        }

        P::end_item();
        // 4. Finish: out = O / l rounded to bfloat16, and lse (prefill never writes partials).
        for r in 0..rows {
            finish_row::<VecAvx512, BFloat16>(plan, item, s, r);
        }
        for r in (0..rows).filter(|_| !lo.is_null()) {
            add_remainders(plan, item, s, r);
        }
    }
}

// ---- The backward's bfloat16 pair products on VDPBF16PS (backward_kernel.rs, TileProduct) ----
// The tile path of flash_backward.rs without tiles: the same operands, each C element one
// float32 chain, acc = C (accumulate) or 0, then acc = vdpbf16ps(acc, A pair (r, k), B pair (k,
// column)) for k = 0 .. 16 chunks - 1 in order. Register blocks of R rows x CV vectors of 16
// columns (6 x 4: 24 accumulators), per pair step CV loads of B and R broadcasts of A; the
// blocking is invisible in the results (each element's chain is the same). Twin of
// flash_avx512bf16.cpp's dot_block.

/// C (R rows x CV vectors) (+)= A (R rows of `steps` pairs) B (`steps` rows of CV x 16 pairs).
/// Strides in bytes.
///
/// # Safety
/// AVX512_BF16; every row read or written lies in its buffer.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn dot_block<const R: usize, const CV: usize>(
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    b_stride: usize,
    steps: usize,
    c: *mut u8,
    c_stride: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); CV]; R];
        if accumulate {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                for (v, x) in acc_r.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(c.add(r * c_stride + v * 64).cast());
                }
            }
        }
        for k in 0..steps {
            let b_row = b.add(k * b_stride);
            let mut pairs = [as_pairs(_mm512_setzero_si512()); CV];
            for (v, pair) in pairs.iter_mut().enumerate() {
                *pair = as_pairs(_mm512_loadu_si512(b_row.add(v * 64).cast()));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let a_pair = as_pairs(_mm512_set1_epi32(
                    a.add(r * a_stride + k * 4).cast::<i32>().read_unaligned(),
                ));
                for v in 0..CV {
                    acc_r[v] = _mm512_dpbf16_ps(acc_r[v], a_pair, pairs[v]);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (v, &x) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(c.add(r * c_stride + v * 64).cast(), x);
            }
        }
    }
}

/// R rows of C, `columns` vectors of 16: blocks of 4 vectors, then the rest in one.
///
/// # Safety
/// As [`dot_block`], for `columns` vectors.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn dot_strip<const R: usize>(
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    b_stride: usize,
    columns: usize,
    steps: usize,
    c: *mut u8,
    c_stride: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let mut u = 0;
        while u + 4 <= columns {
            let (b_u, c_u) = (b.add(u * 64), c.add(u * 64));
            dot_block::<R, 4>(a, a_stride, b_u, b_stride, steps, c_u, c_stride, accumulate);
            u += 4;
        }
        let (b_u, c_u) = (b.add(u * 64), c.add(u * 64));
        match columns - u {
            1 => dot_block::<R, 1>(a, a_stride, b_u, b_stride, steps, c_u, c_stride, accumulate),
            2 => dot_block::<R, 2>(a, a_stride, b_u, b_stride, steps, c_u, c_stride, accumulate),
            3 => dot_block::<R, 3>(a, a_stride, b_u, b_stride, steps, c_u, c_stride, accumulate),
            _ => {}
        }
    }
}

/// [`TileProduct`] on VDPBF16PS: the rows rounded up to 16 (as the tiles compute them), in
/// strips of MICRO_ROWS.
///
/// # Safety
/// AVX512_BF16 available; every row read or written (rows rounded up to 16) lies in its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
unsafe fn backward_dot_product(t: &TileProduct) {
    let (a, b, c) = (t.a.cast::<u8>(), t.b.cast::<u8>(), t.c.cast::<u8>());
    let rows = t.rows.div_ceil(16) * 16;
    let steps = t.chunks * 16;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        for r in (0..rows).step_by(MICRO_ROWS) {
            let (a_rows, c_rows) = (a.add(r * t.a_stride), c.add(r * t.c_stride));
            match_strip_rows!((rows - r).min(MICRO_ROWS), R => dot_strip::<R>(
                a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate
            ));
        }
    }
}

/// [`TileRounding`]: per pair of rows and 16 keys, one VCVTNE2PS2BF16 (the even row's 16 in
/// the low half), then the halves interleaved into pairs (VPERMW). Shared by the dot products
/// here and amxbf16's tiles.
///
/// # Safety
/// AVX512_BF16 and AVX512BW available; src holds rows rows of n floats (stride src_stride), pairs
/// rows_padded / 2 rows of n pairs and rows_out (when not null) rows_padded rows of n elements
/// (stride `stride`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(crate) unsafe fn backward_round_pairs(t: &TileRounding) {
    #[repr(C, align(64))]
    struct Indices([u16; 32]);
    const INTERLEAVE: Indices = Indices([
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12,
        28, 13, 29, 14, 30, 15, 31,
    ]);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        let interleave = _mm512_load_si512(INTERLEAVE.0.as_ptr().cast());
        for r in (0..t.rows_padded).step_by(2) {
            let even = t.src.add(r * t.src_stride);
            let odd = even.add(t.src_stride);
            for j in (0..t.n).step_by(16) {
                let low = if r < t.rows {
                    _mm512_loadu_ps(even.add(j))
                } else {
                    _mm512_setzero_ps()
                };
                let high = if r + 1 < t.rows {
                    _mm512_loadu_ps(odd.add(j))
                } else {
                    _mm512_setzero_ps()
                };
                let rounded =
                    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low));
                _mm512_storeu_si512(
                    t.pairs.add(r / 2 * t.stride + j).cast(),
                    _mm512_permutexvar_epi16(interleave, rounded),
                );
                if t.rows_out.is_null() {
                    continue;
                }
                _mm256_storeu_si256(
                    t.rows_out.add(r * t.stride + j).cast(),
                    _mm512_castsi512_si256(rounded),
                );
                _mm256_storeu_si256(
                    t.rows_out.add((r + 1) * t.stride + j).cast(),
                    _mm512_extracti64x4_epi64::<1>(rounded),
                );
            }
        }
    }
}

/// No tile state to set up or release.
///
/// # Safety
/// None (unsafe only for the table's type).
unsafe fn no_tiles() {}

/// The backward's bfloat16 pair products and roundings on avx512bf16: flash_backward.rs's tile
/// path with VDPBF16PS for TDPBF16PS.
pub const fn backward_tiles_avx512bf16() -> BackwardTiles {
    BackwardTiles {
        begin: no_tiles,
        product: backward_dot_product,
        round: backward_round_pairs,
        end: no_tiles,
    }
}

/// The avx512bf16 table: the avx512 kernels, with bfloat16's attend_rows and pack_pairs of this
/// unit (dot products for prefill, the convert path otherwise), and the backward's bfloat16
/// pair products on VDPBF16PS (flash_backward.rs's tile path).
pub const fn flash_kernels_avx512bf16() -> FlashKernels {
    let mut kernels = crate::flash_avx512::flash_kernels_avx512();
    kernels.isa = "avx512bf16";
    kernels.attend_rows[crate::problem::ElementType::BFloat16 as usize] =
        attend_rows::<DotProducts>;
    kernels.pack_pairs = Some(pack_pairs::<DotProducts>);
    kernels.backward.tiles = Some(backward_tiles_avx512bf16());
    kernels
}

/// measure_peak's VDPBF16PS loop: 16 independent accumulators, each acc += a . b over pairs of
/// small bfloat16 values (2^-10: the sums grow by 2^-19 per instruction, never near overflow).
/// Returns the flop done (64 per instruction).
///
/// # Safety
/// AVX512_BF16 available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub unsafe fn peak_bf16dot_avx512bf16(instructions: u64) -> u64 {
    let a = as_pairs(_mm512_set1_epi32(0x3a80_3a80)); // (2^-10, 2^-10)
    let dot = |acc| _mm512_dpbf16_ps(acc, a, a);
    64 * run_peak_loop!(
        instructions,
        16,
        _mm512_set1_ps,
        dot,
        _mm512_add_ps,
        _mm512_cvtss_f32
    )
}
