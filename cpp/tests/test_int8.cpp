// Tests of int8 K/V (docs/kernels.md, "int8 K/V"):
//   1. the reference kernel on int8 K/V equals, bit for bit, the reference kernel on the
//      dequantized float32 K/V (float32(x) * scale, rounded once to float32);
//   2. the fast kernel on every instruction set against the float64 reference on the same int8
//      K/V, q float32 / float16 / bfloat16, over decode (direct scores), split-key groups that pack
//      K^T panels, prefill; GQA, kv_lens, causal with offsets, bool masks, windows, softcap, ALiBi,
//      sinks; scales read through strides (stride 0 on Lk: one scale per head; a transposed
//      layout); NaN scales (and NaN-free int8 values) at hidden keys: past kv_len, masked, in the
//      causal future;
//   3. check_problem's scale messages.
// Tolerance: the dequantized K/V are of order 1 (scales of order 1 / 127), so the float32 kernel's
// bound applies (test_flash_kernel.cpp): |fast - ref| <= 1e-4 (1 + |ref|) for out and lse; a
// float16 / bfloat16 out adds one rounding of out, 2^-11 / 2^-8 of |ref| (half an ulp, doubled
// for the two roundings that may straddle a midpoint).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "case_options.hpp"
#include "check.hpp"
#include "element.hpp"
#include "twinattn/flash_attention.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

using namespace twinattn;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kTolerance = 1e-4;

struct Case {
    int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lk = 1, D = 8, Dv = 8;
    bool causal = false, bool_mask = false;
    std::vector<int64_t> kv_lens, q_offset;  // empty: Lk, and 0 (causal: kv_len - Lq)
    int64_t window_left = -1;
    float softcap = 0.0f;
    bool alibi = false, sinks = false;
    // 0: scales (B, Hkv, Lk) contiguous; 1: stride 0 on Lk (one scale per (b, head)); 2: stored
    // (Lk, Hkv, B) and read transposed.
    int scale_layout = 0;
    bool nan_hidden = false;  // NaN scales at hidden keys (past kv_len, masked, causal future)
    ElementType dtype = ElementType::Float32;  // q and out
    std::string describe() const {
        char text[256];
        std::snprintf(text, sizeof text,
                      "B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld causal=%d mask=%d layout=%d nan=%d dtype=%d",
                      (long long)B, (long long)Hq, (long long)Hkv, (long long)Lq, (long long)Lk, (long long)D,
                      (long long)Dv, causal, bool_mask, scale_layout, nan_hidden, static_cast<int>(dtype));
        return text;
    }
};

// Storage for one case: q as float32 values (rounded to q's dtype), int8 K/V, their scales.
struct Inputs {
    Case c;
    std::vector<float> q_values;             // already representable in c.dtype
    std::vector<uint16_t> q_half;            // float16 / bfloat16 bits of q
    std::vector<int8_t> k, v;
    std::vector<float> k_scale, v_scale;     // storage (layout per c.scale_layout)
    std::vector<float> k_deq, v_deq;         // dequantized float32 K/V (B, Hkv, Lk, D / Dv)
    std::vector<int64_t> kv_lens, q_offset;
    std::vector<unsigned char> mask;         // (B, Hq, Lq, Lk)
    std::vector<float> alibi, sinks;

    explicit Inputs(const Case& cs, std::mt19937& rng) : c(cs) {
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f), positive(0.5f, 1.5f);
        std::uniform_int_distribution<int> byte(-127, 127);
        q_values.resize(static_cast<size_t>(c.B * c.Hq * c.Lq * c.D));
        for (float& x : q_values) {
            x = unit(rng);
            if (c.dtype == ElementType::Float16) {
                q_half.push_back(f32_to_f16(x));
                x = to_f32(Float16{q_half.back()});
            } else if (c.dtype == ElementType::BFloat16) {
                q_half.push_back(f32_to_bf16(x));
                x = to_f32(BFloat16{q_half.back()});
            }
        }
        k.resize(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D));
        v.resize(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv));
        for (int8_t& x : k) x = static_cast<int8_t>(byte(rng));
        for (int8_t& x : v) x = static_cast<int8_t>(byte(rng));
        const int64_t scales = c.B * c.Hkv * c.Lk;
        k_scale.resize(static_cast<size_t>(c.scale_layout == 1 ? c.B * c.Hkv : scales));
        v_scale.resize(k_scale.size());
        for (float& x : k_scale) x = positive(rng) / 127.0f;
        for (float& x : v_scale) x = positive(rng) / 127.0f;
        kv_lens = c.kv_lens.empty() ? std::vector<int64_t>(static_cast<size_t>(c.B), c.Lk) : c.kv_lens;
        q_offset = c.q_offset;
        if (q_offset.empty())
            for (int64_t b = 0; b < c.B; ++b) q_offset.push_back(c.causal ? std::max<int64_t>(0, kv_lens[b] - c.Lq) : 0);
        if (c.bool_mask) {
            mask.assign(static_cast<size_t>(c.B * c.Hq * c.Lq * c.Lk), 1);
            for (size_t index = 0; index < mask.size(); ++index) {
                const int64_t j = static_cast<int64_t>(index) % c.Lk;
                if (j == 1 || j == c.Lk / 2 || (byte(rng) & 7) == 0) mask[index] = 0;  // keys 1, Lk / 2 hidden from all
            }
        }
        if (c.alibi)
            for (int64_t i = 0; i < c.B * c.Hq; ++i) alibi.push_back(0.01f * static_cast<float>(i % 7 + 1));
        if (c.sinks)
            for (int64_t h = 0; h < c.Hq; ++h) sinks.push_back(0.3f * static_cast<float>(h % 5) - 0.5f);
        if (c.nan_hidden) {
            for (int64_t b = 0; b < c.B; ++b)
                for (int64_t g = 0; g < c.Hkv; ++g)
                    for (int64_t j = 0; j < c.Lk; ++j) {
                        // hidden from every row: past kv_len, masked (keys 1, Lk / 2), or in the
                        // causal future of the last query row
                        const bool hidden = j >= kv_lens[b] || (c.bool_mask && (j == 1 || j == c.Lk / 2)) ||
                                            (c.causal && j > q_offset[b] + c.Lq - 1);
                        if (!hidden) continue;
                        k_scale[static_cast<size_t>(scale_index(b, g, j))] = kNaN;
                        v_scale[static_cast<size_t>(scale_index(b, g, j))] = kNaN;
                    }
        }
        k_deq.resize(k.size());
        v_deq.resize(v.size());
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t g = 0; g < c.Hkv; ++g)
                for (int64_t j = 0; j < c.Lk; ++j) {
                    const int64_t row = (b * c.Hkv + g) * c.Lk + j;
                    const float ks = k_scale[static_cast<size_t>(scale_index(b, g, j))];
                    const float vs = v_scale[static_cast<size_t>(scale_index(b, g, j))];
                    for (int64_t d = 0; d < c.D; ++d)
                        k_deq[static_cast<size_t>(row * c.D + d)] = static_cast<float>(k[static_cast<size_t>(row * c.D + d)]) * ks;
                    for (int64_t d = 0; d < c.Dv; ++d)
                        v_deq[static_cast<size_t>(row * c.Dv + d)] = static_cast<float>(v[static_cast<size_t>(row * c.Dv + d)]) * vs;
                }
    }

    int64_t scale_index(int64_t b, int64_t g, int64_t j) const {
        if (c.scale_layout == 1) return b * c.Hkv + g;
        if (c.scale_layout == 2) return (j * c.Hkv + g) * c.B + b;
        return (b * c.Hkv + g) * c.Lk + j;
    }

    ParamView3 scale_view(const std::vector<float>& storage) const {
        if (c.scale_layout == 1) return ParamView3{storage.data(), {c.B, c.Hkv, c.Lk}, {c.Hkv, 1, 0}};
        if (c.scale_layout == 2) return ParamView3{storage.data(), {c.B, c.Hkv, c.Lk}, {1, c.B, c.B * c.Hkv}};
        return ParamView3{storage.data(), {c.B, c.Hkv, c.Lk}, {c.Hkv * c.Lk, c.Lk, 1}};
    }

    // int8: k / v / scales as given; else the dequantized float32 K/V (q must then be float32).
    AttentionProblem problem(bool int8, void* out, std::vector<float>& lse) const {
        AttentionProblem p{};
        const void* q_data = c.dtype == ElementType::Float32 ? static_cast<const void*>(q_values.data())
                                                             : static_cast<const void*>(q_half.data());
        p.q = TensorView4{q_data, {c.B, c.Hq, c.Lq, c.D}, {c.Hq * c.Lq * c.D, c.Lq * c.D, c.D, 1}};
        const int64_t kd[4] = {c.Hkv * c.Lk * c.D, c.Lk * c.D, c.D, 1};
        const int64_t vd[4] = {c.Hkv * c.Lk * c.Dv, c.Lk * c.Dv, c.Dv, 1};
        p.k = TensorView4{int8 ? static_cast<const void*>(k.data()) : k_deq.data(), {c.B, c.Hkv, c.Lk, c.D},
                          {kd[0], kd[1], kd[2], kd[3]}};
        p.v = TensorView4{int8 ? static_cast<const void*>(v.data()) : v_deq.data(), {c.B, c.Hkv, c.Lk, c.Dv},
                          {vd[0], vd[1], vd[2], vd[3]}};
        p.out = MutTensorView4{out, {c.B, c.Hq, c.Lq, c.Dv}, {c.Hq * c.Lq * c.Dv, c.Lq * c.Dv, c.Dv, 1}};
        lse.assign(static_cast<size_t>(c.B * c.Hq * c.Lq), 0.0f);
        twinattn_test::set_case_options(p, c, lse, q_offset, kv_lens, mask, alibi, sinks);
        p.dtype = c.dtype;
        p.window_left = c.window_left;
        if (int8) {
            p.kv_int8 = true;
            p.k_scale = scale_view(k_scale);
            p.v_scale = scale_view(v_scale);
        }
        return p;
    }
};

// Out as float32 values, whatever its storage.
std::vector<float> out_values(const std::vector<uint16_t>& storage, ElementType dtype) {
    std::vector<float> values;
    for (uint16_t bits : storage)
        values.push_back(dtype == ElementType::Float16 ? to_f32(Float16{bits}) : to_f32(BFloat16{bits}));
    return values;
}

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b) || (a != a && b != b); }

// 1. reference(int8) == reference(dequantized float32), bit for bit (q float32).
void test_reference_dequantizes(const Case& c, std::mt19937& rng) {
    const Inputs in(c, rng);
    const size_t out_size = static_cast<size_t>(c.B * c.Hq * c.Lq * c.Dv);
    std::vector<float> out_int8(out_size), out_float(out_size), lse_int8, lse_float;
    attention_reference(in.problem(true, out_int8.data(), lse_int8), 2);
    attention_reference(in.problem(false, out_float.data(), lse_float), 2);
    int bad = 0;
    for (size_t i = 0; i < out_size; ++i) bad += !same_bits(out_int8[i], out_float[i]);
    for (size_t i = 0; i < lse_int8.size(); ++i) bad += !same_bits(lse_int8[i], lse_float[i]);
    for (float x : out_int8) bad += !std::isfinite(x);
    if (bad) std::fprintf(stderr, "reference int8 != dequantized (%d values): %s\n", bad, c.describe().c_str());
    CHECK(bad == 0);
}

// 2. The fast kernel on every ISA against the reference on the same int8 inputs.
void test_fast_against_reference(const Case& c, std::mt19937& rng) {
    const Inputs in(c, rng);
    const size_t out_size = static_cast<size_t>(c.B * c.Hq * c.Lq * c.Dv);
    const double out_rounding = c.dtype == ElementType::Float16    ? std::ldexp(1.0, -10)
                                : c.dtype == ElementType::BFloat16 ? std::ldexp(1.0, -7)
                                                                   : 0.0;
    std::vector<float> ref, ref_lse;
    std::vector<float> ref32(out_size);
    std::vector<uint16_t> ref16(out_size);
    attention_reference(in.problem(true, c.dtype == ElementType::Float32 ? static_cast<void*>(ref32.data())
                                                                          : static_cast<void*>(ref16.data()),
                                   ref_lse),
                        1);
    ref = c.dtype == ElementType::Float32 ? ref32 : out_values(ref16, c.dtype);
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        for (int threads : {1, 3}) {
            std::vector<float> out32(out_size, kNaN), lse;
            std::vector<uint16_t> out16(out_size, 0x7e00);
            attention_forward(in.problem(true, c.dtype == ElementType::Float32 ? static_cast<void*>(out32.data())
                                                                                : static_cast<void*>(out16.data()),
                                         lse),
                              threads);
            const std::vector<float> out = c.dtype == ElementType::Float32 ? out32 : out_values(out16, c.dtype);
            int bad = 0;
            double worst = 0.0;
            for (size_t i = 0; i < out_size; ++i) {
                const double e = ref[i], a = out[i];
                const double error = std::fabs(a - e);
                if (!(std::isfinite(a) && error <= kTolerance * (1.0 + std::fabs(e)) + out_rounding * std::fabs(e))) ++bad;
                if (error > worst) worst = error;
            }
            for (size_t i = 0; i < lse.size(); ++i) {
                const double e = ref_lse[i], a = lse[i];
                if (!(std::isfinite(a) ? std::fabs(a - e) <= kTolerance * (1.0 + std::fabs(e)) : same_bits(lse[i], ref_lse[i])))
                    ++bad;
            }
            if (bad)
                std::fprintf(stderr, "int8 %s threads=%d: %d bad values (worst out error %.3g): %s\n", isa.c_str(),
                             threads, bad, worst, c.describe().c_str());
            CHECK(bad == 0);
        }
    }
    set_isa(available_isas().back());
}

std::vector<Case> cases() {
    std::vector<Case> all;
    for (ElementType dtype : {ElementType::Float32, ElementType::Float16, ElementType::BFloat16}) {
        Case decode;  // decode: 4 rows per group (direct scores), several split-key chunks
        decode.B = 2, decode.Hq = 8, decode.Hkv = 2, decode.Lk = 2600, decode.D = 128, decode.Dv = 128;
        decode.kv_lens = {2600, 1777}, decode.dtype = dtype;
        all.push_back(decode);
        Case prefill;  // prefill: packed panels, causal with offsets, odd D and Dv
        prefill.B = 2, prefill.Hq = 6, prefill.Hkv = 3, prefill.Lq = 37, prefill.Lk = 530, prefill.D = 65,
        prefill.Dv = 33, prefill.causal = true, prefill.kv_lens = {530, 301}, prefill.dtype = dtype;
        all.push_back(prefill);
    }
    Case packed_split;  // split-key with 32 rows per group (> kDirectScoreRows): panels per block
    packed_split.B = 1, packed_split.Hq = 16, packed_split.Hkv = 1, packed_split.Lq = 2, packed_split.Lk = 1500;
    packed_split.D = 40, packed_split.Dv = 24, packed_split.causal = true, packed_split.q_offset = {1200};
    packed_split.nan_hidden = true;
    all.push_back(packed_split);
    Case masked;  // bool mask, NaN scales at hidden keys, transposed scales, decode with odd D
    masked.B = 2, masked.Hq = 4, masked.Hkv = 2, masked.Lk = 1100, masked.D = 23, masked.Dv = 19;
    masked.kv_lens = {1100, 613}, masked.bool_mask = true, masked.nan_hidden = true, masked.scale_layout = 2;
    all.push_back(masked);
    Case masked_prefill = masked;
    masked_prefill.Lq = 30, masked_prefill.causal = true;
    all.push_back(masked_prefill);
    Case per_head;  // stride-0 scales (one per head), variants
    per_head.B = 1, per_head.Hq = 4, per_head.Hkv = 4, per_head.Lq = 3, per_head.Lk = 700, per_head.D = 32;
    per_head.Dv = 48, per_head.scale_layout = 1, per_head.softcap = 2.5f, per_head.alibi = true;
    per_head.sinks = true, per_head.causal = true, per_head.window_left = 300;
    all.push_back(per_head);
    Case per_head_prefill = per_head;
    per_head_prefill.Lq = 90;
    all.push_back(per_head_prefill);
    return all;
}

// 3. Messages.
void test_messages() {
    std::mt19937 rng(7);
    Case c;
    c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lk = 5, c.D = 4, c.Dv = 4;
    const Inputs in(c, rng);
    std::vector<float> out(static_cast<size_t>(c.B * c.Hq * c.Dv)), lse;
    AttentionProblem p = in.problem(true, out.data(), lse);
    p.k_scale.data = nullptr;
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 1),
                 "k_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None");
    p = in.problem(true, out.data(), lse);
    p.v_scale.data = nullptr;
    CHECK_THROWS(std::invalid_argument, attention_reference(p, 1),
                 "v_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None");
    p = in.problem(true, out.data(), lse);
    p.k_scale.shape[2] = 4;
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 1),
                 "k_scale: expected shape (B=2, Hkv=1, Lk=5), got (2, 1, 4)");
    p = in.problem(true, out.data(), lse);
    p.v_scale.shape[0] = 1;
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 1),
                 "v_scale: expected shape (B=2, Hkv=1, Lk=5), got (1, 1, 5)");
    AttentionProblem f = in.problem(false, out.data(), lse);
    f.v_scale = in.scale_view(in.v_scale);
    CHECK_THROWS(std::invalid_argument, attention_forward(f, 1),
                 "v_scale: expected None with float32 k and v (scales are only for int8), got an array");
    // out may not overlap a scale
    std::vector<float> shared(64, 0.5f);
    p = in.problem(true, shared.data(), lse);
    p.k_scale.data = shared.data();
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 1),
                 "out: expected memory disjoint from k_scale, got arrays that overlap");
}

}  // namespace

int main() {
    std::mt19937 rng(20261130);
    for (const Case& c : cases()) {
        if (c.dtype == ElementType::Float32) test_reference_dequantizes(c, rng);
        test_fast_against_reference(c, rng);
    }
    test_messages();
    if (twinattn_test::failures == 0) std::printf("test_int8: all passed\n");
    return twinattn_test::failures == 0 ? 0 : 1;
}
