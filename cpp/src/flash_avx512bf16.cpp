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
#include <cstring>

#include "flash_bf16_pairs.hpp"
#include "measure_peak.hpp"

namespace twinattn {
namespace {

using DotKernel = PairKernel<VecAvx512Bf16, DotProducts>;

// ---- The backward's bfloat16 pair products on VDPBF16PS (backward_kernel.hpp, TileProduct) ----
// The tile path of flash_backward.cpp without tiles: the same operands, each C element one
// float32 chain, acc = C (accumulate) or 0, then acc = vdpbf16ps(acc, A pair (r, k), B pair (k,
// column)) for k = 0 .. 16 chunks - 1 in order. Register blocks of R rows x CV vectors of 16
// columns (6 x 4: 24 accumulators), per pair step CV loads of B and R broadcasts of A; the
// blocking is invisible in the results (each element's chain is the same).
template <int R, int CV>
void dot_block(const char* a, int64_t a_stride, const char* b, int64_t b_stride, int64_t steps, char* c,
               int64_t c_stride, bool accumulate) {
    __m512 acc[R][CV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v)
            acc[r][v] = accumulate ? _mm512_loadu_ps(reinterpret_cast<const float*>(c + r * c_stride) + v * 16)
                                   : _mm512_setzero_ps();
    for (int64_t k = 0; k < steps; ++k) {
        __m512bh pairs[CV];
        const char* b_row = b + k * b_stride;
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v) pairs[v] = DotProducts::as_pairs(_mm512_loadu_si512(b_row + v * 64));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            std::memcpy(&pair, a + r * a_stride + k * 4, 4);
            const __m512bh a_pair = DotProducts::as_pairs(DotProducts::broadcast_pair(pair));
#pragma GCC unroll 4
            for (int v = 0; v < CV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a_pair, pairs[v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < CV; ++v) _mm512_storeu_ps(reinterpret_cast<float*>(c + r * c_stride) + v * 16, acc[r][v]);
}

template <int R>
void dot_strip(const char* a, int64_t a_stride, const char* b, int64_t b_stride, int64_t columns, int64_t steps,
               char* c, int64_t c_stride, bool accumulate) {
    int64_t u = 0;
    for (; u + 4 <= columns; u += 4)
        dot_block<R, 4>(a, a_stride, b + u * 64, b_stride, steps, c + u * 64, c_stride, accumulate);
    switch (columns - u) {
        case 1: dot_block<R, 1>(a, a_stride, b + u * 64, b_stride, steps, c + u * 64, c_stride, accumulate); break;
        case 2: dot_block<R, 2>(a, a_stride, b + u * 64, b_stride, steps, c + u * 64, c_stride, accumulate); break;
        case 3: dot_block<R, 3>(a, a_stride, b + u * 64, b_stride, steps, c + u * 64, c_stride, accumulate); break;
        default: break;
    }
}

// TileProduct on VDPBF16PS: the rows rounded up to 16 (as the tiles compute them), in strips of
// kMicroRows.
void backward_dot_product(const TileProduct& t) {
    static_assert(kMicroRows == 6, "the switch below lists the strip heights 1..kMicroRows");
    const char* a = static_cast<const char*>(t.a);
    const char* b = static_cast<const char*>(t.b);
    char* c = static_cast<char*>(t.c);
    const int64_t rows = (t.rows + 15) / 16 * 16, steps = t.chunks * 16;
    for (int64_t r = 0; r < rows; r += kMicroRows) {
        const char* a_rows = a + r * t.a_stride;
        char* c_rows = c + r * t.c_stride;
        switch (rows - r < kMicroRows ? rows - r : kMicroRows) {
            case 1: dot_strip<1>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
            case 2: dot_strip<2>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
            case 3: dot_strip<3>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
            case 4: dot_strip<4>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
            case 5: dot_strip<5>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
            default: dot_strip<6>(a_rows, t.a_stride, b, t.b_stride, t.columns, steps, c_rows, t.c_stride, t.accumulate); break;
        }
    }
}

void no_tiles() {}

}  // namespace

// TileRounding (backward_kernel.hpp): per pair of rows and 16 keys, one VCVTNE2PS2BF16 (the even
// row's 16 in the low half), then the halves interleaved into pairs (VPERMW). Shared by the
// dot products below and amxbf16's tiles.
void backward_round_pairs(const TileRounding& t) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                             21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                             11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    for (int64_t r = 0; r < t.rows_padded; r += 2) {
        const float* even = t.src + r * t.src_stride;
        const float* odd = even + t.src_stride;
        for (int64_t j = 0; j < t.n; j += 16) {
            const __m512 low = r < t.rows ? _mm512_loadu_ps(even + j) : _mm512_setzero_ps();
            const __m512 high = r + 1 < t.rows ? _mm512_loadu_ps(odd + j) : _mm512_setzero_ps();
            const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
            _mm512_storeu_si512(t.pairs + r / 2 * t.stride + j, _mm512_permutexvar_epi16(interleave, rounded));
            if (t.rows_out == nullptr) continue;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.rows_out + r * t.stride + j),
                                _mm512_castsi512_si256(rounded));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.rows_out + (r + 1) * t.stride + j),
                                _mm512_extracti64x4_epi64(rounded, 1));
        }
    }
}

// The backward's bfloat16 pair products and roundings on avx512bf16 (no tile state to set up):
// flash_backward.cpp's tile path with VDPBF16PS for TDPBF16PS.
BackwardTiles backward_tiles_avx512bf16() {
    return BackwardTiles{no_tiles, backward_dot_product, backward_round_pairs, no_tiles};
}

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
