//! int8 K/V (issue 15) on the plain reference kernel and the fast kernel of every instruction set
//! this CPU runs, q in float32, float16 and bfloat16:
//! - the reference kernel on int8 K/V equals, bit for bit, the reference kernel on the
//!   dequantized float32 K/V (float32(x) * scale), as the specification says it computes;
//! - the fast kernel against that reference within float32 tolerance: decode (split-key, direct
//!   scores and packed panels) and prefill, GQA, odd D, kv_lens, causal offsets, bool and float
//!   masks, the variants, scales with zero and non-unit strides;
//! - a NaN scale of a hidden key (past kv_len, masked) changes nothing;
//! - check_problem's messages for the scales.

use crate::common;

use common::{fast_kernels, random_case, Case, Kernel, Mask, Output, Rng};
use twinattn::problem::ElementType;
use twinattn::problem::{check_problem, ParamView3};

const Q_DTYPES: [ElementType; 3] = [
    ElementType::Float32,
    ElementType::Float16,
    ElementType::BFloat16,
];

/// Contiguous (B, Hkv, Lk) strides.
fn contiguous(case: &Case) -> [i64; 3] {
    let [_, h, l, _] = case.k.shape;
    [h * l, l, 1]
}

/// `got` against `want` (the reference kernel on the dequantized case): out within `tolerance`
/// relative to 1 + |want| (NaN where want is NaN), lse likewise.
fn assert_close(got: &Output, want: &Output, tolerance: f32, what: &str) {
    let pairs = got.out.values().into_iter().zip(want.out.values());
    for (n, (g, w)) in pairs.enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else {
            (g - w).abs() <= tolerance * (1.0 + w.abs())
        };
        assert!(ok, "{what}: out element {n}: {g} vs reference {w}");
    }
    for (n, (&g, &w)) in got.lse.iter().zip(&want.lse).enumerate() {
        let ok = if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tolerance * (1.0 + w.abs())
        };
        assert!(ok, "{what}: lse element {n}: {g} vs reference {w}");
    }
}

/// Float32 arithmetic on inputs of magnitude <= 1 with D <= 64: the float32 kernels' own error
/// (2e-6 against float64, tests/flash_kernel.rs) plus int8's extra roundings, one per score
/// (acc * k_scale, |score| <= D * 2^-24 * |score| relative) and one per weight (P * v_scale):
/// each 2^-24 relative, i.e. well inside 1e-5 of 1 + |out|. Halves of q and out: their own
/// rounding (half an ulp: 2^-11 float16, 2^-8 bfloat16) on top.
fn tolerance(dtype: ElementType) -> f32 {
    1e-5 + match dtype {
        ElementType::Float16 => 2f32.powi(-11),
        ElementType::BFloat16 => 2f32.powi(-8),
        ElementType::Float32 => 0.0,
    }
}

/// Every q dtype: the int8 reference kernel equals the float32 reference kernel on the
/// dequantized K/V bit for bit; every fast kernel is within tolerance of it. Returns the fast
/// kernels' outputs (float32 q) for further checks.
fn check(case: &Case, what: &str) -> Vec<Output> {
    let mut outputs = Vec::new();
    for dtype in Q_DTYPES {
        let mut int8 = case.clone();
        if dtype != ElementType::Float32 {
            int8.q = case.q.rounded(dtype);
            int8.dtype = dtype;
        }
        // (the float32 twin: q's values already rounded to dtype, stored as float32)
        let mut dequantized = int8.dequantized();
        dequantized.dtype = ElementType::Float32;
        let want = common::run_with(Kernel::Reference, &dequantized, 2);
        let reference = common::run_with(Kernel::Reference, &int8, 2);
        let rounded = common::rounded_bits(dtype, &want.out.values());
        assert_eq!(
            common::bits(&reference.out.values()),
            rounded,
            "{what} reference q {dtype:?}"
        );
        assert_eq!(common::bits(&reference.lse), common::bits(&want.lse));
        for kernel in fast_kernels() {
            let got = common::run_with(kernel, &int8, 2);
            assert_close(
                &got,
                &want,
                tolerance(dtype),
                &format!("{what} {kernel:?} q {dtype:?}"),
            );
            if dtype == ElementType::Float32 {
                outputs.push(got);
            }
        }
    }
    outputs
}

/// Decode (one query row per head: split-key, direct scores) and a few rows (packed split-key
/// panels), GQA, odd D and Dv, key counts off the block sizes, ragged kv_lens.
#[test]
fn decode_paths() {
    let mut rng = Rng::new(1501);
    for (shape, kv_lens) in [
        ((2, 8, 2, 1, 3001, 37, 45), vec![3001, 1234]),
        ((1, 4, 4, 1, 700, 64, 64), vec![700]),
        ((2, 8, 2, 3, 2100, 16, 19), vec![2100, 5]),
        ((1, 32, 8, 1, 2049, 128, 128), vec![2049]),
    ] {
        let mut case = random_case(&mut rng, shape);
        case.kv_lens = kv_lens;
        let strides = contiguous(&case);
        check(
            &case.quantized(strides, strides),
            &format!("decode {shape:?}"),
        );
    }
}

/// Prefill (packed K^T panels, per item and shared), causal with offsets, GQA, odd sizes.
#[test]
fn prefill_paths() {
    let mut rng = Rng::new(1502);
    let case = random_case(&mut rng, (2, 8, 2, 61, 301, 37, 45)).causal(&[240, 0]);
    let strides = contiguous(&case);
    check(&case.quantized(strides, strides), "prefill causal");
    let case = random_case(&mut rng, (1, 2, 1, 130, 130, 64, 64));
    let strides = contiguous(&case);
    check(&case.quantized(strides, strides), "prefill square");
}

/// Scales laid out with a zero stride (one scale per (b, head) broadcast over the tokens, or one
/// per token shared by the heads), and with a non-unit token stride.
#[test]
fn scale_strides() {
    let mut rng = Rng::new(1503);
    for shape in [(2, 4, 2, 1, 1500, 40, 24), (2, 4, 2, 33, 200, 40, 24)] {
        let case = random_case(&mut rng, shape);
        let [_, h, l, _] = case.k.shape;
        for (k_stride, v_stride) in [([h, 1, 0], [0, 0, 0]), ([l, 0, 1], [3 * h * l, 3 * l, 3])] {
            let int8 = case.quantized(k_stride, v_stride);
            check(
                &int8,
                &format!("{shape:?} scale strides {k_stride:?} {v_stride:?}"),
            );
        }
    }
}

/// Masks and the variants; a NaN scale of every key the lengths or the mask hide changes no bit
/// of the result (and the result stays finite).
#[test]
fn masks_variants_and_hidden_nan_scales() {
    let mut rng = Rng::new(1504);
    let (b, hq, hkv, lq, lk, d, dv) = (2, 4, 2, 1, 1500, 40, 24);
    for lq in [lq, 50] {
        let mut case = random_case(&mut rng, (b, hq, hkv, lq, lk, d, dv)).causal(&[1450, 100]);
        case.kv_lens = vec![1500, 257];
        let hidden = |j: i64| j % 10 == 3;
        case.mask = Mask::bool_from_fn([b, hq, lq, lk], |[_, _, _, j]| !hidden(j));
        let strides = contiguous(&case);
        let int8 = case.quantized(strides, strides);
        let clean = check(&int8, &format!("bool mask Lq {lq}"));
        let mut poisoned = int8.clone();
        let scales = poisoned.kv_scales.as_mut().unwrap();
        for kv_head in 0..hkv {
            for j in 0..lk {
                let at = (kv_head * lk + j) as usize;
                if hidden(j) {
                    scales.k[at] = f32::NAN;
                    scales.v[at] = f32::NAN;
                }
                if j >= 257 {
                    scales.k[(hkv * lk) as usize + at] = f32::NAN;
                    scales.v[(hkv * lk) as usize + at] = f32::INFINITY;
                }
            }
        }
        for (kernel, clean) in fast_kernels().into_iter().zip(&clean) {
            let got = common::run_with(kernel, &poisoned, 2);
            assert!(got.out.values().iter().all(|x| x.is_finite()));
            common::assert_identical(&got, clean);
        }
        let mut float_case = case.clone();
        float_case.mask = Mask::float_from_fn([b, hq, lq, lk], |[_, h, i, j]| {
            if hidden(j) {
                f32::NEG_INFINITY
            } else {
                0.01 * ((h * 13 + i * 7 + j * 3) % 17) as f32 - 0.08
            }
        });
        check(&float_case.quantized(strides, strides), "float mask");
        let mut variants = case.clone();
        variants.window_left = 70;
        variants.softcap = 0.5;
        variants.alibi_slopes = Some((0..b * hq).map(|n| 0.01 * n as f32).collect());
        variants.sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
        check(
            &variants.quantized(strides, strides),
            "window, softcap, ALiBi, sinks",
        );
    }
}

/// Zero rows (scale 0) and the extremes +-127 (a row holding its max |x| exactly).
#[test]
fn zero_rows_and_extremes() {
    let mut rng = Rng::new(1505);
    let mut case = random_case(&mut rng, (1, 2, 1, 1, 900, 33, 20));
    for j in (0..900).step_by(7) {
        for d in 0..33 {
            case.k.set([0, 0, j, d], 0.0);
        }
        for d in 0..20 {
            case.v.set([0, 0, j, d], 0.0);
        }
    }
    let strides = contiguous(&case);
    let int8 = case.quantized(strides, strides);
    assert!(int8.k.values().contains(&127.0) || int8.k.values().contains(&-127.0));
    assert_eq!(int8.kv_scales.as_ref().unwrap().k[7], 0.0);
    check(&int8, "zero rows");
}

/// check_problem's messages for the scales (checked only there; the binding converts).
#[test]
fn scale_messages() {
    let mut rng = Rng::new(1506);
    let case = random_case(&mut rng, (2, 4, 2, 1, 5, 8, 8));
    let strides = contiguous(&case);
    let int8 = case.quantized(strides, strides);
    let scales = int8.kv_scales.clone().unwrap();
    let message = |case: &Case, edit: &dyn Fn(&mut twinattn::problem::AttentionProblem)| {
        case.with_problem(|problem| {
            edit(problem);
            check_problem(problem).unwrap_err().0
        })
    };
    assert_eq!(
        message(&int8, &|p| p.k_scale = ParamView3::NONE),
        "k_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"
    );
    assert_eq!(
        message(&int8, &|p| p.v_scale = ParamView3::NONE),
        "v_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"
    );
    let given = ParamView3 {
        data: scales.k.as_ptr(),
        shape: [2, 2, 5],
        stride: [10, 5, 1],
    };
    let mut half = case.clone();
    half.dtype = ElementType::BFloat16;
    assert_eq!(
        message(&half, &|p| p.k_scale = given),
        "k_scale: expected None with bfloat16 k and v (scales are only for int8), got an array"
    );
    assert_eq!(
        message(&case, &|p| p.v_scale = given),
        "v_scale: expected None with float32 k and v (scales are only for int8), got an array"
    );
    assert_eq!(
        message(&int8, &|p| p.k_scale.shape = [2, 2, 4]),
        "k_scale: expected shape (B=2, Hkv=2, Lk=5), got (2, 2, 4)"
    );
    assert_eq!(
        message(&int8, &|p| p.v_scale.shape = [1, 2, 5]),
        "v_scale: expected shape (B=2, Hkv=2, Lk=5), got (1, 2, 5)"
    );
}
