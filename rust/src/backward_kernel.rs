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
//! and [`row_gradients`], P and dS of one row, lane by lane.

use crate::simd::Vector;

/// out[r * out_stride + j] for r < rows, j < n (n a multiple of the vector width) = sum over
/// d < depth, ascending, of a[r * depth + d] * panel[d * panel_stride + j]: one V::fma chain
/// from 0 per element.
pub type PanelProductFn = unsafe fn(
    a: *const f32,
    rows: usize,
    depth: usize,
    panel: *const f32,
    panel_stride: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
);
/// For every output o < outputs: y[o * y_stride + (0, n)] += c * x[t * x_stride + (0, n)] for
/// t < terms, ascending, c = coef[o * output_stride + t * coef_stride], skipping every term whose
/// gate (same index) is 0 (a hidden key: its x is never read): one V::fma chain per element,
/// starting from y.
pub type AccumulateFn = unsafe fn(
    y: *mut f32,
    y_stride: usize,
    outputs: usize,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    output_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
);

/// P and scale dS of one row's n keys (n a multiple of the vector width), in place: probs holds
/// S (base 2) and becomes P = V::exp2(S - lse); grads holds dP and becomes P (dP - delta), times
/// 1 - t^2 (t = capped[j]) when capped is not null, times scale; 0 where P is 0 (a hidden key: its
/// dP is never used).
pub type RowGradientsFn = unsafe fn(
    probs: *mut f32,
    grads: *mut f32,
    capped: *const f32,
    n: usize,
    lse: f32,
    delta: f32,
    scale: f32,
);

/// The backward kernels of one instruction set.
#[derive(Clone, Copy)]
pub struct BackwardKernels {
    pub panel_product: PanelProductFn,
    pub accumulate: AccumulateFn,
    pub row_gradients: RowGradientsFn,
}

/// Rows of a panel_product strip, 4 x 4 vectors; the accumulators of an accumulate chunk are 16
/// vectors with 32 registers (AVX-512), 8 with 16 (AVX2; NEON and the scalar type alike).
const STRIP_ROWS: usize = 4;
const STRIP_VECTORS: usize = 4;

/// R rows x NV vectors of out.
///
/// # Safety
/// As [`panel_product`], for these rows and columns.
#[inline(always)]
unsafe fn product_strip<V: Vector, const R: usize, const NV: usize>(
    a: *const f32,
    depth: usize,
    panel: *const f32,
    panel_stride: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded; every read lies in a's R rows and the panel's NV vectors of columns.
    unsafe {
        let mut acc = [[V::zero(); NV]; R];
        for d in 0..depth {
            let mut column = [V::zero(); NV];
            for (c, vector) in column.iter_mut().enumerate() {
                *vector = V::load(panel.add(d * panel_stride + c * w));
            }
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let x = V::broadcast(*a.add(r * depth + d));
                for (acc_rc, &column_c) in acc_row.iter_mut().zip(&column) {
                    *acc_rc = V::fma(x, column_c, *acc_rc);
                }
            }
        }
        for (r, acc_row) in acc.iter().enumerate() {
            for (c, acc_rc) in acc_row.iter().enumerate() {
                acc_rc.store(out.add(r * out_stride + c * w));
            }
        }
    }
}

/// R rows of out, all n columns: strips of STRIP_VECTORS vectors, then the remaining ones.
///
/// # Safety
/// As [`panel_product`], for these rows.
#[inline(always)]
unsafe fn product_rows<V: Vector, const R: usize>(
    a: *const f32,
    depth: usize,
    panel: *const f32,
    panel_stride: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let w = V::WIDTH;
    let mut j = 0;
    // SAFETY: forwarded; j + the strip's columns <= n.
    unsafe {
        while j + STRIP_VECTORS * w <= n {
            product_strip::<V, R, STRIP_VECTORS>(
                a,
                depth,
                panel.add(j),
                panel_stride,
                out.add(j),
                out_stride,
            );
            j += STRIP_VECTORS * w;
        }
        let (panel, out) = (panel.add(j), out.add(j));
        match (n - j) / w {
            3 => product_strip::<V, R, 3>(a, depth, panel, panel_stride, out, out_stride),
            2 => product_strip::<V, R, 2>(a, depth, panel, panel_stride, out, out_stride),
            1 => product_strip::<V, R, 1>(a, depth, panel, panel_stride, out, out_stride),
            _ => {}
        }
    }
}

/// See [`PanelProductFn`].
///
/// # Safety
/// The CPU supports V's instruction set; a holds rows x depth floats, panel depth rows of
/// panel_stride (>= n) floats, out rows rows of out_stride (>= n) floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_product<V: Vector>(
    a: *const f32,
    rows: usize,
    depth: usize,
    panel: *const f32,
    panel_stride: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut r = 0;
    // SAFETY: forwarded; r + the strip's rows <= rows.
    unsafe {
        while r + STRIP_ROWS <= rows {
            let (a, out) = (a.add(r * depth), out.add(r * out_stride));
            product_rows::<V, STRIP_ROWS>(a, depth, panel, panel_stride, n, out, out_stride);
            r += STRIP_ROWS;
        }
        while r < rows {
            let (a, out) = (a.add(r * depth), out.add(r * out_stride));
            product_rows::<V, 1>(a, depth, panel, panel_stride, n, out, out_stride);
            r += 1;
        }
    }
}

/// Outputs O (1 or 2, sharing each x load), NV vectors of columns each: acc[o] = y_o, then for
/// every term whose gate of output o is nonzero, acc[o] = V::fma(coef_o, x_t, acc[o]).
///
/// # Safety
/// As [`accumulate`], for these outputs and columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_chunk<V: Vector, const O: usize, const NV: usize>(
    y: *mut f32,
    y_stride: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    output_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded; every access lies in the outputs' and the x rows' NV vectors.
    unsafe {
        let mut acc = [[V::zero(); NV]; O];
        for (o, acc_o) in acc.iter_mut().enumerate() {
            for (c, acc_oc) in acc_o.iter_mut().enumerate() {
                *acc_oc = V::load(y.add(o * y_stride + c * w));
            }
        }
        for t in 0..terms {
            let mut live = [false; O];
            for (o, live_o) in live.iter_mut().enumerate() {
                *live_o = *gate.add(t * coef_stride + o * output_stride) != 0.0;
            }
            if !live.iter().any(|&l| l) {
                continue;
            }
            let x_row = x.add(t * x_stride);
            if live.iter().all(|&l| l) {
                let mut factor = [V::zero(); O];
                for (o, factor_o) in factor.iter_mut().enumerate() {
                    *factor_o = V::broadcast(*coef.add(t * coef_stride + o * output_stride));
                }
                for c in 0..NV {
                    let column = V::load(x_row.add(c * w));
                    for (acc_o, &factor_o) in acc.iter_mut().zip(&factor) {
                        acc_o[c] = V::fma(factor_o, column, acc_o[c]);
                    }
                }
                continue;
            }
            for (o, acc_o) in acc.iter_mut().enumerate() {
                if !live[o] {
                    continue;
                }
                let factor = V::broadcast(*coef.add(t * coef_stride + o * output_stride));
                for (c, acc_oc) in acc_o.iter_mut().enumerate() {
                    *acc_oc = V::fma(factor, V::load(x_row.add(c * w)), *acc_oc);
                }
            }
        }
        for (o, acc_o) in acc.iter().enumerate() {
            for (c, acc_oc) in acc_o.iter().enumerate() {
                acc_oc.store(y.add(o * y_stride + c * w));
            }
        }
    }
}

/// One output's columns [0, n), n < WIDTH.
///
/// # Safety
/// As [`accumulate`], for these columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_tail<V: Vector>(
    y: *mut f32,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    // SAFETY: forwarded; every access lies in y's and the x rows' first n floats.
    unsafe {
        let mut acc = V::load_tail(y, n);
        for t in 0..terms {
            if *gate.add(t * coef_stride) == 0.0 {
                continue;
            }
            let factor = V::broadcast(*coef.add(t * coef_stride));
            acc = V::fma(factor, V::load_tail(x.add(t * x_stride), n), acc);
        }
        acc.store_tail(y, n);
    }
}

/// O outputs' columns [0, n): chunks of 16 / O vectors (WIDTH 16) or 8 / O (the others), then 8,
/// 4, 2 and 1 vectors (those below the chunk), then each output's tail.
///
/// # Safety
/// As [`accumulate`], for these outputs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_columns<V: Vector, const O: usize>(
    y: *mut f32,
    y_stride: usize,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    output_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    let w = V::WIDTH;
    let chunk = if w >= 16 { 16 / O } else { 8 / O };
    let mut d = 0;
    // SAFETY: forwarded; d + the chunk's columns <= n.
    unsafe {
        macro_rules! step {
            ($vectors:literal) => {{
                accumulate_chunk::<V, O, $vectors>(
                    y.add(d),
                    y_stride,
                    coef,
                    gate,
                    coef_stride,
                    output_stride,
                    x.add(d),
                    x_stride,
                    terms,
                );
                d += $vectors * w;
            }};
        }
        while d + chunk * w <= n {
            match chunk {
                16 => step!(16),
                8 => step!(8),
                _ => step!(4),
            }
        }
        if chunk > 8 && d + 8 * w <= n {
            step!(8);
        }
        if chunk > 4 && d + 4 * w <= n {
            step!(4);
        }
        if chunk > 2 && d + 2 * w <= n {
            step!(2);
        }
        if chunk > 1 && d + w <= n {
            step!(1);
        }
        if d < n {
            for o in 0..O {
                let at = o * output_stride;
                let (coef, gate) = (coef.add(at), gate.add(at));
                let y = y.add(o * y_stride + d);
                accumulate_tail::<V>(y, n - d, coef, gate, coef_stride, x.add(d), x_stride, terms);
            }
        }
    }
}

/// See [`AccumulateFn`]: outputs in pairs (each x load serving two), then the last one alone.
///
/// # Safety
/// The CPU supports V's instruction set; y holds outputs rows of y_stride (>= n) floats, coef
/// and gate every index the terms and outputs reach, x terms rows of x_stride (>= n) floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accumulate<V: Vector>(
    y: *mut f32,
    y_stride: usize,
    outputs: usize,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    output_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    let mut o = 0;
    // SAFETY: forwarded; o + the outputs of each call <= outputs.
    unsafe {
        while o + 2 <= outputs {
            let (y_o, at) = (y.add(o * y_stride), o * output_stride);
            accumulate_columns::<V, 2>(
                y_o,
                y_stride,
                n,
                coef.add(at),
                gate.add(at),
                coef_stride,
                output_stride,
                x,
                x_stride,
                terms,
            );
            o += 2;
        }
        if o < outputs {
            let (y_o, at) = (y.add(o * y_stride), o * output_stride);
            accumulate_columns::<V, 1>(
                y_o,
                y_stride,
                n,
                coef.add(at),
                gate.add(at),
                coef_stride,
                output_stride,
                x,
                x_stride,
                terms,
            );
        }
    }
}

/// See [`RowGradientsFn`].
///
/// # Safety
/// The CPU supports V's instruction set; probs, grads and (when not null) capped hold n floats.
#[inline(always)]
pub unsafe fn row_gradients<V: Vector>(
    probs: *mut f32,
    grads: *mut f32,
    capped: *const f32,
    n: usize,
    lse: f32,
    delta: f32,
    scale: f32,
) {
    // SAFETY: forwarded; j + WIDTH <= n.
    unsafe {
        let (row_lse, row_delta, factor) =
            (V::broadcast(lse), V::broadcast(delta), V::broadcast(scale));
        let (one, zero) = (V::broadcast(1.0), V::zero());
        for j in (0..n).step_by(V::WIDTH) {
            let prob = V::exp2(V::sub(V::load(probs.add(j)), row_lse));
            let mut ds = V::mul(prob, V::sub(V::load(grads.add(j)), row_delta));
            if !capped.is_null() {
                let t = V::load(capped.add(j));
                ds = V::mul(ds, V::sub(one, V::mul(t, t)));
            }
            prob.store(probs.add(j));
            // 0 < P ? scale dS : P (0, or a NaN P's NaN)
            V::select_less(zero, prob, V::mul(ds, factor), prob).store(grads.add(j));
        }
    }
}
