// The inner products of the backward pass (flash_backward.cpp), written once over a vector type
// V (simd_*.hpp) and compiled once per instruction set by flash_{scalar,avx2,avx512,neon}.cpp
// through flash::make_kernels (the ODR note of flash_kernel.hpp applies: templates over V only,
// no standard container). Twin of rust/src/backward_kernel.rs.
//
// Both are outer-product forms (a broadcast times a vector of the other operand, accumulated
// in registers), so no element needs a horizontal sum, and every element's sum is one V::fma
// chain in a fixed order whatever the vector width:
//   panel_product: S = Q K^T and dP = dO V^T against a transposed key block (panel[d][key]);
//   accumulate:    dV += P^T dO, dK += dS^T Q (one key's row over the tile's rows) and
//                  dQ += dS K (one query row over the block's keys);
// and row_gradients, P and dS of one row, lane by lane. Both products are register-blocked:
// strips of rows (outputs) x vectors of columns held in registers, per step one broadcast per
// row and one load per vector of columns.
#pragma once

#include <cstdint>
#include <limits>

namespace twinattn {

// One panel product: out[r * out_stride + j] for r < rows, j < n (n a multiple of the vector
// width) = sum over d < depth, ascending, of a[r * depth + d] * panel[d * panel_stride + j]: one
// V::fma chain from 0 per element.
struct PanelProduct {
    const float* a;
    int64_t rows, depth;
    const float* panel;
    int64_t panel_stride, n;
    float* out;
    int64_t out_stride;
};

// One accumulation: for every output o < outputs, y[o * y_stride + (0, n)] += c * x[t * x_stride
// + (0, n)] for t < terms, ascending, c = coef[o * output_stride + t * coef_stride], skipping every
// term whose gate (same index) is 0 (a hidden key: its x is never read): one V::fma chain per
// element, starting from y. gate null: every term counts (the caller has checked that no gate is
// 0), and the outputs run in register blocks with no test per term.
struct Accumulation {
    float* y;
    int64_t y_stride, outputs, n;
    const float* coef;
    const float* gate;
    int64_t coef_stride, output_stride;
    const float* x;
    int64_t x_stride, terms;
};

// P and scale dS of one row's n keys (n a multiple of the vector width), in place: probs holds S
// (base 2) and becomes P = V::exp2(S multiplier - lse) (multiplier 1 where S is already scaled:
// the same bits as without it); grads holds dP and becomes P (dP - delta), times 1 - t^2
// (t = capped[j]) when capped is not null, times scale; 0 where P is 0 (a hidden key: its dP is
// never used). Returns how many of the first `counted` (<= n) P are 0.
struct RowGradients {
    float* probs;
    float* grads;
    const float* capped;
    int64_t n;
    float lse, delta, scale, multiplier;
    int64_t counted;
};

using PanelProductFn = void (*)(const PanelProduct&);
using AccumulateFn = void (*)(const Accumulation&);
using RowGradientsFn = int64_t (*)(const RowGradients&);

// One tile product of bfloat16 pairs (the bfloat16 tile path of flash_backward.cpp, amxbf16):
// C (float32) = A B, or C += A B when accumulate, over `rows` rows of A (rounded up to 16) and
// `columns` column tiles of 16 floats: A rows of `chunks` x 16 pairs (a pair: two bfloat16 of
// the summed axis, the lower index in the low half), B rows of pairs, one per 16-pair chunk row
// (chunks x 16 of them), C rows of floats. Strides in bytes. The tiles' order and rounding are
// flash_amx.cpp's (the same in Rust).
struct TileProduct {
    const void* a;
    int64_t a_stride, rows;
    const void* b;
    int64_t b_stride, columns, chunks;
    void* c;
    int64_t c_stride;
    bool accumulate;
};

// One query tile's P or scale dS (src: rows of src_stride floats, n floats each, n a multiple of
// 16) rounded to bfloat16 (nearest even, VCVTNE2PS2BF16, as the forward's P), rows past `rows`
// up to rows_padded (even) as 0:
//   pairs (B of dV^T += dO^T P and dK^T += Q^T dS): pairs[(r / 2) * stride + j] = (src[r][j],
//     src[r + 1][j]), the lower row in the low half;
//   rows, when not null (A of dQ += dS K): rows[r * stride + j] = src[r][j] (so its consecutive
//     pairs are pairs of keys).
struct TileRounding {
    const float* src;
    int64_t src_stride, rows, rows_padded, n;
    uint32_t* pairs;
    uint16_t* rows_out;
    int64_t stride;
};

// The tile products of the backward's bfloat16 tile path: begin() before a work item's
// products on the calling thread (the tile configuration), end() after them; round() the
// roundings of P and dS. All null on every instruction set but amxbf16 (flash_amx.cpp).
using TileBeginFn = void (*)();
using TileProductFn = void (*)(const TileProduct&);
using TileRoundFn = void (*)(const TileRounding&);
using TileEndFn = void (*)();

struct BackwardTiles {
    TileBeginFn begin;
    TileProductFn product;
    TileRoundFn round;
    TileEndFn end;
};

struct BackwardKernels {
    PanelProductFn panel_product;
    AccumulateFn accumulate;
    RowGradientsFn row_gradients;
    BackwardTiles tiles;
};

namespace backward {

template <class V>
struct Ops {
    using Reg = typename V::Reg;
    static constexpr int64_t W = V::kWidth;
    // Register blocks, rows x vectors of accumulators: 6 x 4 (24 of AVX-512's 32 registers), 6 x 2
    // with 16 registers (AVX2; NEON and the scalar type alike), for panel_product's strips and
    // the ungated accumulate's blocks; the gated accumulate's chunks hold kAccumulators vectors.
    static constexpr int kStripRows = 6;
    static constexpr int strip_vectors() { return W >= 16 ? 4 : 2; }
    static constexpr int kAccumulators = W >= 16 ? 16 : 8;
    // The `#pragma GCC unroll` on every loop over a register block's rows or vectors (as
    // flash_kernel.hpp's micro-kernels): unrolled that early, GCC keeps the block in registers;
    // without them it copied every accumulator through the stack before and after each strip's
    // loop (77-79 stack accesses per 6 x 4 block on AVX-512; rustc/LLVM never did).

    // R rows x NV vectors: rows [r, r + R), the columns from j.
    template <int R, int NV>
    static void product_strip(const PanelProduct& p, int64_t r, int64_t j) {
        const float* a = p.a + r * p.depth;
        Reg acc[R][NV];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) acc[i][c] = V::zero();
        for (int64_t d = 0; d < p.depth; ++d) {
            Reg column[NV];
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) column[c] = V::load(p.panel + d * p.panel_stride + j + c * W);
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                const Reg x = V::broadcast(a[i * p.depth + d]);
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) acc[i][c] = V::fma(x, column[c], acc[i][c]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) V::store(p.out + (r + i) * p.out_stride + j + c * W, acc[i][c]);
    }

    // Rows [r, r + R), all n columns: strips of strip_vectors() vectors, then the remaining ones.
    template <int R>
    static void product_rows(const PanelProduct& p, int64_t r) {
        constexpr int kVectors = strip_vectors();
        int64_t j = 0;
        for (; j + kVectors * W <= p.n; j += kVectors * W) product_strip<R, kVectors>(p, r, j);
        switch ((p.n - j) / W) {
            case 3: product_strip<R, 3>(p, r, j); break;
            case 2: product_strip<R, 2>(p, r, j); break;
            case 1: product_strip<R, 1>(p, r, j); break;
            default: break;
        }
    }

    // Strips of kStripRows rows, then one strip of the 1-5 rows left.
    static void panel_product(const PanelProduct& p) {
        int64_t r = 0;
        for (; r + kStripRows <= p.rows; r += kStripRows) product_rows<kStripRows>(p, r);
        switch (p.rows - r) {
            case 5: product_rows<5>(p, r); break;
            case 4: product_rows<4>(p, r); break;
            case 3: product_rows<3>(p, r); break;
            case 2: product_rows<2>(p, r); break;
            case 1: product_rows<1>(p, r); break;
            default: break;
        }
    }

    // Outputs [o, o + O) (sharing each x load), NV vectors of columns from d each: acc = y, then
    // for every term whose gate of that output is nonzero (every term when not kGated),
    // acc = V::fma(coef, x_t, acc). A term that counts for all O outputs: one load per vector
    // and one broadcast per output.
    template <int O, int NV, bool kGated>
    static void accumulate_chunk(const Accumulation& a, int64_t o, int64_t d) {
        float* y = a.y + o * a.y_stride + d;
        const auto at = [&](int64_t t, int i) { return (o + i) * a.output_stride + t * a.coef_stride; };
        Reg acc[O][NV];
#pragma GCC unroll 8
        for (int i = 0; i < O; ++i)
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) acc[i][c] = V::load(y + i * a.y_stride + c * W);
        for (int64_t t = 0; t < a.terms; ++t) {
            const float* x_row = a.x + t * a.x_stride + d;
            if constexpr (kGated) {
                bool live[O];
                bool all = true;
#pragma GCC unroll 8
                for (int i = 0; i < O; ++i) {
                    live[i] = a.gate[at(t, i)] != 0.0f;
                    all = all && live[i];
                }
                if (!all) {  // only the live outputs (none: the term is skipped)
#pragma GCC unroll 8
                    for (int i = 0; i < O; ++i) {
                        if (!live[i]) continue;
                        const Reg factor = V::broadcast(a.coef[at(t, i)]);
#pragma GCC unroll 16
                        for (int c = 0; c < NV; ++c) acc[i][c] = V::fma(factor, V::load(x_row + c * W), acc[i][c]);
                    }
                    continue;
                }
            }
            Reg column[NV];
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) column[c] = V::load(x_row + c * W);
#pragma GCC unroll 8
            for (int i = 0; i < O; ++i) {
                const Reg factor = V::broadcast(a.coef[at(t, i)]);
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) acc[i][c] = V::fma(factor, column[c], acc[i][c]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < O; ++i)
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) V::store(y + i * a.y_stride + c * W, acc[i][c]);
    }

    // Output o's columns [d, n), n - d < W (gated unless gate is null).
    static void accumulate_tail(const Accumulation& a, int64_t o, int64_t d) {
        const int64_t n = a.n - d;
        float* y = a.y + o * a.y_stride + d;
        Reg acc = V::load_tail(y, n);
        for (int64_t t = 0; t < a.terms; ++t) {
            const int64_t at = o * a.output_stride + t * a.coef_stride;
            if (a.gate != nullptr && a.gate[at] == 0.0f) continue;
            acc = V::fma(V::broadcast(a.coef[at]), V::load_tail(a.x + t * a.x_stride + d, n), acc);
        }
        V::store_tail(y, acc, n);
    }

    // Outputs [o, o + O), columns [0, n): chunks of kChunk vectors, then 8, 4, 2 and 1 vectors
    // (those below the chunk), then each output's tail.
    template <int O, int kChunk, bool kGated>
    static void accumulate_columns(const Accumulation& a, int64_t o) {
        int64_t d = 0;
        for (; d + kChunk * W <= a.n; d += kChunk * W) accumulate_chunk<O, kChunk, kGated>(a, o, d);
        if constexpr (kChunk > 8) {
            if (d + 8 * W <= a.n) {
                accumulate_chunk<O, 8, kGated>(a, o, d);
                d += 8 * W;
            }
        }
        if constexpr (kChunk > 4) {
            if (d + 4 * W <= a.n) {
                accumulate_chunk<O, 4, kGated>(a, o, d);
                d += 4 * W;
            }
        }
        if constexpr (kChunk > 2) {
            if (d + 2 * W <= a.n) {
                accumulate_chunk<O, 2, kGated>(a, o, d);
                d += 2 * W;
            }
        }
        if constexpr (kChunk > 1) {
            if (d + W <= a.n) {
                accumulate_chunk<O, 1, kGated>(a, o, d);
                d += W;
            }
        }
        if (d < a.n)
#pragma GCC unroll 8
            for (int i = 0; i < O; ++i) accumulate_tail(a, o + i, d);
    }

    // Ungated (gate null): blocks of kStripRows outputs x strip_vectors() vectors first. Then
    // (every output when gated) outputs in pairs, each x load serving two, and the last one alone.
    template <bool kGated>
    static void accumulate_outputs(const Accumulation& a) {
        int64_t o = 0;
        if constexpr (!kGated)
            for (; o + kStripRows <= a.outputs; o += kStripRows)
                accumulate_columns<kStripRows, strip_vectors(), false>(a, o);
        for (; o + 2 <= a.outputs; o += 2) accumulate_columns<2, kAccumulators / 2, kGated>(a, o);
        if (o < a.outputs) accumulate_columns<1, kAccumulators, kGated>(a, o);
    }

    // See Accumulation: accumulate_outputs, gated unless gate is null.
    static void accumulate(const Accumulation& a) {
        if (a.gate == nullptr)
            accumulate_outputs<false>(a);
        else
            accumulate_outputs<true>(a);
    }

    static int64_t row_gradients(const RowGradients& g) {
        const Reg row_lse = V::broadcast(g.lse), row_delta = V::broadcast(g.delta), factor = V::broadcast(g.scale);
        const Reg multiplier = V::broadcast(g.multiplier);
        const Reg one = V::broadcast(1.0f), zero = V::zero();
        // P < the smallest subnormal: P is 0 (P >= 0; a NaN P is not counted, as P == 0 says)
        const Reg smallest = V::broadcast(std::numeric_limits<float>::denorm_min());
        const int64_t whole = g.counted / W * W;  // the counted keys of whole vectors
        Reg zeros = V::zero();
        for (int64_t j = 0; j < g.n; j += W) {
            const Reg prob = V::exp2(V::sub(V::mul(V::load(g.probs + j), multiplier), row_lse));
            Reg ds = V::mul(prob, V::sub(V::load(g.grads + j), row_delta));
            if (g.capped != nullptr) {
                const Reg t = V::load(g.capped + j);
                ds = V::mul(ds, V::sub(one, V::mul(t, t)));
            }
            V::store(g.probs + j, prob);
            // 0 < P ? scale dS : P (0, or a NaN P's NaN)
            V::store(g.grads + j, V::select_less(zero, prob, V::mul(ds, factor), prob));
            if (j < whole) zeros = V::add(zeros, V::select_less(prob, smallest, one, zero));
        }
        int64_t count = static_cast<int64_t>(V::reduce_sum(zeros));  // whole numbers below 2^24: exact
        for (int64_t j = whole; j < g.counted; ++j) count += g.probs[j] == 0.0f ? 1 : 0;
        return count;
    }
};

template <class V>
BackwardKernels make_backward_kernels() {
    return BackwardKernels{Ops<V>::panel_product, Ops<V>::accumulate, Ops<V>::row_gradients, BackwardTiles{}};
}

}  // namespace backward
}  // namespace twinattn
