//! Records the compiler that built the crate, for `build_info()["compiler"]`, and tells the
//! instruction-set tests (tests/flash_kernel.rs) which sets the CPU running `cargo test` has.

use std::process::Command;

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let version = Command::new(&rustc)
        .arg("-V")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_else(|| "rustc (unknown version)".to_owned());
    println!("cargo:rustc-env=TWINATTN_RUSTC_VERSION={version}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/amx_usable.rs");
    cpu_cfgs();
}

/// `twinattn_cpu_avx2` / `twinattn_cpu_avx512` / `twinattn_cpu_avx512bf16` /
/// `twinattn_cpu_amxbf16`: the CPU building the
/// crate runs that instruction set (the same test as dispatch.rs). The tests of a set the CPU lacks are then `#[ignore]`d, so
/// `cargo test` reports them as ignored instead of passing without running. Cross builds (target
/// differs from host) set neither: nothing is known about the CPU that will run them.
fn cpu_cfgs() {
    println!("cargo::rustc-check-cfg=cfg(twinattn_cpu_avx2)");
    println!("cargo::rustc-check-cfg=cfg(twinattn_cpu_avx512)");
    println!("cargo::rustc-check-cfg=cfg(twinattn_cpu_avx512bf16)");
    println!("cargo::rustc-check-cfg=cfg(twinattn_cpu_amxbf16)");
    if std::env::var("TARGET").ok() != std::env::var("HOST").ok() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2 {
            println!("cargo::rustc-cfg=twinattn_cpu_avx2");
        }
        let avx512 = avx2 && is_x86_feature_detected!("avx512f");
        if avx512 {
            println!("cargo::rustc-cfg=twinattn_cpu_avx512");
        }
        if avx512
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
        {
            println!("cargo::rustc-cfg=twinattn_cpu_avx512bf16");
            if amx_bf16_usable() {
                println!("cargo::rustc-cfg=twinattn_cpu_amxbf16");
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
include!("src/amx_usable.rs");
