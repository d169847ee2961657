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

namespace twinattn {

// out[r * out_stride + j] for r < rows, j < n (n a multiple of the vector width) =
// sum over d < depth, ascending, of a[r * depth + d] * panel[d * panel_stride + j]: one V::fma
// chain from 0 per element.
using PanelProductFn = void (*)(const float* a, int64_t rows, int64_t depth, const float* panel,
                                int64_t panel_stride, int64_t n, float* out, int64_t out_stride);
// y[0, n) += coef[t * coef_stride] * x[t * x_stride + (0, n)] for t < terms, ascending, skipping
// every term whose gate[t * coef_stride] is 0 (a hidden key: its x is never read): one V::fma
// chain per element, starting from y.
using AccumulateFn = void (*)(float* y, int64_t n, const float* coef, const float* gate, int64_t coef_stride,
                              const float* x, int64_t x_stride, int64_t terms);

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
    // Rows of a panel_product strip and accumulators of an accumulate chunk: 4 x 4 vectors and
    // 8 vectors (AVX-512: 16 and 8 of the 32 registers; AVX2 and NEON: as many of 16 and 32).
    static constexpr int kStripRows = 4;
    static constexpr int kStripVectors = 4;
    static constexpr int kChunkVectors = 8;

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

    // y[0, NV W) of accumulate.
    template <int NV>
    static void accumulate_chunk(float* y, const float* coef, const float* gate, int64_t coef_stride, const float* x,
                                 int64_t x_stride, int64_t terms) {
        Reg acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = V::load(y + c * W);
        for (int64_t t = 0; t < terms; ++t) {
            if (gate[t * coef_stride] == 0.0f) continue;
            const Reg factor = V::broadcast(coef[t * coef_stride]);
            for (int c = 0; c < NV; ++c) acc[c] = V::fma(factor, V::load(x + t * x_stride + c * W), acc[c]);
        }
        for (int c = 0; c < NV; ++c) V::store(y + c * W, acc[c]);
    }

    // y[0, n) of accumulate, n < W.
    static void accumulate_tail(float* y, int64_t n, const float* coef, const float* gate, int64_t coef_stride,
                                const float* x, int64_t x_stride, int64_t terms) {
        Reg acc = V::load_tail(y, n);
        for (int64_t t = 0; t < terms; ++t) {
            if (gate[t * coef_stride] == 0.0f) continue;
            acc = V::fma(V::broadcast(coef[t * coef_stride]), V::load_tail(x + t * x_stride, n), acc);
        }
        V::store_tail(y, acc, n);
    }

    // Chunks of kChunkVectors vectors, then 4, 2 and 1 vectors, then the tail.
    static void accumulate(float* y, int64_t n, const float* coef, const float* gate, int64_t coef_stride,
                           const float* x, int64_t x_stride, int64_t terms) {
        int64_t d = 0;
        for (; d + kChunkVectors * W <= n; d += kChunkVectors * W)
            accumulate_chunk<kChunkVectors>(y + d, coef, gate, coef_stride, x + d, x_stride, terms);
        if (d + 4 * W <= n) {
            accumulate_chunk<4>(y + d, coef, gate, coef_stride, x + d, x_stride, terms);
            d += 4 * W;
        }
        if (d + 2 * W <= n) {
            accumulate_chunk<2>(y + d, coef, gate, coef_stride, x + d, x_stride, terms);
            d += 2 * W;
        }
        if (d + W <= n) {
            accumulate_chunk<1>(y + d, coef, gate, coef_stride, x + d, x_stride, terms);
            d += W;
        }
        if (d < n) accumulate_tail(y + d, n - d, coef, gate, coef_stride, x + d, x_stride, terms);
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
