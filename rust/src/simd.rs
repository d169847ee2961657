//! The vector types of the fast kernels: one per instruction set, all behind [`Vector`], so the
//! tile kernel (`flash_kernel.rs`) is written once and compiled once per instruction set.
//!
//! The types themselves (simd_scalar.rs, simd_avx2.rs, simd_avx512.rs, simd_neon.rs) are the twins
//! of `cpp/src/simd_{scalar,avx2,avx512,neon}.hpp`: the same operations, the same exp2
//! polynomial (constants.rs), the same horizontal reduction order (halves folded).
//!
//! Soundness: a value of an AVX type exists only once its instruction set has been detected, so
//! its constructors (`zero`, `broadcast`, `load*`) are `unsafe` with that requirement, and the
//! arithmetic on existing values is safe. (C++ needs no such split: its per-ISA translation
//! units are simply never called on a CPU without the instructions.) NEON is part of every
//! AArch64 CPU, so for the NEON type that requirement always holds.

/// A vector of `WIDTH` floats with the operations the tile kernel needs.
pub trait Vector: Copy {
    /// Floats per vector.
    const WIDTH: usize;
    /// Vectors of keys per S micro-kernel row (constants.rs).
    const SCORE_VECTORS: usize;
    /// Vectors of value columns per P.V micro-kernel row (constants.rs).
    const VALUE_VECTORS: usize;
    /// Rows per direct-score strip (constants.rs, DIRECT_SCORE_ROWS).
    const DIRECT_STRIP_ROWS: usize;
    /// The instruction set's name, as `build_info()["isa"]` reports it.
    const NAME: &'static str;

    /// All lanes 0.
    ///
    /// # Safety
    /// The CPU supports this type's instruction set.
    unsafe fn zero() -> Self;
    /// All lanes `x`.
    ///
    /// # Safety
    /// As [`Vector::zero`].
    unsafe fn broadcast(x: f32) -> Self;
    /// `WIDTH` floats from `p` (any alignment).
    ///
    /// # Safety
    /// As [`Vector::zero`], and `p` is valid for reading `WIDTH` floats.
    unsafe fn load(p: *const f32) -> Self;
    /// The first `n` (< `WIDTH`) floats from `p`; the other lanes are 0 and their memory is
    /// never touched.
    ///
    /// # Safety
    /// As [`Vector::zero`], and `p` is valid for reading `n` floats.
    unsafe fn load_tail(p: *const f32, n: usize) -> Self;
    /// Writes `WIDTH` floats to `p`.
    ///
    /// # Safety
    /// `p` is valid for writing `WIDTH` floats.
    unsafe fn store(self, p: *mut f32);
    /// Writes the first `n` (< `WIDTH`) lanes to `p`; the memory after them is not touched.
    ///
    /// # Safety
    /// `p` is valid for writing `n` floats.
    unsafe fn store_tail(self, p: *mut f32, n: usize);
    /// `WIDTH` float16 values from `p`, converted exactly (element.rs). The default converts
    /// lane by lane in software (the scalar type; NEON, whose float16 vector types are not
    /// stable in Rust: the same bits as its fcvtl); the x86 types use F16C.
    ///
    /// # Safety
    /// As [`Vector::zero`], and `p` is valid for reading `WIDTH` halves.
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        let mut lanes = [0.0f32; 16];
        for (i, lane) in lanes.iter_mut().enumerate().take(Self::WIDTH) {
            // SAFETY: i < WIDTH halves readable at p.
            *lane = crate::element::f16_to_f32(unsafe { *p.add(i) });
        }
        // SAFETY: forwarded; lanes holds 16 >= WIDTH floats.
        unsafe { Self::load(lanes.as_ptr()) }
    }
    /// `WIDTH` bfloat16 values from `p`, converted exactly (bits << 16).
    ///
    /// # Safety
    /// As [`Vector::load_f16`].
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        let mut lanes = [0.0f32; 16];
        for (i, lane) in lanes.iter_mut().enumerate().take(Self::WIDTH) {
            // SAFETY: i < WIDTH halves readable at p.
            *lane = crate::element::bf16_to_f32(unsafe { *p.add(i) });
        }
        // SAFETY: forwarded; lanes holds 16 >= WIDTH floats.
        unsafe { Self::load(lanes.as_ptr()) }
    }
    /// `WIDTH` int8 values from `p`, converted exactly (sign extension to int32, then float32).
    /// The default converts lane by lane (the scalar type); the SIMD types override it
    /// (vpmovsxbd + vcvtdq2ps; NEON vmovl + vcvtq).
    ///
    /// # Safety
    /// As [`Vector::zero`], and `p` is valid for reading `WIDTH` bytes.
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        let mut lanes = [0.0f32; 16];
        for (i, lane) in lanes.iter_mut().enumerate().take(Self::WIDTH) {
            // SAFETY: i < WIDTH bytes readable at p.
            *lane = f32::from(unsafe { *p.add(i) });
        }
        // SAFETY: forwarded; lanes holds 16 >= WIDTH floats.
        unsafe { Self::load(lanes.as_ptr()) }
    }
    /// Writes the lanes rounded to float16 (element.rs) to `p`.
    ///
    /// # Safety
    /// `p` is valid for writing `WIDTH` halves.
    #[inline(always)]
    unsafe fn store_f16(self, p: *mut u16) {
        let mut lanes = [0.0f32; 16];
        // SAFETY: lanes holds 16 >= WIDTH floats; i < WIDTH halves writeable at p.
        unsafe {
            self.store(lanes.as_mut_ptr());
            for (i, &lane) in lanes.iter().enumerate().take(Self::WIDTH) {
                *p.add(i) = crate::element::f32_to_f16(lane);
            }
        }
    }
    /// Writes the lanes rounded to bfloat16 (element.rs, the software rule) to `p`.
    ///
    /// # Safety
    /// `p` is valid for writing `WIDTH` halves.
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut u16) {
        let mut lanes = [0.0f32; 16];
        // SAFETY: lanes holds 16 >= WIDTH floats; i < WIDTH halves writeable at p.
        unsafe {
            self.store(lanes.as_mut_ptr());
            for (i, &lane) in lanes.iter().enumerate().take(Self::WIDTH) {
                *p.add(i) = crate::element::f32_to_bf16(lane);
            }
        }
    }
    /// `a * b + c` (fused on the SIMD types, two roundings on the scalar type, as in C++).
    fn fma(a: Self, b: Self, c: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn add(a: Self, b: Self) -> Self;
    fn sub(a: Self, b: Self) -> Self;
    /// Per lane `a > b ? a : b` (x86 semantics: `b` when either is NaN).
    fn max(a: Self, b: Self) -> Self;
    fn div(a: Self, b: Self) -> Self;
    /// Per lane `a < b ? x : y` (`y` when `a` or `b` is NaN).
    fn select_less(a: Self, b: Self, x: Self, y: Self) -> Self;
    /// 2^x for x <= 0 (constants.rs, "exp2"); -inf gives exactly 0, NaN gives NaN (a NaN score
    /// reaches the row sum).
    fn exp2(x: Self) -> Self;
    /// The largest lane, halves folded (lanes i and i + WIDTH/2, then i and i + WIDTH/4, ...).
    fn reduce_max(x: Self) -> f32;
    /// The sum of the lanes, halves folded like [`Vector::reduce_max`].
    fn reduce_sum(x: Self) -> f32;
    /// Direct scores: the accumulators of four keys -> one vector whose lane 4g + k is key k's
    /// sum over lanes 4g..4g+3 of a[k], in the order (a[4g] + a[4g+2]) + (a[4g+1] + a[4g+3])
    /// (g = a group of four lanes, the SIMD types' 128-bit groups).
    fn reduce4(a0: Self, a1: Self, a2: Self, a3: Self) -> Self;
    /// y[0..WIDTH/4] (batches of four keys, as [`Vector::reduce4`] leaves them) -> WIDTH scores:
    /// lane 4b + k is batch b's lane k summed over the groups, halves folded. (Entries of `y`
    /// past WIDTH/4 are ignored.)
    fn fold_groups(y: &[Self; 4]) -> Self;
    /// `rows[i]` = row i of a `WIDTH` x `WIDTH` block -> `rows[d]` = column d (for packing K^T
    /// panels). `rows` holds exactly `WIDTH` vectors.
    fn transpose(rows: &mut [Self]);
}
