//! The fast kernel, on every instruction set this CPU runs: the shared contract checks
//! (contract/: the seeds' checks among them), then sweeps around the tile sizes (MICRO_ROWS 6,
//! vectors of 8/16, Q_TILE_ROWS 48, KEY_BLOCK 256, SPLIT_KEY_CHUNK 1024) against the plain
//! reference kernel and the float64 naive computation, split-key decode over 32k keys, and
//! scalar-vs-SIMD agreement.

use crate::common;

use common::{
    assert_close_to_naive, assert_identical, random_case, Case, Kernel, Mask, Output, Rng,
};

// One module per instruction set. A set this architecture never has is not compiled; a set this
// CPU lacks is compiled and ignored (build.rs), so `cargo test` lists it as ignored.
mod scalar {
    contract_tests!(crate::common::Kernel::Fast("scalar"));
}
#[cfg(target_arch = "x86_64")]
mod avx2 {
    contract_tests!(
        crate::common::Kernel::Fast("avx2"),
        #[cfg_attr(not(twinattn_cpu_avx2), ignore = "AVX2+FMA is not available on this CPU")]
    );
}
#[cfg(target_arch = "x86_64")]
mod avx512 {
    contract_tests!(
        crate::common::Kernel::Fast("avx512"),
        #[cfg_attr(not(twinattn_cpu_avx512), ignore = "AVX-512F is not available on this CPU")]
    );
}
#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    contract_tests!(
        crate::common::Kernel::Fast("avx512bf16"),
        #[cfg_attr(
            not(twinattn_cpu_avx512bf16),
            ignore = "AVX-512F/BW/VL + AVX512_BF16 is not available on this CPU"
        )]
    );
}
#[cfg(target_arch = "x86_64")]
mod amxbf16 {
    contract_tests!(
        crate::common::Kernel::Fast("amxbf16"),
        #[cfg_attr(
            not(twinattn_cpu_amxbf16),
            ignore = "avx512bf16 + AMX-TILE/AMX-BF16 (and the OS's permission) is not available on this CPU"
        )]
    );
}
#[cfg(target_arch = "aarch64")]
mod neon {
    contract_tests!(crate::common::Kernel::Fast("neon"));
}

/// The ISAs this build and CPU run (x86-64: avx512, avx2, scalar; AArch64: neon, scalar).
fn isas() -> Vec<&'static str> {
    twinattn::dispatch::available_isas()
}

/// bfloat16's path: amxbf16 by default where it is available, else the default follows the
/// measurement where there was a choice (no TWINATTN_ISA, AVX512_BF16); the pair paths (tiles,
/// dot products) are the tables of amxbf16 and avx512bf16 alone. (Nothing here switches the
/// process-wide set: cargo runs the tests in parallel; C++'s test_dispatch does.)
#[test]
fn default_isa_follows_the_bf16_measurement() {
    let default = twinattn::dispatch::default_isa();
    assert!(isas().contains(&default), "{default}");
    let forced = std::env::var("TWINATTN_ISA").is_ok_and(|v| !v.is_empty());
    if !forced && isas().contains(&"amxbf16") {
        assert_eq!(default, "amxbf16");
    }
    let path = match twinattn::dispatch::current_isa() {
        "amxbf16" => "amx",
        "avx512bf16" => "dot",
        _ => "convert",
    };
    assert_eq!(twinattn::dispatch::bfloat16_path(), path);
    for isa in isas() {
        let pairs = twinattn::dispatch::kernels_for(isa).map(|k| k.pack_pairs.is_some());
        assert_eq!(
            pairs,
            Some(isa == "avx512bf16" || isa == "amxbf16"),
            "{isa}"
        );
    }
    match twinattn::dispatch::bf16dot_over_fma32() {
        Some(ratio) => {
            let dot = ratio >= twinattn::constants::BF16_DOT_MIN_RATIO;
            assert_eq!(default, if dot { "avx512bf16" } else { "avx512" });
        }
        None => assert!(forced || isas().contains(&"amxbf16") || !isas().contains(&"avx512bf16")),
    }
}

fn run_on(kernel: Kernel, case: &Case, threads: usize) -> Output {
    common::run_with(kernel, case, threads)
}

/// |fast - reference| within a float32 tolerance that grows with the keys summed over.
fn assert_close_to_reference(case: &Case, fast: &Output, reference: &Output, what: &str) {
    let keys = case.k.shape[2].max(1) as f32;
    let width = case.q.shape[3].max(1) as f32;
    let tolerance = 16.0 * f32::EPSILON * (keys + width).sqrt().max(4.0);
    let (f, r) = (fast.out.values(), reference.out.values());
    assert_eq!(f.len(), r.len());
    for (n, (&a, &b)) in f.iter().zip(&r).enumerate() {
        assert!(
            (a - b).abs() <= tolerance * (1.0 + b.abs()),
            "{what}: out element {n}: fast {a}, reference {b}"
        );
    }
    for (n, (&a, &b)) in fast.lse.iter().zip(&reference.lse).enumerate() {
        let ok = if b == f32::NEG_INFINITY {
            a == b
        } else {
            (a - b).abs() <= tolerance * (1.0 + b.abs())
        };
        assert!(ok, "{what}: lse element {n}: fast {a}, reference {b}");
    }
}

/// Every ISA against the reference kernel, and the reference against naive (small cases).
fn check_all_isas(case: &Case, threads: usize, what: &str) {
    let reference = run_on(Kernel::Reference, case, threads);
    for isa in isas() {
        let fast = run_on(Kernel::Fast(isa), case, threads);
        assert_close_to_reference(case, &fast, &reference, &format!("{isa} {what}"));
    }
}

#[test]
fn tile_boundaries_match_reference() {
    let mut rng = Rng::new(101);
    // (B, Hq, Hkv, Lq, Lk, D, Dv) just below, at and above 6, 16, 48, 64, 256.
    let shapes = [
        (1, 1, 1, 5, 15, 7, 9),
        (1, 1, 1, 6, 16, 16, 16),
        (1, 1, 1, 7, 17, 17, 15),
        (1, 4, 1, 12, 64, 64, 63),
        (1, 4, 1, 13, 65, 65, 64),
        (2, 2, 2, 47, 255, 63, 65),
        (1, 1, 1, 48, 256, 48, 48),
        (1, 1, 1, 49, 257, 49, 47),
        (1, 2, 1, 64, 300, 256, 256),
        (1, 1, 1, 65, 513, 255, 257),
        (1, 8, 2, 11, 300, 80, 80),
        (1, 6, 3, 96, 513, 32, 48),
        (1, 3, 1, 130, 130, 3, 1),
    ];
    for shape in shapes {
        let case = random_case(&mut rng, shape);
        check_all_isas(&case, 2, &format!("{shape:?} full"));
        let mut causal = case.clone().causal(&vec![0; shape.0 as usize]);
        if shape.3 <= shape.4 {
            causal.q_offset = vec![shape.4 - shape.3; shape.0 as usize];
        }
        check_all_isas(&causal, 2, &format!("{shape:?} causal"));
    }
}

#[test]
fn causal_offsets_kv_lens_and_masks() {
    let mut rng = Rng::new(103);
    let base = random_case(&mut rng, (3, 8, 2, 50, 600, 64, 32)).causal(&[550, 100, 0]);
    let mut case = base.clone();
    case.kv_lens = vec![600, 257, 0];
    for b in 0..2 {
        for j in 257..600 {
            for d in 0..64 {
                case.k.set([1, b, j, d], f32::NAN); // padding is never read
            }
            for d in 0..32 {
                case.v.set([1, b, j, d], f32::NAN);
            }
        }
    }
    check_all_isas(&case, 2, "kv_lens");
    let shape = [3, 8, 50, 600];
    let mut bool_case = case.clone();
    bool_case.mask = Mask::bool_from_fn(shape, |[b, h, i, j]| {
        (b * 7 + h * 3 + i * 5 + j * 11) % 10 != 0
    });
    check_all_isas(&bool_case, 2, "bool mask");
    let mut float_case = case.clone();
    float_case.mask = Mask::float_from_fn(shape, |[_, h, i, j]| {
        if (300..310).contains(&j) {
            f32::NEG_INFINITY
        } else {
            0.01 * ((h * 13 + i * 7 + j * 3) % 17) as f32 - 0.08
        }
    });
    check_all_isas(&float_case, 3, "float mask");
    // without causal, a padded bidirectional batch
    let mut bidirectional = case.clone();
    bidirectional.causal = false;
    check_all_isas(&bidirectional, 2, "bidirectional");
}

#[test]
fn grouped_query_heads_against_naive() {
    let mut rng = Rng::new(107);
    for &(hq, hkv, lq) in &[(32, 8, 13), (8, 1, 7), (6, 3, 20), (4, 4, 1)] {
        let case = random_case(&mut rng, (1, hq, hkv, lq, 70, 32, 24)).causal(&[57]);
        for isa in isas() {
            let got = run_on(Kernel::Fast(isa), &case, 2);
            assert_close_to_naive(&case, &got, 2e-6);
        }
    }
}

#[test]
fn decode_with_32k_keys_and_split_key_merge() {
    let mut rng = Rng::new(109);
    for &(lq, lk) in &[
        (1, 32768),
        (4, 20000),
        (1, 1023),
        (1, 1025),
        (1, 2049),
        (3, 4096),
    ] {
        let mut case = random_case(&mut rng, (2, 8, 2, lq, lk, 64, 48)).causal(&[lk - lq, 100]);
        case.kv_lens = vec![lk, (lk / 2).max(101)];
        check_all_isas(&case, 2, &format!("decode Lq={lq} Lk={lk}"));
    }
}

/// Direct split-key scores (rows_per_group <= DIRECT_SCORE_ROWS: every G here at Lq = 1; at
/// Lq = 4, G <= 6 is direct (4 strips at G = 6) and G >= 7 takes the panels): D around the vector widths, kv_len around the 4-key batches, the vector
/// width, the key block and the chunk, masks and NaN in hidden keys (as the C++ sweep).
#[test]
fn direct_split_key_scores_against_reference() {
    const _: () = assert!(twinattn::constants::DIRECT_SCORE_ROWS == 24);
    let mut rng = Rng::new(131);
    let mut i = 0i64;
    for d in [1i64, 15, 16, 17, 64, 80, 128, 129] {
        for g in 1i64..=8 {
            for lk in [1i64, 3, 4, 5, 15, 16, 17, 33, 255, 257, 1023, 1025] {
                i += 1;
                if (d + g + lk + i - 1) % 5 != 0 && lk != 17 {
                    continue;
                }
                let lq = if i % 4 == 0 { 4 } else { 1 };
                let mut case = random_case(&mut rng, (2, 2 * g, 2, lq, lk + 3, d, 24));
                case.kv_lens = vec![lk, (lk / 2).max(1)];
                for b in 0..2 {
                    for kvh in 0..2 {
                        for j in case.kv_lens[b as usize]..lk + 3 {
                            for x in 0..d {
                                case.k.set([b, kvh, j, x], f32::NAN);
                            }
                            for x in 0..24 {
                                case.v.set([b, kvh, j, x], f32::NAN);
                            }
                        }
                    }
                }
                if i % 2 == 0 {
                    case = case.causal(&[lk - 1, (lk / 2).max(1) - 1]);
                }
                let shape = [2, 2 * g, lq, lk + 3];
                case.mask = match i % 3 {
                    0 => Mask::bool_from_fn(shape, |[b, h, _, j]| (b + h + j) % 4 != 1),
                    1 => Mask::float_from_fn(shape, |[_, h, _, j]| ((h * 7 + j) % 5) as f32 * -0.5),
                    _ => Mask::None,
                };
                check_all_isas(&case, 2, &format!("direct D={d} G={g} Lk={lk}"));
            }
        }
    }
}

#[test]
fn thread_counts_give_identical_results() {
    let mut rng = Rng::new(113);
    for &(lq, lk) in &[(1, 5000), (200, 700)] {
        let case = random_case(&mut rng, (2, 8, 2, lq, lk, 64, 64)).causal(&[lk - lq, 0]);
        for isa in isas() {
            let one = run_on(Kernel::Fast(isa), &case, 1);
            for threads in [2, 3, 8] {
                assert_identical(&one, &run_on(Kernel::Fast(isa), &case, threads));
            }
        }
    }
}

#[test]
fn scalar_and_simd_paths_agree() {
    let mut rng = Rng::new(127);
    let case = random_case(&mut rng, (1, 8, 2, 100, 900, 128, 128)).causal(&[800]);
    let scalar = run_on(Kernel::Fast("scalar"), &case, 2);
    let reference = run_on(Kernel::Reference, &case, 2);
    for isa in isas() {
        assert_eq!(twinattn::dispatch::kernels_for(isa).unwrap().isa, isa);
        let simd = run_on(Kernel::Fast(isa), &case, 2);
        assert_close_to_reference(&case, &simd, &scalar, &format!("{isa} vs scalar"));
        // float32 accumulation: not the float64 reference's bits (so the fast path really ran)
        assert_ne!(
            common::bits(&simd.out.values()),
            common::bits(&reference.out.values())
        );
    }
    // the two AVX paths have different vector widths, hence different rounding
    if isas().contains(&"avx2") && isas().contains(&"avx512") {
        let avx2 = run_on(Kernel::Fast("avx2"), &case, 2);
        let avx512 = run_on(Kernel::Fast("avx512"), &case, 2);
        assert_ne!(
            common::bits(&avx2.out.values()),
            common::bits(&avx512.out.values())
        );
    }
}

/// NaN, +inf and -inf in one query row, one visible key, one value element or one bias, on the
/// direct split-key path, the panel split-key path and prefill tiles (merged chunks, diagonal
/// tiles): every ISA gives the plain reference kernel's NaN / +inf / -inf pattern, element by
/// element in out and lse, and its finite values (as the C++ test_nonfinite_patterns...).
#[test]
fn non_finite_patterns_match_reference_kernel() {
    let mut rng = Rng::new(137);
    // (B, Hq, Hkv, Lq, Lk, D, Dv, causal): 8 rows direct, 32 rows panels, 140 rows prefill
    let paths = [
        (2, 4, 2, 2, 1500, 40, 24, true),
        (2, 16, 2, 4, 1500, 40, 24, false),
        (2, 4, 2, 70, 600, 40, 24, true),
    ];
    let mut non_finite = 0;
    for (b, hq, hkv, lq, lk, d, dv, causal) in paths {
        let mut base = random_case(&mut rng, (b, hq, hkv, lq, lk, d, dv));
        if causal {
            base = base.causal(&vec![lk - lq; b as usize]);
        }
        for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let key = 3; // visible to every row
            let mut cases = [base.clone(), base.clone(), base.clone(), base.clone()];
            cases[0].q.set([1, 1, lq - 1, 5], value);
            cases[1].k.set([0, 1, key, 2], value);
            cases[1].k.set([1, 0, lk - 300, 7], value);
            cases[2].v.set([1, 1, key, dv - 1], value);
            cases[3].mask = Mask::float_from_fn([b, hq, lq, lk], |[bb, h, i, j]| {
                if [bb, h, i, j] == [1, 2, lq - 1, key] {
                    value
                } else if (bb + h + i + j) % 5 == 0 {
                    f32::NEG_INFINITY
                } else {
                    0.1 * ((h + 3 * j) % 7) as f32
                }
            });
            for (n, case) in cases.iter().enumerate() {
                let reference = run_on(Kernel::Reference, case, 2);
                for isa in isas() {
                    let fast = run_on(Kernel::Fast(isa), case, 2);
                    let pairs = fast.out.values().into_iter().zip(reference.out.values());
                    let lse_pairs = fast.lse.iter().copied().zip(reference.lse.iter().copied());
                    for (m, (a, r)) in pairs.chain(lse_pairs).enumerate() {
                        let ok = if r.is_nan() {
                            a.is_nan()
                        } else if r.is_infinite() {
                            a == r
                        } else {
                            a.is_finite() && (a - r).abs() <= 1e-4 * (1.0 + r.abs())
                        };
                        assert!(
                            ok,
                            "{isa} case {n} value {value} element {m}: fast {a}, reference {r}"
                        );
                    }
                }
                non_finite += reference
                    .out
                    .values()
                    .iter()
                    .filter(|x| !x.is_finite())
                    .count();
            }
        }
    }
    assert!(non_finite > 0, "the cases produce non-finite results");
}

/// NaN in every key and value row that no query row of sequence b may see because of its window
/// (before the first row's window, after the last row's), so a leak shows up as NaN.
fn poison_outside_windows(case: &mut Case) {
    let [batch, kv_heads, k_len, d] = case.k.shape;
    let (q_len, dv) = (case.q.shape[2], case.v.shape[3]);
    for b in 0..batch {
        let offset = case.q_offset[b as usize];
        let first = if case.window_left >= 0 {
            offset - case.window_left
        } else {
            0
        };
        let last = if case.window_right >= 0 {
            offset + q_len - 1 + case.window_right
        } else {
            k_len
        };
        for g in 0..kv_heads {
            for j in (0..k_len).filter(|&j| j < first || j > last) {
                (0..d).for_each(|x| case.k.set([b, g, j, x], f32::NAN));
                (0..dv).for_each(|x| case.v.set([b, g, j, x], f32::NAN));
            }
        }
    }
}

/// Issue 13's variants, alone and together, every ISA against the plain kernel: windows that
/// straddle key blocks (256), panels (32) and split-key chunks (1024) on the direct, panel and
/// prefill paths, with NaN in every key outside the windows; negative offsets (not causal);
/// softcap with large scores; ALiBi per (b, h); sinks, including split-key decode over 3 chunks.
#[test]
fn variants_match_reference() {
    let mut rng = Rng::new(131);
    let windows = [
        (-1, -1),
        (0, 0),
        (5, -1),
        (100, 0),
        (255, 1),
        (300, 40),
        (-1, 7),
        (1023, 0),
        (1500, 2000),
    ];
    let mut n = 0;
    for (left, right) in windows {
        for lq in [1, 4, 40, 130] {
            for causal in [false, true] {
                n += 1;
                let mut case = random_case(&mut rng, (2, 4, 2, lq, 2600, 40, 24));
                case.kv_lens = vec![2600, 1900];
                case.causal = causal;
                case.q_offset = vec![
                    if n % 3 == 0 { 700 } else { 2600 - lq },
                    if causal {
                        1000
                    } else if n % 2 == 1 {
                        -50
                    } else {
                        1900 - lq
                    },
                ];
                case.window_left = left;
                case.window_right = right;
                if n % 4 == 1 {
                    case.alibi_slopes = Some(
                        (0..8)
                            .map(|x| (-(x % 4 + 1) as f32).exp2() * (1.0 + (x / 4) as f32 * 0.25))
                            .collect(),
                    );
                }
                if n % 3 == 1 {
                    case.sinks = Some(vec![0.5, -1.5, 2.0, 0.0]);
                }
                if n % 5 == 2 {
                    case.softcap = 4.0;
                    case.scale *= 20.0;
                }
                poison_outside_windows(&mut case);
                for b in 0..2 {
                    let kv_len = case.kv_lens[b];
                    for g in 0..2 {
                        for j in kv_len..2600 {
                            case.k.set([b as i64, g, j, 0], f32::NAN); // past kv_len: never read
                        }
                    }
                }
                check_all_isas(
                    &case,
                    2,
                    &format!("window ({left}, {right}) lq {lq} case {n}"),
                );
            }
        }
    }
}

/// Rows whose window holds no key (past kv_len, before key 0): zeros and lse = -inf, or the
/// sink; and softcap with very large scores, ALiBi and sinks on a 3-chunk decode and prefill.
#[test]
fn empty_windows_softcap_alibi_and_sinks() {
    let mut rng = Rng::new(137);
    for sinks in [false, true] {
        for lq in [1, 60] {
            let mut case = random_case(&mut rng, (2, 2, 1, lq, 300, 16, 8));
            case.window_left = 10;
            case.window_right = 5;
            case.q_offset = vec![400, -100];
            if sinks {
                case.sinks = Some(vec![0.75, -2.0]);
            }
            check_all_isas(&case, 2, &format!("empty windows sinks {sinks} lq {lq}"));
            let out = run_on(Kernel::Fast(isas()[0]), &case, 2);
            assert!(out.out.values().iter().all(|&x| x == 0.0));
            for (n, &lse) in out.lse.iter().enumerate() {
                let h = (n / lq as usize) % 2;
                let want = if sinks {
                    [0.75f32, -2.0][h]
                } else {
                    f32::NEG_INFINITY
                };
                // ln 2 * (sink * log2 e) is within an ulp or two of the sink
                assert!(
                    lse == want || (lse - want).abs() <= 4.0 * f32::EPSILON * want.abs(),
                    "lse {lse}, want {want}"
                );
            }
        }
    }
    for lq in [1, 64] {
        let mut case = random_case(&mut rng, (1, 4, 4, lq, 3000, 64, 64)).causal(&[3000 - lq]);
        case.softcap = 30.0;
        case.scale *= 200.0;
        check_all_isas(&case, 2, &format!("softcap large scores lq {lq}"));
        case.softcap = 0.0;
        case.scale /= 200.0;
        case.alibi_slopes = Some(vec![0.5, 0.25, 0.125, 0.0625]);
        check_all_isas(&case, 2, &format!("alibi lq {lq}"));
        case.alibi_slopes = None;
        case.sinks = Some(vec![1.0, -1.0, 3.0, 0.0]);
        check_all_isas(&case, 2, &format!("sinks lq {lq}"));
        case.alibi_slopes = Some(vec![0.5, 0.25, 0.125, 0.0625]);
        case.softcap = 50.0;
        case.window_left = 1000;
        check_all_isas(&case, 2, &format!("all together lq {lq}"));
    }
}

/// The vectorised tanh of softcap alone, every ISA, against f64::tanh: 4e6 points over
/// [-1e4, 1e4] (dense near 0 and around TANH_SMALL, where the branches meet), denormals, +-0,
/// +-inf and NaN. Bound: 3e-7 relative (measured worst about 1.9e-7, 2 ulp, in the exp2
/// branch; a wrong coefficient or branch is off by >= 1e-6), exact for denormals, +-1 at +-inf,
/// NaN for NaN. Also: every ISA gives the scalar type's bits up to the scalar type's unfused
/// multiply-adds, so the SIMD ISAs must agree with each other exactly.
#[test]
fn tanh_matches_std_on_every_isa() {
    let mut inputs = Vec::new();
    for n in -1_000_000i32..=1_000_000 {
        let t = f64::from(n) / 1e6;
        inputs.push((1e4 * t * t * t) as f32);
        inputs.push((2.0 * t) as f32);
    }
    let edge = [
        0.0f32,
        -0.0,
        1e-45,
        -1e-45,
        1e-40,
        -3e-39,
        f32::MIN_POSITIVE,
        1e-30,
        1e-4,
        0.625,
        f32::from_bits(0.625f32.to_bits() + 1),
        f32::from_bits(0.625f32.to_bits() - 1),
        9.0,
        44.0,
        88.0,
        1e4,
        -1e4,
        3e38,
        -3e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    inputs.extend_from_slice(&edge);
    while inputs.len() % 16 != 0 {
        inputs.push(0.5);
    }
    let mut simd_bits: Option<Vec<u32>> = None;
    for isa in isas() {
        let kernels = twinattn::dispatch::kernels_for(isa).expect("an available ISA");
        let mut values = inputs.clone();
        // SAFETY: kernels_for hands out only the kernels of an ISA this CPU runs.
        unsafe { (kernels.tanh_values)(&mut values) };
        let mut worst = 0.0f64;
        for (&x, &t) in inputs.iter().zip(&values) {
            let want = f64::from(x).tanh();
            if x.is_nan() {
                assert!(t.is_nan(), "{isa}: tanh(NaN) = {t}");
            } else if x.abs() < f32::MIN_POSITIVE {
                assert_eq!(
                    t, x,
                    "{isa}: tanh({x:e}) = {t:e}, a denormal or zero is exact"
                );
            } else {
                let error = (f64::from(t) - want).abs() / want.abs();
                worst = worst.max(error);
                assert!(error <= 3e-7, "{isa}: tanh({x:e}) = {t:e}, want {want:e}");
            }
        }
        println!("{isa}: tanh worst relative error {worst:.3e}");
        if isa != "scalar" {
            let bits = common::bits(&values);
            if let Some(previous) = &simd_bits {
                assert!(
                    previous == &bits,
                    "{isa}: tanh differs from the other SIMD ISA"
                );
            }
            simd_bits = Some(bits);
        }
    }
}

/// A denormal softcap: scale / softcap overflows float32; a zero in q must still give a finite
/// score (tanh saturates), as in the reference, not 0 * inf = NaN. Both paths, every ISA.
#[test]
fn denormal_softcap_keeps_zero_queries_finite() {
    let mut rng = Rng::new(139);
    for lq in [1, 60] {
        let mut case = random_case(&mut rng, (1, 1, 1, lq, 3, 2, 2));
        for i in 0..lq {
            case.q.set([0, 0, i, 0], 0.0); // q = (0, x): 0 * multiplier
        }
        case.softcap = 1e-40;
        check_all_isas(&case, 2, &format!("denormal softcap lq {lq}"));
    }
}

// ---- The thread pool (thread_pool.rs; C++: test_thread_pool in test_flash_kernel.cpp) ----

mod thread_pool {
    use std::panic::catch_unwind;
    use std::sync::atomic::{AtomicU64, Ordering};
    use twinattn::thread_pool::parallel_for;

    #[test]
    fn thread_pool_every_item_once() {
        for threads in [1, 2, 3, 8] {
            for items in [0, 1, 2, 5, 100] {
                let hits: Vec<AtomicU64> = (0..items).map(|_| AtomicU64::new(0)).collect();
                parallel_for(items, threads, &|item, thread| {
                    assert!(thread < threads.max(1));
                    hits[item].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn thread_pool_concurrent_callers_and_nested_calls_finish() {
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..50 {
                        let sum = AtomicU64::new(0);
                        parallel_for(64, 3, &|item, _| {
                            // a nested call finds the pool busy and runs inline
                            parallel_for(2, 2, &|_, _| {});
                            sum.fetch_add(item as u64, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
                    }
                });
            }
        });
    }

    #[test]
    fn thread_pool_a_panic_reaches_the_caller() {
        let result = catch_unwind(|| {
            parallel_for(10, 2, &|item, _| {
                if item == 3 {
                    panic!("item 3");
                }
            })
        });
        assert!(result.is_err());
        parallel_for(10, 2, &|_, _| {}); // the pool still works
    }
}
