//! Run-time instruction-set dispatch: the CPU is detected once, TWINATTN_ISA forces a path, and
//! the chosen kernels are cached behind an atomic index (set_isa may switch them at run time).
//! Twin of `cpp/src/dispatch.cpp`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use crate::constants::BF16_DOT_MIN_RATIO;
use crate::flash_kernel::FlashKernels;

// Slowest first. NEON and the x86 sets are never in the same build, so "fastest available" is
// the highest index either way. The indices of sets another architecture's build lacks are only
// defined there (they would be dead code here); their names stay, never available.
const SCALAR: usize = 0;
#[cfg(target_arch = "aarch64")]
const NEON: usize = 1;
#[cfg(target_arch = "x86_64")]
const AVX2: usize = 2;
#[cfg(target_arch = "x86_64")]
const AVX512: usize = 3;
#[cfg(target_arch = "x86_64")]
const AVX512_BF16: usize = 4;
#[cfg(target_arch = "x86_64")]
const AMX_BF16: usize = 5;
const ISA_COUNT: usize = 6;
const ISA_NAMES: [&str; ISA_COUNT] = ["scalar", "neon", "avx2", "avx512", "avx512bf16", "amxbf16"];

/// What this build compiled and this CPU (and OS, for the wide registers) can run.
fn detect() -> [bool; ISA_COUNT] {
    let mut support = [false; ISA_COUNT];
    support[SCALAR] = true;
    #[cfg(target_arch = "aarch64")]
    {
        support[NEON] = true; // NEON is part of the AArch64 baseline: nothing to ask
    }
    #[cfg(target_arch = "x86_64")]
    {
        // F16C converts float16 (every AVX2 CPU has it; checked all the same)
        support[AVX2] = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        support[AVX512] = support[AVX2] && is_x86_feature_detected!("avx512f");
        // the bfloat16 unit is compiled with BW and VL as well (flash_avx512bf16.rs)
        support[AVX512_BF16] = support[AVX512]
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16");
        // AMX: CPUID's AMX-TILE and AMX-BF16, and the OS's permission for the tile data (asked
        // here, once per process: flash_amx.rs).
        support[AMX_BF16] = support[AVX512_BF16] && crate::flash_amx::amx_bf16_usable();
    }
    support
}

fn cpu() -> &'static [bool; ISA_COUNT] {
    static SUPPORT: OnceLock<[bool; ISA_COUNT]> = OnceLock::new();
    SUPPORT.get_or_init(detect)
}

/// The table of instruction set `isa`, each one a constant built at compile time.
fn table(isa: usize) -> FlashKernels {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == AMX_BF16 {
            return const { crate::flash_amx::flash_kernels_amxbf16() };
        }
        if isa == AVX512_BF16 {
            return const { crate::flash_avx512bf16::flash_kernels_avx512bf16() };
        }
        if isa == AVX512 {
            return const { crate::flash_avx512::flash_kernels_avx512() };
        }
        if isa == AVX2 {
            return const { crate::flash_avx2::flash_kernels_avx2() };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if isa == NEON {
            return const { crate::flash_neon::flash_kernels_neon() };
        }
    }
    let _ = isa;
    const { crate::flash_scalar::flash_kernels_scalar() }
}

struct Dispatch {
    current: AtomicUsize,
    /// The choice at first use (TWINATTN_ISA, or preferred()).
    default_isa: usize,
    /// Measured by preferred() when it had the choice.
    bf16dot_over_fma32: Option<f64>,
    /// Some while TWINATTN_ISA names an instruction set that cannot run here and set_isa has
    /// not been called since: attention_forward and init_isa_from_environment then fail.
    environment_error: Option<String>,
    environment_failed: AtomicBool,
}

fn fastest() -> usize {
    (SCALAR + 1..ISA_COUNT)
        .rev()
        .find(|&isa| cpu()[isa])
        .unwrap_or(SCALAR)
}

/// The default without TWINATTN_ISA: the fastest available set (amxbf16 where the tiles are
/// usable), except that avx512bf16 differs from avx512 only in bfloat16's path (dot or convert),
/// so there the faster unit decides, from one short measurement (constants.rs, "bfloat16 path
/// choice"), returned beside it.
fn preferred() -> (usize, Option<f64>) {
    let isa = fastest();
    #[cfg(target_arch = "x86_64")]
    if isa == AVX512_BF16 {
        let ratio = crate::measure_peak::measure_bf16dot_over_fma32();
        let dot = ratio.is_some_and(|r| r >= BF16_DOT_MIN_RATIO);
        return (if dot { AVX512_BF16 } else { AVX512 }, ratio);
    }
    (isa, None)
}

fn isa_index(name: &str, what: &str) -> Result<usize, String> {
    (0..ISA_COUNT)
        .find(|&isa| name == ISA_NAMES[isa] && cpu()[isa])
        .ok_or_else(|| {
            format!(
                "{what}: expected one of the instruction sets this build and CPU can run ({}), got '{name}'",
                available_isas().join(", ")
            )
        })
}

fn dispatch() -> &'static Dispatch {
    // Built once, thread-safely: the initial choice (TWINATTN_ISA, or the preferred one: nothing
    // is measured when TWINATTN_ISA decides).
    static STATE: OnceLock<Dispatch> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut default_isa = fastest();
        let mut bf16dot_over_fma32 = None;
        let mut environment_error = None;
        match std::env::var("TWINATTN_ISA") {
            Ok(value) if !value.is_empty() => match isa_index(&value, "TWINATTN_ISA") {
                Ok(isa) => default_isa = isa,
                Err(error) => environment_error = Some(error),
            },
            _ => (default_isa, bf16dot_over_fma32) = preferred(),
        }
        Dispatch {
            current: AtomicUsize::new(default_isa),
            default_isa,
            bf16dot_over_fma32,
            environment_failed: AtomicBool::new(environment_error.is_some()),
            environment_error,
        }
    })
}

/// "amxbf16" (avx512bf16 + AMX-TILE and AMX-BF16, the OS granting the tiles), "avx512bf16"
/// (AVX-512F/BW/VL + AVX512_BF16), "avx512" (AVX-512F), "avx2" (AVX2 + FMA + F16C),
/// "neon" (AArch64), "scalar" (portable): the names this build and this CPU can run, fastest
/// first.
pub fn available_isas() -> Vec<&'static str> {
    (0..ISA_COUNT)
        .rev()
        .filter(|&isa| cpu()[isa])
        .map(|isa| ISA_NAMES[isa])
        .collect()
}

/// The instruction set attention_forward uses now: default_isa() until set_isa switches it.
pub fn current_isa() -> &'static str {
    ISA_NAMES[dispatch().current.load(Ordering::Relaxed)]
}

/// The instruction set chosen at first use, whatever set_isa did since: TWINATTN_ISA when it is
/// set, else the fastest available one, except that a CPU with AVX512_BF16 whose VDPBF16PS is
/// not clearly faster than its FMA (bf16dot_over_fma32() below BF16_DOT_MIN_RATIO, constants.rs)
/// gets avx512, the same kernels but for bfloat16's convert path.
pub fn default_isa() -> &'static str {
    ISA_NAMES[dispatch().default_isa]
}

/// The path bfloat16 prefill takes with the instruction set in use: "amx" (TDPBF16PS on tiles,
/// amxbf16), "dot" (VDPBF16PS, the avx512bf16 kernels) or "convert" (widened to float32, FMA: every other set; and bfloat16
/// decode, the split-key path, on every set).
pub fn bfloat16_path() -> &'static str {
    let isa = dispatch().current.load(Ordering::Relaxed);
    #[cfg(target_arch = "x86_64")]
    if isa == AMX_BF16 {
        return "amx";
    }
    if table(isa).pack_pairs.is_some() {
        "dot"
    } else {
        "convert"
    }
}

/// One core's VDPBF16PS flop rate over its float32 FMA rate, measured once at first use when the
/// default had the choice (AVX512_BF16 and no TWINATTN_ISA); None otherwise.
pub fn bf16dot_over_fma32() -> Option<f64> {
    dispatch().bf16dot_over_fma32
}

/// Switches the instruction set; the error names the available ones.
pub fn set_isa(name: &str) -> Result<(), String> {
    let d = dispatch();
    d.current.store(isa_index(name, "isa")?, Ordering::Relaxed);
    d.environment_failed.store(false, Ordering::Relaxed);
    Ok(())
}

/// Applies TWINATTN_ISA (if set and non-empty); an error with a clear message when it names an
/// instruction set that this build or CPU cannot run. The Python module calls it at import.
pub fn init_isa_from_environment() -> Result<(), String> {
    let d = dispatch();
    match &d.environment_error {
        Some(error) if d.environment_failed.load(Ordering::Relaxed) => Err(error.clone()),
        _ => Ok(()),
    }
}

/// The kernels of the instruction set in use.
pub fn current_kernels() -> Result<FlashKernels, String> {
    init_isa_from_environment()?;
    Ok(table(dispatch().current.load(Ordering::Relaxed)))
}

/// The kernels of the named instruction set, if this build and CPU can run it (for tests that
/// exercise every path without touching the process-wide choice).
pub fn kernels_for(name: &str) -> Option<FlashKernels> {
    isa_index(name, "isa").ok().map(table)
}
