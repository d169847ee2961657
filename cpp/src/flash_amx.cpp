// The "amxbf16" instruction set (docs/kernels.md, "Reduced precision"): avx512bf16 plus AMX-TILE
// and AMX-BF16, whose TDPBF16PS multiplies bfloat16 pair tiles into float32 tiles, for bfloat16
// prefill. Compile flags of this translation unit: those of flash_avx512bf16.cpp plus -mamx-tile
// -mamx-bf16 (cpp/CMakeLists.txt).
//
// Everything but bfloat16 prefill is avx512bf16's (dispatch.cpp copies its table); the convert
// path's kernel here, for split-key items and unsafe blocks, has its own vector type
// (VecAvx512Amx, ODR note in simd_avx512.hpp), the same source and results. bfloat16
// prefill is the dot path (flash_bf16_pairs.hpp: the same K pair panels, raw Q pairs, P rounded
// to bfloat16 pairs, V pair rows, the same masking and softmax) with its two products on tiles.
// Every tile is 16 rows x 64 bytes (palette 1, tmm0-7; LDTILECFG at the start of a work item,
// TILERELEASE at its end); C(i, j) = tmm(2 i + j), A(i) = tmm(4 + i), B(j) = tmm(6 + j):
//   S: A = 16 Q pair rows x 16 pairs of D (row stride D2 pairs), B = 16 pairs of D x 16 keys of a
//     K pair panel (row stride kKeyPanel pairs: the panel layout is already the B tile's), C =
//     16 rows x 16 keys of scores. Per 2 (or 1) row tiles and per K panel (its 2 key tiles):
//     C = 0; for each 16 pairs of D in order: load A, B, then C(i, j) += A(i) B(j) in the order
//     (0,0) (0,1) (1,0) (1,1); store C; then S = C * q_multiplier in float32 (rows < `rows`).
//     Whole panels: keys up to n rounded up to kKeyPanel.
//   P.V: rows whose alpha is not 1 are rescaled in memory first (O *= alpha, AVX-512). A = 16 P
//     pair rows x 16 key pairs, B = 16 key pairs x 16 columns of the V pair rows (row stride
//     value_stride pairs), C = 16 rows x 16 columns of O, loaded from O and stored back. Per 2 (or
//     1) row tiles and per 2 (or 1) column tiles: for each 16 key pairs in order: as S.
//     Key pairs up to n rounded up to 32 keys (kKeyGranule): P is 0 past n (round_probs writes
//     whole 32-key groups), the V pairs past the packed keys are zero (the packing pads to 32),
//     and a block whose P.V could meet a non-finite V at a key of weight 0 (masked, or n not a
//     multiple of 32) takes the convert path's safe P.V, as the dot path decides for its pairs.
//   Rows past `rows` (up to 16 per tile) are computed and ignored: Q pad rows are zero, the P and
//   O rows there are scratch.
// Needs D a multiple of 32 (whole tiles of D); other D run the dot path (the same packing).
// TDPBF16PS treats bfloat16 subnormal inputs as zero and flushes subnormal results (fixed, as
// VDPBF16PS): accepted, and the same in both ports. The Rust twin issues the same tile
// instructions in the same order (inline asm), so the ports agree bit for bit.
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "flash_bf16_pairs.hpp"
#include "measure_peak.hpp"

namespace twinattn {
namespace {

constexpr int kTileBytes = 64;  // bytes per tile row: 16 pairs of bfloat16, or 16 floats
constexpr int kTileRows = 16;

// LDTILECFG's 64-byte operand: palette 1, tiles 0-7 of 16 rows x 64 bytes.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

TileConfig tile_config() {
    TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = kTileBytes;
        config.rows[t] = kTileRows;
    }
    return config;
}

// C(i, j) (+)= sum over `chunks` steps of A(i) B(j): RT row tiles (A rows 16 apart) by CT column
// tiles (B and C 64 bytes apart); step k reads A at +64 k bytes and B at +16 k rows. C starts at
// zero or at c (accumulate). Strides in bytes.
template <int RT, int CT>
void tile_product(const char* a, int64_t a_stride, const char* b, int64_t b_stride, int64_t chunks, char* c,
                  int64_t c_stride, bool accumulate) {
    if (accumulate) {
        _tile_loadd(0, c, c_stride);
        if (CT == 2) _tile_loadd(1, c + kTileBytes, c_stride);
        if (RT == 2) _tile_loadd(2, c + kTileRows * c_stride, c_stride);
        if (RT == 2 && CT == 2) _tile_loadd(3, c + kTileRows * c_stride + kTileBytes, c_stride);
    } else {
        _tile_zero(0);
        if (CT == 2) _tile_zero(1);
        if (RT == 2) _tile_zero(2);
        if (RT == 2 && CT == 2) _tile_zero(3);
    }
    for (int64_t k = 0; k < chunks; ++k) {
        _tile_loadd(4, a + k * kTileBytes, a_stride);
        if (RT == 2) _tile_loadd(5, a + kTileRows * a_stride + k * kTileBytes, a_stride);
        _tile_loadd(6, b + k * kTileRows * b_stride, b_stride);
        if (CT == 2) _tile_loadd(7, b + k * kTileRows * b_stride + kTileBytes, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (CT == 2) _tile_dpbf16ps(1, 4, 7);
        if (RT == 2) _tile_dpbf16ps(2, 5, 6);
        if (RT == 2 && CT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, c_stride);
    if (CT == 2) _tile_stored(1, c + kTileBytes, c_stride);
    if (RT == 2) _tile_stored(2, c + kTileRows * c_stride, c_stride);
    if (RT == 2 && CT == 2) _tile_stored(3, c + kTileRows * c_stride + kTileBytes, c_stride);
}

// C = A B over row tiles of `rows` (2 at a time, then 1) and `columns` column tiles (2 at a time,
// then 1): A's row tile t at a + 16 t a_stride, B's column tile u at b + 64 u, C's (t, u) at c +
// 16 t c_stride + 64 u.
void tile_products(const void* a, int64_t a_stride, int64_t rows, const void* b, int64_t b_stride, int64_t columns,
                   int64_t chunks, void* c, int64_t c_stride, bool accumulate) {
    const char* a_bytes = static_cast<const char*>(a);
    const char* b_bytes = static_cast<const char*>(b);
    char* c_bytes = static_cast<char*>(c);
    using TileProductFn = void (*)(const char*, int64_t, const char*, int64_t, int64_t, char*, int64_t, bool);
    static constexpr TileProductFn kBlocks[2][2] = {{tile_product<1, 1>, tile_product<1, 2>},
                                                    {tile_product<2, 1>, tile_product<2, 2>}};
    const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
    for (int64_t t = 0; t < row_tiles; t += 2) {
        const bool two_rows = t + 2 <= row_tiles;
        for (int64_t u = 0; u < columns; u += 2) {
            const bool two_columns = u + 2 <= columns;
            kBlocks[two_rows][two_columns](a_bytes + t * kTileRows * a_stride, a_stride, b_bytes + u * kTileBytes,
                                           b_stride, chunks, c_bytes + t * kTileRows * c_stride + u * kTileBytes,
                                           c_stride, accumulate);
        }
    }
}

// The tile configuration on the calling thread, before a work item's products; released after.
void begin_tiles() {
    static const TileConfig config = tile_config();
    _tile_loadconfig(&config);
}

void end_tiles() { _tile_release(); }

struct AmxProducts {
    static constexpr int64_t kKeyGranule = 32;
    static constexpr int64_t kRowGranule = kTileRows;

    static void begin_item() { begin_tiles(); }
    static void end_item() { end_tiles(); }

    static void block_scores(const uint32_t* q_pairs, int64_t D2, int64_t rows, const uint32_t* panels, int64_t n,
                             float* scores, float q_multiplier) {
        const int64_t panel_count = (n + kKeyPanel - 1) / kKeyPanel;
        const int64_t panel_pairs = D2 * kKeyPanel;
        for (int64_t panel = 0; panel < panel_count; ++panel)
            tile_products(q_pairs, D2 * 4, rows, panels + panel * panel_pairs, kKeyPanel * 4, kKeyPanel / 16,
                          D2 / 16, scores + panel * kKeyPanel, kKeyBlock * 4, false);
        const __m512 multiplier = _mm512_set1_ps(q_multiplier);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < panel_count * kKeyPanel; j += 16) {
                float* s = scores + r * kKeyBlock + j;
                _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_loadu_ps(s), multiplier));
            }
    }

    static void block_values(const uint32_t* probs_pairs, int64_t rows, int64_t pairs, const uint32_t* v_pairs,
                             int64_t value_stride, float* out_acc, const float* rescale) {
        for (int64_t r = 0; r < rows; ++r) {
            if (rescale[r] == 1.0f) continue;
            const __m512 alpha = _mm512_set1_ps(rescale[r]);
            for (int64_t c = 0; c < value_stride; c += 16) {
                float* o = out_acc + r * value_stride + c;
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
            }
        }
        tile_products(probs_pairs, kPairsPerBlock * 4, rows, v_pairs, value_stride * 4, value_stride / 16,
                      pairs / 16, out_acc, value_stride * 4, true);
    }
};

using AmxKernel = PairKernel<VecAvx512Amx, AmxProducts>;
using DotKernel = PairKernel<VecAvx512Amx, DotProducts>;

// D a multiple of 32 takes the tiles; any other D the dot path (the packing is the same).
void attend_rows(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s) {
    if (plan.head_dim % 32 == 0) return AmxKernel::attend_rows(plan, item, s);
    DotKernel::attend_rows(plan, item, s);
}

void backward_tile_product(const TileProduct& t) {
    tile_products(t.a, t.a_stride, t.rows, t.b, t.b_stride, t.columns, t.chunks, t.c, t.c_stride, t.accumulate);
}

}  // namespace

// The backward's bfloat16 tile products and roundings (backward_kernel.hpp, BackwardTiles):
// tile_products, as prefill runs them.
BackwardTiles backward_tiles_amxbf16() {
    return BackwardTiles{begin_tiles, backward_tile_product, backward_round_pairs, end_tiles};
}

// avx512bf16's kernels, with bfloat16 prefill on tiles (dispatch.cpp copies the rest of the table
// from the avx512 kernels, as for avx512bf16).
FlashKernels flash_kernels_amxbf16() {
    FlashKernels kernels = flash_kernels_avx512bf16();
    kernels.attend_rows[static_cast<int>(ElementType::BFloat16)] = attend_rows;
    kernels.pack_pairs = AmxKernel::pack_pairs;
    return kernels;
}

// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and the OS lets
// this process use the tile data (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// asked once; the permission then holds for every thread of the process).
bool amx_bf16_usable() {
#if defined(__linux__)
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (((edx >> 24) & 1u) == 0 || ((edx >> 22) & 1u) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
}

// measure_peak (measure_peak.hpp): TDPBF16PS on 4 independent accumulator tiles of 16 x 16
// floats, each step C += A B over 16 x 32 bfloat16 of small values (2^-10: the sums grow by 2^-15
// per instruction, never near overflow): 16 x 16 x 32 multiply-adds, 16384 flop, per instruction.
int64_t peak_bf16tile_amxbf16(int64_t instructions) {
    static const TileConfig config = tile_config();
    alignas(64) uint32_t operand[kTileRows * 16];
    alignas(64) float result[kTileRows * 16];
    for (uint32_t& pair : operand) pair = 0x3a803a80u;  // (2^-10, 2^-10)
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, operand, kTileBytes);
    _tile_loadd(6, operand, kTileBytes);
    int64_t done = 0;
    for (; done < instructions; done += 4) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, result, kTileBytes);
    _tile_release();
    volatile float sink = result[0];  // the loop's result is used
    (void)sink;
    return 16384 * done;
}

}  // namespace twinattn
