//! The inner products of the backward pass (flash_backward.rs), written once over a vector type
//! V (simd_*.rs) and compiled once per instruction set by the `#[target_feature]` entry
//! functions of [`crate::flash_kernel::make_kernels`]. Twin of `cpp/src/backward_kernel.hpp`.
//!
//! Both are outer-product forms (a broadcast times a vector of the other operand, accumulated in
//! registers), so no element needs a horizontal sum, and every element's sum is one V::fma chain
//! in a fixed order whatever the vector width:
//!
//! - [`panel_product`]: S = Q K^T and dP = dO V^T against a transposed key block (panel[d][key]);
//! - [`accumulate`]: dV += P^T dO, dK += dS^T Q (one key's row over the tile's rows) and
//!   dQ += dS K (one query row over the block's keys);
//!
//! and [`row_gradients`], P and dS of one row, lane by lane. Both products are register-blocked:
//! strips of rows (outputs) x vectors of columns held in registers, per step one broadcast per
//! row and one load per vector of columns.

use crate::simd::Vector;

/// One panel product: out[r * out_stride + j] for r < rows, j < n (n a multiple of the vector
/// width) = sum over d < depth, ascending, of a[r * depth + d] * panel[d * panel_stride + j]: one
/// V::fma chain from 0 per element.
pub struct PanelProduct {
    pub a: *const f32,
    pub rows: usize,
    pub depth: usize,
    pub panel: *const f32,
    pub panel_stride: usize,
    pub n: usize,
    pub out: *mut f32,
    pub out_stride: usize,
}

/// One accumulation: for every output o < outputs, y[o * y_stride + (0, n)] += c * x[t *
/// x_stride + (0, n)] for t < terms, ascending, c = coef[o * output_stride + t * coef_stride],
/// skipping every term whose gate (same index) is 0 (a hidden key: its x is never read): one
/// V::fma chain per element, starting from y. gate null: every term counts (the caller has
/// checked that no gate is 0), and the outputs run in register blocks with no test per term.
pub struct Accumulation {
    pub y: *mut f32,
    pub y_stride: usize,
    pub outputs: usize,
    pub n: usize,
    pub coef: *const f32,
    pub gate: *const f32,
    pub coef_stride: usize,
    pub output_stride: usize,
    pub x: *const f32,
    pub x_stride: usize,
    pub terms: usize,
}

/// P and scale dS of one row's n keys (n a multiple of the vector width), in place: probs holds
/// S (base 2) and becomes P = V::exp2(S multiplier - lse) (multiplier 1 where S is already
/// scaled: the same bits as without it); grads holds dP and becomes P (dP - delta), times 1 - t^2
/// (t = capped[j]) when capped is not null, times scale; 0 where P is 0 (a hidden key: its dP is
/// never used). Returns how many of the first `counted` (<= n) P are 0.
pub struct RowGradients {
    pub probs: *mut f32,
    pub grads: *mut f32,
    pub capped: *const f32,
    pub n: usize,
    pub lse: f32,
    pub delta: f32,
    pub scale: f32,
    pub multiplier: f32,
    pub counted: usize,
}

pub type PanelProductFn = unsafe fn(&PanelProduct);
pub type AccumulateFn = unsafe fn(&Accumulation);
pub type RowGradientsFn = unsafe fn(&RowGradients) -> usize;

/// One tile product of bfloat16 pairs (the bfloat16 tile path of flash_backward.rs, amxbf16):
/// C (float32) = A B, or C += A B when accumulate, over `rows` rows of A (rounded up to 16) and
/// `columns` column tiles of 16 floats: A rows of `chunks` x 16 pairs (a pair: two bfloat16 of
/// the summed axis, the lower index in the low half), B rows of pairs, one per 16-pair chunk row
/// (chunks x 16 of them), C rows of floats. Strides in bytes. The tiles' order and rounding are
/// flash_amx.rs's (the same in C++).
pub struct TileProduct {
    pub a: *const u8,
    pub a_stride: usize,
    pub rows: usize,
    pub b: *const u8,
    pub b_stride: usize,
    pub columns: usize,
    pub chunks: usize,
    pub c: *mut u8,
    pub c_stride: usize,
    pub accumulate: bool,
}

/// One query tile's P or scale dS (src: rows of src_stride floats, n floats each, n a multiple
/// of 16) rounded to bfloat16 (nearest even, VCVTNE2PS2BF16, as the forward's P), rows past
/// `rows` up to rows_padded (even) as 0:
///
/// - pairs (B of dV^T += dO^T P and dK^T += Q^T dS): pairs[(r / 2) * stride + j] = (src[r][j],
///   src[r + 1][j]), the lower row in the low half;
/// - rows_out, when not null (A of dQ += dS K): rows_out[r * stride + j] = src[r][j] (so its
///   consecutive pairs are pairs of keys).
pub struct TileRounding {
    pub src: *const f32,
    pub src_stride: usize,
    pub rows: usize,
    pub rows_padded: usize,
    pub n: usize,
    pub pairs: *mut u32,
    pub rows_out: *mut u16,
    pub stride: usize,
}

/// The tile products of the backward's bfloat16 tile path: begin() before a work item's
/// products on the calling thread (the tile configuration), end() after them; round() the
/// roundings of P and dS. None on every instruction set but amxbf16 (flash_amx.rs).
pub type TileBeginFn = unsafe fn();
pub type TileProductFn = unsafe fn(&TileProduct);
pub type TileRoundFn = unsafe fn(&TileRounding);
pub type TileEndFn = unsafe fn();

#[derive(Clone, Copy)]
pub struct BackwardTiles {
    pub begin: TileBeginFn,
    pub product: TileProductFn,
    pub round: TileRoundFn,
    pub end: TileEndFn,
}

/// The backward kernels of one instruction set.
#[derive(Clone, Copy)]
pub struct BackwardKernels {
    pub panel_product: PanelProductFn,
    pub accumulate: AccumulateFn,
    pub row_gradients: RowGradientsFn,
    pub tiles: Option<BackwardTiles>,
}

/// Register blocks, rows x vectors of accumulators: 6 x 4 (24 of AVX-512's 32 registers), 6 x 2
/// with 16 registers (AVX2; NEON and the scalar type alike), for panel_product's strips and the
/// ungated accumulate's blocks; the gated accumulate's chunks hold 16 vectors (AVX-512) or 8.
const STRIP_ROWS: usize = 6;

/// The vectors of a register block (above) for V.
#[inline(always)]
fn strip_vectors<V: Vector>() -> usize {
    if V::WIDTH >= 16 {
        4
    } else {
        2
    }
}

/// R rows x NV vectors of the columns from j of rows [r, r + R) of the product.
///
/// # Safety
/// As [`panel_product`], for these rows and columns.
#[inline(always)]
unsafe fn product_strip<V: Vector, const R: usize, const NV: usize>(
    p: &PanelProduct,
    r: usize,
    j: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded; every access lies in rows [r, r + R) and columns [j, j + NV w).
    unsafe {
        let a = p.a.add(r * p.depth);
        let mut acc = [[V::zero(); NV]; R];
        for d in 0..p.depth {
            let mut column = [V::zero(); NV];
            for (c, vector) in column.iter_mut().enumerate() {
                *vector = V::load(p.panel.add(d * p.panel_stride + j + c * w));
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let x = V::broadcast(*a.add(i * p.depth + d));
                for (acc_ic, &column_c) in acc_row.iter_mut().zip(&column) {
                    *acc_ic = V::fma(x, column_c, *acc_ic);
                }
            }
        }
        for (i, acc_row) in acc.iter().enumerate() {
            for (c, acc_ic) in acc_row.iter().enumerate() {
                acc_ic.store(p.out.add((r + i) * p.out_stride + j + c * w));
            }
        }
    }
}

/// Rows [r, r + R), all n columns: strips of strip_vectors vectors, then the remaining ones.
///
/// # Safety
/// As [`panel_product`], for these rows.
#[inline(always)]
unsafe fn product_rows<V: Vector, const R: usize>(p: &PanelProduct, r: usize) {
    let (w, vectors) = (V::WIDTH, strip_vectors::<V>());
    let mut j = 0;
    // SAFETY: forwarded; j + the strip's columns <= n.
    unsafe {
        while j + vectors * w <= p.n {
            match vectors {
                4 => product_strip::<V, R, 4>(p, r, j),
                _ => product_strip::<V, R, 2>(p, r, j),
            }
            j += vectors * w;
        }
        match (p.n - j) / w {
            3 => product_strip::<V, R, 3>(p, r, j),
            2 => product_strip::<V, R, 2>(p, r, j),
            1 => product_strip::<V, R, 1>(p, r, j),
            _ => {}
        }
    }
}

/// See [`PanelProduct`]: strips of STRIP_ROWS rows, then one strip of the 1-5 rows left.
///
/// # Safety
/// The CPU supports V's instruction set; a holds rows x depth floats, panel depth rows of
/// panel_stride (>= n) floats, out rows rows of out_stride (>= n) floats.
#[inline(always)]
pub unsafe fn panel_product<V: Vector>(p: &PanelProduct) {
    let mut r = 0;
    // SAFETY: forwarded; r + the strip's rows <= rows.
    unsafe {
        while r + STRIP_ROWS <= p.rows {
            product_rows::<V, STRIP_ROWS>(p, r);
            r += STRIP_ROWS;
        }
        match p.rows - r {
            5 => product_rows::<V, 5>(p, r),
            4 => product_rows::<V, 4>(p, r),
            3 => product_rows::<V, 3>(p, r),
            2 => product_rows::<V, 2>(p, r),
            1 => product_rows::<V, 1>(p, r),
            _ => {}
        }
    }
}

/// Outputs [o, o + O) (sharing each x load), NV vectors of columns from d each: acc = y, then
/// for every term whose gate of that output is nonzero (every term when not GATED),
/// acc = V::fma(coef, x_t, acc). A term that counts for all O outputs: one load per vector and
/// one broadcast per output.
///
/// # Safety
/// As [`accumulate`], for these outputs and columns.
#[inline(always)]
unsafe fn accumulate_chunk<V: Vector, const O: usize, const NV: usize, const GATED: bool>(
    a: &Accumulation,
    o: usize,
    d: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded; every access lies in the outputs' and the x rows' NV vectors from d.
    unsafe {
        let y = a.y.add(o * a.y_stride + d);
        let at = |t: usize, i: usize| (o + i) * a.output_stride + t * a.coef_stride;
        let mut acc = [[V::zero(); NV]; O];
        for (i, acc_i) in acc.iter_mut().enumerate() {
            for (c, acc_ic) in acc_i.iter_mut().enumerate() {
                *acc_ic = V::load(y.add(i * a.y_stride + c * w));
            }
        }
        for t in 0..a.terms {
            let x_row = a.x.add(t * a.x_stride + d);
            if GATED {
                let mut live = [false; O];
                for (i, live_i) in live.iter_mut().enumerate() {
                    *live_i = *a.gate.add(at(t, i)) != 0.0;
                }
                if !live.iter().all(|&l| l) {
                    // only the live outputs (none: the term is skipped)
                    for (i, acc_i) in acc.iter_mut().enumerate() {
                        if !live[i] {
                            continue;
                        }
                        let factor = V::broadcast(*a.coef.add(at(t, i)));
                        for (c, acc_ic) in acc_i.iter_mut().enumerate() {
                            *acc_ic = V::fma(factor, V::load(x_row.add(c * w)), *acc_ic);
                        }
                    }
                    continue;
                }
            }
            let mut column = [V::zero(); NV];
            for (c, vector) in column.iter_mut().enumerate() {
                *vector = V::load(x_row.add(c * w));
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let factor = V::broadcast(*a.coef.add(at(t, i)));
                for (acc_ic, &column_c) in acc_i.iter_mut().zip(&column) {
                    *acc_ic = V::fma(factor, column_c, *acc_ic);
                }
            }
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (c, acc_ic) in acc_i.iter().enumerate() {
                acc_ic.store(y.add(i * a.y_stride + c * w));
            }
        }
    }
}

/// Output o's columns [d, n), n - d < WIDTH (gated unless gate is null).
///
/// # Safety
/// As [`accumulate`], for these columns.
#[inline(always)]
unsafe fn accumulate_tail<V: Vector>(a: &Accumulation, o: usize, d: usize) {
    let n = a.n - d;
    // SAFETY: forwarded; every access lies in y's and the x rows' columns [d, a.n).
    unsafe {
        let y = a.y.add(o * a.y_stride + d);
        let mut acc = V::load_tail(y, n);
        for t in 0..a.terms {
            let at = o * a.output_stride + t * a.coef_stride;
            if !a.gate.is_null() && *a.gate.add(at) == 0.0 {
                continue;
            }
            let factor = V::broadcast(*a.coef.add(at));
            acc = V::fma(factor, V::load_tail(a.x.add(t * a.x_stride + d), n), acc);
        }
        acc.store_tail(y, n);
    }
}

/// Outputs [o, o + O), columns [0, n): chunks of `chunk` vectors (16, 8, 4 or 2), then 8, 4, 2
/// and 1 vectors (those below the chunk), then each output's tail.
///
/// # Safety
/// As [`accumulate`], for these outputs.
#[inline(always)]
unsafe fn accumulate_columns<V: Vector, const O: usize, const GATED: bool>(
    a: &Accumulation,
    o: usize,
    chunk: usize,
) {
    let w = V::WIDTH;
    let mut d = 0;
    // SAFETY: forwarded; d + the chunk's columns <= n.
    unsafe {
        while d + chunk * w <= a.n {
            match chunk {
                16 => accumulate_chunk::<V, O, 16, GATED>(a, o, d),
                8 => accumulate_chunk::<V, O, 8, GATED>(a, o, d),
                4 => accumulate_chunk::<V, O, 4, GATED>(a, o, d),
                _ => accumulate_chunk::<V, O, 2, GATED>(a, o, d),
            }
            d += chunk * w;
        }
        if chunk > 8 && d + 8 * w <= a.n {
            accumulate_chunk::<V, O, 8, GATED>(a, o, d);
            d += 8 * w;
        }
        if chunk > 4 && d + 4 * w <= a.n {
            accumulate_chunk::<V, O, 4, GATED>(a, o, d);
            d += 4 * w;
        }
        if chunk > 2 && d + 2 * w <= a.n {
            accumulate_chunk::<V, O, 2, GATED>(a, o, d);
            d += 2 * w;
        }
        if chunk > 1 && d + w <= a.n {
            accumulate_chunk::<V, O, 1, GATED>(a, o, d);
            d += w;
        }
        if d < a.n {
            for i in 0..O {
                accumulate_tail::<V>(a, o + i, d);
            }
        }
    }
}

/// Ungated (not GATED): blocks of STRIP_ROWS outputs x strip_vectors vectors first. Then (every
/// output when GATED) outputs in pairs, each x load serving two, and the last one alone.
///
/// # Safety
/// As [`accumulate`], with gate not null when GATED.
#[inline(always)]
unsafe fn accumulate_outputs<V: Vector, const GATED: bool>(a: &Accumulation) {
    // the gated chunks' vectors: 16 accumulators with 32 registers (AVX-512), 8 with 16
    let accumulators = if V::WIDTH >= 16 { 16 } else { 8 };
    let mut o = 0;
    // SAFETY: forwarded; o + the outputs of each call <= outputs.
    unsafe {
        if !GATED {
            while o + STRIP_ROWS <= a.outputs {
                accumulate_columns::<V, STRIP_ROWS, false>(a, o, strip_vectors::<V>());
                o += STRIP_ROWS;
            }
        }
        while o + 2 <= a.outputs {
            accumulate_columns::<V, 2, GATED>(a, o, accumulators / 2);
            o += 2;
        }
        if o < a.outputs {
            accumulate_columns::<V, 1, GATED>(a, o, accumulators);
        }
    }
}

/// See [`Accumulation`]: accumulate_outputs, gated unless gate is null.
///
/// # Safety
/// The CPU supports V's instruction set; y holds outputs rows of y_stride (>= n) floats, coef
/// and gate (when not null) every index the terms and outputs reach, x terms rows of x_stride
/// (>= n) floats.
#[inline(always)]
pub unsafe fn accumulate<V: Vector>(a: &Accumulation) {
    // SAFETY: forwarded.
    unsafe {
        match a.gate.is_null() {
            true => accumulate_outputs::<V, false>(a),
            false => accumulate_outputs::<V, true>(a),
        }
    }
}

/// See [`RowGradients`].
///
/// # Safety
/// The CPU supports V's instruction set; probs, grads and (when not null) capped hold n floats.
#[inline(always)]
pub unsafe fn row_gradients<V: Vector>(g: &RowGradients) -> usize {
    // SAFETY: forwarded; j + WIDTH <= n, and counted <= n.
    unsafe {
        let (row_lse, row_delta, factor, multiplier) = (
            V::broadcast(g.lse),
            V::broadcast(g.delta),
            V::broadcast(g.scale),
            V::broadcast(g.multiplier),
        );
        let (one, zero) = (V::broadcast(1.0), V::zero());
        // P < the smallest subnormal: P is 0 (P >= 0; a NaN P is not counted, as P == 0 says)
        let smallest = V::broadcast(f32::from_bits(1));
        let whole = g.counted / V::WIDTH * V::WIDTH; // the counted keys of whole vectors
        let mut zeros = V::zero();
        for j in (0..g.n).step_by(V::WIDTH) {
            let prob = V::exp2(V::sub(V::mul(V::load(g.probs.add(j)), multiplier), row_lse));
            let mut ds = V::mul(prob, V::sub(V::load(g.grads.add(j)), row_delta));
            if !g.capped.is_null() {
                let t = V::load(g.capped.add(j));
                ds = V::mul(ds, V::sub(one, V::mul(t, t)));
            }
            prob.store(g.probs.add(j));
            // 0 < P ? scale dS : P (0, or a NaN P's NaN)
            V::select_less(zero, prob, V::mul(ds, factor), prob).store(g.grads.add(j));
            if j < whole {
                zeros = V::add(zeros, V::select_less(prob, smallest, one, zero));
            }
        }
        // whole numbers below 2^24: exact
        let mut count = V::reduce_sum(zeros) as usize;
        for j in whole..g.counted {
            count += usize::from(*g.probs.add(j) == 0.0);
        }
        count
    }
}
