// Tests of the fast kernel (flash_attention.hpp): every instruction set this machine runs against
// the scalar reference kernel (attention_reference, accumulated in double), over tile-boundary
// sizes, causal offsets, kv_lens, masks, GQA, strided views, a 32k-key decode, the split-key
// merge, thread counts and concurrent callers; plus the dispatch and the thread pool.
//
// Tolerances (inputs uniform in [-1, 1], scale 1/sqrt(D)): the fast kernel works in float32.
// A score is a D-term float32 dot product (relative error about sqrt(D) * 2^-24 typical, D * 2^-24
// worst), exp2 is a polynomial with relative error <= 8.4e-8, and l and O are float32 sums over
// up to 32k keys whose rounding grows like sqrt(n) * 2^-24 (about 2e-5 relative at 32k keys, the
// per-block sums being exact to a few ulp). Hence out: |fast - ref| <= 1e-4 * (1 + |ref|) and
// lse: |fast - ref| <= 1e-4 * (1 + |ref|); both well above the observed errors (printed on
// failure) and far below any algorithmic mistake (a wrong or missing key moves out by >= 1e-3).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "contract.hpp"
#include "dispatch.hpp"
#include "thread_pool.hpp"
#include "twinattn/constants.hpp"
#include "twinattn/flash_attention.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

using namespace twinattn;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kTolerance = 1e-4;

enum class Mask { None, Bool, Float, BroadcastBool };

struct Case {
    int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lk = 1, D = 8, Dv = 8;
    bool causal = false;
    std::vector<int64_t> q_offset;  // empty: bottom-right (kv_len - Lq, clamped at 0)
    std::vector<int64_t> kv_lens;   // empty: Lk
    Mask mask = Mask::None;
    bool strided = false;        // q, k, v, out as (B, L, H, D) arrays viewed as (B, H, L, D)
    bool nan_in_hidden = false;  // NaN in keys / values past kv_len and in the causal future
    int threads = 2;
    uint32_t seed = 1;
    // Variants (issue 13): window sides, softcap, per-(b, h) ALiBi slopes, per-head sinks, and a
    // multiplier of the scale (large scores for softcap).
    int64_t window_left = -1, window_right = -1;
    float softcap = 0.0f;
    bool alibi = false, sinks = false;
    float scale_multiplier = 1.0f;
};

std::string describe(const Case& c) {
    char text[256];
    std::snprintf(text, sizeof text,
                  "B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld causal=%d mask=%d strided=%d nan=%d threads=%d "
                  "window=(%lld,%lld) softcap=%g alibi=%d sinks=%d scale*=%g",
                  (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.Lq, (long long)c.Lk,
                  (long long)c.D, (long long)c.Dv, c.causal, int(c.mask), c.strided, c.nan_in_hidden, c.threads,
                  (long long)c.window_left, (long long)c.window_right, c.softcap, c.alibi, c.sinks,
                  c.scale_multiplier);
    return text;
}

// Storage for one (B, H, L, X) tensor, either contiguous (B, H, L, X) or (B, L, H, X).
struct Storage {
    int64_t shape[4];
    bool strided;
    std::vector<float> data;
    Storage(int64_t B, int64_t H, int64_t L, int64_t X, bool strided_layout)
        : shape{B, H, L, X}, strided(strided_layout), data(static_cast<size_t>(B * H * L * X), 0.0f) {}
    int64_t stride(int axis) const {
        const int64_t H = shape[1], L = shape[2], X = shape[3];
        if (!strided) {
            const int64_t s[4] = {H * L * X, L * X, X, 1};
            return s[axis];
        }
        const int64_t s[4] = {H * L * X, X, H * X, 1};
        return s[axis];
    }
    float& at(int64_t b, int64_t h, int64_t l, int64_t x) {
        return data[static_cast<size_t>(b * stride(0) + h * stride(1) + l * stride(2) + x)];
    }
    TensorView4 view() const {
        return TensorView4{data.data(), {shape[0], shape[1], shape[2], shape[3]}, {stride(0), stride(1), stride(2), 1}};
    }
    MutTensorView4 mut_view() {
        return MutTensorView4{data.data(), {shape[0], shape[1], shape[2], shape[3]}, {stride(0), stride(1), stride(2), 1}};
    }
};

struct Inputs {
    Case c;
    Storage q, k, v;
    std::vector<int64_t> q_offset, kv_lens;
    std::vector<unsigned char> bool_mask;
    std::vector<float> bias;
    int64_t mask_stride[4] = {0, 0, 0, 0};
    std::vector<float> slopes, sinks;  // (B, Hq), (Hq,)

    explicit Inputs(const Case& cs)
        : c(cs), q(cs.B, cs.Hq, cs.Lq, cs.D, cs.strided), k(cs.B, cs.Hkv, cs.Lk, cs.D, cs.strided),
          v(cs.B, cs.Hkv, cs.Lk, cs.Dv, cs.strided) {
        std::mt19937 rng(cs.seed);
        std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
        for (float& x : q.data) x = uniform(rng);
        for (float& x : k.data) x = uniform(rng);
        for (float& x : v.data) x = uniform(rng);
        kv_lens = cs.kv_lens.empty() ? std::vector<int64_t>(static_cast<size_t>(cs.B), cs.Lk) : cs.kv_lens;
        q_offset = cs.q_offset;
        if (q_offset.empty())
            for (int64_t b = 0; b < cs.B; ++b) q_offset.push_back(std::max<int64_t>(0, kv_lens[b] - cs.Lq));
        if (cs.nan_in_hidden)
            for (int64_t b = 0; b < cs.B; ++b) {
                // Past kv_len, past the last query's position when causal or past its window,
                // and before the first query's window.
                int64_t first_hidden = kv_lens[b];
                if (cs.causal) first_hidden = std::min(first_hidden, q_offset[b] + cs.Lq);
                if (cs.window_right >= 0)
                    first_hidden = std::min(first_hidden, q_offset[b] + cs.Lq + cs.window_right);
                const int64_t last_hidden = cs.window_left >= 0 ? q_offset[b] - cs.window_left : 0;
                for (int64_t g = 0; g < cs.Hkv; ++g)
                    for (int64_t j = 0; j < cs.Lk; ++j) {
                        if (j >= std::max<int64_t>(first_hidden, 0) || j < last_hidden) {
                            for (int64_t d = 0; d < cs.D; ++d) k.at(b, g, j, d) = kNaN;
                            for (int64_t d = 0; d < cs.Dv; ++d) v.at(b, g, j, d) = kNaN;
                        }
                    }
            }
        const int64_t count = cs.B * cs.Hq * cs.Lq * cs.Lk;
        const int64_t dense[4] = {cs.Hq * cs.Lq * cs.Lk, cs.Lq * cs.Lk, cs.Lk, 1};
        std::copy(dense, dense + 4, mask_stride);
        if (cs.mask == Mask::Bool) {
            bool_mask.resize(static_cast<size_t>(count));
            for (auto& m : bool_mask) m = (rng() % 4) != 0;
        } else if (cs.mask == Mask::Float) {
            bias.resize(static_cast<size_t>(count));
            for (auto& x : bias) x = (rng() % 5) == 0 ? -kInf : uniform(rng);
        } else if (cs.mask == Mask::BroadcastBool) {  // one (Lk,) row broadcast with stride 0
            bool_mask.resize(static_cast<size_t>(cs.Lk));
            for (auto& m : bool_mask) m = (rng() % 3) != 0;
            const int64_t broadcast[4] = {0, 0, 0, 1};
            std::copy(broadcast, broadcast + 4, mask_stride);
        }
        if (cs.alibi) {  // distinct slopes per (b, h), as 2^(-8 h / Hq) scaled per sequence
            for (int64_t b = 0; b < cs.B; ++b)
                for (int64_t h = 0; h < cs.Hq; ++h)
                    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(cs.Hq)) *
                                     (1.0f + 0.25f * static_cast<float>(b)));
        }
        if (cs.sinks)
            for (int64_t h = 0; h < cs.Hq; ++h) sinks.push_back(2.0f * uniform(rng) + 0.5f);
    }

    AttentionProblem problem(Storage& out, std::vector<float>& lse) const {
        AttentionProblem p{};
        p.q = q.view();
        p.k = k.view();
        p.v = v.view();
        p.out = out.mut_view();
        p.lse = contiguous_lse_view(lse.data(), c.B, c.Hq, c.Lq);
        p.q_offset = q_offset;
        p.kv_lens = kv_lens;
        p.mask = MaskView{MaskKind::None, nullptr, {}, {}};
        if (!bool_mask.empty()) p.mask = MaskView{MaskKind::Bool, bool_mask.data(), {c.B, c.Hq, c.Lq, c.Lk}, {}};
        if (!bias.empty()) p.mask = MaskView{MaskKind::Float, bias.data(), {c.B, c.Hq, c.Lq, c.Lk}, {}};
        std::copy(mask_stride, mask_stride + 4, p.mask.stride);
        p.causal = c.causal;
        p.scale = c.scale_multiplier / std::sqrt(static_cast<float>(std::max<int64_t>(c.D, 1)));
        p.window_left = c.window_left;
        p.window_right = c.window_right;
        p.softcap = c.softcap;
        if (c.alibi) p.alibi_slopes = ParamView2{slopes.data(), {c.B, c.Hq}, {c.Hq, 1}};
        if (c.sinks) p.sinks = ParamView1{sinks.data(), {c.Hq}, {1}};
        return p;
    }
};

struct Result {
    Storage out;
    std::vector<float> lse;
};

Result run(const Inputs& in, bool fast, int threads) {
    Result r{Storage(in.c.B, in.c.Hq, in.c.Lq, in.c.Dv, in.c.strided),
             std::vector<float>(static_cast<size_t>(in.c.B * in.c.Hq * in.c.Lq), kNaN)};
    std::fill(r.out.data.begin(), r.out.data.end(), kNaN);  // every element must be written
    const AttentionProblem p = in.problem(r.out, r.lse);
    if (fast) attention_forward(p, threads);
    else attention_reference(p, 1);
    return r;
}

bool near(double actual, double expected) {
    if (std::isinf(expected)) return actual == expected;
    return std::fabs(actual - expected) <= kTolerance * (1.0 + std::fabs(expected));
}

// The fast kernel against the reference for one case; returns the worst error seen.
double check_case(const Case& c, const char* isa) {
    const Inputs in(c);
    const Result expected = run(in, false, 1);
    const Result actual = run(in, true, c.threads);
    double worst = 0.0;
    int reported = 0;
    for (size_t n = 0; n < expected.out.data.size(); ++n) {
        const double a = actual.out.data[n], e = expected.out.data[n];
        if (std::isfinite(e)) worst = std::max(worst, std::fabs(a - e));
        if (!near(a, e) && reported++ < 3) {
            std::fprintf(stderr, "[%s] %s: out[%zu] = %.9g, expected %.9g\n", isa, describe(c).c_str(), n, a, e);
            ++twinattn_test::failures;
        }
    }
    for (size_t n = 0; n < expected.lse.size(); ++n) {
        const double a = actual.lse[n], e = expected.lse[n];
        if (!near(a, e) && reported++ < 3) {
            std::fprintf(stderr, "[%s] %s: lse[%zu] = %.9g, expected %.9g\n", isa, describe(c).c_str(), n, a, e);
            ++twinattn_test::failures;
        }
    }
    return worst;
}

// ---- the case tables --------------------------------------------------------------------------

const int64_t kBoundarySizes[] = {1, 5, 6, 7, 15, 16, 17, 47, 48, 49, 63, 64, 65, 255, 256, 257};

std::vector<Case> boundary_cases() {
    std::vector<Case> cases;
    // Each of Lq, Lk, D, Dv swept over the tile boundaries, the others moderate.
    for (int64_t n : kBoundarySizes) {
        for (bool causal : {false, true}) {
            Case c;
            c.Hq = 4, c.Hkv = 2, c.Lq = n, c.Lk = std::max<int64_t>(n, 40), c.D = 24, c.Dv = 20, c.causal = causal;
            cases.push_back(c);  // Lq (packed rows 2n: both paths)
            c.Lq = 9, c.Lk = n;
            c.q_offset = {causal ? std::max<int64_t>(0, n - 9) : 0};
            cases.push_back(c);  // Lk
            c.q_offset.clear();
            c.Lq = 30, c.Lk = 70, c.D = n;
            cases.push_back(c);  // D
            c.D = 16, c.Dv = n;
            cases.push_back(c);  // Dv
        }
    }
    // Tiles of GQA-packed rows and key blocks crossing together.
    for (int64_t lq : {48, 49, 96, 100}) {
        Case c;
        c.B = 2, c.Hq = 8, c.Hkv = 2, c.Lq = lq, c.Lk = 600, c.D = 64, c.Dv = 48, c.causal = true;
        cases.push_back(c);
        c.causal = false, c.D = 65, c.Dv = 129;
        cases.push_back(c);
    }
    return cases;
}

std::vector<Case> contract_cases() {
    std::vector<Case> cases;
    Case base;
    base.B = 3, base.Hq = 6, base.Hkv = 3, base.Lq = 37, base.Lk = 300, base.D = 32, base.Dv = 24;
    // Causal with explicit offsets (0: right-padded prompts; mid; past the end).
    for (std::vector<int64_t> offsets : {std::vector<int64_t>{0, 0, 0}, {5, 263, 100}, {400, 2, 290}}) {
        Case c = base;
        c.causal = true, c.q_offset = offsets;
        cases.push_back(c);
        c.kv_lens = {300, 17, 0};
        cases.push_back(c);
    }
    // kv_lens, masks, broadcast masks, NaN in every hidden key, strided views.
    for (Mask mask : {Mask::None, Mask::Bool, Mask::Float, Mask::BroadcastBool})
        for (bool causal : {false, true})
            for (bool strided : {false, true}) {
                Case c = base;
                c.mask = mask, c.causal = causal, c.strided = strided;
                c.kv_lens = {300, 129, 1};
                c.nan_in_hidden = mask == Mask::None;
                cases.push_back(c);
                c.Lq = 2;  // split-key path
                cases.push_back(c);
            }
    // MHA, MQA, GQA with many heads per group.
    for (int64_t hkv : {8, 4, 1}) {
        Case c = base;
        c.B = 1, c.Hq = 8, c.Hkv = hkv, c.Lq = 50, c.causal = true;
        cases.push_back(c);
        c.Lq = 3;
        cases.push_back(c);
    }
    // Split-key: long and ragged caches, several chunks per group, causal chunks with offsets.
    {
        Case c;
        c.B = 3, c.Hq = 8, c.Hkv = 2, c.Lq = 4, c.Lk = 5000, c.D = 64, c.Dv = 64, c.causal = true;
        c.kv_lens = {5000, 1024, 2049};
        c.nan_in_hidden = true;
        cases.push_back(c);
        c.causal = false;
        cases.push_back(c);
        c.mask = Mask::Float, c.nan_in_hidden = false;
        cases.push_back(c);
        c.mask = Mask::None, c.Lq = 12, c.Hq = 8, c.Hkv = 2;  // 48 packed rows: still split-key
        c.causal = true;
        cases.push_back(c);
    }
    // Direct split-key scores (rows_per_group <= kDirectScoreRows: every G here at Lq = 1; at
    // Lq = 4, G <= 6 is direct (4 strips at G = 6) and G >= 7 takes the panels): D around the vector widths, kv_len around the 4-key batches, the vector
    // width, the key block and the chunk, masks and NaN in hidden keys.
    {
        static_assert(kDirectScoreRows == 24, "the sweep below straddles the direct path's bound");
        int64_t i = 0;
        for (int64_t D : {1, 15, 16, 17, 64, 80, 128, 129})
            for (int64_t G = 1; G <= 8; ++G)
                for (int64_t lk : {1, 3, 4, 5, 15, 16, 17, 33, 255, 257, 1023, 1025}) {
                    if ((D + G + lk + i++) % 5 != 0 && lk != 17) continue;
                    Case c;
                    c.B = 2, c.Hkv = 2, c.Hq = 2 * G, c.Lq = i % 4 == 0 ? 4 : 1, c.Lk = lk + 3, c.D = D, c.Dv = 24;
                    c.kv_lens = {lk, std::max<int64_t>(1, lk / 2)};
                    c.causal = i % 2 == 0;
                    c.mask = i % 3 == 0 ? Mask::Bool : i % 3 == 1 ? Mask::Float : Mask::None;
                    c.nan_in_hidden = true;
                    cases.push_back(c);
                }
    }
    // Decode against 32k keys (GQA 8/2, D = Dv = 128) and a 256-query chunk after 1000 cached keys.
    {
        Case c;
        c.Hq = 8, c.Hkv = 2, c.Lq = 1, c.Lk = 32768, c.D = 128, c.Dv = 128, c.causal = true;
        cases.push_back(c);
        c.Lq = 256, c.Lk = 1256, c.Hq = 4;
        cases.push_back(c);
    }
    // Variants (issue 13): windows straddling key blocks (256), panels (32) and split-key chunks
    // (1024), with NaN in every key outside the windows; empty windows (past the end, before
    // the start, negative offsets); softcap with large scores; ALiBi; sinks on both paths,
    // including split-key decode with several chunks; and all of them together.
    {
        struct Window { int64_t left, right; };
        const Window windows[] = {{-1, -1}, {0, 0}, {5, -1}, {100, 0}, {255, 1}, {300, 40}, {-1, 7}, {1023, 0}, {1500, 2000}};
        int64_t i = 0;
        for (const Window& w : windows)
            for (int64_t lq : {1, 4, 40, 130})
                for (bool causal : {false, true}) {
                    ++i;
                    Case c;
                    c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = lq, c.Lk = 2600, c.D = 40, c.Dv = 24, c.causal = causal;
                    c.kv_lens = {2600, 1900};
                    c.window_left = w.left, c.window_right = w.right;
                    c.nan_in_hidden = true;
                    c.q_offset = {i % 3 == 0 ? 700 : 2600 - lq, causal ? 1000 : (i % 2 ? -50 : 1900 - lq)};
                    c.alibi = i % 4 == 1;
                    c.sinks = i % 3 == 1;
                    c.softcap = i % 5 == 2 ? 4.0f : 0.0f;
                    c.scale_multiplier = c.softcap > 0 ? 20.0f : 1.0f;
                    c.mask = i % 7 == 3 ? Mask::Float : i % 7 == 5 ? Mask::Bool : Mask::None;
                    if (c.mask != Mask::None) c.nan_in_hidden = false;
                    cases.push_back(c);
                }
        // Empty windows: a window past kv_len, before key 0, all rows; with and without sinks.
        for (bool sinks : {false, true})
            for (int64_t lq : {1, 60}) {
                Case c;
                c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lq = lq, c.Lk = 300, c.D = 16, c.Dv = 8, c.sinks = sinks;
                c.window_left = 10, c.window_right = 5;
                c.q_offset = {400, -100};
                cases.push_back(c);
            }
        // Softcap alone with very large scores, both paths; ALiBi alone; sinks on a 3-chunk decode.
        for (int64_t lq : {1, 64}) {
            Case c;
            c.Hq = 4, c.Hkv = 4, c.Lq = lq, c.Lk = 3000, c.D = 64, c.Dv = 64, c.causal = true;
            c.softcap = 30.0f, c.scale_multiplier = 200.0f;
            cases.push_back(c);
            c.softcap = 0.0f, c.scale_multiplier = 1.0f, c.alibi = true;
            cases.push_back(c);
            c.alibi = false, c.sinks = true;
            cases.push_back(c);
            c.alibi = true, c.softcap = 50.0f, c.window_left = 1000;
            cases.push_back(c);
        }
    }
    // Empty axes and degenerate sizes.
    for (auto dims : {std::vector<int64_t>{0, 2, 4, 8}, {1, 0, 4, 8}, {1, 2, 0, 8}, {1, 2, 4, 0}}) {
        Case c;
        c.B = dims[0], c.Hq = dims[1], c.Hkv = dims[1] == 0 ? 1 : 2, c.Lq = dims[2], c.Lk = 9, c.D = dims[3], c.Dv = 5;
        if (c.Hq == 0) c.Hkv = 0;
        cases.push_back(c);
    }
    {
        Case c;
        c.Lk = 0, c.Lq = 3;
        cases.push_back(c);
        c.Lq = 60;
        cases.push_back(c);
    }
    return cases;
}

void test_every_isa_against_reference() {
    std::vector<Case> cases = boundary_cases();
    for (const Case& c : contract_cases()) cases.push_back(c);
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        CHECK(current_isa() == isa);
        double worst = 0.0;
        for (Case c : cases) {
            c.seed = static_cast<uint32_t>(c.Lq * 131 + c.Lk * 7 + c.D);
            worst = std::max(worst, check_case(c, isa.c_str()));
        }
        std::printf("%s: %zu cases, worst |out - reference| = %.3g\n", isa.c_str(), cases.size(), worst);
    }
}

// Non-finite inputs at visible positions: the fast kernel gives the plain kernel's NaN / +inf /
// -inf pattern in out and lse, element by element, and its finite values (the rule of
// twinattn/reference.py: a NaN score makes the row NaN; a +inf score makes out NaN and lse +inf;
// NaN or inf in v reaches its column). A -inf bias hides a key whose k and v rows hold NaN.
int check_pattern(const Inputs& in, const char* isa, const char* what) {
    const Result expected = run(in, false, 1);
    const Result actual = run(in, true, in.c.threads);
    int nonfinite = 0, reported = 0;
    auto same = [](double a, double e) {
        if (std::isnan(e)) return std::isnan(a);
        if (std::isinf(e)) return a == e;
        return std::isfinite(a) && std::fabs(a - e) <= kTolerance * (1.0 + std::fabs(e));
    };
    for (int pass = 0; pass < 2; ++pass) {
        const std::vector<float>& e = pass == 0 ? expected.out.data : expected.lse;
        const std::vector<float>& a = pass == 0 ? actual.out.data : actual.lse;
        for (size_t n = 0; n < e.size(); ++n) {
            nonfinite += !std::isfinite(e[n]);
            if (!same(a[n], e[n]) && reported++ < 3) {
                std::fprintf(stderr, "[%s] %s, %s: %s[%zu] = %.9g, expected %.9g\n", isa, what,
                             describe(in.c).c_str(), pass == 0 ? "out" : "lse", n, a[n], e[n]);
                ++twinattn_test::failures;
            }
        }
    }
    return nonfinite;
}

void test_nonfinite_patterns_match_reference() {
    std::vector<Case> paths;
    {
        Case c;  // direct split-key scores: 8 packed rows, two key chunks
        c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = 2, c.Lk = 1500, c.D = 40, c.Dv = 24, c.causal = true;
        paths.push_back(c);
        c.Hq = 16, c.Hkv = 2, c.Lq = 4, c.causal = false;  // 32 rows: split-key panels
        paths.push_back(c);
        c.Hq = 4, c.Lq = 70, c.Lk = 600, c.causal = true;  // prefill tiles, diagonal
        paths.push_back(c);
    }
    const float values[] = {kNaN, kInf, -kInf};
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        int nonfinite = 0;
        for (const Case& path : paths)
            for (float value : values) {
                const int64_t key = 3;  // visible to every row
                {
                    Inputs in(path);
                    in.q.at(1, 1, path.Lq - 1, 5) = value;
                    nonfinite += check_pattern(in, isa.c_str(), "q row");
                }
                {
                    Inputs in(path);
                    in.k.at(0, 1, key, 2) = value;
                    in.k.at(1, 0, path.Lk - 300, 7) = value;  // a later key block (non-causal rows)
                    nonfinite += check_pattern(in, isa.c_str(), "k row");
                }
                {
                    Inputs in(path);
                    in.v.at(1, 1, key, path.Dv - 1) = value;
                    nonfinite += check_pattern(in, isa.c_str(), "v row");
                }
                {
                    Case c = path;
                    c.mask = Mask::Float;
                    Inputs in(c);
                    in.bias[static_cast<size_t>(((1 * c.Hq + 2) * c.Lq + c.Lq - 1) * c.Lk + key)] = value;
                    nonfinite += check_pattern(in, isa.c_str(), "bias");
                }
            }
        CHECK(nonfinite > 0);  // the cases do produce NaN / inf (the plain kernel says so)
        std::printf("%s: non-finite patterns match the plain kernel (%d non-finite results)\n", isa.c_str(), nonfinite);
    }
}

// A -inf bias hides a key exactly like a False bool mask, even when that key's k and v rows hold
// NaN: the plain and the fast kernel both give the result of the bool mask.
void test_minus_inf_bias_hides_nan_keys() {
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        for (int64_t lq : {1, 12, 70}) {
            Case c;
            c.Hq = 2, c.Hkv = 1, c.Lq = lq, c.Lk = 300, c.D = 16, c.Dv = 8, c.mask = Mask::Float;
            Inputs with_bias(c);
            c.mask = Mask::Bool;
            Inputs with_bool(c);
            with_bool.q = with_bias.q, with_bool.k = with_bias.k, with_bool.v = with_bias.v;
            for (size_t n = 0; n < with_bias.bias.size(); ++n) with_bias.bias[n] = 0.0f;
            for (size_t n = 0; n < with_bool.bool_mask.size(); ++n) with_bool.bool_mask[n] = 1;
            for (int64_t j : {0, 7, 200}) {  // hidden from every row, NaN in k and v
                for (int64_t d = 0; d < c.D; ++d) with_bias.k.at(0, 0, j, d) = with_bool.k.at(0, 0, j, d) = kNaN;
                for (int64_t d = 0; d < c.Dv; ++d) with_bias.v.at(0, 0, j, d) = with_bool.v.at(0, 0, j, d) = kNaN;
                for (int64_t row = 0; row < c.Hq * c.Lq; ++row) {
                    with_bias.bias[static_cast<size_t>(row * c.Lk + j)] = -kInf;
                    with_bool.bool_mask[static_cast<size_t>(row * c.Lk + j)] = 0;
                }
            }
            for (bool fast : {false, true}) {
                const Result a = run(with_bias, fast, 2), b = run(with_bool, fast, 2);
                bool finite = true;
                for (float x : a.out.data) finite &= std::isfinite(x);
                CHECK(finite);
                CHECK(std::memcmp(a.out.data.data(), b.out.data.data(), a.out.data.size() * sizeof(float)) == 0);
                CHECK(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0);
            }
        }
    }
}

// Results do not depend on the thread count (bit for bit), prefill and split-key alike.
void test_thread_counts_bit_identical() {
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        for (int64_t lq : {1, 200}) {
            Case c;
            c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = lq, c.Lk = 3000, c.D = 40, c.Dv = 33, c.causal = true;
            const Inputs in(c);
            const Result one = run(in, true, 1);
            for (int threads : {2, 3, 7}) {
                const Result many = run(in, true, threads);
                CHECK(std::memcmp(one.out.data.data(), many.out.data.data(), one.out.data.size() * sizeof(float)) == 0);
                CHECK(std::memcmp(one.lse.data(), many.lse.data(), one.lse.size() * sizeof(float)) == 0);
            }
        }
    }
}

// Several threads calling at once (one owns the pool, the others run inline): all correct.
void test_concurrent_callers() {
    Case c;
    c.B = 1, c.Hq = 4, c.Hkv = 1, c.Lq = 100, c.Lk = 700, c.D = 32, c.Dv = 32, c.causal = true;
    const Inputs in(c);
    const Result expected = run(in, true, 2);
    std::vector<int> mismatches(6, 0);
    std::vector<std::thread> callers;
    for (int t = 0; t < 6; ++t)
        callers.emplace_back([&, t] {
            for (int repeat = 0; repeat < 20; ++repeat) {
                const Result r = run(in, true, 2);
                if (std::memcmp(r.out.data.data(), expected.out.data.data(), r.out.data.size() * sizeof(float)) != 0)
                    ++mismatches[t];
            }
        });
    for (std::thread& caller : callers) caller.join();
    for (int m : mismatches) CHECK(m == 0);
}

void test_dispatch() {
    const std::vector<std::string> isas = available_isas();
    CHECK(!isas.empty() && isas.back() == "scalar");
    // An instruction set this build or CPU cannot run (the other architecture's, at least) is
    // refused with the list of those it can.
    for (const char* name : {"avx512", "avx2", "neon"})
        if (std::find(isas.begin(), isas.end(), name) == isas.end())
            CHECK_THROWS(std::invalid_argument, set_isa(name), "scalar");
    CHECK_THROWS(std::invalid_argument, set_isa("avx1024"), "got 'avx1024'");
    // bfloat16's path: amxbf16 by default where it is available, else the default follows the
    // measurement where there was a choice (no TWINATTN_ISA, AVX512_BF16); the tile path runs
    // exactly on amxbf16, the dot path exactly on avx512bf16.
    CHECK(std::find(isas.begin(), isas.end(), default_isa()) != isas.end());
    const std::optional<double> ratio = bf16dot_over_fma32();
    const char* forced = std::getenv("TWINATTN_ISA");
    const bool is_forced = forced != nullptr && *forced != '\0';
    const bool has_dot = std::find(isas.begin(), isas.end(), "avx512bf16") != isas.end();
    const bool has_amx = std::find(isas.begin(), isas.end(), "amxbf16") != isas.end();
    if (!is_forced && has_amx) CHECK(default_isa() == "amxbf16");
    if (ratio) CHECK(default_isa() == (*ratio >= kBf16DotMinRatio ? "avx512bf16" : "avx512"));
    else CHECK(is_forced || has_amx || !has_dot);
    for (const std::string& isa : isas) {
        set_isa(isa);
        CHECK(bfloat16_path() == (isa == "amxbf16" ? "amx" : isa == "avx512bf16" ? "dot" : "convert"));
    }
    set_isa(isas.front());
    CHECK(current_isa() == isas.front());
}

void test_thread_pool() {
    // Every item exactly once, for several thread counts and item counts.
    for (int threads : {1, 2, 3, 8})
        for (int64_t items : {0, 1, 2, 5, 1000}) {
            std::vector<int> seen(static_cast<size_t>(items), 0);
            parallel_for(items, threads, [&](int64_t item, int thread) {
                CHECK(thread >= 0 && thread < threads);
                ++seen[static_cast<size_t>(item)];  // distinct items: no race
            });
            for (int count : seen) CHECK(count == 1);
        }
    // An exception reaches the caller, and the pool still works afterwards.
    CHECK_THROWS(std::runtime_error,
                 parallel_for(100, 2, [](int64_t item, int) { if (item == 37) throw std::runtime_error("item 37"); }),
                 "item 37");
    int64_t total = 0;
    std::vector<int64_t> partial(2, 0);
    parallel_for(10, 2, [&](int64_t item, int thread) { partial[static_cast<size_t>(thread)] += item; });
    total = partial[0] + partial[1];
    CHECK(total == 45);
}

void test_rejects_bad_problems() {
    Case c;
    const Inputs in(c);
    Storage out(1, 1, 1, 8, false);
    std::vector<float> lse(1);
    AttentionProblem p = in.problem(out, lse);
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 0), "num_threads: expected an int >= 1, got 0");
    p.scale = std::numeric_limits<float>::infinity();
    CHECK_THROWS(std::invalid_argument, attention_forward(p, 1), "scale: expected a finite number, got inf");
}

}  // namespace

// The vectorised tanh of softcap alone, on every instruction set, against std::tanh in double:
// 2e6 points over [-1e4, 1e4] (dense near 0 and around kTanhSmall, where the branches meet),
// denormals, +-0, +-inf and NaN. Bound: 3e-7 relative (the measured worst is about 2 ulp,
// 1.9e-7, in the exp2 branch; a wrong coefficient or branch is off by >= 1e-6), exact for
// denormals (a^3 underflows: tanh(x) = x), +-1 at +-inf, NaN for NaN.
void test_tanh_every_isa() {
    std::vector<float> inputs;
    for (int n = -1000000; n <= 1000000; ++n) {
        const double t = n / 1e6;  // dense near 0: x = 1e4 * t^3, plus a uniform sweep of [-2, 2]
        inputs.push_back(static_cast<float>(1e4 * t * t * t));
        inputs.push_back(static_cast<float>(2.0 * t));
    }
    for (float x : {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-40f, -3e-39f, 1.17549435e-38f, 1e-30f, 1e-4f,
                    0.625f, std::nextafter(0.625f, 1.0f), std::nextafter(0.625f, 0.0f), 9.0f,
                    44.0f, 88.0f, 1e4f, -1e4f, 3e38f, -3e38f, kInf, -kInf, kNaN})
        inputs.push_back(x);
    while (inputs.size() % 16 != 0) inputs.push_back(0.5f);
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        std::vector<float> values = inputs;
        current_kernels().tanh_values(values.data(), static_cast<int64_t>(values.size()));
        double worst = 0.0;
        int reported = 0;
        for (size_t n = 0; n < inputs.size(); ++n) {
            const float x = inputs[n], t = values[n];
            const double expected = std::tanh(static_cast<double>(x));
            bool ok;
            if (std::isnan(x)) ok = std::isnan(t);
            else if (std::fabs(x) < 1.17549435e-38f) ok = t == x;  // denormal or zero: exact
            else {
                const double error = std::fabs(t - expected) / std::fabs(expected);
                worst = std::max(worst, error);
                ok = error <= 3e-7;
            }
            if (!ok && reported++ < 5) {
                std::fprintf(stderr, "[%s] tanh(%.9g) = %.9g, expected %.9g\n", isa.c_str(), x, t, expected);
                ++twinattn_test::failures;
            }
        }
        std::printf("%s: tanh worst relative error %.3g over %zu inputs\n", isa.c_str(), worst, inputs.size());
    }
    set_isa(available_isas().front());
}

// A denormal softcap: scale / softcap overflows float32; a zero in q must still give a finite
// score (tanh saturates), as in the reference, not 0 * inf = NaN. One query row against three
// keys, on every instruction set and both paths (1 and 60 packed rows).
void test_denormal_softcap() {
    for (int64_t lq : {1, 60}) {
        Case c;
        c.Lq = lq, c.Lk = 3, c.D = 2, c.Dv = 2, c.softcap = 1e-40f;
        Inputs in(c);
        for (int64_t i = 0; i < lq; ++i) in.q.at(0, 0, i, 0) = 0.0f;  // q = (0, x): 0 * multiplier
        for (const std::string& isa : available_isas()) {
            set_isa(isa);
            const Result expected = run(in, false, 1);
            const Result actual = run(in, true, 2);
            for (size_t n = 0; n < expected.out.data.size(); ++n)
                if (!near(actual.out.data[n], expected.out.data[n])) {
                    std::fprintf(stderr, "[%s] denormal softcap lq=%lld: out[%zu] = %.9g, expected %.9g\n",
                                 isa.c_str(), (long long)lq, n, actual.out.data[n], expected.out.data[n]);
                    ++twinattn_test::failures;
                }
        }
    }
    set_isa(available_isas().front());
}

int main() {
    test_dispatch();
    test_denormal_softcap();
    test_tanh_every_isa();
    test_thread_pool();
    test_rejects_bad_problems();
    test_every_isa_against_reference();
    test_nonfinite_patterns_match_reference();
    test_minus_inf_bias_hides_nan_keys();
    test_thread_counts_bit_identical();
    test_concurrent_callers();
    // The contract suite (contract.hpp) on every instruction set this machine runs, as the
    // reference kernel passes it (test_reference_kernel.cpp).
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        contract::run_contract_tests(isa.c_str(), attention_forward);
    }
    if (twinattn_test::failures != 0) std::fprintf(stderr, "%d check(s) failed\n", twinattn_test::failures);
    return twinattn_test::failures == 0 ? 0 : 1;
}
