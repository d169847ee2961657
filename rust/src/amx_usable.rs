/// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and the OS lets
/// this process use the tile data (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
/// asked once by dispatch.rs; the permission then holds for every thread of the process).
/// Included by flash_amx.rs and build.rs, so it names everything by its full path.
pub fn amx_bf16_usable() -> bool {
    #[cfg(target_os = "linux")]
    {
        if std::arch::x86_64::__get_cpuid_max(0).0 < 7 {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        if (edx >> 24) & 1 == 0 || (edx >> 22) & 1 == 0 {
            return false;
        }
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let result: isize;
        // SAFETY: the arch_prctl system call, which only changes this process's permissions.
        unsafe {
            std::arch::asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL as isize => result,
                 in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
                 lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        result == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

