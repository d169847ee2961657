//! The portable vector type: a plain array of SCALAR_WIDTH floats, element by element in fixed
//! order. Same tiled algorithm as the SIMD paths; the compiler may vectorise the loops with the
//! baseline instruction set (SSE2 on x86-64), never more. Twin of `cpp/src/simd_scalar.hpp`.

use crate::constants::{
    EXP2_COEFFICIENTS, EXP2_DEGREE, EXP2_MIN, SCALAR_DIRECT_STRIP_ROWS, SCALAR_SCORE_VECTORS,
    SCALAR_VALUE_VECTORS, SCALAR_WIDTH,
};
use crate::simd::Vector;

const W: usize = SCALAR_WIDTH;

#[derive(Clone, Copy, Debug)]
pub struct VecScalar([f32; W]);

impl VecScalar {
    #[inline(always)]
    fn map2(a: Self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        VecScalar(std::array::from_fn(|i| f(a.0[i], b.0[i])))
    }
}

/// 2^x of one lane (constants.rs, "exp2"), as `VecScalar::exp2_lane` in C++.
#[inline(always)]
pub fn exp2_lane(x_in: f32) -> f32 {
    let x = if x_in >= EXP2_MIN { x_in } else { EXP2_MIN }; // NaN too
    let mut whole = x as i32; // rounds toward zero: floor for x <= 0 is one less unless whole
    if whole as f32 > x {
        whole -= 1;
    }
    let f = x - whole as f32;
    let mut p = EXP2_COEFFICIENTS[EXP2_DEGREE];
    for c in (0..EXP2_DEGREE).rev() {
        p = p * f + EXP2_COEFFICIENTS[c];
    }
    let value = p * f32::from_bits(((whole + 127) as u32) << 23);
    if x_in.is_nan() {
        x_in // NaN gives NaN, as the SIMD types
    } else {
        value
    }
}

impl Vector for VecScalar {
    const WIDTH: usize = W;
    const SCORE_VECTORS: usize = SCALAR_SCORE_VECTORS;
    const VALUE_VECTORS: usize = SCALAR_VALUE_VECTORS;
    const DIRECT_STRIP_ROWS: usize = SCALAR_DIRECT_STRIP_ROWS;
    const NAME: &'static str = "scalar";

    #[inline(always)]
    unsafe fn zero() -> Self {
        VecScalar([0.0; W])
    }
    #[inline(always)]
    unsafe fn broadcast(x: f32) -> Self {
        VecScalar([x; W])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees W readable floats at p.
        VecScalar(unsafe { p.cast::<[f32; W]>().read_unaligned() })
    }
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, n: usize) -> Self {
        VecScalar(std::array::from_fn(|i| {
            if i < n {
                // SAFETY: the caller guarantees n readable floats at p, and i < n.
                unsafe { *p.add(i) }
            } else {
                0.0
            }
        }))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees W writeable floats at p.
        unsafe { p.cast::<[f32; W]>().write_unaligned(self.0) }
    }
    #[inline(always)]
    unsafe fn store_tail(self, p: *mut f32, n: usize) {
        for (i, &x) in self.0.iter().enumerate().take(n) {
            // SAFETY: the caller guarantees n writeable floats at p, and i < n.
            unsafe { *p.add(i) = x };
        }
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        VecScalar(std::array::from_fn(|i| a.0[i] * b.0[i] + c.0[i]))
    }
    #[inline(always)]
    fn mul(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    fn div(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x / y)
    }
    #[inline(always)]
    fn select_less(a: Self, b: Self, x: Self, y: Self) -> Self {
        VecScalar(std::array::from_fn(|i| {
            if a.0[i] < b.0[i] {
                x.0[i]
            } else {
                y.0[i]
            }
        }))
    }
    #[inline(always)]
    fn exp2(x: Self) -> Self {
        VecScalar(x.0.map(exp2_lane))
    }
    #[inline(always)]
    fn reduce_max(mut x: Self) -> f32 {
        let mut half = W / 2;
        while half >= 1 {
            for i in 0..half {
                x.0[i] = if x.0[i] > x.0[i + half] {
                    x.0[i]
                } else {
                    x.0[i + half]
                };
            }
            half /= 2;
        }
        x.0[0]
    }
    #[inline(always)]
    fn reduce_sum(mut x: Self) -> f32 {
        let mut half = W / 2;
        while half >= 1 {
            for i in 0..half {
                x.0[i] += x.0[i + half];
            }
            half /= 2;
        }
        x.0[0]
    }
    #[inline(always)]
    fn reduce4(a0: Self, a1: Self, a2: Self, a3: Self) -> Self {
        let a = [a0, a1, a2, a3];
        let mut r = [0.0; W];
        for g in 0..W / 4 {
            for (k, a_k) in a.iter().enumerate() {
                let x = &a_k.0[4 * g..4 * g + 4];
                r[4 * g + k] = (x[0] + x[2]) + (x[1] + x[3]);
            }
        }
        VecScalar(r)
    }
    #[inline(always)]
    fn fold_groups(y: &[Self; 4]) -> Self {
        let mut r = [0.0; W];
        for (b, y_b) in y.iter().enumerate().take(W / 4) {
            for k in 0..4 {
                let mut s = [0.0f32; W / 4];
                for (g, s_g) in s.iter_mut().enumerate() {
                    *s_g = y_b.0[4 * g + k];
                }
                let mut half = W / 8;
                while half >= 1 {
                    for g in 0..half {
                        s[g] += s[g + half];
                    }
                    half /= 2;
                }
                r[4 * b + k] = s[0];
            }
        }
        VecScalar(r)
    }
    #[inline(always)]
    fn transpose(rows: &mut [Self]) {
        debug_assert_eq!(rows.len(), W);
        for i in 0..W {
            for j in i + 1..W {
                let x = rows[i].0[j];
                rows[i].0[j] = rows[j].0[i];
                rows[j].0[i] = x;
            }
        }
    }
}
