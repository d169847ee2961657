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
// and row_gradients, P and dS of one row, lane by lane.
#pragma once

#include <cstdint>
#include <type_traits>

namespace twinattn {

// out[r * out_stride + j] for r < rows, j < n (n a multiple of the vector width) =
// sum over d < depth, ascending, of a[r * depth + d] * panel[d * panel_stride + j]: one V::fma
// chain from 0 per element.
using PanelProductFn = void (*)(const float* a, int64_t rows, int64_t depth, const float* panel,
                                int64_t panel_stride, int64_t n, float* out, int64_t out_stride);
// For every output o < outputs: y[o * y_stride + (0, n)] += c * x[t * x_stride + (0, n)] for
// t < terms, ascending, c = coef[o * output_stride + t * coef_stride], skipping every term whose
// gate (same index) is 0 (a hidden key: its x is never read): one V::fma chain per element,
// starting from y.
using AccumulateFn = void (*)(float* y, int64_t y_stride, int64_t outputs, int64_t n, const float* coef,
                              const float* gate, int64_t coef_stride, int64_t output_stride, const float* x,
                              int64_t x_stride, int64_t terms);

// P and scale dS of one row's n keys (n a multiple of the vector width), in place: probs holds S
// (base 2) and becomes P = V::exp2(S - lse); grads holds dP and becomes P (dP - delta), times
// 1 - t^2 (t = capped[j]) when capped is not null, times scale; 0 where P is 0 (a hidden key: its
// dP is never used).
using RowGradientsFn = void (*)(float* probs, float* grads, const float* capped, int64_t n, float lse, float delta,
                                float scale);

struct BackwardKernels {
    PanelProductFn panel_product;
    AccumulateFn accumulate;
    RowGradientsFn row_gradients;
};

namespace backward {

template <class V>
struct Ops {
    using Reg = typename V::Reg;
    static constexpr int64_t W = V::kWidth;
    // Rows of a panel_product strip, 4 x 4 vectors, and accumulators of an accumulate chunk: 16
    // vectors with 32 registers (AVX-512), 8 with 16 (AVX2; NEON and the scalar type alike).
    static constexpr int kStripRows = 4;
    static constexpr int kStripVectors = 4;
    static constexpr int kAccumulators = W >= 16 ? 16 : 8;

    // R rows x NV vectors of out.
    template <int R, int NV>
    static void product_strip(const float* a, int64_t depth, const float* panel, int64_t panel_stride, float* out,
                              int64_t out_stride) {
        Reg acc[R][NV];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < NV; ++c) acc[r][c] = V::zero();
        for (int64_t d = 0; d < depth; ++d) {
            Reg column[NV];
            for (int c = 0; c < NV; ++c) column[c] = V::load(panel + d * panel_stride + c * W);
            for (int r = 0; r < R; ++r) {
                const Reg x = V::broadcast(a[r * depth + d]);
                for (int c = 0; c < NV; ++c) acc[r][c] = V::fma(x, column[c], acc[r][c]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < NV; ++c) V::store(out + r * out_stride + c * W, acc[r][c]);
    }

    // R rows of out, all n columns: strips of kStripVectors vectors, then the remaining ones.
    template <int R>
    static void product_rows(const float* a, int64_t depth, const float* panel, int64_t panel_stride, int64_t n,
                             float* out, int64_t out_stride) {
        int64_t j = 0;
        for (; j + kStripVectors * W <= n; j += kStripVectors * W)
            product_strip<R, kStripVectors>(a, depth, panel + j, panel_stride, out + j, out_stride);
        switch ((n - j) / W) {
            case 3: product_strip<R, 3>(a, depth, panel + j, panel_stride, out + j, out_stride); break;
            case 2: product_strip<R, 2>(a, depth, panel + j, panel_stride, out + j, out_stride); break;
            case 1: product_strip<R, 1>(a, depth, panel + j, panel_stride, out + j, out_stride); break;
            default: break;
        }
    }

    static void panel_product(const float* a, int64_t rows, int64_t depth, const float* panel, int64_t panel_stride,
                              int64_t n, float* out, int64_t out_stride) {
        int64_t r = 0;
        for (; r + kStripRows <= rows; r += kStripRows)
            product_rows<kStripRows>(a + r * depth, depth, panel, panel_stride, n, out + r * out_stride, out_stride);
        for (; r < rows; ++r) product_rows<1>(a + r * depth, depth, panel, panel_stride, n, out + r * out_stride, out_stride);
    }

    // Outputs O (1 or 2, sharing each x load), NV vectors of columns each: acc[o] = y_o, then for
    // every term whose gate of output o is nonzero, acc[o] = V::fma(coef_o, x_t, acc[o]).
    template <int O, int NV>
    static void accumulate_chunk(float* y, int64_t y_stride, const float* coef, const float* gate, int64_t coef_stride,
                                 int64_t output_stride, const float* x, int64_t x_stride, int64_t terms) {
        Reg acc[O][NV];
        for (int o = 0; o < O; ++o)
            for (int c = 0; c < NV; ++c) acc[o][c] = V::load(y + o * y_stride + c * W);
        for (int64_t t = 0; t < terms; ++t) {
            bool live[O];
            bool all = true, any = false;
            for (int o = 0; o < O; ++o) {
                live[o] = gate[t * coef_stride + o * output_stride] != 0.0f;
                all = all && live[o];
                any = any || live[o];
            }
            if (!any) continue;
            const float* x_row = x + t * x_stride;
            if (all) {
                Reg factor[O];
                for (int o = 0; o < O; ++o) factor[o] = V::broadcast(coef[t * coef_stride + o * output_stride]);
                for (int c = 0; c < NV; ++c) {
                    const Reg column = V::load(x_row + c * W);
                    for (int o = 0; o < O; ++o) acc[o][c] = V::fma(factor[o], column, acc[o][c]);
                }
                continue;
            }
            for (int o = 0; o < O; ++o) {
                if (!live[o]) continue;
                const Reg factor = V::broadcast(coef[t * coef_stride + o * output_stride]);
                for (int c = 0; c < NV; ++c) acc[o][c] = V::fma(factor, V::load(x_row + c * W), acc[o][c]);
            }
        }
        for (int o = 0; o < O; ++o)
            for (int c = 0; c < NV; ++c) V::store(y + o * y_stride + c * W, acc[o][c]);
    }

    // One output's columns [0, n), n < W.
    static void accumulate_tail(float* y, int64_t n, const float* coef, const float* gate, int64_t coef_stride,
                                const float* x, int64_t x_stride, int64_t terms) {
        Reg acc = V::load_tail(y, n);
        for (int64_t t = 0; t < terms; ++t) {
            if (gate[t * coef_stride] == 0.0f) continue;
            acc = V::fma(V::broadcast(coef[t * coef_stride]), V::load_tail(x + t * x_stride, n), acc);
        }
        V::store_tail(y, acc, n);
    }

    // O outputs' columns [0, n): chunks of kAccumulators / O vectors, then 8, 4, 2 and 1 vectors
    // (those below the chunk), then each output's tail.
    template <int O>
    static void accumulate_columns(float* y, int64_t y_stride, int64_t n, const float* coef, const float* gate,
                                   int64_t coef_stride, int64_t output_stride, const float* x, int64_t x_stride,
                                   int64_t terms) {
        constexpr int kChunk = kAccumulators / O;
        int64_t d = 0;
        const auto step = [&](auto vectors) {
            constexpr int NV = decltype(vectors)::value;
            accumulate_chunk<O, NV>(y + d, y_stride, coef, gate, coef_stride, output_stride, x + d, x_stride, terms);
            d += NV * W;
        };
        while (d + kChunk * W <= n) step(std::integral_constant<int, kChunk>{});
        if constexpr (kChunk > 8) if (d + 8 * W <= n) step(std::integral_constant<int, 8>{});
        if constexpr (kChunk > 4) if (d + 4 * W <= n) step(std::integral_constant<int, 4>{});
        if constexpr (kChunk > 2) if (d + 2 * W <= n) step(std::integral_constant<int, 2>{});
        if constexpr (kChunk > 1) if (d + W <= n) step(std::integral_constant<int, 1>{});
        if (d < n)
            for (int o = 0; o < O; ++o)
                accumulate_tail(y + o * y_stride + d, n - d, coef + o * output_stride, gate + o * output_stride,
                                coef_stride, x + d, x_stride, terms);
    }

    // Outputs in pairs (each x load serving two), then the last one alone.
    static void accumulate(float* y, int64_t y_stride, int64_t outputs, int64_t n, const float* coef,
                           const float* gate, int64_t coef_stride, int64_t output_stride, const float* x,
                           int64_t x_stride, int64_t terms) {
        int64_t o = 0;
        for (; o + 2 <= outputs; o += 2)
            accumulate_columns<2>(y + o * y_stride, y_stride, n, coef + o * output_stride, gate + o * output_stride,
                                  coef_stride, output_stride, x, x_stride, terms);
        if (o < outputs)
            accumulate_columns<1>(y + o * y_stride, y_stride, n, coef + o * output_stride, gate + o * output_stride,
                                  coef_stride, output_stride, x, x_stride, terms);
    }

    static void row_gradients(float* probs, float* grads, const float* capped, int64_t n, float lse, float delta,
                              float scale) {
        const Reg row_lse = V::broadcast(lse), row_delta = V::broadcast(delta), factor = V::broadcast(scale);
        const Reg one = V::broadcast(1.0f), zero = V::zero();
        for (int64_t j = 0; j < n; j += W) {
            const Reg prob = V::exp2(V::sub(V::load(probs + j), row_lse));
            Reg ds = V::mul(prob, V::sub(V::load(grads + j), row_delta));
            if (capped != nullptr) {
                const Reg t = V::load(capped + j);
                ds = V::mul(ds, V::sub(one, V::mul(t, t)));
            }
            V::store(probs + j, prob);
            // 0 < P ? scale dS : P (0, or a NaN P's NaN)
            V::store(grads + j, V::select_less(zero, prob, V::mul(ds, factor), prob));
        }
    }
};

template <class V>
BackwardKernels make_backward_kernels() {
    return BackwardKernels{Ops<V>::panel_product, Ops<V>::accumulate, Ops<V>::row_gradients};
}

}  // namespace backward
}  // namespace twinattn
