//! The contract checks every kernel must pass: the seeds' checks, the worked example, heads,
//! lengths, masks, layouts, threads, empty axes and check_problem. Each test crate runs them
//! for its kernels (`contract_tests!`): the reference kernel in reference_kernel.rs, every
//! instruction set of the fast kernel in flash_kernel.rs.
#![allow(dead_code)]

use crate::common::{
    self, assert_identical, assert_lse_eq, assert_matches_naive, bits, Case, Mask, Rng, Tensor,
};
use twinattn::problem::{check_problem, AttentionProblem, LseView, MaskView, MutTensorView4};

const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// The seeds' example: three 2-D tokens, keys = queries, scale 1/sqrt(2).
fn seed_case(values: &[&[f32]]) -> Case {
    let tokens = Tensor::rows(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]);
    let mut case = Case::new(tokens.clone(), tokens, Tensor::rows(values)).causal(&[0]);
    case.scale = SQRT_HALF;
    case
}

const SEED_VALUES: [&[f32]; 3] = [&[2.0, 0.0], &[0.0, 3.0], &[-1.0, 1.0]];

// ---- the seeds' three checks ---------------------------------------------------------------

pub fn seed_first_causal_row_has_one_legal_key() {
    let full = seed_case(&SEED_VALUES).run(1).unwrap();
    assert_eq!(full.out.at([0, 0, 0, 0]), 2.0);
    assert_eq!(full.out.at([0, 0, 0, 1]), 0.0);
    assert_lse_eq(full.lse[0], SQRT_HALF); // one key: lse = its score, (q0 . k0) / sqrt(2)
}

pub fn seed_cached_last_row_equals_full_last_row() {
    let full_case = seed_case(&SEED_VALUES);
    let full = full_case.run(1).unwrap();
    let mut cached_case = full_case.clone();
    cached_case.q = full_case.q.seq(2..3);
    cached_case.q_offset = vec![2];
    let cached = cached_case.run(1).unwrap();
    for d in 0..2 {
        assert_eq!(
            cached.out.at([0, 0, 0, d]).to_bits(),
            full.out.at([0, 0, 2, d]).to_bits()
        );
    }
    assert_eq!(cached.lse[0].to_bits(), full.lse[2].to_bits());
}

pub fn seed_future_value_cannot_change_earlier_rows() {
    let full = seed_case(&SEED_VALUES).run(1).unwrap();
    let changed = seed_case(&[SEED_VALUES[0], SEED_VALUES[1], &[100.0, 100.0]])
        .run(1)
        .unwrap();
    for i in 0..2 {
        for d in 0..2 {
            assert_eq!(
                full.out.at([0, 0, i, d]).to_bits(),
                changed.out.at([0, 0, i, d]).to_bits()
            );
        }
    }
    assert_ne!(full.out.at([0, 0, 2, 0]), changed.out.at([0, 0, 2, 0]));
}

/// Chunked causal runs (a KV cache filled chunk by chunk) equal the matching rows of the full
/// run, bit for bit, for several prompt lengths, chunk sizes and offsets; the cache holds NaN
/// past the tokens written so far.
pub fn chunked_causal_runs_equal_full_run() {
    let mut rng = Rng::new(7);
    for &(prompt_len, chunk) in &[(1, 1), (5, 1), (5, 2), (13, 4), (13, 13), (17, 5)] {
        for &(q_heads, kv_heads) in &[(1, 1), (4, 2)] {
            let q = Tensor::random([2, q_heads, prompt_len, 8], &mut rng);
            let k = Tensor::random([2, kv_heads, prompt_len, 8], &mut rng);
            let v = Tensor::random([2, kv_heads, prompt_len, 6], &mut rng);
            let full_case = Case::new(q.clone(), k.clone(), v.clone()).causal(&[0, 0]);
            let full = full_case.run(1).unwrap();
            assert_matches_naive(&full_case, &full);

            let capacity = prompt_len + 3;
            let mut start = 0;
            while start < prompt_len {
                let end = (start + chunk).min(prompt_len);
                // The cache: tokens [0, end) written, the rest NaN (never read).
                let cached = |t: &Tensor| {
                    let shape = [t.shape[0], t.shape[1], capacity, t.shape[3]];
                    Tensor::from_fn(shape, |[b, h, j, d]| {
                        if j < end {
                            t.at([b, h, j, d])
                        } else {
                            f32::NAN
                        }
                    })
                };
                let mut case =
                    Case::new(q.seq(start..end), cached(&k), cached(&v)).causal(&[start, start]);
                case.kv_lens = vec![end, end];
                let got = case.run(1).unwrap();
                for (b, h, i, d) in iproduct(2, q_heads, end - start, 6) {
                    // A short chunk may take the split-key direct-score path, whose dot products
                    // sum D in another order than the full run's panels: equal to float32
                    // rounding of the scores (a few ulp of the output), not bit for bit.
                    let (g, w) = (got.out.at([b, h, i, d]), full.out.at([b, h, start + i, d]));
                    assert!(
                        (g - w).abs() <= 8.0 * f32::EPSILON * (1.0 + w.abs()),
                        "N={prompt_len} chunk={chunk} start={start}: {g} vs {w}"
                    );
                }
                start = end;
            }
        }
    }
}

fn iproduct(a: i64, b: i64, c: i64, d: i64) -> impl Iterator<Item = (i64, i64, i64, i64)> {
    (0..a).flat_map(move |x| {
        (0..b).flat_map(move |y| (0..c).flat_map(move |z| (0..d).map(move |w| (x, y, z, w))))
    })
}

/// Changing (even to NaN) the key and value at position t leaves every row before t bit-identical.
pub fn future_keys_and_values_never_leak_backwards() {
    let mut rng = Rng::new(11);
    let q = Tensor::random([1, 2, 9, 4], &mut rng);
    let k = Tensor::random([1, 2, 9, 4], &mut rng);
    let v = Tensor::random([1, 2, 9, 3], &mut rng);
    let base = Case::new(q, k, v).causal(&[0]);
    let full = base.run(2).unwrap();
    for t in 1..9 {
        for poison in [100.0, f32::NAN, f32::INFINITY] {
            let mut case = base.clone();
            for h in 0..2 {
                for d in 0..4 {
                    case.k.set([0, h, t, d], poison);
                }
                for d in 0..3 {
                    case.v.set([0, h, t, d], poison);
                }
            }
            let changed = case.run(2).unwrap();
            for (_, h, i, d) in iproduct(1, 2, t, 3) {
                assert_eq!(
                    changed.out.at([0, h, i, d]).to_bits(),
                    full.out.at([0, h, i, d]).to_bits()
                );
            }
        }
    }
}

// ---- the worked example --------------------------------------------------------------------

fn worked_case() -> Case {
    let mut case = Case::new(
        Tensor::rows(&[&[1.0, 0.0]]),
        Tensor::rows(&[&[1.0, 0.0], &[0.0, 1.0]]),
        Tensor::rows(&[&[2.0, 0.0], &[0.0, 4.0]]),
    );
    case.scale = SQRT_HALF;
    case
}

pub fn worked_example() {
    let got = worked_case().run(1).unwrap();
    let out = got.out.values();
    assert!((out[0] - 1.3395).abs() < 5e-5, "{out:?}");
    assert!((out[1] - 1.3210).abs() < 5e-5, "{out:?}");
    let want_lse = ((std::f64::consts::FRAC_1_SQRT_2).exp() + 1.0).ln();
    assert!(
        (f64::from(got.lse[0]) - want_lse).abs() < 1e-6,
        "{} vs {want_lse}",
        got.lse[0]
    );
    assert_matches_naive(&worked_case(), &got);
}

pub fn worked_example_with_second_key_causally_hidden() {
    let case = worked_case().causal(&[0]);
    let got = case.run(1).unwrap();
    assert_eq!(got.out.values(), vec![2.0, 0.0]);
    assert_lse_eq(got.lse[0], SQRT_HALF); // log(exp(1/sqrt2)), exactly: one key
}

// ---- heads, lengths, masks -----------------------------------------------------------------

pub fn grouped_query_heads_read_their_kv_head() {
    let mut rng = Rng::new(3);
    for &(q_heads, kv_heads) in &[(6, 2), (6, 3), (4, 1), (3, 3)] {
        let case = Case::new(
            Tensor::random([2, q_heads, 5, 7], &mut rng),
            Tensor::random([2, kv_heads, 6, 7], &mut rng),
            Tensor::random([2, kv_heads, 6, 3], &mut rng),
        );
        let got = case.run(1).unwrap();
        assert_matches_naive(&case, &got);
        // Direct check of the mapping: query head h alone against KV head h / group alone.
        let group = q_heads / kv_heads;
        for h in 0..q_heads {
            let one_head = |t: &Tensor, head: i64| {
                Tensor::from_fn([2, 1, t.shape[2], t.shape[3]], |[b, _, i, d]| {
                    t.at([b, head, i, d])
                })
            };
            let single = Case::new(
                one_head(&case.q, h),
                one_head(&case.k, h / group),
                one_head(&case.v, h / group),
            );
            let single = single.run(1).unwrap();
            // One head alone may take another path than the packed group (direct scores vs
            // panels, a different summation order of D): equal to float32 rounding.
            for (b, _, i, d) in iproduct(2, 1, 5, 3) {
                let (s, g) = (single.out.at([b, 0, i, d]), got.out.at([b, h, i, d]));
                assert!(
                    (s - g).abs() <= 8.0 * f32::EPSILON * (1.0 + g.abs()),
                    "head {h}: {s} vs {g}"
                );
            }
        }
    }
}

pub fn padded_keys_are_never_read() {
    let mut rng = Rng::new(5);
    let kv_lens = [5i64, 2, 0, 8];
    let pad = |t: Tensor| {
        let shape = t.shape;
        Tensor::from_fn(shape, |[b, h, j, d]| {
            if j < kv_lens[b as usize] {
                t.at([b, h, j, d])
            } else {
                f32::NAN
            }
        })
    };
    let q = Tensor::random([4, 2, 3, 4], &mut rng);
    let k = pad(Tensor::random([4, 2, 8, 4], &mut rng));
    let v = pad(Tensor::random([4, 2, 8, 5], &mut rng));
    for causal in [false, true] {
        let mut case = Case::new(q.clone(), k.clone(), v.clone());
        case.kv_lens = kv_lens.to_vec();
        if causal {
            case = case.causal(&[2, 0, 0, 5]);
        }
        let got = case.run(3).unwrap();
        assert!(got.out.values().iter().all(|x| x.is_finite()));
        assert_matches_naive(&case, &got);
        // Each sequence equals the run on its keys alone (Lk = kv_len).
        for b in 0..4 {
            let one = |t: &Tensor, len: i64| {
                Tensor::from_fn([1, 2, len, t.shape[3]], |[_, h, j, d]| t.at([b, h, j, d]))
            };
            let len = kv_lens[b as usize];
            let mut alone = Case::new(one(&q, 3), one(&k, len), one(&v, len));
            alone.causal = causal;
            alone.q_offset = vec![case.q_offset[b as usize]];
            let alone = alone.run(1).unwrap();
            for (_, h, i, d) in iproduct(1, 2, 3, 5) {
                assert_eq!(
                    alone.out.at([0, h, i, d]).to_bits(),
                    got.out.at([b, h, i, d]).to_bits()
                );
            }
        }
        // kv_len 0: zero rows, lse -inf.
        assert!((0..6).all(|r| got.lse[2 * 6 + r] == f32::NEG_INFINITY));
    }
}

pub fn bool_mask_and_float_bias() {
    let mut rng = Rng::new(9);
    let shape = [2, 4, 5, 7];
    let q = Tensor::random([2, 4, 5, 3], &mut rng);
    let k = Tensor::random([2, 2, 7, 3], &mut rng);
    let v = Tensor::random([2, 2, 7, 4], &mut rng);
    let allowed = |[b, h, i, j]: [i64; 4]| (b + 2 * h + 3 * i + 5 * j) % 3 != 0;
    let mut bool_case = Case::new(q.clone(), k.clone(), v.clone());
    bool_case.mask = Mask::bool_from_fn(shape, allowed);
    let got_bool = bool_case.run(2).unwrap();
    assert_matches_naive(&bool_case, &got_bool);

    // -inf bias hides exactly like false.
    let mut hide_case = bool_case.clone();
    hide_case.mask = Mask::float_from_fn(shape, |index| {
        if allowed(index) {
            0.0
        } else {
            f32::NEG_INFINITY
        }
    });
    assert_identical(&got_bool, &hide_case.run(2).unwrap());

    // A general bias, with causal on top.
    let mut bias_case = Case::new(q, k, v).causal(&[1, 3]);
    bias_case.mask = Mask::float_from_fn(shape, |[b, h, i, j]| {
        if (b + h + i + j) % 4 == 0 {
            f32::NEG_INFINITY
        } else {
            0.25 * (h - j) as f32 + 0.1 * i as f32
        }
    });
    assert_matches_naive(&bias_case, &bias_case.run(1).unwrap());
}

pub fn rows_without_visible_keys_give_zeros_and_minus_infinity() {
    let mut rng = Rng::new(13);
    let shape = [1, 2, 3, 4];
    let q = Tensor::random([1, 2, 3, 2], &mut rng);
    let k = Tensor::random([1, 1, 4, 2], &mut rng);
    let v = Tensor::from_fn([1, 1, 4, 2], |_| f32::NAN); // a weighted NaN would show
                                                         // row (h=1, i=1) is fully masked
    let mut case = Case::new(q.clone(), k.clone(), v.clone());
    case.mask = Mask::bool_from_fn(shape, |[_, h, i, _]| !(h == 1 && i == 1));
    let got = case.run(1).unwrap();
    assert_eq!(
        bits(&[got.out.at([0, 1, 1, 0]), got.out.at([0, 1, 1, 1])]),
        bits(&[0.0, 0.0])
    );
    assert_eq!(got.lse[3 + 1], f32::NEG_INFINITY);
    // every bias -inf
    case.mask = Mask::float_from_fn(shape, |_| f32::NEG_INFINITY);
    let got = case.run(1).unwrap();
    assert_eq!(bits(&got.out.values()), bits(&[0.0; 12]));
    assert!(got.lse.iter().all(|&x| x == f32::NEG_INFINITY));
    // Lk = 0
    let case = Case::new(q, Tensor::zeros([1, 1, 0, 2]), Tensor::zeros([1, 1, 0, 5]));
    let got = case.run(1).unwrap();
    assert_eq!(bits(&got.out.values()), bits(&[0.0; 30]));
    assert!(got.lse.iter().all(|&x| x == f32::NEG_INFINITY));
}

pub fn large_scores_do_not_overflow() {
    let q = Tensor::rows(&[&[30.0, -20.0]]);
    let k = Tensor::rows(&[&[30.0, 1.0], &[29.0, 0.0], &[-30.0, 0.0]]);
    let v = Tensor::rows(&[&[1.0, 0.0], &[0.0, 1.0], &[5.0, 5.0]]);
    let case = Case::new(q, k, v);
    let got = case.run(1).unwrap();
    assert!(got.out.values().iter().all(|x| x.is_finite()));
    assert_matches_naive(&case, &got);
}

// ---- layouts and threads -------------------------------------------------------------------

pub fn strided_views_equal_contiguous_ones() {
    let mut rng = Rng::new(17);
    let mut case = Case::new(
        Tensor::random([2, 4, 6, 5], &mut rng),
        Tensor::random([2, 2, 7, 5], &mut rng),
        Tensor::random([2, 2, 7, 3], &mut rng),
    )
    .causal(&[1, 0]);
    case.kv_lens = vec![7, 5];
    // a (B, Hq, Lq, Lk) bias broadcast over heads and query rows (stride 0), any last stride
    case.mask = Mask::Float {
        buffer: (0..14).map(|x| 0.1 * x as f32).collect(),
        stride: [7, 0, 0, 1],
    };
    let want = case.run(1).unwrap();
    assert_matches_naive(&case, &want);

    let mut strided = case.clone();
    strided.q = case.q.relayout([0, 2, 1, 3], &[2], 0); // (B, L, H, D) storage, rows reversed
    strided.k = case.k.relayout([2, 1, 0, 3], &[0, 1], 3); // sequence outermost, padded rows
    strided.v = case.v.relayout([1, 0, 2, 3], &[2], 1);
    assert!(strided.q.stride[2] < 0 && strided.k.stride[0] < 0);
    let mut out = Tensor::zeros(case.out_shape()).relayout([2, 0, 1, 3], &[1], 2);
    let mut lse = vec![0.0; 2 * 4 * 6];
    strided.run_into(&mut out, Some(&mut lse), 2).unwrap();
    assert_identical(&want, &common::Output { out, lse });

    // a bool mask broadcast over the batch (stride 0), key stride 2, rows overlapping
    let mut masked = case.clone();
    masked.mask = Mask::Bool {
        buffer: (0..64).map(|x| (x % 5 != 0) as u8).collect(),
        stride: [0, 12, 2, 2],
    };
    assert_matches_naive(&masked, &masked.run(3).unwrap());
}

pub fn thread_counts_give_identical_results() {
    let mut rng = Rng::new(19);
    let mut case = Case::new(
        Tensor::random([3, 4, 9, 8], &mut rng),
        Tensor::random([3, 2, 11, 8], &mut rng),
        Tensor::random([3, 2, 11, 8], &mut rng),
    )
    .causal(&[2, 0, 1]);
    case.kv_lens = vec![11, 9, 4];
    let one = case.run(1).unwrap();
    // 0 is an error (check_problem_rejects_bad_problems); any larger count only caps the threads
    for threads in [2, 3, 5, 12, 64, usize::MAX] {
        assert_identical(&one, &case.run(threads).unwrap());
    }
}

pub fn empty_axes_are_legal() {
    for (q, k, v) in [
        ([0, 2, 3, 4], [0, 1, 5, 4], [0, 1, 5, 2]), // B = 0
        ([1, 0, 3, 4], [1, 1, 5, 4], [1, 1, 5, 2]), // Hq = 0
        ([1, 2, 0, 4], [1, 1, 5, 4], [1, 1, 5, 2]), // Lq = 0
        ([1, 2, 3, 4], [1, 1, 5, 4], [1, 1, 5, 0]), // Dv = 0
    ] {
        let case = Case::new(Tensor::zeros(q), Tensor::zeros(k), Tensor::zeros(v));
        let got = case.run(2).unwrap();
        assert!(got.out.values().is_empty());
    }
    // NumPy 2 gives empty arrays all-zero strides, the last axis included.
    let empty = |shape: [i64; 4]| Tensor::with_layout(shape, [0; 4], 0, 0, |_| 0.0);
    let case = Case::new(
        empty([2, 4, 0, 8]),
        Tensor::zeros([2, 2, 5, 8]),
        Tensor::zeros([2, 2, 5, 3]),
    );
    case.run(1).unwrap();
    let mut case = Case::new(
        Tensor::zeros([1, 2, 3, 4]),
        empty([1, 1, 0, 4]),
        empty([1, 1, 0, 2]),
    );
    case.kv_lens = vec![0];
    assert_eq!(case.run(1).unwrap().out.values(), vec![0.0; 12]);
    // D = 0: every score is 0, so every key weighs the same.
    let v = Tensor::rows(&[&[1.0, 2.0], &[3.0, 6.0]]);
    let got = Case::new(Tensor::zeros([1, 1, 2, 0]), Tensor::zeros([1, 1, 2, 0]), v)
        .run(1)
        .unwrap();
    assert_eq!(got.out.values(), vec![2.0, 4.0, 2.0, 4.0]);
    assert_lse_eq(got.lse[0], 2f32.ln());
}

// ---- check_problem -------------------------------------------------------------------------

fn error_of(case: &Case) -> String {
    case.run(1)
        .expect_err("expected check_problem to reject the problem")
        .0
}

pub fn check_problem_rejects_bad_problems() {
    let mut rng = Rng::new(23);
    let good = Case::new(
        Tensor::random([2, 8, 3, 64], &mut rng),
        Tensor::random([2, 4, 10, 64], &mut rng),
        Tensor::random([2, 4, 10, 16], &mut rng),
    );
    good.run(1).unwrap();

    let mut case = good.clone();
    case.k = Tensor::zeros([2, 4, 10, 32]);
    assert_eq!(
        error_of(&case),
        "k: expected shape (B=2, Hkv, Lk, D=64), got (2, 4, 10, 32)"
    );
    case.k = Tensor::zeros([3, 4, 10, 64]);
    assert_eq!(
        error_of(&case),
        "k: expected shape (B=2, Hkv, Lk, D=64), got (3, 4, 10, 64)"
    );

    let mut case = good.clone();
    case.v = Tensor::zeros([2, 4, 9, 16]);
    assert_eq!(
        error_of(&case),
        "v: expected shape (B=2, Hkv=4, Lk=10, Dv), got (2, 4, 9, 16)"
    );

    let mut case = good.clone();
    case.k = Tensor::zeros([2, 3, 10, 64]);
    case.v = Tensor::zeros([2, 3, 10, 16]);
    assert_eq!(
        error_of(&case),
        "k: expected Hkv dividing Hq=8 (query head h reads KV head h // (Hq // Hkv)), got Hkv=3"
    );
    case.k = Tensor::zeros([2, 0, 10, 64]);
    case.v = Tensor::zeros([2, 0, 10, 16]);
    assert_eq!(
        error_of(&case),
        "k: expected Hkv dividing Hq=8 (query head h reads KV head h // (Hq // Hkv)), got Hkv=0"
    );

    let mut case = good.clone();
    case.kv_lens = vec![10, 11];
    assert_eq!(
        error_of(&case),
        "kv_lens: expected values in [0, Lk=10], got kv_lens[1]=11"
    );
    case.kv_lens = vec![-1, 3];
    assert_eq!(
        error_of(&case),
        "kv_lens: expected values in [0, Lk=10], got kv_lens[0]=-1"
    );
    case.kv_lens = vec![3];
    assert_eq!(error_of(&case), "kv_lens: expected shape (B=2,), got (1,)");

    let mut case = good.clone();
    case.q_offset = vec![0, -2];
    case.run(1).unwrap(); // ignored without causal
    case.causal = true;
    assert_eq!(
        error_of(&case),
        "q_offset: expected values >= 0 when causal, got q_offset[1]=-2"
    );
    case.q_offset = vec![0, 0, 0];
    assert_eq!(error_of(&case), "q_offset: expected shape (B=2,), got (3,)");

    for (scale, given) in [
        (f32::NAN, "NaN"),
        (-f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
    ] {
        let mut case = good.clone();
        case.scale = scale;
        assert_eq!(
            error_of(&case),
            format!("scale: expected a finite number, got {given}")
        );
    }

    let mut case = good.clone();
    case.q = good.q.relayout([0, 1, 3, 2], &[], 0); // D axis not unit-stride
    assert_eq!(
        error_of(&case),
        "q: expected unit stride on the last axis (D=64), got stride 3 elements"
    );

    let mut out = Tensor::zeros([2, 8, 3, 15]);
    assert_eq!(
        good.run_into(&mut out, None, 1).unwrap_err().0,
        "out: expected shape (B=2, Hq=8, Lq=3, Dv=16), got (2, 8, 3, 15)"
    );
    // out whose elements overlap (stride 0 over heads)
    let mut out = Tensor::with_layout([2, 8, 3, 16], [48, 0, 16, 1], 0, 96, |_| 0.0);
    assert_eq!(
        good.run_into(&mut out, None, 1).unwrap_err().0,
        "out: expected elements that do not overlap each other, got strides (48, 0, 16, 1)"
    );
    // a thread count of 0 is rejected, as in C++ (it used to be taken as 1)
    let mut out = Tensor::zeros([2, 8, 3, 16]);
    assert_eq!(
        good.run_into(&mut out, None, 0).unwrap_err().0,
        "num_threads: expected an int >= 1, got 0"
    );
    assert_eq!(
        twinattn::problem::check_num_threads(-7).unwrap_err().0,
        "num_threads: expected an int >= 1, got -7"
    );
    assert_eq!(twinattn::problem::check_num_threads(1 << 40), Ok(1 << 40));
}

pub fn check_problem_rejects_overlapping_outputs_and_bad_lse() {
    let mut buffer = vec![0.0f32; 64];
    let base = buffer.as_mut_ptr();
    let view = |at: usize, shape: [i64; 4]| MutTensorView4 {
        data: base.wrapping_add(at).cast(),
        shape,
        stride: [
            shape[1] * shape[2] * shape[3],
            shape[2] * shape[3],
            shape[3],
            1,
        ],
    };
    let q = view(0, [1, 1, 2, 4]);
    let k = view(8, [1, 1, 2, 4]);
    let v = view(16, [1, 1, 2, 4]);
    let lens = [2i64];
    let offsets = [0i64];
    let problem = |out: MutTensorView4, lse: LseView| AttentionProblem {
        dtype: twinattn::problem::ElementType::Float32,
        q: twinattn::problem::TensorView4 {
            data: q.data,
            shape: q.shape,
            stride: q.stride,
        },
        k: twinattn::problem::TensorView4 {
            data: k.data,
            shape: k.shape,
            stride: k.stride,
        },
        v: twinattn::problem::TensorView4 {
            data: v.data,
            shape: v.shape,
            stride: v.stride,
        },
        out,
        lse,
        q_offset: &offsets,
        kv_lens: &lens,
        mask: MaskView::NONE,
        causal: false,
        scale: 0.5,
        window_left: -1,
        window_right: -1,
        softcap: 0.0,
        alibi_slopes: twinattn::problem::ParamView2::NONE,
        sinks: twinattn::problem::ParamView1::NONE,
        kv_int8: false,
        k_scale: twinattn::problem::ParamView3::NONE,
        v_scale: twinattn::problem::ParamView3::NONE,
        pages: twinattn::problem::KeyPages::NONE,
        out32: twinattn::problem::MutTensorView4::NONE,
    };
    let lse_at = |at: usize, n: i64| LseView {
        data: base.wrapping_add(at),
        shape: [1, 1, n],
        stride: [n, n, 1],
    };
    assert!(check_problem(&problem(view(24, [1, 1, 2, 4]), lse_at(32, 2))).is_ok());
    let err = |p: AttentionProblem| check_problem(&p).unwrap_err().0;
    assert_eq!(
        err(problem(view(4, [1, 1, 2, 4]), LseView::NONE)),
        "out: expected memory disjoint from q, got arrays that overlap"
    );
    assert_eq!(
        err(problem(view(20, [1, 1, 2, 4]), LseView::NONE)),
        "out: expected memory disjoint from v, got arrays that overlap"
    );
    assert_eq!(
        err(problem(view(24, [1, 1, 2, 4]), lse_at(30, 2))),
        "out: expected memory disjoint from lse, got arrays that overlap"
    );
    assert_eq!(
        err(problem(view(24, [1, 1, 2, 4]), lse_at(9, 2))),
        "lse: expected memory disjoint from k, got arrays that overlap"
    );
    assert_eq!(
        err(problem(view(24, [1, 1, 2, 4]), lse_at(32, 3))),
        "lse: expected shape (B=1, Hq=1, Lq=2), got (1, 1, 3)"
    );
    // The mask carries its shape, (B, Hq, Lq, Lk) of q and k; a broadcast mask has zero strides.
    let allowed = [1u8; 2];
    let with_mask = |shape: [i64; 4]| AttentionProblem {
        mask: MaskView {
            kind: twinattn::problem::MaskKind::Bool,
            data: allowed.as_ptr(),
            shape,
            stride: [0, 0, 0, 1],
        },
        ..problem(view(24, [1, 1, 2, 4]), LseView::NONE)
    };
    assert!(check_problem(&with_mask([1, 1, 2, 2])).is_ok());
    assert_eq!(
        err(with_mask([1, 1, 2, 3])),
        "mask: expected shape (B=1, Hq=1, Lq=2, Lk=2), got (1, 1, 2, 3)"
    );
}

/// Keys hidden by the mask (false, or a -inf bias) whose values are NaN or inf contribute
/// nothing, not even 0 * NaN, while the other keys of the row stay visible.
pub fn masked_keys_with_non_finite_values_do_not_contribute() {
    let mut rng = Rng::new(29);
    let shape = [1, 2, 3, 5];
    let q = Tensor::random([1, 2, 3, 4], &mut rng);
    let k = Tensor::random([1, 1, 5, 4], &mut rng);
    let mut v = Tensor::random([1, 1, 5, 2], &mut rng);
    v.set([0, 0, 1, 0], f32::NAN);
    v.set([0, 0, 3, 1], f32::INFINITY);
    let hidden = |[_, _, _, j]: [i64; 4]| j == 1 || j == 3;
    let mut case = Case::new(q, k, v);
    case.mask = Mask::bool_from_fn(shape, |index| !hidden(index));
    let got = case.run(1).unwrap();
    assert!(got.out.values().iter().all(|x| x.is_finite()));
    assert_matches_naive(&case, &got);
    case.mask = Mask::float_from_fn(shape, |index| {
        if hidden(index) {
            f32::NEG_INFINITY
        } else {
            0.5
        }
    });
    let got = case.run(1).unwrap();
    assert!(got.out.values().iter().all(|x| x.is_finite()));
    assert_matches_naive(&case, &got);
}

/// Non-finite inputs at visible positions propagate as in the NumPy reference
/// (python/twinattn/reference.py): a NaN score makes its row NaN (out and lse), a +inf score makes
/// out NaN and lse +inf, a -inf score leaves its key out, inf in v reaches its column; and a -inf
/// bias hides a key whose k and v rows hold NaN exactly as a False mask does.
pub fn non_finite_inputs_propagate() {
    let base = Case::new(
        Tensor::rows(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, -1.0]]),
        Tensor::rows(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]),
        Tensor::rows(&[&[2.0, 0.0], &[0.0, 4.0], &[1.0, 1.0]]),
    );
    let row = |got: &common::Output, i: usize| got.out.values()[2 * i..2 * i + 2].to_vec();
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * (1.0 + b.abs());
    // NaN in query row 1: that row is NaN, the others are untouched.
    let mut case = base.clone();
    case.q.set([0, 0, 1, 0], f32::NAN);
    let got = case.run(1).unwrap();
    let clean = base.run(1).unwrap();
    assert!(row(&got, 1).iter().all(|x| x.is_nan()) && got.lse[1].is_nan());
    for i in [0, 2] {
        assert_eq!(common::bits(&row(&got, i)), common::bits(&row(&clean, i)));
    }
    // +inf in key 0: rows 0 and 2 (q . k = +inf) give NaN with lse +inf; row 1 (0 * inf) NaN.
    let mut case = base.clone();
    case.k.set([0, 0, 0, 0], f32::INFINITY);
    let got = case.run(1).unwrap();
    assert!(got.out.values().iter().all(|x| x.is_nan()), "{got:?}");
    assert_eq!(got.lse[0], f32::INFINITY);
    assert!(got.lse[1].is_nan());
    assert_eq!(got.lse[2], f32::INFINITY);
    // -inf in key 0: rows 0 and 2 score -inf there, so key 0 is left out for them.
    let mut case = base.clone();
    case.k.set([0, 0, 0, 0], f32::NEG_INFINITY);
    let got = case.run(1).unwrap();
    let mut without = base.clone();
    without.mask = Mask::bool_from_fn([1, 1, 3, 3], |[_, _, _, j]| j != 0);
    let want = without.run(1).unwrap();
    for i in [0, 2] {
        let (g, w) = (row(&got, i), row(&want, i));
        assert!(
            close(g[0], w[0]) && close(g[1], w[1]),
            "row {i}: {g:?} vs {w:?}"
        );
        assert!(close(got.lse[i], want.lse[i]));
    }
    assert!(row(&got, 1).iter().all(|x| x.is_nan()) && got.lse[1].is_nan());
    // +inf in value 2's first column: that column is +inf in every row, the other finite.
    let mut case = base.clone();
    case.v.set([0, 0, 2, 0], f32::INFINITY);
    let got = case.run(1).unwrap();
    for i in 0..3 {
        let r = row(&got, i);
        assert!(
            r[0] == f32::INFINITY && r[1].is_finite() && got.lse[i].is_finite(),
            "{r:?}"
        );
    }
    // NaN in a visible bias: that row NaN.
    let mut case = base.clone();
    case.mask = Mask::float_from_fn(
        [1, 1, 3, 3],
        |[_, _, i, j]| {
            if i == 2 && j == 1 {
                f32::NAN
            } else {
                0.25
            }
        },
    );
    let got = case.run(1).unwrap();
    assert!(row(&got, 2).iter().all(|x| x.is_nan()) && got.lse[2].is_nan());
    assert!(row(&got, 0)
        .iter()
        .chain(&row(&got, 1))
        .all(|x| x.is_finite()));
    // A -inf bias over key 1, whose k and v are NaN: the same as a False mask there.
    let mut case = base.clone();
    case.k.set([0, 0, 1, 0], f32::NAN);
    case.v.set([0, 0, 1, 1], f32::NAN);
    case.mask = Mask::float_from_fn(
        [1, 1, 3, 3],
        |[_, _, _, j]| {
            if j == 1 {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        },
    );
    let got = case.run(1).unwrap();
    case.mask = Mask::bool_from_fn([1, 1, 3, 3], |[_, _, _, j]| j != 1);
    let want = case.run(1).unwrap();
    assert!(got.out.values().iter().all(|x| x.is_finite()), "{got:?}");
    for (a, b) in got.out.values().iter().zip(want.out.values()) {
        assert!(close(*a, b), "{a} vs {b}");
    }
    for (a, b) in got.lse.iter().zip(&want.lse) {
        assert!(close(*a, *b), "{a} vs {b}");
    }
}

/// `#[test]` functions running every contract check above with the given kernel selection; the
/// attributes after it (e.g. a `cfg_attr(..., ignore = ...)`) go on every test.
macro_rules! contract_tests {
    ($kernel:expr $(, #[$attr:meta])* $(,)?) => {
        #[test]
        $(#[$attr])*
        fn seed_first_causal_row_has_one_legal_key() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::seed_first_causal_row_has_one_legal_key,
            );
        }
        #[test]
        $(#[$attr])*
        fn seed_cached_last_row_equals_full_last_row() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::seed_cached_last_row_equals_full_last_row,
            );
        }
        #[test]
        $(#[$attr])*
        fn seed_future_value_cannot_change_earlier_rows() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::seed_future_value_cannot_change_earlier_rows,
            );
        }
        #[test]
        $(#[$attr])*
        fn chunked_causal_runs_equal_full_run() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::chunked_causal_runs_equal_full_run,
            );
        }
        #[test]
        $(#[$attr])*
        fn future_keys_and_values_never_leak_backwards() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::future_keys_and_values_never_leak_backwards,
            );
        }
        #[test]
        $(#[$attr])*
        fn worked_example() {
            crate::common::with_kernel($kernel, crate::contract::worked_example);
        }
        #[test]
        $(#[$attr])*
        fn worked_example_with_second_key_causally_hidden() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::worked_example_with_second_key_causally_hidden,
            );
        }
        #[test]
        $(#[$attr])*
        fn grouped_query_heads_read_their_kv_head() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::grouped_query_heads_read_their_kv_head,
            );
        }
        #[test]
        $(#[$attr])*
        fn padded_keys_are_never_read() {
            crate::common::with_kernel($kernel, crate::contract::padded_keys_are_never_read);
        }
        #[test]
        $(#[$attr])*
        fn bool_mask_and_float_bias() {
            crate::common::with_kernel($kernel, crate::contract::bool_mask_and_float_bias);
        }
        #[test]
        $(#[$attr])*
        fn rows_without_visible_keys_give_zeros_and_minus_infinity() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::rows_without_visible_keys_give_zeros_and_minus_infinity,
            );
        }
        #[test]
        $(#[$attr])*
        fn large_scores_do_not_overflow() {
            crate::common::with_kernel($kernel, crate::contract::large_scores_do_not_overflow);
        }
        #[test]
        $(#[$attr])*
        fn strided_views_equal_contiguous_ones() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::strided_views_equal_contiguous_ones,
            );
        }
        #[test]
        $(#[$attr])*
        fn thread_counts_give_identical_results() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::thread_counts_give_identical_results,
            );
        }
        #[test]
        $(#[$attr])*
        fn empty_axes_are_legal() {
            crate::common::with_kernel($kernel, crate::contract::empty_axes_are_legal);
        }
        #[test]
        $(#[$attr])*
        fn check_problem_rejects_bad_problems() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::check_problem_rejects_bad_problems,
            );
        }
        #[test]
        $(#[$attr])*
        fn check_problem_rejects_overlapping_outputs_and_bad_lse() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::check_problem_rejects_overlapping_outputs_and_bad_lse,
            );
        }
        #[test]
        $(#[$attr])*
        fn masked_keys_with_non_finite_values_do_not_contribute() {
            crate::common::with_kernel(
                $kernel,
                crate::contract::masked_keys_with_non_finite_values_do_not_contribute,
            );
        }
        #[test]
        $(#[$attr])*
        fn non_finite_inputs_propagate() {
            crate::common::with_kernel($kernel, crate::contract::non_finite_inputs_propagate);
        }
    };
}
