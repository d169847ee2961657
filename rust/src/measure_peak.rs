//! measure_peak: the arithmetic ceiling of this machine for the benchmark's roofline
//! (docs/native_api.md): GFLOP/s of register-resident loops of independent multiply-adds on
//! num_threads threads of the pool for about `seconds`. "fma32": AVX-512 FMA on 16 floats (32 flop
//! per instruction), or AVX2 FMA on 8 floats (16) on a CPU without AVX-512F; "bf16dot":
//! VDPBF16PS (64 flop per instruction, AVX512_BF16); "bf16tile": AMX TDPBF16PS (16384 flop per
//! instruction, AMX-BF16). Twin of `cpp/src/measure_peak.cpp`, same
//! checks, same messages.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(target_arch = "x86_64")]
use crate::constants::{BF16_CHOICE_INSTRUCTIONS, BF16_CHOICE_ROUNDS};
use crate::dispatch::available_isas;
use crate::problem::{check_num_threads, ProblemError};
use crate::thread_pool::parallel_for;

/// A loop of `instructions` independent operations; returns the flop done. # Safety: the CPU
/// runs its instruction set.
type PeakLoop = unsafe fn(u64) -> u64;

/// GFLOP/s of `kind` on `num_threads` threads for about `seconds` (checked by the caller:
/// the binding says (0, 1e6]).
pub fn measure_peak(kind: &str, num_threads: i64, seconds: f64) -> Result<f64, ProblemError> {
    let has = |isa: &str| available_isas().contains(&isa);
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut peak_loop: Option<PeakLoop> = None;
    match kind {
        "fma32" => {
            #[cfg(target_arch = "x86_64")]
            if has("avx512") {
                peak_loop = Some(crate::flash_avx512::peak_fma32_avx512);
            } else if has("avx2") {
                peak_loop = Some(crate::flash_avx2::peak_fma32_avx2);
            }
            if peak_loop.is_none() {
                return Err(ProblemError(
                    "kind: \"fma32\" needs AVX2 or AVX-512F, which this CPU lacks".to_owned(),
                ));
            }
        }
        "bf16dot" => {
            #[cfg(target_arch = "x86_64")]
            if has("avx512bf16") {
                peak_loop = Some(crate::flash_avx512bf16::peak_bf16dot_avx512bf16);
            }
            if peak_loop.is_none() {
                return Err(ProblemError(
                    "kind: \"bf16dot\" needs AVX512_BF16, which this CPU lacks".to_owned(),
                ));
            }
        }
        "bf16tile" => {
            #[cfg(target_arch = "x86_64")]
            if has("amxbf16") {
                peak_loop = Some(crate::flash_amx::peak_bf16tile_amxbf16);
            }
            if peak_loop.is_none() {
                return Err(ProblemError(
                    "kind: \"bf16tile\" needs AMX-BF16 (and the OS's permission), which this CPU lacks"
                        .to_owned(),
                ));
            }
        }
        _ => {
            return Err(ProblemError(format!(
                "kind: expected \"fma32\", \"bf16dot\" or \"bf16tile\", got \"{kind}\""
            )))
        }
    }
    let _ = has; // (no loop on other architectures)
    let peak_loop = peak_loop.expect("every kind above set its loop or returned");
    let threads = check_num_threads(num_threads)?;
    if !(seconds > 0.0 && seconds <= 1e6) {
        return Err(ProblemError(format!(
            "seconds: expected a number in (0, 1e6], got {seconds}"
        )));
    }
    // One item per thread, each looping in chunks of 2^20 instructions (about a millisecond)
    // until `seconds` have passed since the call began; the rate is all flop over the wall time.
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let flop = AtomicU64::new(0);
    parallel_for(threads, threads, &|_, _| {
        let mut done = 0;
        loop {
            // SAFETY: the loop's instruction set was found available above.
            done += unsafe { peak_loop(1 << 20) };
            if Instant::now() >= deadline {
                break;
            }
        }
        flop.fetch_add(done, Ordering::Relaxed);
    });
    let elapsed = start.elapsed().as_secs_f64();
    Ok(flop.load(Ordering::Relaxed) as f64 / elapsed / 1e9)
}

/// One core's VDPBF16PS flop rate over its float32 AVX-512 FMA rate, for dispatch.rs's choice of
/// the bfloat16 path (constants.rs, "bfloat16 path choice"): on the calling thread, a warm-up
/// call of each loop, then BF16_CHOICE_ROUNDS rounds that time BF16_CHOICE_INSTRUCTIONS
/// instructions of each in turn; the best rate of each (another process only ever slows a
/// timing). None on a CPU (or build) without AVX512_BF16.
pub fn measure_bf16dot_over_fma32() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !available_isas().contains(&"avx512bf16") {
            return None;
        }
        let loops: [PeakLoop; 2] = [
            crate::flash_avx512::peak_fma32_avx512,
            crate::flash_avx512bf16::peak_bf16dot_avx512bf16,
        ];
        let mut best = [0.0f64; 2]; // flop per second
        for round in 0..=BF16_CHOICE_ROUNDS {
            // round 0 warms up
            for (kind, peak_loop) in loops.iter().enumerate() {
                let start = Instant::now();
                // SAFETY: avx512bf16 (and so avx512) was found available above.
                let flop = unsafe { peak_loop(BF16_CHOICE_INSTRUCTIONS) };
                let elapsed = start.elapsed().as_secs_f64();
                if round > 0 && elapsed > 0.0 {
                    best[kind] = best[kind].max(flop as f64 / elapsed);
                }
            }
        }
        Some(if best[0] > 0.0 {
            best[1] / best[0]
        } else {
            0.0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The loop of each kind, expanded inside its `#[target_feature]` function (a macro: the
/// intrinsics differ; C++ passes lambdas to one template): N independent accumulators,
/// accumulator i starting at `broadcast(i)`, each advanced by `step` (a closure, inlined with
/// the function's target features) once per round until `instructions`
/// are issued (whole rounds), then summed (`add`) and the sum's first lane kept (black_box), so
/// that the loop stays. Evaluates to the instructions issued.
macro_rules! run_peak_loop {
    ($instructions:expr, $n:literal, $broadcast:ident, $step:ident, $add:ident, $first_lane:ident) => {{
        let mut accumulators: [_; $n] = std::array::from_fn(|i| $broadcast(i as f32));
        let mut done = 0;
        while done < $instructions {
            for slot in &mut accumulators {
                *slot = $step(*slot);
            }
            done += $n;
        }
        let mut sum = accumulators[0];
        for x in &accumulators[1..] {
            sum = $add(sum, *x);
        }
        std::hint::black_box($first_lane(sum)); // the loop's result is used
        $instructions.div_ceil($n) * $n
    }};
}
pub(crate) use run_peak_loop;
