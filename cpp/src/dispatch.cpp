// Run-time instruction-set dispatch: the CPU is detected once, TWINATTN_ISA forces a path, and
// the chosen kernels are cached behind an atomic index (set_isa may switch them at run time).
#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.hpp"
#include "measure_peak.hpp"
#include "twinattn/constants.hpp"
#include "twinattn/flash_attention.hpp"

namespace twinattn {
namespace {

// Slowest first. NEON and the x86 sets are never in the same build, so "fastest available" is
// the highest index either way.
enum IsaIndex { kScalar = 0, kNeon = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4, kAmxBf16 = 5, kIsaCount = 6 };
const char* const kIsaNames[kIsaCount] = {"scalar", "neon", "avx2", "avx512", "avx512bf16", "amxbf16"};

struct CpuSupport {
    bool isa[kIsaCount];
};

// What this build compiled and this CPU (and OS, for the wide registers) can run.
CpuSupport detect() {
    CpuSupport support{{true, false, false, false, false, false}};
#if defined(TWINATTN_HAVE_NEON_KERNELS)
    support.isa[kNeon] = true;  // NEON is part of the AArch64 baseline: nothing to ask
#endif
#if defined(TWINATTN_HAVE_X86_KERNELS) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    // F16C too (float16 loads and stores): every AVX2 CPU has it, but the kernels rely on it.
    support.isa[kAvx2] = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
    support.isa[kAvx512] = support.isa[kAvx2] && __builtin_cpu_supports("avx512f");
    // The bfloat16 unit is compiled with BW and VL as well (its 16-bit conversions may use them).
    support.isa[kAvx512Bf16] = support.isa[kAvx512] && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    // AMX: CPUID's AMX-TILE and AMX-BF16, and the OS's permission for the tile data (asked here,
    // once per process: flash_amx.cpp).
    support.isa[kAmxBf16] = support.isa[kAvx512Bf16] && amx_bf16_usable();
#endif
    return support;
}

const CpuSupport& cpu() {
    static const CpuSupport support = detect();
    return support;
}

// Only ever called for an instruction set the CPU supports: the AVX units may use their
// instructions anywhere, even to build the table.
FlashKernels kernels_for(int isa) {
#if defined(TWINATTN_HAVE_NEON_KERNELS)
    if (isa == kNeon) return flash_kernels_neon();
#endif
#if defined(TWINATTN_HAVE_X86_KERNELS)
    if (isa == kAvx512) return flash_kernels_avx512();
    if (isa == kAvx512Bf16 || isa == kAmxBf16) {
        // float32 and float16 run exactly the avx512 kernels; bfloat16 its own (dot products, or
        // tile products on amxbf16).
        const FlashKernels avx512 = flash_kernels_avx512();
        FlashKernels kernels = isa == kAmxBf16 ? flash_kernels_amxbf16() : flash_kernels_avx512bf16();
        for (ElementType type : {ElementType::Float32, ElementType::Float16}) {
            kernels.attend_rows[static_cast<int>(type)] = avx512.attend_rows[static_cast<int>(type)];
            kernels.pack_keys[static_cast<int>(type)] = avx512.pack_keys[static_cast<int>(type)];
        }
        kernels.tanh_values = avx512.tanh_values;
        // int8 K/V: the avx512 kernels too (the convert path; no dot product applies).
        for (int type = 0; type < kElementTypes; ++type) kernels.attend_rows_int8[type] = avx512.attend_rows_int8[type];
        kernels.pack_keys_int8 = avx512.pack_keys_int8;
        kernels.backward = avx512.backward;
        // bfloat16 backward products on bfloat16 pairs (flash_backward.cpp's tile path): AMX tiles,
        // or VDPBF16PS.
        kernels.backward.tiles = isa == kAmxBf16 ? backward_tiles_amxbf16() : backward_tiles_avx512bf16();
        return kernels;
    }
    if (isa == kAvx2) return flash_kernels_avx2();
#endif
    (void)isa;
    return flash_kernels_scalar();
}

struct Dispatch {
    FlashKernels table[kIsaCount];
    std::atomic<int> current{kScalar};
    int default_isa = kScalar;  // the choice at first use (TWINATTN_ISA, or preferred())
    std::optional<double> bf16dot_over_fma32;  // measured by preferred() when it had the choice
    // Non-empty while TWINATTN_ISA names an instruction set that cannot run here and set_isa
    // has not been called since: attention_forward and init_isa_from_environment then throw.
    std::string environment_error;
    std::atomic<bool> environment_failed{false};
};

int fastest() {
    for (int isa = kIsaCount - 1; isa > kScalar; --isa)
        if (cpu().isa[isa]) return isa;
    return kScalar;
}

// The default without TWINATTN_ISA: the fastest available set (amxbf16 where the tiles are
// usable), except that avx512bf16 differs from avx512 only in bfloat16's path (dot or convert),
// so there the faster unit decides, from one short measurement (constants.hpp, "bfloat16 path
// choice"), kept in *ratio.
int preferred(std::optional<double>* ratio) {
    const int isa = fastest();
    if (isa != kAvx512Bf16) return isa;
    *ratio = measure_bf16dot_over_fma32();
    return ratio->has_value() && **ratio >= kBf16DotMinRatio ? kAvx512Bf16 : kAvx512;
}

std::string available_list() {
    std::string text;
    for (const std::string& name : available_isas()) text += (text.empty() ? "" : ", ") + name;
    return text;
}

int isa_index(const std::string& name, const char* what) {
    for (int isa = 0; isa < kIsaCount; ++isa)
        if (name == kIsaNames[isa] && cpu().isa[isa]) return isa;
    throw std::invalid_argument(std::string(what) + ": expected one of the instruction sets this build and CPU can run (" +
                                available_list() + "), got '" + name + "'");
}

Dispatch& dispatch() {
    // Built once, thread-safely: the kernel table, then the initial choice (TWINATTN_ISA, or the
    // preferred one: nothing is measured when TWINATTN_ISA decides).
    static Dispatch* state = [] {
        Dispatch* d = new Dispatch();
        for (int isa = 0; isa < kIsaCount; ++isa)
            d->table[isa] = cpu().isa[isa] ? kernels_for(isa) : kernels_for(kScalar);
        d->default_isa = fastest();
        const char* value = std::getenv("TWINATTN_ISA");
        if (value != nullptr && *value != '\0') {
            try {
                d->default_isa = isa_index(value, "TWINATTN_ISA");
            } catch (const std::invalid_argument& error) {
                d->environment_error = error.what();
                d->environment_failed.store(true);
            }
        } else {
            d->default_isa = preferred(&d->bf16dot_over_fma32);
        }
        d->current.store(d->default_isa);
        return d;
    }();
    return *state;
}

}  // namespace

std::vector<std::string> available_isas() {
    std::vector<std::string> names;
    for (int isa = kIsaCount - 1; isa >= 0; --isa)
        if (cpu().isa[isa]) names.emplace_back(kIsaNames[isa]);
    return names;
}

std::string current_isa() { return kIsaNames[dispatch().current.load()]; }

std::string default_isa() { return kIsaNames[dispatch().default_isa]; }

std::string bfloat16_path() {
    Dispatch& d = dispatch();
    const int isa = d.current.load();
    if (isa == kAmxBf16) return "amx";
    return d.table[isa].pack_pairs != nullptr ? "dot" : "convert";
}

std::optional<double> bf16dot_over_fma32() { return dispatch().bf16dot_over_fma32; }

void set_isa(const std::string& name) {
    Dispatch& d = dispatch();
    d.current.store(isa_index(name, "isa"));
    d.environment_failed.store(false);
}

void init_isa_from_environment() {
    Dispatch& d = dispatch();
    if (d.environment_failed.load()) throw std::invalid_argument(d.environment_error);
}

FlashKernels current_kernels() {
    Dispatch& d = dispatch();
    if (d.environment_failed.load()) throw std::invalid_argument(d.environment_error);
    return d.table[d.current.load()];
}

}  // namespace twinattn
