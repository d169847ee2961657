// Tests of the backward pass (flash_backward.hpp): attention_backward against a naive float64
// backward written here (P from the float64 forward, FlashAttention-2's formulas), on small
// asymmetric problems (Lq != Lk, Hq = 2 Hkv, D != Dv, odd sizes) with every variant, a problem
// crossing query tiles and key blocks on several threads, and the checks of bad input. The Rust
// twin is rust/tests/backward.rs, with the same cases.
//
// Tolerance: each gradient element is a float32 sum of L terms (L = Lk for dq, Lq G for dk and
// dv) of products of P and dS, where P's relative error is about the unit roundoff times the size
// of the scores and lse (S and lse are float32) and dS = P (dP - Drow) inherits dP's and Drow's
// absolute errors. So |got - want| <= 4 u (sqrt(L) + size) M, with u = 2^-24, size = 2 +
// max |S| + max |lse| + sqrt(max(D, Dv)) and M the element's sum of absolute terms (as
// tests/test_backward_native.py).
#include <algorithm>
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
#include "twinattn/flash_backward.hpp"
#include "twinattn/problem.hpp"

using namespace twinattn;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kUnitRoundoff = 1.0 / 16777216.0;  // 2^-24

struct Case {
    const char* name;
    int64_t B = 2, Hq = 4, Hkv = 2, Lq = 5, Lk = 7, D = 8, Dv = 6;
    bool causal = false;
    std::vector<int64_t> q_offset;  // empty: 0
    std::vector<int64_t> kv_lens;   // empty: Lk
    int64_t window_left = -1, window_right = -1;
    float softcap = 0.0f;
    bool alibi = false, sinks = false;
    bool bool_mask = false;   // with a row that sees nothing
    bool float_mask = false;  // with -inf entries
    int threads = 1;
};

// Everything one case owns, and its problems.
struct Data {
    Case c;
    std::vector<float> q, k, v, out, dout, lse, dq, dk, dv, slopes, sinks, dsinks, bias;
    std::vector<unsigned char> allowed;
    std::vector<int64_t> q_offset, kv_lens;
    float scale;

    explicit Data(const Case& kase) : c(kase), scale(1.0f / std::sqrt(static_cast<float>(kase.D))) {
        std::mt19937 rng(7);
        std::normal_distribution<float> normal;
        const auto fill = [&](std::vector<float>& x, int64_t n) {
            x.resize(static_cast<size_t>(n));
            for (float& value : x) value = normal(rng);
        };
        fill(q, c.B * c.Hq * c.Lq * c.D);
        fill(k, c.B * c.Hkv * c.Lk * c.D);
        fill(v, c.B * c.Hkv * c.Lk * c.Dv);
        fill(dout, c.B * c.Hq * c.Lq * c.Dv);
        out.assign(static_cast<size_t>(c.B * c.Hq * c.Lq * c.Dv), 0.0f);
        lse.assign(static_cast<size_t>(c.B * c.Hq * c.Lq), 0.0f);
        dq.assign(q.size(), std::nanf(""));
        dk.assign(k.size(), std::nanf(""));
        dv.assign(v.size(), std::nanf(""));
        for (int64_t i = 0; i < c.B * c.Hq; ++i) slopes.push_back(0.05f * static_cast<float>(i % 5 + 1));
        for (int64_t h = 0; h < c.Hq; ++h) sinks.push_back(0.5f * static_cast<float>(h) - 1.0f);
        dsinks.assign(static_cast<size_t>(c.Hq), std::nanf(""));
        const int64_t cells = c.B * c.Hq * c.Lq * c.Lk;
        allowed.resize(static_cast<size_t>(cells));
        bias.resize(static_cast<size_t>(cells));
        std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
        for (int64_t i = 0; i < cells; ++i) {
            allowed[i] = uniform(rng) < 0.7f;
            bias[i] = uniform(rng) < 0.25f ? -std::numeric_limits<float>::infinity() : normal(rng);
        }
        for (int64_t j = 0; j < c.Lk; ++j) allowed[((1 * c.Hq + 2) * c.Lq + 3) * c.Lk + j] = 0;  // row (1, 2, 3)
        q_offset = c.q_offset.empty() ? std::vector<int64_t>(static_cast<size_t>(c.B), 0) : c.q_offset;
        kv_lens = c.kv_lens.empty() ? std::vector<int64_t>(static_cast<size_t>(c.B), c.Lk) : c.kv_lens;
    }

    AttentionProblem forward() {
        AttentionProblem p{};
        p.q = contiguous_view(q.data(), c.B, c.Hq, c.Lq, c.D);
        p.k = contiguous_view(k.data(), c.B, c.Hkv, c.Lk, c.D);
        p.v = contiguous_view(v.data(), c.B, c.Hkv, c.Lk, c.Dv);
        p.out = contiguous_mut_view(out.data(), c.B, c.Hq, c.Lq, c.Dv);
        twinattn_test::set_case_options(p, c, lse, q_offset, kv_lens, allowed, slopes, sinks);
        if (c.float_mask)
            p.mask = MaskView{MaskKind::Float, bias.data(), {c.B, c.Hq, c.Lq, c.Lk},
                              {c.Hq * c.Lq * c.Lk, c.Lq * c.Lk, c.Lk, 1}};
        p.window_left = c.window_left;
        p.window_right = c.window_right;
        return p;
    }

    BackwardProblem backward() {
        BackwardProblem bp{};
        bp.forward = forward();
        bp.dout = contiguous_view(dout.data(), c.B, c.Hq, c.Lq, c.Dv);
        bp.dq = contiguous_mut_view(dq.data(), c.B, c.Hq, c.Lq, c.D);
        bp.dk = contiguous_mut_view(dk.data(), c.B, c.Hkv, c.Lk, c.D);
        bp.dv = contiguous_mut_view(dv.data(), c.B, c.Hkv, c.Lk, c.Dv);
        if (c.sinks) bp.dsinks = MutParamView1{dsinks.data(), {c.Hq}, {1}};
        return bp;
    }
};

// The float64 gradients and each element's bound (see the top of the file).
struct Expected {
    std::vector<double> dq, dk, dv, dsinks, dq_bound, dk_bound, dv_bound, dsinks_bound;
};

Expected naive_backward(const Data& x) {
    const Case& c = x.c;
    const int64_t G = c.Hq / c.Hkv;
    Expected e;
    e.dq.assign(x.q.size(), 0.0);
    e.dq_bound.assign(x.q.size(), 0.0);
    e.dk.assign(x.k.size(), 0.0);
    e.dk_bound.assign(x.k.size(), 0.0);
    e.dv.assign(x.v.size(), 0.0);
    e.dv_bound.assign(x.v.size(), 0.0);
    e.dsinks.assign(static_cast<size_t>(c.Hq), 0.0);
    e.dsinks_bound.assign(static_cast<size_t>(c.Hq), 0.0);
    double size = 2.0 + std::sqrt(static_cast<double>(std::max(c.D, c.Dv)));
    double max_score = 0.0, max_lse = 0.0;
    std::vector<double> s(static_cast<size_t>(c.Lk)), t(static_cast<size_t>(c.Lk));
    struct Row { int64_t b, h, i; std::vector<double> p, ds, ds_abs; };
    std::vector<Row> rows;
    for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.Hq; ++h)
            for (int64_t i = 0; i < c.Lq; ++i) {
                const int64_t kv = h / G, row = (b * c.Hq + h) * c.Lq + i;
                const int64_t position = x.q_offset[b] + i;
                double top = c.sinks ? x.sinks[h] : kNegInf;
                for (int64_t j = 0; j < c.Lk; ++j) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < c.D; ++d)
                        dot += double(x.q[row * c.D + d]) * x.k[((b * c.Hkv + kv) * c.Lk + j) * c.D + d];
                    double score = x.scale * dot;
                    t[j] = 0.0;
                    if (c.softcap > 0.0f) {
                        t[j] = std::tanh(score / c.softcap);
                        score = c.softcap * t[j];
                    }
                    if (c.alibi) score -= x.slopes[b * c.Hq + h] * std::fabs(double(position - j));
                    bool visible = j < x.kv_lens[b] && (!c.causal || j <= position) &&
                                   (c.window_left < 0 || j >= position - c.window_left) &&
                                   (c.window_right < 0 || j <= position + c.window_right);
                    const int64_t cell = row * c.Lk + j;
                    if (c.bool_mask) visible = visible && x.allowed[cell];
                    if (c.float_mask) {
                        visible = visible && !std::isinf(x.bias[cell]);
                        if (visible) score += x.bias[cell];
                    }
                    s[j] = visible ? score : kNegInf;
                    if (visible) max_score = std::max(max_score, std::fabs(score));
                    top = std::max(top, s[j]);
                }
                double total = c.sinks ? std::exp(x.sinks[h] - top) : 0.0;
                for (int64_t j = 0; j < c.Lk; ++j) total += s[j] == kNegInf ? 0.0 : std::exp(s[j] - top);
                const double lse = total == 0.0 ? kNegInf : top + std::log(total);
                if (total != 0.0) max_lse = std::max(max_lse, std::fabs(lse));
                double delta = 0.0;  // from the out the kernel is given
                for (int64_t cc = 0; cc < c.Dv; ++cc) delta += double(x.dout[row * c.Dv + cc]) * x.out[row * c.Dv + cc];
                Row r{b, h, i, std::vector<double>(c.Lk, 0.0), std::vector<double>(c.Lk, 0.0), std::vector<double>(c.Lk, 0.0)};
                for (int64_t j = 0; j < c.Lk; ++j) {
                    if (s[j] == kNegInf) continue;
                    r.p[j] = std::exp(s[j] - lse);
                    double dp = 0.0;
                    for (int64_t cc = 0; cc < c.Dv; ++cc)
                        dp += double(x.dout[row * c.Dv + cc]) * x.v[((b * c.Hkv + kv) * c.Lk + j) * c.Dv + cc];
                    const double capped = c.softcap > 0.0f ? 1.0 - t[j] * t[j] : 1.0;
                    r.ds[j] = r.p[j] * (dp - delta) * capped;
                    r.ds_abs[j] = r.p[j] * (std::fabs(dp) + std::fabs(delta)) * capped;
                }
                if (c.sinks && total != 0.0) {
                    const double sink_prob = std::exp(x.sinks[h] - lse);
                    e.dsinks[h] -= sink_prob * delta;
                    e.dsinks_bound[h] += sink_prob * std::fabs(delta);
                }
                rows.push_back(r);
            }
    size += max_score + max_lse;
    for (const Row& r : rows) {
        const int64_t kv = r.h / G, row = (r.b * c.Hq + r.h) * c.Lq + r.i;
        for (int64_t j = 0; j < c.Lk; ++j) {
            if (r.p[j] == 0.0) continue;
            const int64_t key = (r.b * c.Hkv + kv) * c.Lk + j;
            for (int64_t d = 0; d < c.D; ++d) {
                e.dq[row * c.D + d] += x.scale * r.ds[j] * x.k[key * c.D + d];
                e.dq_bound[row * c.D + d] += x.scale * r.ds_abs[j] * std::fabs(x.k[key * c.D + d]);
                e.dk[key * c.D + d] += x.scale * r.ds[j] * x.q[row * c.D + d];
                e.dk_bound[key * c.D + d] += x.scale * r.ds_abs[j] * std::fabs(x.q[row * c.D + d]);
            }
            for (int64_t cc = 0; cc < c.Dv; ++cc) {
                e.dv[key * c.Dv + cc] += r.p[j] * x.dout[row * c.Dv + cc];
                e.dv_bound[key * c.Dv + cc] += r.p[j] * std::fabs(x.dout[row * c.Dv + cc]);
            }
        }
    }
    const auto scale_bounds = [&](std::vector<double>& bound, int64_t terms) {
        for (double& value : bound) value *= 4.0 * kUnitRoundoff * (std::sqrt(double(terms)) + size);
    };
    scale_bounds(e.dq_bound, c.Lk);
    scale_bounds(e.dk_bound, c.Lq * G);
    scale_bounds(e.dv_bound, c.Lq * G);
    scale_bounds(e.dsinks_bound, c.B * c.Lq);
    return e;
}

void check_close(const char* name, const char* gradient, const std::vector<float>& got,
                 const std::vector<double>& want, const std::vector<double>& bound) {
    for (size_t n = 0; n < got.size(); ++n)
        if (!(std::fabs(got[n] - want[n]) <= bound[n])) {  // NaN (an element left unwritten) fails
            std::fprintf(stderr, "%s: %s[%zu] = %.9g, expected %.9g +- %.3g\n", name, gradient, n, got[n], want[n],
                         bound[n]);
            ++twinattn_test::failures;
            return;
        }
}

void test_case(const Case& c) {
    Data x(c);
    attention_forward(x.forward(), 1);
    attention_backward(x.backward(), c.threads);
    const Expected e = naive_backward(x);
    check_close(c.name, "dq", x.dq, e.dq, e.dq_bound);
    check_close(c.name, "dk", x.dk, e.dk, e.dk_bound);
    check_close(c.name, "dv", x.dv, e.dv, e.dv_bound);
    if (c.sinks) check_close(c.name, "dsinks", x.dsinks, e.dsinks, e.dsinks_bound);
    // The thread count changes nothing.
    Data serial(c);
    serial.out = x.out;
    serial.lse = x.lse;
    attention_backward(serial.backward(), 1);
    CHECK(std::equal(x.dq.begin(), x.dq.end(), serial.dq.begin()));
    CHECK(std::equal(x.dk.begin(), x.dk.end(), serial.dk.begin()));
    CHECK(std::equal(x.dv.begin(), x.dv.end(), serial.dv.begin()));
}

std::vector<Case> cases() {
    std::vector<Case> list;
    const auto add = [&](const char* name, auto set) {
        Case c;
        c.name = name;
        set(c);
        list.push_back(c);
    };
    add("plain", [](Case&) {});
    add("causal_offset", [](Case& c) { c.causal = true; c.q_offset = {2, 0}; });
    add("kv_lens", [](Case& c) { c.kv_lens = {7, 3}; });
    add("kv_len_zero_causal", [](Case& c) { c.causal = true; c.kv_lens = {0, 4}; });
    add("window", [](Case& c) { c.window_left = 2; c.window_right = 1; c.q_offset = {1, 3}; });
    add("softcap", [](Case& c) { c.softcap = 2.5f; });
    add("alibi", [](Case& c) { c.alibi = true; c.q_offset = {1, 2}; });
    add("sinks", [](Case& c) { c.sinks = true; c.kv_lens = {5, 0}; });
    add("bool_mask", [](Case& c) { c.bool_mask = true; });
    add("float_mask", [](Case& c) { c.float_mask = true; });
    add("everything", [](Case& c) {
        c.causal = true; c.q_offset = {2, 1}; c.kv_lens = {6, 5}; c.window_left = 3; c.softcap = 4.0f;
        c.alibi = true; c.sinks = true; c.float_mask = true;
    });
    // 4 heads on one KV head over 60 positions: 240 packed rows (5 query tiles, two chunks of the
    // fused pass); 150 keys (3 key blocks); 3 threads, which run passes 2 and 3 on its 2
    // (sequence, KV head) pairs, checked bit for bit against 1 thread, which runs the fused pass.
    add("tiles", [](Case& c) {
        c.Hq = 4; c.Hkv = 1; c.Lq = 60; c.Lk = 150; c.D = 20; c.Dv = 12; c.causal = true; c.q_offset = {120, 40};
        c.kv_lens = {150, 101}; c.window_left = 90; c.softcap = 5.0f; c.sinks = true; c.threads = 3;
    });
    return list;
}

void test_bad_input() {
    Case c;
    c.name = "bad";
    Data x(c);
    attention_forward(x.forward(), 1);
    {
        BackwardProblem bp = x.backward();
        bp.dq.shape[3] = 9;
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1),
                     "dq: expected shape (B=2, Hq=4, Lq=5, D=8), got (2, 4, 5, 9)");
    }
    {
        BackwardProblem bp = x.backward();
        bp.forward.lse.data = nullptr;
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1), "lse: required");
    }
    {
        BackwardProblem bp = x.backward();
        bp.dsinks = MutParamView1{x.dsinks.data(), {4}, {1}};
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1), "dsinks: expected None without sinks");
    }
    {
        BackwardProblem bp = x.backward();
        bp.forward.kv_int8 = true;
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1), "int8 keys and values carry no gradient");
    }
    {
        BackwardProblem bp = x.backward();
        bp.dq.data = x.q.data();
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1),
                     "dq: expected memory disjoint from q, got arrays that overlap");
    }
    {
        BackwardProblem bp = x.backward();
        bp.dv.data = x.dk.data();  // dv over dk (both have 2 * 2 * 7 rows; Dv < D)
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1),
                     "dv: expected memory disjoint from dk, got arrays that overlap");
    }
    {
        BackwardProblem bp = x.backward();
        bp.dk.stride[1] = 0;
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 1),
                     "dk: expected elements that do not overlap each other");
    }
    {
        BackwardProblem bp = x.backward();
        CHECK_THROWS(std::invalid_argument, attention_backward(bp, 0), "num_threads: expected an int >= 1, got 0");
    }
}

}  // namespace

// The bfloat16 tile path (avx512bf16 and amxbf16: bfloat16 with D a multiple of 32, products on
// bfloat16 pairs, VDPBF16PS or AMX tiles, P and dS rounded to bfloat16; docs/kernels.md,
// "Backward"), on a case of 3 query tiles and 3 key blocks: 1 and 3 threads give the same bits;
// the result is not avx512's (float32 products) but within bfloat16's rounding of it (2^-5 of each gradient's largest element: P and dS carry
// 2^-8 each, the result's rounding 2^-9); NaN in the keys no row sees (past sequence 0's last
// position, below its kv_len) gives finite gradients as close, and 0 for those keys.
struct Bf16Grads {
    std::vector<BFloat16> dq, dk, dv;
};

void test_bf16_tile_path(const std::string& isa) {
    Case c;
    c.name = "bf16_tiles";
    c.Hq = 8; c.Hkv = 2; c.Lq = 70; c.Lk = 150; c.D = 64; c.Dv = 32; c.causal = true; c.q_offset = {60, 0};
    c.kv_lens = {150, 111}; c.softcap = 5.0f; c.sinks = true;
    Data x(c);
    const auto rounded = [](const std::vector<float>& values) {
        std::vector<BFloat16> out(values.size());
        for (size_t i = 0; i < values.size(); ++i) from_f32(values[i], &out[i]);
        return out;
    };
    std::vector<BFloat16> q = rounded(x.q), k = rounded(x.k), v = rounded(x.v), dout = rounded(x.dout);
    std::vector<BFloat16> out(x.out.size());
    const auto problem = [&](Bf16Grads& g) {
        g = Bf16Grads{std::vector<BFloat16>(q.size()), std::vector<BFloat16>(k.size()), std::vector<BFloat16>(v.size())};
        BackwardProblem bp = x.backward();
        bp.forward.dtype = ElementType::BFloat16;
        bp.forward.q.data = q.data();
        bp.forward.k.data = k.data();
        bp.forward.v.data = v.data();
        bp.forward.out.data = out.data();
        bp.dout.data = dout.data();
        bp.dq.data = g.dq.data();
        bp.dk.data = g.dk.data();
        bp.dv.data = g.dv.data();
        return bp;
    };
    const auto bits = [](const std::vector<BFloat16>& values) {
        std::vector<uint16_t> out;
        for (const BFloat16& value : values) out.push_back(value.bits);
        return out;
    };
    // max |a - b| <= 2^-5 max |b| per gradient, every element finite; returns whether a != b
    const auto close = [](const std::vector<BFloat16>& a, const std::vector<BFloat16>& b) {
        double largest = 0.0, error = 0.0;
        bool differ = false;
        for (size_t i = 0; i < a.size(); ++i) {
            CHECK(std::isfinite(to_f32(a[i])));
            largest = std::max(largest, std::fabs(static_cast<double>(to_f32(b[i]))));
            error = std::max(error, std::fabs(static_cast<double>(to_f32(a[i])) - to_f32(b[i])));
            differ = differ || a[i].bits != b[i].bits;
        }
        CHECK(error <= largest / 32.0);
        return differ;
    };
    Bf16Grads tiles, threads, floats, poisoned;
    set_isa(isa);
    BackwardProblem bp = problem(tiles);
    attention_forward(bp.forward, 1);
    attention_backward(bp, 1);
    attention_backward(problem(threads), 3);
    CHECK(bits(tiles.dq) == bits(threads.dq) && bits(tiles.dk) == bits(threads.dk) && bits(tiles.dv) == bits(threads.dv));
    set_isa("avx512");
    attention_backward(problem(floats), 1);
    CHECK(close(tiles.dq, floats.dq) & close(tiles.dk, floats.dk) & close(tiles.dv, floats.dv));
    set_isa(isa);
    for (int64_t kv_head = 0; kv_head < c.Hkv; ++kv_head)
        for (int64_t key = 130; key < c.Lk; ++key) {  // sequence 0's positions end at 60 + 69
            for (int64_t d = 0; d < c.D; ++d) k[(kv_head * c.Lk + key) * c.D + d] = BFloat16{0x7fc0};
            for (int64_t e = 0; e < c.Dv; ++e) v[(kv_head * c.Lk + key) * c.Dv + e] = BFloat16{0x7fc0};
        }
    attention_backward(problem(poisoned), 1);
    close(poisoned.dq, tiles.dq);
    close(poisoned.dk, tiles.dk);
    close(poisoned.dv, tiles.dv);
    for (int64_t kv_head = 0; kv_head < c.Hkv; ++kv_head)
        for (int64_t key = 130; key < c.Lk; ++key) {
            for (int64_t d = 0; d < c.D; ++d) CHECK(to_f32(poisoned.dk[(kv_head * c.Lk + key) * c.D + d]) == 0.0f);
            for (int64_t e = 0; e < c.Dv; ++e) CHECK(to_f32(poisoned.dv[(kv_head * c.Lk + key) * c.Dv + e]) == 0.0f);
        }
}

int main() {
    // Every instruction set: the backward's inner products are each one's own kernels.
    const std::vector<std::string> isas = available_isas();
    for (const std::string& isa : isas) {
        set_isa(isa);
        for (const Case& c : cases()) test_case(c);
    }
    for (const char* isa : {"avx512bf16", "amxbf16"})
        if (std::find(isas.begin(), isas.end(), isa) != isas.end()) test_bf16_tile_path(isa);
    test_bad_input();
    if (twinattn_test::failures != 0) std::fprintf(stderr, "%d check(s) failed\n", twinattn_test::failures);
    else std::printf("test_backward: all checks passed\n");
    return twinattn_test::failures != 0;
}
