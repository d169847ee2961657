// The "avx512bf16" instruction set (docs/kernels.md, "Reduced precision"): AVX-512F plus
// AVX512_BF16's VDPBF16PS for bfloat16 prefill. Compile flags of this translation unit:
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c (cpp/CMakeLists.txt).
//
// float32 and float16 problems run the avx512 kernels themselves (dispatch.cpp copies their
// table entries), and so do the bfloat16 split-key items: the convert path, here compiled with
// its own vector type (VecAvx512Bf16, ODR note in simd_avx512.hpp), same source, same results.
// bfloat16 prefill (plan.packed_keys != nullptr) computes S = Q K^T and O += P V by dot products
// of bfloat16 pairs, accumulated in float32:
//   K pair panels, per panel of kKeyPanel keys: [D2][kKeyPanel] 32-bit pairs, D2 = ceil(D / 2);
//     pair (d2, key) = (K[key][2 d2], K[key][2 d2 + 1]), low half the even d; an odd D pads the
//     last pair's high half with 0; keys past the end are 0.
//   Q tile: each row's raw bfloat16 q as D2 pairs (padded like K), not scaled.
//   S micro-kernel (6 rows x 2 vectors of 16 keys): acc = 0; for d2 in order:
//     acc = vdpbf16ps(acc, broadcast(q pair (r, d2)), panel vector at d2); S = acc * q_multiplier.
//   softcap, mask, online softmax: the float32 kernel's (P float32; l sums the float32 P).
//   P rounded to bfloat16 pairs (vcvtne2ps2bf16, nearest even) into probs_pairs (rows,
//     kKeyBlock / 2): pair kp = (P[2 kp], P[2 kp + 1]); the pad key of an odd n has P = 0.
//   V pair rows, per key pair kp: value_stride (Dv rounded up to 16) pairs, pair (kp, c) =
//     (V[2 kp][c], V[2 kp + 1][c]); columns past Dv and keys past the end are 0.
//   P.V micro-kernel (6 rows x 4 vectors of 16 columns, then single vectors up to value_stride):
//     acc = O (times alpha when a row rescales); for kp in order:
//     acc = vdpbf16ps(acc, broadcast(P pair (r, kp)), V vector at kp).
//   A dot product adds 0 * NaN for a key that P weights 0, so a block takes the convert path's
//   value_micro<kSafe = true> for its P.V instead (V read in place, converted; float32 P) when
//   (a) it is masked (crosses a row's visible range, or a mask is given: kSafe in the float32
//       kernel) or n is odd (its last pair's second key, key_block + n, is outside the block:
//       not visible, or the zero pad past the packed keys), and
//   (b) a V value of the keys [key_block, key_block + n rounded up to even) is non-finite,
//       decided from value_finite (one flag per key, recorded while packing; the zero pad key of
//       an odd packed range counts as finite).
//   (The Rust twin makes the same decision with the same key range.)
// VDPBF16PS treats bfloat16 subnormal inputs as zero and flushes subnormal results to zero (the
// instruction's fixed behaviour, MXCSR notwithstanding): accepted, and the same in both ports.
#include "flash_bf16_pairs.hpp"
#include "measure_peak.hpp"

namespace twinattn {
namespace {

using DotKernel = PairKernel<VecAvx512Bf16, DotProducts>;

}  // namespace

// float32 and float16 entries are replaced by the avx512 kernels' in dispatch.cpp; the bfloat16
// ones are this unit's (dot products for prefill, the convert path otherwise).
FlashKernels flash_kernels_avx512bf16() {
    FlashKernels kernels = flash::make_kernels<VecAvx512Bf16>();
    kernels.attend_rows[static_cast<int>(ElementType::BFloat16)] = DotKernel::attend_rows;
    kernels.pack_pairs = DotKernel::pack_pairs;
    return kernels;
}

// measure_peak (measure_peak.hpp): 16 independent accumulators, each acc += a . b over pairs of
// small bfloat16 values (2^-10: the sums grow by 2^-19 per instruction, never near overflow).
int64_t peak_bf16dot_avx512bf16(int64_t instructions) {
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3a803a80));  // (2^-10, 2^-10)
    const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3a803a80));
    return 64 * run_peak_loop<16>(
                    instructions, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); },
                    [a, b](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); },
                    [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); },
                    [](__m512 x) { return _mm512_cvtss_f32(x); });
}

}  // namespace twinattn
