//! The storage types of q, k, v and out (docs/kernels.md, "dtypes"): float32, IEEE float16 and
//! bfloat16. The kernels compute in float32 whatever the storage: halves are converted exactly
//! to float32 when read and out is rounded to its type when stored (lse is always float32).
//!
//! [`Element`] is the kernels' second generic parameter (the first is the vector type): one
//! `load` / `load_tail` / `store` / `store_tail` per storage type, so the float32 instantiation
//! is exactly the float32 kernel (its loads are plain `V::load`). Twin of C++'s storage types in
//! `cpp/src/element.hpp`.
//!
//! Conversions (the shared specification, issue 12):
//! - float16 -> float32 and bfloat16 -> float32: exact. float16 NaNs come back quiet, as F16C's
//!   vcvtph2ps and NEON's fcvtl return them (payload kept, quiet bit set).
//! - float32 -> float16: IEEE round to nearest even, subnormals kept, overflow to inf; a NaN
//!   becomes the quiet NaN with the payload's top ten bits (vcvtps2ph with
//!   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC; NEON's fcvtn).
//! - float32 -> bfloat16: always the software rule below, vectorised per instruction set (never
//!   vcvtneps2bf16, which flushes subnormals): bits >> 16 rounded to nearest even, NaN quieted.

use crate::problem::ElementType;
use crate::simd::Vector;

/// An IEEE 754 binary16 value, as its bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Float16(pub u16);

/// A bfloat16 value (the top half of a float32), as its bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct BFloat16(pub u16);

/// float16 bits -> float32, exactly (subnormals, inf; NaN quieted).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exponent = u32::from(h >> 10) & 0x1f;
    let mantissa = u32::from(h & 0x3ff);
    let magnitude = match exponent {
        // a subnormal: mantissa * 2^-24, exact in float32 (a normal number there)
        0 => (mantissa as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        0x1f if mantissa == 0 => 0x7f80_0000,
        0x1f => 0x7fc0_0000 | (mantissa << 13),
        _ => ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// float32 -> float16 bits, round to nearest even (subnormals kept, overflow to inf, NaN
/// quieted with the payload's top bits). The bit steps of a software conversion; the sums are
/// exact integer or float32 additions, so it equals vcvtps2ph bit for bit.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let magnitude = bits & 0x7fff_ffff;
    let half = if magnitude > 0x7f80_0000 {
        0x7e00 | ((magnitude >> 13) & 0x3ff) as u16 // NaN: quiet, payload's top bits
    } else if magnitude >= 0x477f_f000 {
        0x7c00 // inf, or rounds past 65504 (the halfway point 65520 rounds to even: up)
    } else if magnitude < 0x3880_0000 {
        // below 2^-14: a subnormal or zero. Adding 0.5 leaves the value in units of 2^-24 in
        // the low mantissa bits, rounded to nearest even by the float32 addition itself.
        let sum = f32::from_bits(magnitude) + 0.5;
        (sum.to_bits() - 0x3f00_0000) as u16
    } else {
        // normal: rebias the exponent (127 -> 15), then round the 13 dropped bits to even
        let odd = (magnitude >> 13) & 1;
        ((magnitude - (112 << 23) + 0xfff + odd) >> 13) as u16
    };
    sign | half
}

/// bfloat16 bits -> float32, exactly.
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// float32 -> bfloat16 bits: the specification's rule, round to nearest even, subnormals kept,
/// NaN quieted: NaN: (bits >> 16) | 0x0040; else (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        ((bits >> 16) | 0x0040) as u16
    } else {
        ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    }
}

/// A storage type that the kernels read as float32 vectors of type V: q's, k's and v's
/// ([`Element`]s), or int8 for k and v (their per-token scales are applied by the kernels:
/// docs/kernels.md, "int8 K/V").
pub trait Load: Copy + Send + Sync + 'static {
    /// Zero in this type (the lanes past a tail).
    const ZERO: Self;
    /// int8: each token's value is float32(x) times its scale (k_scale / v_scale).
    const SCALED: bool = false;
    /// The exact float32 value.
    fn to_f32(self) -> f32;

    /// `V::WIDTH` elements from `p`, converted.
    ///
    /// # Safety
    /// V's instruction set is available; `p` is valid for reading `V::WIDTH` elements.
    unsafe fn load<V: Vector>(p: *const Self) -> V;

    /// The first `n` (< `V::WIDTH`) elements from `p`, the other lanes 0; the memory past them is
    /// never touched. (Halves and int8: through a zeroed buffer; no instruction set here has a
    /// masked 16-bit or 8-bit load in its baseline.)
    ///
    /// # Safety
    /// V's instruction set is available; `p` is valid for reading `n` elements.
    #[inline(always)]
    unsafe fn load_tail<V: Vector>(p: *const Self, n: usize) -> V {
        let mut lanes = [Self::ZERO; MAX_LANES];
        // SAFETY: n < V::WIDTH <= MAX_LANES elements readable at p; lanes holds MAX_LANES.
        unsafe {
            std::ptr::copy_nonoverlapping(p, lanes.as_mut_ptr(), n);
            Self::load::<V>(lanes.as_ptr())
        }
    }
}

/// A storage type of q, k, v and out: read as [`Load`], and written from float32 vectors.
pub trait Element: Load {
    const DTYPE: ElementType;
    /// The value rounded to this type (module documentation).
    fn from_f32(x: f32) -> Self;

    /// Rounds and writes `V::WIDTH` elements to `p`.
    ///
    /// # Safety
    /// `p` is valid for writing `V::WIDTH` elements (x proves V's instruction set).
    unsafe fn store<V: Vector>(x: V, p: *mut Self);

    /// Rounds and writes the first `n` (< `V::WIDTH`) lanes to `p`; the memory after them is not
    /// touched.
    ///
    /// # Safety
    /// `p` is valid for writing `n` elements.
    #[inline(always)]
    unsafe fn store_tail<V: Vector>(x: V, p: *mut Self, n: usize) {
        let mut lanes = [Self::ZERO; MAX_LANES];
        // SAFETY: lanes holds MAX_LANES >= V::WIDTH elements; n are writeable at p.
        unsafe {
            Self::store::<V>(x, lanes.as_mut_ptr());
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), p, n);
        }
    }
}

/// The widest vector type's WIDTH (AVX-512: 16 floats).
const MAX_LANES: usize = 16;

impl Load for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<V: Vector>(p: *const f32) -> V {
        // SAFETY: forwarded.
        unsafe { V::load(p) }
    }
    #[inline(always)]
    unsafe fn load_tail<V: Vector>(p: *const f32, n: usize) -> V {
        // SAFETY: forwarded.
        unsafe { V::load_tail(p, n) }
    }
}

impl Element for f32 {
    const DTYPE: ElementType = ElementType::Float32;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    unsafe fn store<V: Vector>(x: V, p: *mut f32) {
        // SAFETY: forwarded.
        unsafe { x.store(p) }
    }
    #[inline(always)]
    unsafe fn store_tail<V: Vector>(x: V, p: *mut f32, n: usize) {
        // SAFETY: forwarded.
        unsafe { x.store_tail(p, n) }
    }
}

impl Load for Float16 {
    const ZERO: Self = Float16(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    unsafe fn load<V: Vector>(p: *const Float16) -> V {
        // SAFETY: forwarded (Float16 is a transparent u16).
        unsafe { V::load_f16(p.cast()) }
    }
}

impl Element for Float16 {
    const DTYPE: ElementType = ElementType::Float16;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Float16(f32_to_f16(x))
    }
    #[inline(always)]
    unsafe fn store<V: Vector>(x: V, p: *mut Float16) {
        // SAFETY: forwarded.
        unsafe { x.store_f16(p.cast()) }
    }
}

impl Load for BFloat16 {
    const ZERO: Self = BFloat16(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.0)
    }
    #[inline(always)]
    unsafe fn load<V: Vector>(p: *const BFloat16) -> V {
        // SAFETY: forwarded (BFloat16 is a transparent u16).
        unsafe { V::load_bf16(p.cast()) }
    }
}

impl Element for BFloat16 {
    const DTYPE: ElementType = ElementType::BFloat16;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        BFloat16(f32_to_bf16(x))
    }
    #[inline(always)]
    unsafe fn store<V: Vector>(x: V, p: *mut BFloat16) {
        // SAFETY: forwarded.
        unsafe { x.store_bf16(p.cast()) }
    }
}

/// int8 K and V (docs/kernels.md, "int8 K/V"): exact (sign extension, then float32); the
/// per-token scales are the kernels' part. Never q or out, so not an [`Element`].
impl Load for i8 {
    const ZERO: Self = 0;
    const SCALED: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    #[inline(always)]
    unsafe fn load<V: Vector>(p: *const i8) -> V {
        // SAFETY: forwarded.
        unsafe { V::load_i8(p) }
    }
}
