//! float16 and bfloat16 storage (issue 12) on the plain reference kernel and the fast kernel of
//! every instruction set this CPU runs:
//! - the convert path: a half case gives, bit for bit, the float32 kernel's result on the same
//!   (already rounded) inputs, rounded to the half type; lse identical;
//! - against the float64 computation on the rounded inputs, within the half type's precision;
//! - the shapes around the tile sizes, odd D and key counts, GQA, causal with offsets, kv_lens,
//!   masks, strided layouts, the variants, decode (direct and packed split-key) and prefill,
//!   NaN in hidden values.

use crate::common;

use common::{assert_close_to_naive, fast_kernels, random_case, Case, Kernel, Mask, Output, Rng};
use twinattn::problem::ElementType;

const HALVES: [ElementType; 2] = [ElementType::Float16, ElementType::BFloat16];

fn kernels() -> Vec<Kernel> {
    let mut kernels = vec![Kernel::Reference];
    kernels.extend(fast_kernels());
    kernels
}

/// The half case on `kernel` against the float32 case with the same rounded inputs, its out
/// rounded: identical bits (NaN patterns included), lse identical.
fn assert_convert_path(case: &Case, kernel: Kernel, dtype: ElementType, what: &str) -> Output {
    let half = case.stored_as(dtype);
    let mut float = half.clone();
    float.dtype = ElementType::Float32;
    let got = common::run_with(kernel, &half, 2);
    let want = common::run_with(kernel, &float, 2);
    let rounded = common::rounded_bits(dtype, &want.out.values());
    let got_bits = common::bits(&got.out.values());
    if let Some(n) = (0..rounded.len()).find(|&n| got_bits[n] != rounded[n]) {
        panic!(
            "{what} {kernel:?} {dtype:?}: out element {n}: {} vs float32 rounded {}",
            f32::from_bits(got_bits[n]),
            f32::from_bits(rounded[n])
        );
    }
    assert_eq!(
        common::bits(&got.lse),
        common::bits(&want.lse),
        "{what} {kernel:?} {dtype:?}: lse"
    );
    got
}

/// Every kernel and half type: the convert path, and the result against float64 on the rounded
/// inputs: the output's own rounding (half an ulp of the type) plus float32 accumulation.
fn check(case: &Case, what: &str) {
    for dtype in HALVES {
        let rounded = case.stored_as(dtype);
        for kernel in kernels() {
            let pairs = kernel == Kernel::Fast("avx512bf16") || kernel == Kernel::Fast("amxbf16");
            if pairs && dtype == ElementType::BFloat16 {
                assert_pair_path(&rounded, kernel, what);
                continue;
            }
            let got = assert_convert_path(case, kernel, dtype, what);
            // (the naive computation knows no variants)
            if case.window_left < 0 && case.softcap == 0.0 && case.sinks.is_none() {
                let epsilon = match dtype {
                    ElementType::Float16 => 2f64.powi(-11),
                    _ => 2f64.powi(-8),
                };
                assert_close_to_naive(&rounded, &got, epsilon + 1e-5);
            }
        }
    }
}

/// A bfloat16 pair path (prefill; the convert path elsewhere): avx512bf16's dot products or
/// amxbf16's tiles, against the reference kernel on the same bfloat16 inputs: P rounded to
/// bfloat16 costs up to 2^-9 of the largest |v| per output, the output's rounding 2^-9 of itself,
/// float32 sums far less; NaN and inf where the reference has them. Returns the output.
fn assert_pair_path(case: &Case, kernel: Kernel, what: &str) -> Output {
    let got = common::run_with(kernel, case, 2);
    let want = common::run_with(Kernel::Reference, case, 2);
    let v_max = case.v.values().iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let tolerance = 2f32.powi(-7);
    let pairs = got.out.values().into_iter().zip(want.out.values());
    for (n, (g, w)) in pairs.enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tolerance * (v_max + w.abs())
        };
        assert!(
            ok,
            "{what} {kernel:?}: out element {n}: {g} vs reference {w}"
        );
    }
    for (n, (&g, &w)) in got.lse.iter().zip(&want.lse).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= 1e-5 * (1.0 + w.abs())
        };
        assert!(
            ok,
            "{what} {kernel:?}: lse element {n}: {g} vs reference {w}"
        );
    }
    got
}

/// Prefill in bfloat16 on avx512bf16 takes the dot-product path (its results differ from the
/// convert path's: P is rounded to bfloat16), decode the convert path (bit for bit the avx512
/// kernel's); odd D and odd key counts, GQA, causal offsets, NaN in hidden values.
#[test]
#[cfg_attr(
    not(twinattn_cpu_avx512bf16),
    ignore = "AVX-512F/BW/VL + AVX512_BF16 is not available on this CPU"
)]
fn bf16_dot_product_path() {
    pair_path_checks(Kernel::Fast("avx512bf16"), 37);
}

/// The same on amxbf16's tiles (D a multiple of 32; Dv 45: an odd count of 16-column tiles),
/// and any other D there runs the dot path (avx512bf16's bits).
#[test]
#[cfg_attr(
    not(twinattn_cpu_amxbf16),
    ignore = "avx512bf16 + AMX-TILE/AMX-BF16 (and the OS's permission) is not available on this CPU"
)]
fn bf16_tile_path() {
    pair_path_checks(Kernel::Fast("amxbf16"), 64);
    let mut rng = Rng::new(433);
    let case = random_case(&mut rng, (1, 8, 2, 40, 300, 48, 40)).causal(&[260]);
    let case = case.stored_as(ElementType::BFloat16);
    let tiles = common::run_with(Kernel::Fast("amxbf16"), &case, 2);
    let dot = common::run_with(Kernel::Fast("avx512bf16"), &case, 2);
    common::assert_identical(&tiles, &dot);
}

fn pair_path_checks(kernel: Kernel, d: i64) {
    let mut rng = Rng::new(431);
    let mut case = random_case(&mut rng, (2, 8, 2, 61, 301, d, 45)).causal(&[240, 0]);
    case.kv_lens = vec![301, 99];
    let case = case.stored_as(ElementType::BFloat16);
    let dot = assert_pair_path(&case, kernel, "prefill");
    let convert = common::run_with(Kernel::Fast("avx512"), &case, 2);
    assert_ne!(
        common::bits(&dot.out.values()),
        common::bits(&convert.out.values()),
        "the prefill ran the convert path"
    );
    let mut decode = case.clone();
    decode.q = decode.q.seq(60..61);
    decode.q_offset = vec![300, 60];
    let dot = common::run_with(kernel, &decode, 2);
    let convert = common::run_with(Kernel::Fast("avx512"), &decode, 2);
    common::assert_identical(&dot, &convert);
    // NaN / inf in values hidden by a mask (masked blocks) and past kv_lens (an odd pair pad)
    let mut hidden = case.clone();
    hidden.v.set([1, 0, 99, 3], f32::NAN);
    for j in (0..301).filter(|j| j % 7 == 2) {
        hidden.v.set([0, 1, j, 4], f32::INFINITY);
        hidden.v.set([0, 1, j, 5], f32::NAN);
    }
    hidden.mask = Mask::bool_from_fn([2, 8, 61, 301], |[_, _, _, j]| j % 7 != 2);
    let got = assert_pair_path(&hidden, kernel, "hidden non-finite values");
    assert!(got.out.values().iter().all(|x| x.is_finite()));
    // a visible NaN reaches its column, as in the reference
    let mut visible = case.clone();
    visible.v.set([0, 1, 5, 4], f32::NAN);
    let got = assert_pair_path(&visible, kernel, "visible NaN");
    assert!(got.out.values().iter().any(|x| x.is_nan()));
}

#[test]
fn shapes_around_tiles() {
    let mut rng = Rng::new(401);
    // (B, Hq, Hkv, Lq, Lk, D, Dv): odd D and key counts, below/at/above 6, 16, 48, 256
    let shapes = [
        (1, 1, 1, 5, 15, 7, 9),
        (1, 1, 1, 7, 17, 17, 15),
        (2, 2, 2, 47, 255, 63, 65),
        (1, 1, 1, 49, 257, 49, 47),
        (1, 8, 2, 11, 300, 80, 80),
        (1, 6, 3, 96, 513, 33, 48),
        (1, 3, 1, 130, 130, 3, 1),
    ];
    for shape in shapes {
        let case = random_case(&mut rng, shape);
        check(&case, &format!("{shape:?} full"));
        let mut causal = case.clone().causal(&vec![0; shape.0 as usize]);
        if shape.3 <= shape.4 {
            causal.q_offset = vec![shape.4 - shape.3; shape.0 as usize];
        }
        check(&causal, &format!("{shape:?} causal"));
    }
}

#[test]
fn decode_paths_gqa_and_strides() {
    let mut rng = Rng::new(409);
    // one query row (direct scores), 8 rows of a GQA group (direct), 32 rows (packed
    // split-key), 4500 keys: several split-key chunks and a merge; odd D
    for (hq, lq, d) in [(4, 1, 128), (8, 1, 37), (32, 1, 64), (4, 8, 40)] {
        let case = random_case(&mut rng, (2, hq, 4.min(hq), lq, 4500, d, d))
            .causal(&[4500 - lq, 3000 - lq]);
        let mut case = case;
        case.kv_lens = vec![4500, 3000];
        check(&case, &format!("decode hq={hq} lq={lq} d={d}"));
    }
    // (B, L, H, D) layouts and reversed axes, read in place
    let case = random_case(&mut rng, (2, 4, 2, 60, 300, 24, 20));
    let mut strided = case.clone();
    strided.q = case.q.relayout([0, 2, 1, 3], &[1], 3);
    strided.k = case.k.relayout([0, 2, 1, 3], &[2], 0);
    strided.v = case.v.relayout([2, 0, 1, 3], &[], 5);
    check(&strided.causal(&[240, 100]), "strided");
}

#[test]
fn masks_variants_and_hidden_non_finite_values() {
    let mut rng = Rng::new(419);
    let (b, hq, hkv, lq, lk, d, dv) = (2, 4, 2, 50, 600, 40, 24);
    let mut case = random_case(&mut rng, (b, hq, hkv, lq, lk, d, dv)).causal(&[550, 100]);
    case.kv_lens = vec![600, 257];
    // NaN in every value and key the mask or the lengths hide
    for kv_head in 0..hkv {
        for j in 257..lk {
            case.k.set([1, kv_head, j, 3], f32::NAN);
            case.v.set([1, kv_head, j, 5], f32::NAN);
        }
    }
    let hidden = |j: i64| j % 10 == 3;
    for kv_head in 0..hkv {
        for j in (0..lk).filter(|&j| hidden(j)) {
            case.v.set([0, kv_head, j, 1], f32::NAN);
            case.v.set([0, kv_head, j, 2], f32::INFINITY);
        }
    }
    let shape = [b, hq, lq, lk];
    let mut bool_case = case.clone();
    bool_case.mask = Mask::bool_from_fn(shape, |[_, _, _, j]| !hidden(j));
    let got = assert_convert_path(
        &bool_case,
        Kernel::Fast("scalar"),
        ElementType::BFloat16,
        "nan",
    );
    assert!(got.out.values().iter().all(|x| x.is_finite()));
    check(&bool_case, "bool mask, NaN in hidden values");
    let mut float_case = case.clone();
    float_case.mask = Mask::float_from_fn(shape, |[_, h, i, j]| {
        if hidden(j) {
            f32::NEG_INFINITY
        } else {
            0.01 * ((h * 13 + i * 7 + j * 3) % 17) as f32 - 0.08
        }
    });
    check(&float_case, "float mask, NaN in hidden values");
    let mut variants = case.clone();
    variants.window_left = 70;
    variants.softcap = 0.5;
    variants.alibi_slopes = Some((0..b * hq).map(|n| 0.01 * n as f32).collect());
    variants.sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
    check(&variants, "window, softcap, ALiBi, sinks");
}

/// Large logits (scores up to ~900) and values near float16's largest (65504), tiny values in
/// float16's subnormal range: the convert path holds bit for bit and nothing overflows.
#[test]
fn large_logits_and_extreme_values() {
    let mut rng = Rng::new(421);
    let mut case = random_case(&mut rng, (1, 2, 1, 9, 70, 16, 16));
    for x in &mut case.q.buffer {
        *x *= 30.0;
    }
    for (n, x) in case.v.buffer.iter_mut().enumerate() {
        *x *= if n % 2 == 0 { 65000.0 } else { 1e-6 };
    }
    for dtype in HALVES {
        for kernel in kernels() {
            let got = assert_convert_path(&case, kernel, dtype, "large");
            assert!(got.out.values().iter().all(|x| x.is_finite()), "{kernel:?}");
        }
    }
    check(&case, "large");
}

/// The vector types' conversions (F16C, the vectorised bfloat16 rule) equal the software ones
/// (element.rs) bit for bit: every float16 and bfloat16 in, and float32 patterns out that hit
/// every exponent, the halfway points, subnormals, inf and NaN.
#[test]
fn vector_conversions_match_software() {
    use twinattn::element::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    use twinattn::simd::Vector;

    fn check<V: Vector>() {
        let halves: Vec<u16> = (0..=u16::MAX).collect();
        let mut lanes = [0.0f32; 16];
        let mut back = [0u16; 16];
        for chunk in halves.chunks(V::WIDTH) {
            // SAFETY: the caller checked V's instruction set; chunk holds WIDTH halves, lanes
            // 16 >= WIDTH floats.
            unsafe {
                V::load_f16(chunk.as_ptr()).store(lanes.as_mut_ptr());
                for (t, &h) in chunk.iter().enumerate() {
                    assert_eq!(lanes[t].to_bits(), f16_to_f32(h).to_bits(), "{h:#06x}");
                }
                V::load_bf16(chunk.as_ptr()).store(lanes.as_mut_ptr());
                for (t, &h) in chunk.iter().enumerate() {
                    assert_eq!(lanes[t].to_bits(), bf16_to_f32(h).to_bits(), "{h:#06x}");
                }
            }
        }
        let mut floats = Vec::new();
        for high in 0u32..0x10000 {
            for low in [
                0u32, 1, 0xfff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001, 0xffff,
            ] {
                floats.push(f32::from_bits((high << 16) | low));
            }
        }
        for chunk in floats.chunks(V::WIDTH) {
            // SAFETY: as above; back holds 16 >= WIDTH halves.
            unsafe {
                let x = V::load(chunk.as_ptr());
                x.store_f16(back.as_mut_ptr());
                for (t, &f) in chunk.iter().enumerate() {
                    assert_eq!(back[t], f32_to_f16(f), "f16 of {:#010x}", f.to_bits());
                }
                x.store_bf16(back.as_mut_ptr());
                for (t, &f) in chunk.iter().enumerate() {
                    assert_eq!(back[t], f32_to_bf16(f), "bf16 of {:#010x}", f.to_bits());
                }
            }
        }
    }
    check::<twinattn::simd_scalar::VecScalar>();
    #[cfg(target_arch = "x86_64")]
    {
        if twinattn::dispatch::kernels_for("avx2").is_some() {
            check::<twinattn::simd_avx2::VecAvx2>();
        }
        if twinattn::dispatch::kernels_for("avx512").is_some() {
            check::<twinattn::simd_avx512::VecAvx512>();
        }
    }
    #[cfg(target_arch = "aarch64")]
    check::<twinattn::simd_neon::VecNeon>();
}

// ---- The software conversions (element.rs) ----------------------------------------------

mod conversions {
    use twinattn::element::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

    /// Every float16 through float32 and back is itself (NaNs: quieted).
    #[test]
    fn f16_round_trip() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            let back = f32_to_f16(x);
            if x.is_nan() {
                assert_eq!(back, h | 0x0200, "{h:#06x}");
            } else {
                assert_eq!(back, h, "{h:#06x}");
                assert_eq!(f64::from(x), f16_value(h), "{h:#06x}");
            }
        }
    }

    /// The value of a non-NaN float16 from its fields, in float64.
    fn f16_value(h: u16) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exponent = i32::from((h >> 10) & 0x1f);
        let mantissa = f64::from(h & 0x3ff);
        sign * match exponent {
            0 => mantissa * 2f64.powi(-24),
            0x1f => f64::INFINITY,
            _ => (1.0 + mantissa / 1024.0) * 2f64.powi(exponent - 15),
        }
    }

    /// Rounding to float16 against float64 arithmetic: the nearest float16 (ties to the even
    /// mantissa), over a sweep of float32 bit patterns that hits every exponent, the halfway
    /// points and their neighbours.
    #[test]
    fn f32_to_f16_rounds_to_nearest_even() {
        let mut checked = 0;
        for high in 0u32..0x7f80 {
            for low in [
                0u32, 1, 0xfff, 0x1000, 0x1001, 0x2000, 0x3000, 0x7fff, 0xffff,
            ] {
                let bits = (high << 16) | low;
                for sign in [0, 0x8000_0000] {
                    let x = f32::from_bits(bits | sign);
                    let h = f32_to_f16(x);
                    assert_eq!(h, nearest_f16(f64::from(x)), "{:#010x}", bits | sign);
                    checked += 1;
                }
            }
        }
        assert!(checked > 500_000);
    }

    fn nearest_f16(x: f64) -> u16 {
        // candidates: the two float16 neighbours by magnitude (finite ones, then inf)
        let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
        let a = x.abs();
        // the largest finite float16 <= a (values grow with the bits: a binary search)
        let (mut lo_bits, mut hi_bits) = (0u16, 0x7c00u16);
        while hi_bits - lo_bits > 1 {
            let mid = lo_bits + (hi_bits - lo_bits) / 2;
            if f16_value(mid) <= a {
                lo_bits = mid;
            } else {
                hi_bits = mid;
            }
        }
        let below = lo_bits;
        let above = below + 1; // 0x7c00 = inf past 65504
        let (lo, hi) = (f16_value(below), f16_value(above));
        let hi = if above == 0x7c00 { 65520.0 } else { hi }; // inf's rounding boundary
        let pick = if a - lo < hi - a || (a - lo == hi - a && below % 2 == 0) {
            below
        } else {
            above
        };
        sign | pick
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even below
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, even above
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8001)), 0x0001); // subnormal kept
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds past the largest: inf
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xff80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // NaN quieted
        assert_eq!(f32_to_bf16(f32::from_bits(0xffc1_2345)), 0xffc1);
        for h in 0..=u16::MAX {
            let x = bf16_to_f32(h);
            let back = f32_to_bf16(x);
            assert_eq!(back, if x.is_nan() { h | 0x40 } else { h }, "{h:#06x}");
        }
    }
}
