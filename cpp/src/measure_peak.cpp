// measure_peak: the arithmetic ceiling of this machine for the benchmark's roofline (docs/
// native_api.md): GFLOP/s of register-resident loops of independent multiply-adds on num_threads
// threads of the pool for about `seconds`. "fma32": AVX-512 FMA on 16 floats (32 flop per
// instruction), or AVX2 FMA on 8 floats (16) on a CPU without AVX-512F; "bf16dot": VDPBF16PS
// (64 flop per instruction, AVX512_BF16); "bf16tile": AMX TDPBF16PS (16384 flop per
// instruction, AMX-BF16). Twin of rust/src/measure_peak.rs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "measure_peak.hpp"
#include "thread_pool.hpp"
#include "twinattn/constants.hpp"
#include "twinattn/flash_attention.hpp"

namespace twinattn {

double measure_peak(const std::string& kind, int64_t num_threads_requested, double seconds) {
    const std::vector<std::string> isas = available_isas();
    [[maybe_unused]] const auto has = [&](const char* isa) { return std::find(isas.begin(), isas.end(), isa) != isas.end(); };
    PeakLoop loop = nullptr;
    if (kind == "fma32") {
#if defined(TWINATTN_HAVE_X86_KERNELS)
        loop = has("avx512") ? peak_fma32_avx512 : has("avx2") ? peak_fma32_avx2 : nullptr;
#endif
        if (loop == nullptr)
            throw std::invalid_argument("kind: \"fma32\" needs AVX2 or AVX-512F, which this CPU lacks");
    } else if (kind == "bf16dot") {
#if defined(TWINATTN_HAVE_X86_KERNELS)
        if (has("avx512bf16")) loop = peak_bf16dot_avx512bf16;
#endif
        if (loop == nullptr)
            throw std::invalid_argument("kind: \"bf16dot\" needs AVX512_BF16, which this CPU lacks");
    } else if (kind == "bf16tile") {
#if defined(TWINATTN_HAVE_X86_KERNELS)
        if (has("amxbf16")) loop = peak_bf16tile_amxbf16;
#endif
        if (loop == nullptr)
            throw std::invalid_argument("kind: \"bf16tile\" needs AMX-BF16 (and the OS's permission), which this CPU lacks");
    } else {
        throw std::invalid_argument("kind: expected \"fma32\", \"bf16dot\" or \"bf16tile\", got \"" + kind + "\"");
    }
    const int num_threads = check_num_threads(num_threads_requested);
    if (!(seconds > 0.0) || seconds > 1e6)
        throw std::invalid_argument("seconds: expected a number in (0, 1e6], got " + std::to_string(seconds));

    // One item per thread, each looping in chunks of 2^20 instructions (about a millisecond) until
    // `seconds` have passed since the call began; the rate is all flop over the wall time.
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    std::atomic<int64_t> flop{0};
    parallel_for(num_threads, num_threads, [&](int64_t, int) {
        int64_t done = 0;
        do done += loop(int64_t{1} << 20);
        while (Clock::now() < deadline);
        flop += done;
    });
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    return static_cast<double>(flop.load()) / elapsed / 1e9;
}

std::optional<double> measure_bf16dot_over_fma32() {
#if defined(TWINATTN_HAVE_X86_KERNELS)
    const std::vector<std::string> isas = available_isas();
    if (std::find(isas.begin(), isas.end(), "avx512bf16") == isas.end()) return std::nullopt;
    using Clock = std::chrono::steady_clock;
    const PeakLoop loops[2] = {peak_fma32_avx512, peak_bf16dot_avx512bf16};
    double best[2] = {0.0, 0.0};  // flop per second
    for (int round = 0; round <= kBf16ChoiceRounds; ++round) {  // round 0 warms up
        for (int kind = 0; kind < 2; ++kind) {
            const Clock::time_point start = Clock::now();
            const int64_t flop = loops[kind](kBf16ChoiceInstructions);
            const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
            if (round > 0 && elapsed > 0.0) best[kind] = std::max(best[kind], static_cast<double>(flop) / elapsed);
        }
    }
    return best[0] > 0.0 ? best[1] / best[0] : 0.0;
#else
    return std::nullopt;
#endif
}

}  // namespace twinattn
