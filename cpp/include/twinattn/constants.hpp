// Every tuning number and polynomial coefficient of the fast kernels (docs/kernels.md, "Shared
// constants"). The Rust twin is rust/src/constants.rs: the same values under the same names in
// Rust's case (kKeyBlock <-> KEY_BLOCK). build_info()["constants"] reports them as snake_case
// keys (key_block), and a test checks that the two ports agree. Change both ports together.
#pragma once

#include <cstdint>

namespace twinattn {

// ---- Tiles ------------------------------------------------------------------------------------

// Packed query rows per prefill work item (one tile). A multiple of kMicroRows; 12 positions x 4
// heads for GQA 32/8. Groups with at most this many packed rows (rows_per_group = Lq * Hq / Hkv)
// take the split-key path instead.
constexpr int64_t kQTileRows = 48;
// Rows of the register-blocked micro-kernels (S = Q K^T and O += P V).
constexpr int64_t kMicroRows = 6;
// Keys per key block: one S block of kQTileRows x kKeyBlock scores, one online-softmax step.
constexpr int64_t kKeyBlock = 256;
// Keys per packed K^T panel: panel[d][key], kKeyPanel keys wide, D deep, zero-padded.
// A multiple of every vector width (16 floats for AVX-512, 8 for AVX2, NEON and the scalar type).
constexpr int64_t kKeyPanel = 32;
// Value columns per packed V panel (prefill): panel[key][column], kValuePanel columns wide, one
// row per key, zero-padded past Dv. A multiple of every P.V micro-kernel's columns (64 for
// AVX-512, 16 for AVX2, NEON and the scalar type), so a column block never straddles two panels.
constexpr int64_t kValuePanel = 64;
// Keys per split-key work item (decode and short chunks).
constexpr int64_t kSplitKeyChunk = 1024;
// The most bytes of packed K^T and V panels a prefill call keeps at once (flash_attention.cpp,
// step 2): the call packs and runs its (sequence, KV head) groups in waves, each as many groups as
// fit (at least one), so a long prefill holds a few heads' panels, not every head's (at N = 8192,
// D = 128, float32, a head's K and V panels take 8 MiB: two heads per wave, not the call's 64 MiB).
// A prefill of 32 / 8 heads at N = 2048 (2 MiB a head) is one wave.
constexpr int64_t kPrefillPackBytes = 16 << 20;

// Split-key groups with at most this many packed rows (decode, and GQA 32/8 chunks of up to 6
// queries) compute S directly from the K rows in place (no K^T panels): vectorised over D, one
// accumulator per (row, key), 4 keys at a time, reduced to one vector of scores per row
// (docs/kernels.md, step 6). Measured (AVX-512, 2 threads, G = 4, D = 128, direct vs panels):
// 32k keys, 12 rows 14.4 vs 20.0 ms, 16 rows 19.6 vs 23.3, 24 rows 25.8 vs 29.1, 32 rows a tie
// (33.2 vs 33.4), 48 rows 46.4 vs 43.9; 16k keys, 28 rows 14.3 vs 15.0.
constexpr int64_t kDirectScoreRows = 24;

// How far ahead of its reads the direct split-key path prefetches (docs/kernels.md, step 6): an
// item reads each key block's K rows, then its V rows, then the next block's K rows, and while it
// reads one row it prefetches the row kDecodePrefetchBytes of K rows ahead in that order into L2
// (prefetcht2) and the row kDecodeNearPrefetchBytes ahead from there into L1 (prefetcht0); each
// at least one row, at most kKeyBlock. Measured (decode, 32k keys, G = 4, D = 128, two threads,
// CPU time on a loaded machine, alternating in one process; float32 / bfloat16 / float16 / int8
// GB/s, a plain read of 1 GiB 30-31): one prefetcht0 2048 bytes ahead (before) 21.1-22.6 /
// 18.5-19.5 / 17.7-18.9 / 14.6; prefetcht2 alone 2048 bytes ahead 23.7 / 20.2 / 20.3, 3072
// bytes 23.2-24.6 / 19.6-20.3 / 20.1-20.2 / 15.0, 16384 bytes 23.2 / 17.7; prefetcht2 3072
// and prefetcht0 512 bytes ahead 23.2-24.6 / 20.5-20.8 / 20.8 / 15.9.
constexpr int64_t kDecodePrefetchBytes = 3072;
// The read-ahead's distance into L1 (see kDecodePrefetchBytes).
constexpr int64_t kDecodeNearPrefetchBytes = 512;

// How far ahead in the packed K^T panels the S micro-kernel prefetches (docs/kernels.md, "What
// bounds prefill"): a strip of Q rows reads the block's panels as one stream from L2, and
// reading panel row d it prefetches the same columns this many bytes further on (16 panel rows
// of kKeyPanel floats). Measured (causal prefill N = 2048, 32 / 8 heads, D = 128, one thread,
// CPU time on a loaded machine, C++): no prefetch 397-484 ms, 512 bytes 368, 1024 bytes 357,
// 2048 bytes 339-352, 4096 bytes 350.
constexpr int64_t kScorePrefetchBytes = 2048;

// Keys per chunk of O += P V (docs/kernels.md, "What bounds prefill"): every strip of a tile
// runs over one chunk of the block's keys before the next chunk, so the chunk's V rows (32 KB
// at Dv = 128) are read from L1 by all strips but the first. Measured (as above, with the
// prefetch): one chunk of kKeyBlock keys 298-307 ms, 16 keys 304, 32 keys 291-301, 64 keys
// 287-288, 128 keys 309.
constexpr int64_t kValueKeyChunk = 64;

// Keys per key block of the backward pass (flash_backward.cpp): one item's dK and dV rows, and
// the keys each query tile recomputes P against at a time. Query tiles are kQTileRows packed
// rows, as the forward's.
constexpr int64_t kBackwardKeyBlock = 64;
// Packed query rows per query tile of the backward's bfloat16 tile path (amxbf16,
// flash_backward.cpp): dV += P^T dO and dK += dS^T Q sum over a tile's rows in chunks of 32 (16
// pairs of rows, one tile step), so this many rows load and store the float32 dK and dV tiles
// once per 3 steps.
constexpr int64_t kBackwardTileRows = 96;
// Query tiles whose dV += P^T dO and dK += dS^T Q the tile path sums at once (their P and dS
// pairs kept, up to kBackwardTileGroup kBackwardTileRows kBackwardKeyBlock x 4 bytes each), so
// the float32 dK and dV tiles are loaded and stored once per 3 kBackwardTileGroup steps; also the
// chunk of a head's rows that meets every key block in turn (its query side stays in L2).
constexpr int64_t kBackwardTileGroup = 4;
// Query tiles (kQTileRows packed rows each) per chunk of a head's rows in the backward's fused
// float32 pass (flash_backward.cpp, head_blocks): each chunk meets every key block in turn, its
// query side (2 KB per row at D = Dv = 128: 384 KB) kept in L2. float32 backward alone, N = 2048,
// 2 threads, Zen 5 (C++, best of 5 calls, each chunk size in its own process, two runs): chunks
// of 2 tiles 219-224 ms, 4 223-226, 6 232-236, 8 238-260, the whole head per key block 267-338.
constexpr int64_t kBackwardChunkTiles = 4;

static_assert(kQTileRows % kMicroRows == 0, "tiles are whole micro-kernel strips");
static_assert(kKeyBlock % kKeyPanel == 0, "key blocks are whole panels");
static_assert(kSplitKeyChunk % kKeyBlock == 0, "split-key chunks are whole key blocks");
static_assert(kDecodeNearPrefetchBytes <= kDecodePrefetchBytes, "key_rows holds the far read-ahead's rows");
static_assert(kBackwardKeyBlock <= kKeyBlock, "a backward key block fits the forward's score rows");
static_assert(kBackwardTileRows % 32 == 0, "backward tiles are whole pair chunks of rows");
static_assert(kBackwardKeyBlock % 32 == 0, "backward key blocks are whole pair chunks of keys");

// ---- Threads ----------------------------------------------------------------------------------
// How long a pool thread spins (checking for its next job, or the caller for the workers'
// reports) before it sleeps on a condition variable. Waking a sleeping thread costs tens of
// microseconds on these machines: decode at 1024 keys on 2 threads measured 156-170 us without
// spinning, 119-132 us with 100 us of spin. Short enough that an idle process stops using CPU
// at once, and that NumPy's own threads, which run right after a call, lose at most this much.
constexpr int64_t kPoolSpinMicroseconds = 100;
// A call whose work, B * Hq * Lq * Lk * (D + Dv) multiply-adds (causal masks not subtracted),
// is below this runs on the calling thread whatever num_threads says: handing a pool thread a
// few microseconds of work costs more than it saves, and a thread woken between the ops of a
// framework competes with that framework's own threads. One-token decode, 9 query / 3 KV heads,
// D 64, quiet machine, 1 vs 2 threads: 17 keys (work 19584) 6.9 vs 9.4 us, 256 keys (294912)
// 12.9 vs 13.4 us, 512 keys (589824) 15.8 vs 15.1 us, 1024 keys 36.2 vs 28.0 us; on a busy one
// 17 keys took 11 us on 1 thread, 308 us on 2. Results do not depend on the thread count.
constexpr int64_t kSerialWork = 1 << 19;

// ---- Register blocking per instruction set (vectors per micro-kernel row) ----------------------
// S micro-kernel: kMicroRows rows x (ScoreVectors x width) keys; P.V micro-kernel: kMicroRows
// rows x (ValueVectors x width) value columns.
//   AVX-512 (16 floats, 32 registers): 6 x 64 keys (24 accumulators; the 64 keys span two K^T
//   panels), 6 x 64 columns (24). S at 6 x 64 reads 10 vectors per 24 FMAs against 16 at 6 x 32:
//   causal prefill N = 2048, one thread, C++ alternating in one process, loaded machine: 263-276
//   ms against 278-293 (docs/kernels.md, "What bounds prefill").
//   AVX2 (8 floats, 16 registers):     6 x 16 keys (12 accumulators), 6 x 16 columns (12).
//   NEON (AArch64, 32 128-bit registers): a width-8 vector is two of them, so AVX2's blocking
//   fits: 6 x 16 keys = 24 accumulator registers + 4 for the keys + 1 broadcast; as AVX2.
//   scalar (a plain array of 8 floats, auto-vectorised where the compiler can): as AVX2.
constexpr int kAvx512ScoreVectors = 4;
constexpr int kAvx512ValueVectors = 4;
constexpr int kAvx2ScoreVectors = 2;
constexpr int kAvx2ValueVectors = 2;
constexpr int kNeonScoreVectors = 2;
constexpr int kNeonValueVectors = 2;
constexpr int kScalarWidth = 8;
constexpr int kScalarScoreVectors = 2;
constexpr int kScalarValueVectors = 2;
// Direct scores: rows per strip (each strip holds rows x 4 keys accumulators over the D loop).
//   AVX-512: 6 x 4 = 24 accumulators + 4 key vectors; AVX2: 2 x 4 = 8 + 4; NEON and scalar: as
//   AVX2.
constexpr int kAvx512DirectStripRows = 6;
constexpr int kAvx2DirectStripRows = 2;
constexpr int kNeonDirectStripRows = 2;
constexpr int kScalarDirectStripRows = 2;

// ---- exp2 ------------------------------------------------------------------------------------
// exp2(x) for x <= 0: x is clamped to >= kExp2Min, split as x = n + f with n = floor(x) and
// f in [0, 1); 2^f = c0 + c1 f + ... + c6 f^6 (Horner, float32 FMAs), then 2^n is added to the
// exponent bits. At x = kExp2Min, 2^n has a zero exponent field, so exp2(-inf) is exactly 0.
// Coefficients: a relative-error minimax fit of 2^f on [0, 1) (Lawson's algorithm, degree 6,
// rounded to float32); measured relative error in float32 Horner <= 8.4e-8 (about 1.4 ulp).
constexpr int kExp2Degree = 6;
constexpr float kExp2Coefficients[kExp2Degree + 1] = {
    1.0f, 0.693147004f, 0.24022983f, 0.0554833412f, 0.00967884064f, 0.00124396884f,
    0.000217022549f,
};
constexpr float kExp2Min = -127.0f;

// ---- tanh (softcap) ---------------------------------------------------------------------------
// tanh(x) for every float x, odd: with a = |x|,
//   a <= kTanhSmall: tanh(a) = a + a^3 P(a^2), P(u) = c0 + c1 u + ... + c5 u^5 (Horner, FMAs);
//   a >  kTanhSmall: tanh(a) = (1 - e) / (1 + e), e = exp2(-2 log2(e) a) (the exp2 above; e is
//                    exactly 0 once a > 44, so +-inf gives +-1);
// then the sign of x. A NaN takes the polynomial branch and stays NaN; denormals come out exact
// (a^3 underflows). Coefficients: a relative-error minimax fit of (tanh(a) - a) / a^3 on
// [0, 0.625] in u = a^2 (Lawson's algorithm, degree 5, rounded to float32). Measured relative
// error in float32 (both branches, against double tanh over 2e6 points): <= 7.6e-8 below
// kTanhSmall, <= 1.9e-7 (2 ulp) above it, where e's rounding is what remains.
constexpr int kTanhDegree = 5;
constexpr float kTanhCoefficients[kTanhDegree + 1] = {
    -0.333333313f, 0.133332014f, -0.0539462529f, 0.0216982849f, -0.00817208178f, 0.00213856110f,
};
constexpr float kTanhSmall = 0.625f;

// log2(e) (folded into Q with the scale) and ln(2) (lse = ln 2 * (m + log2 l)).
constexpr float kLog2E = 1.44269504088896340736f;
constexpr float kLn2 = 0.693147180559945309417f;


// ---- bfloat16 path choice (dispatch.cpp) --------------------------------------------------------
// On a CPU with AVX512_BF16, bfloat16 prefill can multiply by VDPBF16PS (the "dot" path, the
// avx512bf16 kernels) or widen bfloat16 to float32 and use FMA (the "convert" path, the avx512
// kernels; float32, float16 and int8 run the avx512 kernels either way). With no TWINATTN_ISA,
// the default is chosen once per process: kBf16ChoiceRounds alternating timings of
// kBf16ChoiceInstructions instructions of each peak loop (measure_peak.hpp) on the calling thread,
// the best rate of each, and the dot path only where one core's VDPBF16PS flop rate is at least
// kBf16DotMinRatio times its float32 FMA rate. Measured ratios: about 2.0 on AMD Zen 5 (dot path
// the faster), about 0.5 on an Intel Xeon with AMX (convert path 1.2-1.3x faster in causal
// prefill N=2048); the threshold sits a factor of 1.6 or more from both, and leans to the
// convert path (exact P) where the two units are about equally fast. A few milliseconds.
constexpr double kBf16DotMinRatio = 1.25;
constexpr int kBf16ChoiceRounds = 7;
constexpr int64_t kBf16ChoiceInstructions = int64_t{1} << 16;

}  // namespace twinattn
