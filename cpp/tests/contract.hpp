// The contract checks every kernel must pass: the seeds' three checks and worked example, then
// the rest of the contract (GQA, kv_lens, masks, empty rows, lse, strides, threads) and
// check_problem. Each test program runs them for its kernels (run_contract_tests): the reference
// kernel in test_reference_kernel.cpp, every instruction set of the fast kernel in
// test_flash_kernel.cpp. Rust twin: rust/tests/contract/mod.rs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

namespace contract {

using namespace twinattn;

// The kernel under test: attention_reference or attention_forward (with set_isa before).
using KernelFn = void (*)(const AttentionProblem& problem, int num_threads);
inline KernelFn run_kernel = nullptr;


inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Contiguous float storage of a 4-D shape.
struct Tensor {
    int64_t shape[4];
    std::vector<float> data;

    Tensor(int64_t d0, int64_t d1, int64_t d2, int64_t d3, float fill = 0.0f)
        : shape{d0, d1, d2, d3}, data(static_cast<size_t>(d0 * d1 * d2 * d3), fill) {}
    float& at(int64_t a, int64_t b, int64_t c, int64_t d) {
        return data[static_cast<size_t>(((a * shape[1] + b) * shape[2] + c) * shape[3] + d)];
    }
    const float& at(int64_t a, int64_t b, int64_t c, int64_t d) const {
        return data[static_cast<size_t>(((a * shape[1] + b) * shape[2] + c) * shape[3] + d)];
    }
    TensorView4 view() const { return contiguous_view(data.data(), shape[0], shape[1], shape[2], shape[3]); }
    MutTensorView4 mut_view() { return contiguous_mut_view(data.data(), shape[0], shape[1], shape[2], shape[3]); }
};

Tensor random_tensor(int64_t d0, int64_t d1, int64_t d2, int64_t d3, std::mt19937& rng) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    Tensor t(d0, d1, d2, d3);
    for (float& x : t.data) x = uniform(rng);
    return t;
}

// A problem over contiguous tensors without a mask or lse; tests adjust fields as needed.
AttentionProblem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                              const int64_t* q_offset, const int64_t* kv_lens, bool causal) {
    AttentionProblem p{};
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.mut_view();
    p.lse = LseView{nullptr, {0, 0, 0}, {0, 0, 0}};
    p.q_offset = Int64Span(q_offset, q.shape[0]);  // B entries each
    p.kv_lens = Int64Span(kv_lens, q.shape[0]);
    p.mask = MaskView{MaskKind::None, nullptr, {}, {}};
    p.causal = causal;
    p.scale = 1.0f / std::sqrt(static_cast<float>(q.shape[3]));
    return p;
}

// Direct double-precision attention over contiguous tensors, written independently of the
// kernel: a full score row with -inf for hidden keys, unnormalised weights divided at the end.
struct Expected {
    std::vector<double> out;  // (B, Hq, Lq, Dv)
    std::vector<double> lse;  // (B, Hq, Lq)
};

Expected direct_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                          const std::vector<int64_t>& q_offset, const std::vector<int64_t>& kv_lens,
                          bool causal, double scale, const std::vector<unsigned char>* bool_mask,
                          const std::vector<float>* bias) {
    const int64_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], D = q.shape[3];
    const int64_t Hkv = k.shape[1], Lk = k.shape[2], Dv = v.shape[3];
    Expected e{std::vector<double>(static_cast<size_t>(B * Hq * Lq * Dv), 0.0),
               std::vector<double>(static_cast<size_t>(B * Hq * Lq), 0.0)};
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
            for (int64_t i = 0; i < Lq; ++i) {
                const int64_t g = h * Hkv / Hq;  // same as h / (Hq / Hkv)
                std::vector<double> s(static_cast<size_t>(Lk), -INFINITY);
                for (int64_t j = 0; j < kv_lens[b]; ++j) {
                    if (causal && j > q_offset[b] + i) continue;
                    const size_t m = static_cast<size_t>(((b * Hq + h) * Lq + i) * Lk + j);
                    if (bool_mask && !(*bool_mask)[m]) continue;
                    if (bias && (*bias)[m] == -kInf) continue;
                    double dot = 0;
                    for (int64_t d = 0; d < D; ++d) dot += double(q.at(b, h, i, d)) * k.at(b, g, j, d);
                    s[j] = scale * dot + (bias ? (*bias)[m] : 0.0);
                }
                double row_max = -INFINITY;
                for (double x : s) row_max = std::max(row_max, x);
                const size_t row = static_cast<size_t>((b * Hq + h) * Lq + i);
                if (row_max == -INFINITY) {
                    e.lse[row] = -INFINITY;
                    continue;
                }
                double sum = 0;
                std::vector<double> acc(static_cast<size_t>(Dv), 0.0);
                for (int64_t j = 0; j < Lk; ++j) {
                    if (s[j] == -INFINITY) continue;
                    const double w = std::exp(s[j] - row_max);
                    sum += w;
                    for (int64_t d = 0; d < Dv; ++d) acc[d] += w * v.at(b, g, j, d);
                }
                for (int64_t d = 0; d < Dv; ++d) e.out[row * Dv + d] = acc[d] / sum;
                e.lse[row] = row_max + std::log(sum);
            }
    return e;
}

void check_close_to(const Tensor& out, const std::vector<float>* lse, const Expected& e) {
    for (size_t n = 0; n < out.data.size(); ++n) CHECK_NEAR(out.data[n], e.out[n], 1e-5 + 1e-5 * std::fabs(e.out[n]));
    if (lse)
        for (size_t n = 0; n < lse->size(); ++n) {
            if (std::isinf(e.lse[n])) CHECK((*lse)[n] == float(e.lse[n]));
            else CHECK_NEAR((*lse)[n], e.lse[n], 1e-5 + 1e-6 * std::fabs(e.lse[n]));
        }
}

bool bit_identical(const float* a, const float* b, size_t count) {
    return std::memcmp(a, b, count * sizeof(float)) == 0;
}

bool all_finite(const std::vector<float>& x) {
    for (float value : x)
        if (!std::isfinite(value)) return false;
    return true;
}

// The seed's three queries, used as keys too, and its values: one head, D = Dv = 2.
Tensor seed_queries() {
    Tensor t(1, 1, 3, 2);
    t.data = {1, 0, 0, 1, 1, 1};
    return t;
}
Tensor seed_values() {
    Tensor t(1, 1, 3, 2);
    t.data = {2, 0, 0, 3, -1, 1};
    return t;
}

// ---- the seeds' checks -------------------------------------------------------------------

// (a) The first causal row has exactly one legal key, so its output is that key's value.
void test_seed_first_row_one_key() {
    const Tensor q = seed_queries(), v = seed_values();
    Tensor out(1, 1, 3, 2);
    const int64_t q_offset[] = {0}, kv_lens[] = {3};
    run_kernel(make_problem(q, q, v, out, q_offset, kv_lens, true), 1);
    CHECK(out.at(0, 0, 0, 0) == 2.0f);
    CHECK(out.at(0, 0, 0, 1) == 0.0f);
}

// (b) A cached one-row chunk at offset 2 equals the last row of the full run.
void test_seed_cached_last_row() {
    const Tensor q = seed_queries(), v = seed_values();
    Tensor full(1, 1, 3, 2);
    const int64_t zero[] = {0}, three[] = {3};
    run_kernel(make_problem(q, q, v, full, zero, three, true), 1);

    Tensor last_query(1, 1, 1, 2);
    last_query.data = {1, 1};
    Tensor cached(1, 1, 1, 2);
    const int64_t two[] = {2};
    run_kernel(make_problem(last_query, q, v, cached, two, three, true), 1);
    for (int64_t d = 0; d < 2; ++d) CHECK(cached.at(0, 0, 0, d) == full.at(0, 0, 2, d));
}

// (b) More generally: prompt lengths x chunk sizes; each chunk sits at its offset, sees a cache
// whose unwritten tail is NaN, and must reproduce the full run's rows bit for bit.
void test_chunked_equals_full() {
    std::mt19937 rng(7);
    const int64_t capacity = 20, Hq = 4, Hkv = 2, D = 5, Dv = 3;
    for (int64_t prompt_len : {1, 2, 5, 9, 16}) {
        const Tensor q = random_tensor(1, Hq, prompt_len, D, rng);
        Tensor k = random_tensor(1, Hkv, capacity, D, rng);
        Tensor v = random_tensor(1, Hkv, capacity, Dv, rng);
        for (int64_t g = 0; g < Hkv; ++g)
            for (int64_t j = prompt_len; j < capacity; ++j) {
                for (int64_t d = 0; d < D; ++d) k.at(0, g, j, d) = kNaN;
                for (int64_t d = 0; d < Dv; ++d) v.at(0, g, j, d) = kNaN;
            }
        Tensor full(1, Hq, prompt_len, Dv);
        const int64_t zero[] = {0}, full_len[] = {prompt_len};
        run_kernel(make_problem(q, k, v, full, zero, full_len, true), 1);
        CHECK(all_finite(full.data));

        for (int64_t chunk : {1, 2, 3, 7}) {
            for (int64_t start = 0; start < prompt_len; start += chunk) {
                const int64_t rows = std::min(chunk, prompt_len - start);
                Tensor part(1, Hq, rows, Dv);
                const int64_t offset[] = {start}, kv_len[] = {start + rows};
                AttentionProblem p = make_problem(q, k, v, part, offset, kv_len, true);
                p.q.data = q.data.data() + start * D;  // rows [start, start + rows) of q
                p.q.shape[2] = rows;
                run_kernel(p, 1);
                for (int64_t h = 0; h < Hq; ++h) {
                    if (run_kernel == attention_reference) {
                        CHECK(bit_identical(&part.at(0, h, 0, 0), &full.at(0, h, start, 0),
                                            static_cast<size_t>(rows * Dv)));
                        continue;
                    }
                    // The fast kernel: a short chunk may take the split-key direct-score path,
                    // whose dot products sum D in another order than the full run's panels:
                    // equal to float32 rounding of the scores (a few ulp of the output), not
                    // bit for bit (as rust/tests/contract/mod.rs).
                    for (int64_t n = 0; n < rows * Dv; ++n) {
                        const float got = (&part.at(0, h, 0, 0))[n], want = (&full.at(0, h, start, 0))[n];
                        CHECK(std::fabs(got - want) <= 8.0f * std::numeric_limits<float>::epsilon() * (1.0f + std::fabs(want)));
                    }
                }
            }
        }
    }
}

// A batch with different offsets and lengths per sequence equals each sequence run alone.
void test_batch_equals_single_sequences() {
    std::mt19937 rng(11);
    const int64_t B = 3, Hq = 2, Hkv = 1, Lq = 3, Lk = 9, D = 4, Dv = 2;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    const Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const int64_t q_offset[] = {6, 0, 2}, kv_lens[] = {9, 3, 5};
    Tensor out(B, Hq, Lq, Dv);
    run_kernel(make_problem(q, k, v, out, q_offset, kv_lens, true), 1);
    for (int64_t b = 0; b < B; ++b) {
        Tensor one(1, Hq, Lq, Dv);
        AttentionProblem p = make_problem(q, k, v, one, q_offset + b, kv_lens + b, true);
        p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = 1;
        p.q_offset.size = p.kv_lens.size = 1;
        p.q.data = static_cast<const float*>(p.q.data) + b * p.q.stride[0];
        p.k.data = static_cast<const float*>(p.k.data) + b * p.k.stride[0];
        p.v.data = static_cast<const float*>(p.v.data) + b * p.v.stride[0];
        run_kernel(p, 1);
        CHECK(bit_identical(one.data.data(), &out.at(b, 0, 0, 0), one.data.size()));
    }
}

// (c) Changing a future key or value leaves every earlier row bit-identical.
void test_future_does_not_leak() {
    {   // the seed's version
        const Tensor q = seed_queries();
        Tensor v = seed_values();
        Tensor before(1, 1, 3, 2), after(1, 1, 3, 2);
        const int64_t zero[] = {0}, three[] = {3};
        run_kernel(make_problem(q, q, v, before, zero, three, true), 1);
        v.at(0, 0, 2, 0) = v.at(0, 0, 2, 1) = 100.0f;
        run_kernel(make_problem(q, q, v, after, zero, three, true), 1);
        CHECK(bit_identical(before.data.data(), after.data.data(), 4));  // rows 0 and 1
    }
    std::mt19937 rng(3);
    const int64_t L = 6, Hq = 2, Hkv = 2, D = 3, Dv = 4;
    const Tensor q = random_tensor(1, Hq, L, D, rng);
    const Tensor k = random_tensor(1, Hkv, L, D, rng), v = random_tensor(1, Hkv, L, Dv, rng);
    Tensor base(1, Hq, L, Dv);
    const int64_t zero[] = {0}, len[] = {L};
    run_kernel(make_problem(q, k, v, base, zero, len, true), 1);
    for (int64_t future = 1; future < L; ++future) {
        Tensor k2 = k, v2 = v, changed(1, Hq, L, Dv);
        for (int64_t g = 0; g < Hkv; ++g) {
            for (int64_t d = 0; d < D; ++d) k2.at(0, g, future, d) = 50.0f;
            for (int64_t d = 0; d < Dv; ++d) v2.at(0, g, future, d) = -100.0f;
        }
        run_kernel(make_problem(q, k2, v2, changed, zero, len, true), 1);
        for (int64_t h = 0; h < Hq; ++h)
            CHECK(bit_identical(&base.at(0, h, 0, 0), &changed.at(0, h, 0, 0),
                                static_cast<size_t>(future * Dv)));
    }
}

// (d) The hand-worked read: q=[1,0], keys [1,0],[0,1], values [2,0],[0,4], scale 1/sqrt(2).
void test_worked_example() {
    Tensor q(1, 1, 1, 2), k(1, 1, 2, 2), v(1, 1, 2, 2), out(1, 1, 1, 2);
    q.data = {1, 0};
    k.data = {1, 0, 0, 1};
    v.data = {2, 0, 0, 4};
    std::vector<float> lse(1);
    const int64_t zero[] = {0}, two[] = {2};
    AttentionProblem p = make_problem(q, k, v, out, zero, two, false);
    p.lse = contiguous_lse_view(lse.data(), 1, 1, 1);
    run_kernel(p, 1);
    CHECK_NEAR(out.data[0], 1.3395, 5e-5);
    CHECK_NEAR(out.data[1], 1.3210, 5e-5);
    CHECK_NEAR(lse[0], std::log(std::exp(1.0 / std::sqrt(2.0)) + 1.0), 1e-6);

    // First position of a causal sequence: the second key is hidden, output is v1 exactly.
    p.causal = true;
    run_kernel(p, 1);
    CHECK(out.data[0] == 2.0f && out.data[1] == 0.0f);
    CHECK_NEAR(lse[0], 1.0 / std::sqrt(2.0), 1e-6);
}

// ---- the rest of the contract ------------------------------------------------------------

// Query head h reads KV head h / (Hq / Hkv); asymmetric random data against direct doubles.
void test_gqa_head_mapping() {
    std::mt19937 rng(5);
    const int64_t B = 2, Hq = 6, Hkv = 2, Lq = 3, Lk = 5, D = 4, Dv = 3;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    const Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const std::vector<int64_t> q_offset = {2, 1}, kv_lens = {5, 4};
    for (bool causal : {false, true}) {
        Tensor out(B, Hq, Lq, Dv);
        std::vector<float> lse(static_cast<size_t>(B * Hq * Lq));
        AttentionProblem p = make_problem(q, k, v, out, q_offset.data(), kv_lens.data(), causal);
        p.lse = contiguous_lse_view(lse.data(), B, Hq, Lq);
        run_kernel(p, 1);
        check_close_to(out, &lse,
                       direct_attention(q, k, v, q_offset, kv_lens, causal, p.scale, nullptr, nullptr));
    }
    // MQA: every query head reads the single KV head.
    const Tensor k1 = random_tensor(1, 1, Lk, D, rng), v1 = random_tensor(1, 1, Lk, Dv, rng);
    const Tensor q1 = random_tensor(1, 4, Lq, D, rng);
    Tensor out1(1, 4, Lq, Dv);
    const std::vector<int64_t> zero = {0}, len = {Lk};
    AttentionProblem p = make_problem(q1, k1, v1, out1, zero.data(), len.data(), false);
    run_kernel(p, 1);
    check_close_to(out1, nullptr, direct_attention(q1, k1, v1, zero, len, false, p.scale, nullptr, nullptr));
}

// Keys past kv_lens[b] hold NaN: never read, output finite and equal to the truncated run.
void test_kv_lens_nan_padding() {
    std::mt19937 rng(9);
    const int64_t B = 2, Hq = 2, Hkv = 1, Lq = 3, Lk = 8, D = 4, Dv = 3;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const int64_t kv_lens[] = {5, 3}, q_offset[] = {2, 0};
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = kv_lens[b]; j < Lk; ++j) {
            for (int64_t d = 0; d < D; ++d) k.at(b, 0, j, d) = kNaN;
            for (int64_t d = 0; d < Dv; ++d) v.at(b, 0, j, d) = kNaN;
        }
    for (bool causal : {false, true}) {
        Tensor out(B, Hq, Lq, Dv);
        run_kernel(make_problem(q, k, v, out, q_offset, kv_lens, causal), 1);
        CHECK(all_finite(out.data));
        for (int64_t b = 0; b < B; ++b) {
            const int64_t n = kv_lens[b];
            Tensor qb(1, Hq, Lq, D), kb(1, Hkv, n, D), vb(1, Hkv, n, Dv), ob(1, Hq, Lq, Dv);
            std::copy_n(&q.at(b, 0, 0, 0), qb.data.size(), qb.data.begin());
            std::copy_n(&k.at(b, 0, 0, 0), kb.data.size(), kb.data.begin());
            std::copy_n(&v.at(b, 0, 0, 0), vb.data.size(), vb.data.begin());
            run_kernel(make_problem(qb, kb, vb, ob, q_offset + b, &n, causal), 1);
            CHECK(bit_identical(ob.data.data(), &out.at(b, 0, 0, 0), ob.data.size()));
        }
    }
}

// Keys hidden by causality hold NaN: they never contribute, not even as 0 * NaN.
void test_causal_hidden_nan() {
    std::mt19937 rng(13);
    const Tensor q = random_tensor(1, 1, 2, 3, rng);
    Tensor k = random_tensor(1, 1, 4, 3, rng), v = random_tensor(1, 1, 4, 2, rng);
    for (int64_t j = 2; j < 4; ++j) {  // rows 0 and 1 at positions 0, 1 see keys 0..1 only
        for (int64_t d = 0; d < 3; ++d) k.at(0, 0, j, d) = kNaN;
        for (int64_t d = 0; d < 2; ++d) v.at(0, 0, j, d) = kNaN;
    }
    Tensor out(1, 1, 2, 2);
    const int64_t zero[] = {0}, four[] = {4};
    run_kernel(make_problem(q, k, v, out, zero, four, true), 1);
    CHECK(all_finite(out.data));
}

// Bool masks (True = may attend) and float biases (-inf hides), against direct doubles, plus a
// key hidden for every row by a broadcast (stride-0) mask whose k and v hold NaN.
void test_masks() {
    std::mt19937 rng(17);
    const int64_t B = 2, Hq = 2, Hkv = 1, Lq = 4, Lk = 6, D = 3, Dv = 2;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    const Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const std::vector<int64_t> q_offset = {2, 1}, kv_lens = {6, 5};
    const int64_t count = B * Hq * Lq * Lk;
    std::vector<unsigned char> bool_mask(static_cast<size_t>(count));
    std::vector<float> bias(static_cast<size_t>(count));
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    for (int64_t n = 0; n < count; ++n) {
        bool_mask[n] = (rng() % 3) != 0;
        bias[n] = (rng() % 4) == 0 ? -kInf : uniform(rng);
    }
    const int64_t mask_strides[4] = {Hq * Lq * Lk, Lq * Lk, Lk, 1};
    for (bool causal : {false, true}) {
        Tensor out(B, Hq, Lq, Dv);
        std::vector<float> lse(static_cast<size_t>(B * Hq * Lq));
        AttentionProblem p = make_problem(q, k, v, out, q_offset.data(), kv_lens.data(), causal);
        p.lse = contiguous_lse_view(lse.data(), B, Hq, Lq);
        p.mask = MaskView{MaskKind::Bool, bool_mask.data(), {B, Hq, Lq, Lk}, {mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3]}};
        run_kernel(p, 1);
        check_close_to(out, &lse, direct_attention(q, k, v, q_offset, kv_lens, causal, p.scale, &bool_mask, nullptr));
        p.mask = MaskView{MaskKind::Float, bias.data(), {B, Hq, Lq, Lk}, {mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3]}};
        run_kernel(p, 1);
        check_close_to(out, &lse, direct_attention(q, k, v, q_offset, kv_lens, causal, p.scale, nullptr, &bias));
    }

    // Key-padding masks broadcast over (B, Hq, Lq): key 1 hidden everywhere, its k, v are NaN.
    Tensor k_nan = k, v_nan = v;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t d = 0; d < D; ++d) k_nan.at(b, 0, 1, d) = kNaN;
        for (int64_t d = 0; d < Dv; ++d) v_nan.at(b, 0, 1, d) = kNaN;
    }
    const unsigned char key_allowed[Lk] = {1, 0, 1, 1, 1, 1};
    const float key_bias[Lk] = {0.5f, -kInf, 0.0f, -0.25f, 1.0f, 0.0f};
    std::vector<unsigned char> full_allowed(static_cast<size_t>(count));
    std::vector<float> full_bias(static_cast<size_t>(count));
    for (int64_t n = 0; n < count; ++n) {
        full_allowed[n] = key_allowed[n % Lk];
        full_bias[n] = key_bias[n % Lk];
    }
    Tensor out(B, Hq, Lq, Dv);
    AttentionProblem p = make_problem(q, k_nan, v_nan, out, q_offset.data(), kv_lens.data(), false);
    p.mask = MaskView{MaskKind::Bool, key_allowed, {B, Hq, Lq, Lk}, {0, 0, 0, 1}};
    run_kernel(p, 1);
    CHECK(all_finite(out.data));
    check_close_to(out, nullptr, direct_attention(q, k, v, q_offset, kv_lens, false, p.scale, &full_allowed, nullptr));
    p.mask = MaskView{MaskKind::Float, key_bias, {B, Hq, Lq, Lk}, {0, 0, 0, 1}};
    run_kernel(p, 1);
    CHECK(all_finite(out.data));
    check_close_to(out, nullptr, direct_attention(q, k, v, q_offset, kv_lens, false, p.scale, nullptr, &full_bias));
}

// Non-finite inputs at visible positions propagate as in the NumPy reference (twin of Rust's
// contract check non_finite_inputs_propagate): a NaN score makes its row NaN (out and lse), a +inf
// score makes out NaN and lse +inf, inf in v reaches its column; a -inf bias hides a key whose k
// and v rows hold NaN exactly as a False mask does.
void test_non_finite_inputs_propagate() {
    Tensor q(1, 1, 3, 2), k(1, 1, 3, 2), v(1, 1, 3, 2);
    q.data = {1, 0, 0, 1, 1, -1};
    k.data = {1, 0, 0, 1, 1, 1};
    v.data = {2, 0, 0, 4, 1, 1};
    const int64_t zero[] = {0}, full[] = {3};
    struct Run {
        Tensor out{1, 1, 3, 2};
        std::vector<float> lse = std::vector<float>(3);
    };
    auto run = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, MaskView mask) {
        Run r;
        AttentionProblem p = make_problem(qq, kk, vv, r.out, zero, full, false);
        p.lse = contiguous_lse_view(r.lse.data(), 1, 1, 3);
        p.mask = mask;
        run_kernel(p, 1);
        return r;
    };
    const MaskView none{MaskKind::None, nullptr, {}, {}};
    const Run clean = run(q, k, v, none);
    {  // NaN in query row 1
        Tensor bad = q;
        bad.at(0, 0, 1, 0) = kNaN;
        const Run r = run(bad, k, v, none);
        CHECK(std::isnan(r.out.at(0, 0, 1, 0)) && std::isnan(r.out.at(0, 0, 1, 1)) && std::isnan(r.lse[1]));
        CHECK(r.out.at(0, 0, 0, 0) == clean.out.at(0, 0, 0, 0) && r.lse[2] == clean.lse[2]);
    }
    {  // +inf in key 0: rows 0 and 2 score +inf (out NaN, lse +inf), row 1 scores 0 * inf = NaN
        Tensor bad = k;
        bad.at(0, 0, 0, 0) = kInf;
        const Run r = run(q, bad, v, none);
        for (float x : r.out.data) CHECK(std::isnan(x));
        CHECK(r.lse[0] == kInf && std::isnan(r.lse[1]) && r.lse[2] == kInf);
    }
    {  // +inf in value 2's first column: that column +inf in every row, the other finite
        Tensor bad = v;
        bad.at(0, 0, 2, 0) = kInf;
        const Run r = run(q, k, bad, none);
        for (int64_t i = 0; i < 3; ++i)
            CHECK(r.out.at(0, 0, i, 0) == kInf && std::isfinite(r.out.at(0, 0, i, 1)) && std::isfinite(r.lse[i]));
    }
    {  // -inf bias over key 1, whose k and v are NaN: as a False mask there
        Tensor bad_k = k, bad_v = v;
        bad_k.at(0, 0, 1, 0) = kNaN;
        bad_v.at(0, 0, 1, 1) = kNaN;
        const float bias[3] = {0.0f, -kInf, 0.0f};
        const unsigned char allowed[3] = {1, 0, 1};
        const Run with_bias = run(q, bad_k, bad_v, MaskView{MaskKind::Float, bias, {1, 1, 3, 3}, {0, 0, 0, 1}});
        const Run with_bool = run(q, bad_k, bad_v, MaskView{MaskKind::Bool, allowed, {1, 1, 3, 3}, {0, 0, 0, 1}});
        CHECK(all_finite(with_bias.out.data) && all_finite(with_bias.lse));
        CHECK(bit_identical(with_bias.out.data.data(), with_bool.out.data.data(), 6));
        CHECK(bit_identical(with_bias.lse.data(), with_bool.lse.data(), 3));
    }
}

// Rows with no visible key: out = 0 (overwriting whatever was there) and lse = -inf.
void test_rows_without_visible_keys() {
    std::mt19937 rng(19);
    const int64_t Lq = 2, Lk = 3, D = 2, Dv = 3;
    const Tensor q = random_tensor(1, 1, Lq, D, rng);
    const Tensor k = random_tensor(1, 1, Lk, D, rng), v = random_tensor(1, 1, Lk, Dv, rng);
    const int64_t zero[] = {0}, full[] = {Lk}, none[] = {0};
    const unsigned char row0_hidden[Lq * Lk] = {0, 0, 0, 1, 0, 1};
    const float row0_bias[Lq * Lk] = {-kInf, -kInf, -kInf, 0.0f, -kInf, 1.0f};
    for (int variant = 0; variant < 3; ++variant) {
        Tensor out(1, 1, Lq, Dv, 7.0f);
        std::vector<float> lse(Lq, 7.0f);
        AttentionProblem p = make_problem(q, k, v, out, zero, full, false);
        p.lse = contiguous_lse_view(lse.data(), 1, 1, Lq);
        if (variant == 0) p.mask = MaskView{MaskKind::Bool, row0_hidden, {1, 1, Lq, Lk}, {0, 0, Lk, 1}};
        if (variant == 1) p.mask = MaskView{MaskKind::Float, row0_bias, {1, 1, Lq, Lk}, {0, 0, Lk, 1}};
        if (variant == 2) p.kv_lens = none;  // every row empty
        run_kernel(p, 1);
        for (int64_t d = 0; d < Dv; ++d) CHECK(out.at(0, 0, 0, d) == 0.0f);
        CHECK(lse[0] == -kInf);
        if (variant == 2) {
            for (int64_t d = 0; d < Dv; ++d) CHECK(out.at(0, 0, 1, d) == 0.0f);
            CHECK(lse[1] == -kInf);
        } else {
            CHECK(all_finite(out.data) && std::isfinite(lse[1]) && out.at(0, 0, 1, 0) != 0.0f);
        }
    }
    // Lk = 0: zero rows.
    Tensor k0(1, 1, 0, D), v0(1, 1, 0, Dv), out(1, 1, Lq, Dv, 7.0f);
    const int64_t no_keys[] = {0};
    run_kernel(make_problem(q, k0, v0, out, zero, no_keys, true), 1);
    for (float x : out.data) CHECK(x == 0.0f);
}

// Empty axes write nothing and do not crash; D = 0 gives uniform weights.
void test_empty_axes() {
    const int64_t zero[] = {0}, two[] = {2};
    {
        Tensor q(0, 2, 3, 4), k(0, 1, 5, 4), v(0, 1, 5, 3), out(0, 2, 3, 3);
        run_kernel(make_problem(q, k, v, out, nullptr, nullptr, true), 2);
    }
    {
        Tensor q(1, 2, 0, 4), k(1, 1, 5, 4), v(1, 1, 5, 3), out(1, 2, 0, 3);
        const int64_t five[] = {5};
        run_kernel(make_problem(q, k, v, out, zero, five, true), 2);
    }
    {
        Tensor q(1, 1, 1, 0), k(1, 1, 2, 0), v(1, 1, 2, 2), out(1, 1, 1, 2);
        v.data = {1, 2, 3, 6};
        AttentionProblem p = make_problem(q, k, v, out, zero, two, false);
        p.scale = 1.0f;
        run_kernel(p, 1);
        CHECK(out.data[0] == 2.0f && out.data[1] == 4.0f);
    }
    {
        Tensor q(1, 1, 2, 3), k(1, 1, 2, 3), v(1, 1, 2, 0), out(1, 1, 2, 0);
        run_kernel(make_problem(q, k, v, out, zero, two, false), 1);
    }
}

// Non-contiguous views give bit-identical results to contiguous copies, and writes stay in
// their elements: q read as a (B, L, H, D) buffer (swapaxes), k and v with a negative batch
// stride, out and lse with gaps.
void test_strided_views() {
    std::mt19937 rng(23);
    const int64_t B = 2, Hq = 4, Hkv = 2, Lq = 3, Lk = 5, D = 4, Dv = 3;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    const Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const int64_t q_offset[] = {2, 1}, kv_lens[] = {5, 4};
    Tensor expected(B, Hq, Lq, Dv);
    std::vector<float> expected_lse(static_cast<size_t>(B * Hq * Lq));
    AttentionProblem p = make_problem(q, k, v, expected, q_offset, kv_lens, true);
    p.lse = contiguous_lse_view(expected_lse.data(), B, Hq, Lq);
    run_kernel(p, 1);

    Tensor q_blhd(B, Lq, Hq, D);  // q stored (B, L, H, D)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
            for (int64_t i = 0; i < Lq; ++i)
                for (int64_t d = 0; d < D; ++d) q_blhd.at(b, i, h, d) = q.at(b, h, i, d);
    Tensor k_rev(B, Hkv, Lk, D), v_rev(B, Hkv, Lk, Dv);  // batches stored in reverse order
    for (int64_t b = 0; b < B; ++b) {
        std::copy_n(&k.at(b, 0, 0, 0), Hkv * Lk * D, &k_rev.at(B - 1 - b, 0, 0, 0));
        std::copy_n(&v.at(b, 0, 0, 0), Hkv * Lk * Dv, &v_rev.at(B - 1 - b, 0, 0, 0));
    }
    const float sentinel = 12345.0f;
    const int64_t out_row = Dv + 2;  // two unused floats after every output row
    std::vector<float> out_buffer(static_cast<size_t>(B * Hq * Lq * out_row), sentinel);
    std::vector<float> lse_buffer(static_cast<size_t>(B * Hq * Lq * 2), sentinel);

    AttentionProblem s = p;
    s.q = TensorView4{q_blhd.data.data(), {B, Hq, Lq, D}, {Lq * Hq * D, D, Hq * D, 1}};
    s.k = TensorView4{&k_rev.at(B - 1, 0, 0, 0), {B, Hkv, Lk, D}, {-Hkv * Lk * D, Lk * D, D, 1}};
    s.v = TensorView4{&v_rev.at(B - 1, 0, 0, 0), {B, Hkv, Lk, Dv}, {-Hkv * Lk * Dv, Lk * Dv, Dv, 1}};
    s.out = MutTensorView4{out_buffer.data(), {B, Hq, Lq, Dv}, {Hq * Lq * out_row, Lq * out_row, out_row, 1}};
    s.lse = LseView{lse_buffer.data(), {B, Hq, Lq}, {Hq * Lq * 2, Lq * 2, 2}};
    run_kernel(s, 2);
    for (int64_t row = 0; row < B * Hq * Lq; ++row) {
        CHECK(bit_identical(&out_buffer[row * out_row], &expected.data[row * Dv], Dv));
        CHECK(out_buffer[row * out_row + Dv] == sentinel && out_buffer[row * out_row + Dv + 1] == sentinel);
        CHECK(lse_buffer[row * 2] == expected_lse[row] && lse_buffer[row * 2 + 1] == sentinel);
    }
}

// Results do not depend on the number of threads, bit for bit.
void test_threads_bit_identical() {
    std::mt19937 rng(29);
    const int64_t B = 3, Hq = 4, Hkv = 2, Lq = 5, Lk = 7, D = 6, Dv = 5;
    const Tensor q = random_tensor(B, Hq, Lq, D, rng);
    const Tensor k = random_tensor(B, Hkv, Lk, D, rng), v = random_tensor(B, Hkv, Lk, Dv, rng);
    const int64_t q_offset[] = {2, 0, 1}, kv_lens[] = {7, 5, 6};
    Tensor one(B, Hq, Lq, Dv);
    std::vector<float> lse_one(static_cast<size_t>(B * Hq * Lq));
    AttentionProblem p = make_problem(q, k, v, one, q_offset, kv_lens, true);
    p.lse = contiguous_lse_view(lse_one.data(), B, Hq, Lq);
    run_kernel(p, 1);
    for (int threads : {2, 3, 12, 64}) {
        Tensor many(B, Hq, Lq, Dv);
        std::vector<float> lse_many(lse_one.size());
        p.out = many.mut_view();
        p.lse = contiguous_lse_view(lse_many.data(), B, Hq, Lq);
        run_kernel(p, threads);
        CHECK(bit_identical(one.data.data(), many.data.data(), one.data.size()));
        CHECK(bit_identical(lse_one.data(), lse_many.data(), lse_one.size()));
    }
}

// check_problem names the argument, the expectation and what it got.
void test_check_problem_rejects() {
    std::mt19937 rng(31);
    const Tensor q = random_tensor(2, 4, 3, 8, rng);
    const Tensor k = random_tensor(2, 2, 5, 8, rng), v = random_tensor(2, 2, 5, 6, rng);
    Tensor out(2, 4, 3, 6);
    const int64_t q_offset[] = {0, 2}, kv_lens[] = {5, 3};
    const AttentionProblem good = make_problem(q, k, v, out, q_offset, kv_lens, true);
    check_problem(good);  // does not throw

    {   // The message format from the contract.
        AttentionProblem p{};
        p.q = TensorView4{nullptr, {2, 8, 5, 64}, {0, 0, 0, 1}};
        p.k = TensorView4{nullptr, {2, 4, 10, 32}, {0, 0, 0, 1}};
        CHECK_THROWS(std::invalid_argument, check_problem(p),
                     "k: expected shape (B=2, Hkv, Lk, D=64), got (2, 4, 10, 32)");
    }
    AttentionProblem p = good;
    p.k.shape[0] = 3;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "k: expected shape (B=2, Hkv, Lk, D=8), got (3,");
    p = good;
    p.v.shape[2] = 4;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "v: expected shape (B=2, Hkv=2, Lk=5, Dv), got (2, 2, 4, 6)");
    p = good;
    p.out.shape[3] = 5;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "out: expected shape (B=2, Hq=4, Lq=3, Dv=6), got (2, 4, 3, 5)");
    p = good;
    p.q.shape[1] = 3;
    p.out.shape[1] = 3;
    CHECK_THROWS(std::invalid_argument, check_problem(p),
                 "k: expected Hkv dividing Hq=3 (query head h reads KV head h // (Hq // Hkv)), got Hkv=2");
    p = good;
    p.k.shape[1] = 0;
    p.v.shape[1] = 0;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "k: expected Hkv dividing Hq=4 (query head h reads KV head h // (Hq // Hkv)), got Hkv=0");
    p = good;
    p.q.stride[3] = 2;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "q: expected unit stride on the last axis (D=8), got stride 2");
    p = good;
    p.v.stride[3] = -1;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "v: expected unit stride");
    p = good;
    const int64_t too_long[] = {5, 6};
    p.kv_lens = too_long;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "kv_lens: expected values in [0, Lk=5], got kv_lens[1]=6");
    p = good;
    const int64_t negative_len[] = {-1, 3};
    p.kv_lens = negative_len;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "kv_lens: expected values in [0, Lk=5], got kv_lens[0]=-1");
    p = good;
    const int64_t negative_offset[] = {0, -1};
    p.q_offset = negative_offset;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "q_offset: expected values >= 0 when causal, got q_offset[1]=-1");
    p.causal = false;  // any offset without causal
    check_problem(p);
    p.q_offset = Int64Span(q_offset, 1);  // B entries each, causal or not
    CHECK_THROWS(std::invalid_argument, check_problem(p), "q_offset: expected shape (B=2,), got (1,)");
    p = good;
    p.kv_lens = Int64Span(nullptr, 2);
    CHECK_THROWS(std::invalid_argument, check_problem(p), "kv_lens: expected data for a non-empty array of shape (2,), got a null pointer");
    p = good;
    std::vector<float> lse(24);
    p.lse = contiguous_lse_view(lse.data(), 2, 4, 2);
    CHECK_THROWS(std::invalid_argument, check_problem(p), "lse: expected shape (B=2, Hq=4, Lq=3), got (2, 4, 2)");
    p = good;
    p.scale = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS(std::invalid_argument, check_problem(p), "scale: expected a finite number, got nan");
    p.scale = -kInf;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "scale: expected a finite number, got -inf");
    p = good;
    p.mask = MaskView{MaskKind::Bool, nullptr, {2, 4, 3, 5}, {0, 0, 0, 0}};
    CHECK_THROWS(std::invalid_argument, check_problem(p), "mask: expected data");
    const unsigned char allowed[5] = {1, 1, 1, 1, 1};
    p.mask = MaskView{MaskKind::Bool, allowed, {2, 4, 3, 4}, {0, 0, 0, 1}};
    CHECK_THROWS(std::invalid_argument, check_problem(p), "mask: expected shape (B=2, Hq=4, Lq=3, Lk=5), got (2, 4, 3, 4)");
    p.mask.shape[3] = 5;
    check_problem(p);
    p = good;
    p.q.data = nullptr;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "q: expected data");
    p = good;
    p.k.shape[2] = p.v.shape[2] = 0;  // empty: its strides do not matter (NumPy may give 0)
    p.k.stride[3] = p.v.stride[3] = 0;
    const int64_t no_keys[] = {0, 0};
    p.kv_lens = no_keys;
    check_problem(p);
    p = good;
    p.q.shape[2] = -1;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "q: expected shape");
    // Outputs: elements that alias each other, or memory shared with an input.
    p = good;
    p.out.stride[1] = 0;  // every head writes the same rows
    CHECK_THROWS(std::invalid_argument, check_problem(p),
                 "out: expected elements that do not overlap each other, got strides (72, 0, 6, 1)");
    p = good;
    p.out.stride[2] = 4;  // rows of 6 floats 4 apart
    p.out.stride[1] = 12;
    p.out.stride[0] = 48;
    CHECK_THROWS(std::invalid_argument, check_problem(p), "out: expected elements that do not overlap each other");
    p = good;
    p.out = MutTensorView4{const_cast<void*>(p.q.data), {2, 4, 3, 6}, {96, 24, 8, 1}};  // inside q
    CHECK_THROWS(std::invalid_argument, check_problem(p), "out: expected memory disjoint from q, got arrays that overlap");
    p = good;
    p.lse = LseView{static_cast<float*>(const_cast<void*>(p.v.data)), {2, 4, 3}, {12, 3, 1}};  // inside v
    CHECK_THROWS(std::invalid_argument, check_problem(p), "lse: expected memory disjoint from v, got arrays that overlap");
    p = good;
    p.lse = LseView{out.data.data() + 3, {2, 4, 3}, {12, 3, 1}};
    CHECK_THROWS(std::invalid_argument, check_problem(p), "out: expected memory disjoint from lse, got arrays that overlap");
    p = good;
    std::vector<float> lse_storage(24);
    p.lse = LseView{lse_storage.data(), {2, 4, 3}, {3, 3, 1}};  // sequences 0 and 1 share heads
    CHECK_THROWS(std::invalid_argument, check_problem(p), "lse: expected elements that do not overlap each other, got strides (3, 3, 1)");
    p.lse = contiguous_lse_view(lse_storage.data(), 2, 4, 3);
    check_problem(p);
    CHECK(check_num_threads(int64_t{1} << 40) == std::numeric_limits<int>::max());
    CHECK_THROWS(std::invalid_argument, check_num_threads(-5), "num_threads: expected an int >= 1, got -5");
    // The kernel checks too, and rejects num_threads < 1.
    p = good;
    p.kv_lens = too_long;
    CHECK_THROWS(std::invalid_argument, run_kernel(p, 1), "kv_lens: expected values in [0, Lk=5], got kv_lens[1]=6");
    CHECK_THROWS(std::invalid_argument, run_kernel(good, 0), "num_threads: expected an int >= 1, got 0");
}

// Runs every check above on `kernel` (named `name` in the report).
inline void run_contract_tests(const char* name, KernelFn kernel) {
    run_kernel = kernel;
    struct Test {
        const char* name;
        void (*run)();
    };
    const Test tests[] = {
        {"seed_first_row_one_key", test_seed_first_row_one_key},
        {"seed_cached_last_row", test_seed_cached_last_row},
        {"chunked_equals_full", test_chunked_equals_full},
        {"batch_equals_single_sequences", test_batch_equals_single_sequences},
        {"future_does_not_leak", test_future_does_not_leak},
        {"worked_example", test_worked_example},
        {"gqa_head_mapping", test_gqa_head_mapping},
        {"kv_lens_nan_padding", test_kv_lens_nan_padding},
        {"causal_hidden_nan", test_causal_hidden_nan},
        {"masks", test_masks},
        {"rows_without_visible_keys", test_rows_without_visible_keys},
        {"non_finite_inputs_propagate", test_non_finite_inputs_propagate},
        {"empty_axes", test_empty_axes},
        {"strided_views", test_strided_views},
        {"threads_bit_identical", test_threads_bit_identical},
        {"check_problem_rejects", test_check_problem_rejects},
    };
    for (const Test& test : tests) {
        const int before = twinattn_test::failures;
        try {
            test.run();
        } catch (const std::exception& error) {
            std::fprintf(stderr, "%s [%s]: unexpected exception: %s\n", test.name, name, error.what());
            ++twinattn_test::failures;
        }
        std::printf("%s %s [%s]\n", twinattn_test::failures == before ? "ok  " : "FAIL", test.name, name);
    }
}

}  // namespace contract
