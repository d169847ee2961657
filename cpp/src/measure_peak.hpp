// measure_peak's register-resident loops (measure_peak.cpp), shared by the units that define
// them: flash_avx2.cpp, flash_avx512.cpp and flash_avx512bf16.cpp, each compiled with its own -m
// flags. Rust twin: rust/src/measure_peak.rs (run_peak_loop) and the same per-ISA files.
#pragma once

#include <cstdint>
#include <optional>

namespace twinattn {

// A loop of `instructions` independent operations; returns the flop done.
using PeakLoop = int64_t (*)(int64_t instructions);

// `instructions` independent multiply-adds (16 accumulators, 12 on AVX2, rotated), returning
// the flop they did: FMA on 16 floats (32 flop each), FMA on 8 floats (16), VDPBF16PS on 16 x 2
// bfloat16 pairs (64). Defined in the units of their instruction sets.
int64_t peak_fma32_avx512(int64_t instructions);
int64_t peak_fma32_avx2(int64_t instructions);
int64_t peak_bf16dot_avx512bf16(int64_t instructions);
// TDPBF16PS on 16 x 16 float tiles from 16 x 32 bfloat16 (16384 flop each; flash_amx.cpp).
int64_t peak_bf16tile_amxbf16(int64_t instructions);

// One core's VDPBF16PS flop rate over its float32 AVX-512 FMA rate, for dispatch.cpp's choice of
// the bfloat16 path (constants.hpp, "bfloat16 path choice"): on the calling thread, a warm-up
// call of each loop, then kBf16ChoiceRounds rounds that time kBf16ChoiceInstructions
// instructions of each in turn; the best rate of each (another process only ever slows a
// timing). Empty on a CPU (or build) without AVX512_BF16.
std::optional<double> measure_bf16dot_over_fma32();

// The loop of each: kAccumulators independent accumulators, acc[i] = init(i), each advanced by
// acc = step(acc) once per round until `instructions` are issued (whole rounds), then summed
// (add) and the sum's first lane kept (first_lane, into a volatile), so that the loop stays.
// Returns the instructions issued. Each unit instantiates it with its own lambdas, so no
// symbol is shared across instruction sets (ODR note in flash_kernel.hpp).
template <int kAccumulators, typename Init, typename Step, typename Add, typename FirstLane>
int64_t run_peak_loop(int64_t instructions, Init init, Step step, Add add, FirstLane first_lane) {
    static_assert(kAccumulators <= 16, "the unroll pragma below covers up to 16 accumulators");
    decltype(init(0)) acc[kAccumulators];
    for (int i = 0; i < kAccumulators; ++i) acc[i] = init(i);
    for (int64_t done = 0; done < instructions; done += kAccumulators)
#pragma GCC unroll 16
        for (int i = 0; i < kAccumulators; ++i) acc[i] = step(acc[i]);
    auto sum = acc[0];
    for (int i = 1; i < kAccumulators; ++i) sum = add(sum, acc[i]);
    volatile float sink = first_lane(sum);  // the loop's result is used
    (void)sink;
    return (instructions + kAccumulators - 1) / kAccumulators * kAccumulators;
}

}  // namespace twinattn
