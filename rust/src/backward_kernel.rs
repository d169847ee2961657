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
/// y[0, n) += coef[t * coef_stride] * x[t * x_stride + (0, n)] for t < terms, ascending,
/// skipping every term whose gate[t * coef_stride] is 0 (a hidden key: its x is never read): one
/// V::fma chain per element, starting from y.
pub type AccumulateFn = unsafe fn(
    y: *mut f32,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
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

/// Rows of a panel_product strip and accumulators of an accumulate chunk: 4 x 4 vectors and 8
/// vectors (AVX-512: 16 and 8 of the 32 registers; AVX2 and NEON: as many of 16 and 32).
const STRIP_ROWS: usize = 4;
const STRIP_VECTORS: usize = 4;
const CHUNK_VECTORS: usize = 8;

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

/// y[0, NV WIDTH) of accumulate.
///
/// # Safety
/// As [`accumulate`], for these columns.
#[inline(always)]
unsafe fn accumulate_chunk<V: Vector, const NV: usize>(
    y: *mut f32,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    let w = V::WIDTH;
    // SAFETY: forwarded; every access lies in y's and the x rows' NV vectors.
    unsafe {
        let mut acc = [V::zero(); NV];
        for (c, acc_c) in acc.iter_mut().enumerate() {
            *acc_c = V::load(y.add(c * w));
        }
        for t in 0..terms {
            if *gate.add(t * coef_stride) == 0.0 {
                continue;
            }
            let factor = V::broadcast(*coef.add(t * coef_stride));
            let x_row = x.add(t * x_stride);
            for (c, acc_c) in acc.iter_mut().enumerate() {
                *acc_c = V::fma(factor, V::load(x_row.add(c * w)), *acc_c);
            }
        }
        for (c, acc_c) in acc.iter().enumerate() {
            acc_c.store(y.add(c * w));
        }
    }
}

/// y[0, n) of accumulate, n < WIDTH.
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

/// See [`AccumulateFn`]: chunks of CHUNK_VECTORS vectors, then 4, 2 and 1 vectors, then the tail.
///
/// # Safety
/// The CPU supports V's instruction set; y holds n floats, coef and gate terms entries of
/// stride coef_stride, x terms rows of x_stride (>= n) floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accumulate<V: Vector>(
    y: *mut f32,
    n: usize,
    coef: *const f32,
    gate: *const f32,
    coef_stride: usize,
    x: *const f32,
    x_stride: usize,
    terms: usize,
) {
    let w = V::WIDTH;
    let mut d = 0;
    // SAFETY: forwarded; d + the chunk's columns <= n.
    unsafe {
        let chunk = |d: usize| (y.add(d), x.add(d));
        while d + CHUNK_VECTORS * w <= n {
            let (y, x) = chunk(d);
            accumulate_chunk::<V, CHUNK_VECTORS>(y, coef, gate, coef_stride, x, x_stride, terms);
            d += CHUNK_VECTORS * w;
        }
        if d + 4 * w <= n {
            let (y, x) = chunk(d);
            accumulate_chunk::<V, 4>(y, coef, gate, coef_stride, x, x_stride, terms);
            d += 4 * w;
        }
        if d + 2 * w <= n {
            let (y, x) = chunk(d);
            accumulate_chunk::<V, 2>(y, coef, gate, coef_stride, x, x_stride, terms);
            d += 2 * w;
        }
        if d + w <= n {
            let (y, x) = chunk(d);
            accumulate_chunk::<V, 1>(y, coef, gate, coef_stride, x, x_stride, terms);
            d += w;
        }
        if d < n {
            let (y, x) = chunk(d);
            accumulate_tail::<V>(y, n - d, coef, gate, coef_stride, x, x_stride, terms);
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
