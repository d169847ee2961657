// The portable vector type of the fast kernels: a plain array of kScalarWidth floats, element by
// element in fixed order. Same tiled algorithm as the SIMD paths; the compiler may vectorise the
// loops with the baseline instruction set (SSE2 on x86-64), never more.
#pragma once

#include <cstdint>
#include <cstring>

#include "element.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {

struct VecScalar {
    struct Reg {
        float lane[kScalarWidth];
    };
    static constexpr int kWidth = kScalarWidth;
    static constexpr int kScoreVectors = kScalarScoreVectors;
    static constexpr int kValueVectors = kScalarValueVectors;
    static constexpr int kDirectStripRows = kScalarDirectStripRows;
    static constexpr const char* kName = "scalar";

    static Reg zero() { return broadcast(0.0f); }
    static Reg broadcast(float x) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = x;
        return r;
    }
    static Reg load(const float* p) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = p[i];
        return r;
    }
    static void store(float* p, Reg x) {
        for (int i = 0; i < kWidth; ++i) p[i] = x.lane[i];
    }
    // The first n (< kWidth) lanes; the others are 0 and their memory is never touched.
    static Reg load_tail(const float* p, int64_t n) {
        Reg r = zero();
        for (int64_t i = 0; i < n; ++i) r.lane[i] = p[i];
        return r;
    }
    static void store_tail(float* p, Reg x, int64_t n) {
        for (int64_t i = 0; i < n; ++i) p[i] = x.lane[i];
    }
    // a * b + c with two roundings (std::fma would be a library call without -mfma); the SIMD
    // paths round once. Both are within the float32 tolerances the tests derive.
    static Reg fma(Reg a, Reg b, Reg c) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] * b.lane[i] + c.lane[i];
        return r;
    }
    static Reg mul(Reg a, Reg b) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] * b.lane[i];
        return r;
    }
    static Reg add(Reg a, Reg b) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] + b.lane[i];
        return r;
    }
    static Reg sub(Reg a, Reg b) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] - b.lane[i];
        return r;
    }
    static Reg max(Reg a, Reg b) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] > b.lane[i] ? a.lane[i] : b.lane[i];
        return r;
    }

    static Reg div(Reg a, Reg b) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] / b.lane[i];
        return r;
    }
    // Per lane a < b ? x : y (y when a or b is NaN).
    static Reg select_less(Reg a, Reg b, Reg x, Reg y) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = a.lane[i] < b.lane[i] ? x.lane[i] : y.lane[i];
        return r;
    }

    static float exp2_lane(float x_in) {
        const float x = x_in >= kExp2Min ? x_in : kExp2Min;  // NaN too (no float-to-int of NaN)
        int32_t whole = static_cast<int32_t>(x);  // rounds toward zero: floor for x <= 0 is
        if (static_cast<float>(whole) > x) --whole;  // one less unless x is whole
        const float n = static_cast<float>(whole);
        const float f = x - n;
        float p = kExp2Coefficients[kExp2Degree];
        for (int c = kExp2Degree - 1; c >= 0; --c) p = p * f + kExp2Coefficients[c];
        const uint32_t bits = static_cast<uint32_t>(whole + 127) << 23;
        float scale;
        std::memcpy(&scale, &bits, sizeof scale);
        return x_in != x_in ? x_in : p * scale;  // NaN gives NaN, as the SIMD types
    }
    // 2^x for x <= 0 (constants.hpp, "exp2"); -inf gives exactly 0, NaN gives NaN.
    static Reg exp2(Reg x) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = exp2_lane(x.lane[i]);
        return r;
    }

    // Horizontal reductions in a fixed order: halves folded, as the SIMD types do.
    static float reduce_max(Reg x) {
        for (int half = kWidth / 2; half >= 1; half /= 2)
            for (int i = 0; i < half; ++i)
                x.lane[i] = x.lane[i] > x.lane[i + half] ? x.lane[i] : x.lane[i + half];
        return x.lane[0];
    }
    static float reduce_sum(Reg x) {
        for (int half = kWidth / 2; half >= 1; half /= 2)
            for (int i = 0; i < half; ++i) x.lane[i] += x.lane[i + half];
        return x.lane[0];
    }

    // Direct scores, in the order the SIMD types define (groups of four lanes = their 128-bit
    // groups): lane 4g + k = (a_k[4g] + a_k[4g+2]) + (a_k[4g+1] + a_k[4g+3]).
    static Reg reduce4(Reg a0, Reg a1, Reg a2, Reg a3) {
        const Reg* a[4] = {&a0, &a1, &a2, &a3};
        Reg r;
        for (int g = 0; g < kWidth / 4; ++g)
            for (int k = 0; k < 4; ++k) {
                const float* x = a[k]->lane + 4 * g;
                r.lane[4 * g + k] = (x[0] + x[2]) + (x[1] + x[3]);
            }
        return r;
    }
    // y[b] (kWidth / 4 batches of four keys) -> kWidth scores: lane 4b + k = batch b's lane k
    // summed over the groups, halves folded.
    static Reg fold_groups(const Reg y[kWidth / 4]) {
        Reg r;
        for (int b = 0; b < kWidth / 4; ++b)
            for (int k = 0; k < 4; ++k) {
                float s[kWidth / 4];
                for (int g = 0; g < kWidth / 4; ++g) s[g] = y[b].lane[4 * g + k];
                for (int half = kWidth / 8; half >= 1; half /= 2)
                    for (int g = 0; g < half; ++g) s[g] += s[g + half];
                r.lane[4 * b + k] = s[0];
            }
        return r;
    }

    // rows[i] = row i of a kWidth x kWidth block -> rows[d] = column d.
    static void transpose(Reg rows[kWidth]) {
        for (int i = 0; i < kWidth; ++i)
            for (int j = i + 1; j < kWidth; ++j) {
                const float x = rows[i].lane[j];
                rows[i].lane[j] = rows[j].lane[i];
                rows[j].lane[i] = x;
            }
    }

    // ---- Storage types (element.hpp): loads convert to float32 exactly, stores round ------
    template <typename T>
    static Reg load_as_f32(const T* p) {
        Reg r;
        for (int i = 0; i < kWidth; ++i) r.lane[i] = to_f32(p[i]);
        return r;
    }
    template <typename T>
    static void store_from_f32(T* p, Reg x) {
        for (int i = 0; i < kWidth; ++i) from_f32(x.lane[i], &p[i]);
    }
    template <typename T>
    static Reg load_tail_as_f32(const T* p, int64_t n) {
        Reg r = zero();
        for (int64_t i = 0; i < n; ++i) r.lane[i] = to_f32(p[i]);
        return r;
    }
    template <typename T>
    static void store_tail_from_f32(T* p, Reg x, int64_t n) {
        for (int64_t i = 0; i < n; ++i) from_f32(x.lane[i], &p[i]);
    }

};

}  // namespace twinattn
