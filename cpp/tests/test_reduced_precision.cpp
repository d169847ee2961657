// Tests of float16 / bfloat16 (docs/kernels.md, "Reduced precision"):
//   1. the software conversions (element.hpp) against independent definitions: every float16
//      to float32, float32 to float16 / bfloat16 against the nearest representable value (ties to
//      even) found by search, on edge values and a sweep of float32 bit patterns;
//   2. the convert path on every instruction set: the 16-bit kernel equals, bit for bit, the
//      float32 kernel of the same instruction set run on the converted inputs, then rounded (out)
//      and unrounded (lse); over prefill and split-key (direct and panel) shapes, odd D and Dv,
//      odd key counts, GQA, causal with offsets, kv_lens, masks with NaN in hidden K and V,
//      strided views, softcap, ALiBi and sinks;
//   3. the reference kernel the same way (it converts in and rounds out too);
//   4. the bfloat16 dot-product path ("avx512bf16", where the CPU has it) against the float64
//      reference on the same rounded inputs, within bfloat16 tolerances (derived below).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
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
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- 1. Conversions ----------------------------------------------------------------------------

// float16 bits -> value, from the definition (sign, 5-bit exponent, 10-bit fraction).
double float16_value(uint16_t h) {
    const int sign = h >> 15, exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
    double magnitude;
    if (exponent == 0x1f) magnitude = fraction != 0 ? std::nan("") : INFINITY;
    else if (exponent == 0) magnitude = std::ldexp(fraction, -24);
    else magnitude = std::ldexp(1024 + fraction, exponent - 25);
    return sign ? -magnitude : magnitude;
}

// The 16-bit pattern nearest to x among the finite non-negative patterns [0, top] whose values
// value(bits) increase with bits, ties to the even pattern; top + 1 (inf) when x is at or beyond
// the midpoint between value(top) and `beyond` (the next power of two past the largest finite).
template <typename ValueFn>
uint16_t nearest(double x, uint16_t top, double beyond, ValueFn value) {
    if (x >= (value(top) + beyond) / 2) return static_cast<uint16_t>(top + 1);
    uint16_t low = 0, high = top;  // value(low) <= x < value(high + 1) after the search
    while (low < high) {
        const uint16_t mid = static_cast<uint16_t>((low + high + 1) / 2);
        if (value(mid) <= x) low = mid;
        else high = static_cast<uint16_t>(mid - 1);
    }
    if (low == top) return low;
    const double below = x - value(low), above = value(static_cast<uint16_t>(low + 1)) - x;
    if (below < above || (below == above && (low & 1) == 0)) return low;
    return static_cast<uint16_t>(low + 1);
}

double bfloat16_value(uint16_t h) { return static_cast<double>(bits_float(static_cast<uint32_t>(h) << 16)); }

void check_from_f32(float x) {
    const bool negative = std::signbit(x);
    const double magnitude = std::fabs(static_cast<double>(x));
    const uint16_t sign = negative ? 0x8000 : 0;
    uint16_t want_half, want_brain;
    if (std::isnan(x)) {
        const uint32_t bits = float_bits(x);
        want_half = static_cast<uint16_t>(sign | 0x7e00 | ((bits >> 13) & 0x3ff));
        want_brain = static_cast<uint16_t>((bits >> 16) | 0x40);
    } else {
        want_half = static_cast<uint16_t>(sign | nearest(magnitude, 0x7bff, 65536.0, float16_value));
        want_brain = static_cast<uint16_t>(sign | nearest(magnitude, 0x7f7f, std::ldexp(1.0, 128), bfloat16_value));
    }
    const uint16_t half = f32_to_f16(x), brain = f32_to_bf16(x);
    if (half != want_half || brain != want_brain) {
        if (twinattn_test::failures < 10)
            std::fprintf(stderr, "convert %.9g (0x%08x): float16 0x%04x want 0x%04x, bfloat16 0x%04x want 0x%04x\n", x,
                         float_bits(x), half, want_half, brain, want_brain);
        ++twinattn_test::failures;
    }
}

void test_conversions() {
    for (uint32_t h = 0; h < 0x10000; ++h) {  // every float16, and its bfloat16 twin
        const double want = float16_value(static_cast<uint16_t>(h));
        const float got = to_f32(Float16{static_cast<uint16_t>(h)});
        const bool ok = std::isnan(want) ? std::isnan(got) && (float_bits(got) & 0x400000u) != 0
                                         : static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
        if (!ok && twinattn_test::failures++ < 10)
            std::fprintf(stderr, "float16 0x%04x -> %.9g, want %.9g\n", h, got, want);
        CHECK(float_bits(to_f32(BFloat16{static_cast<uint16_t>(h)})) == h << 16);
        // every finite float16 reads back as itself
        if (!std::isnan(want)) CHECK(f32_to_f16(got) == h);
    }
    // Edges: float16's smallest subnormal and its halves, the normal / subnormal border, the
    // largest finite value and the inf threshold, ties, float32 subnormals, NaNs.
    const float edges[] = {0.0f, -0.0f, 5.96046448e-8f, 2.98023224e-8f, 2.98023253e-8f, 2.98023195e-8f,
                           8.94069672e-8f, 6.10351562e-5f, 6.09755516e-5f, 65504.0f, 65519.99f, 65520.0f,
                           65536.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256,
                           1e-45f, 1.17549435e-38f, 1.17549421e-38f, 3.40282347e38f, 3.3961776e38f, kInf, -kInf,
                           kNaN, -kNaN, bits_float(0x7f800001u), bits_float(0xffc12345u)};
    for (float x : edges) {
        check_from_f32(x);
        check_from_f32(-x);
    }
    // A sweep of float32 bit patterns (a prime stride touches every exponent and low bits), plus
    // each pattern's neighbours in the low 16 bits (bfloat16 ties and near-ties).
    for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 65521) {
        check_from_f32(bits_float(static_cast<uint32_t>(bits)));
        check_from_f32(bits_float((static_cast<uint32_t>(bits) & 0xffff0000u) | 0x8000u));
        check_from_f32(bits_float((static_cast<uint32_t>(bits) & 0xffffe000u) | 0x1000u));
    }
}

// ---- 2-4. Kernels ------------------------------------------------------------------------------

struct Case {
    int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lk = 1, D = 8, Dv = 8;
    bool causal = false;
    std::vector<int64_t> q_offset;  // empty: bottom-right
    std::vector<int64_t> kv_lens;   // empty: Lk
    bool bool_mask = false;
    bool strided = false;        // (B, L, H, X) memory viewed as (B, H, L, X)
    bool nan_in_hidden = false;  // NaN in K and V rows that no query sees (past kv_len, masked,
                                 // and past the last query's position when causal)
    float softcap = 0.0f;
    bool alibi = false, sinks = false;
    float input_scale = 1.0f;  // inputs uniform in [-input_scale, input_scale]
    int64_t nan_value_key = -1;  // >= 0: NaN in every other column of this key's V rows
    uint32_t seed = 7;
};

std::string describe(const Case& c) {
    char text[256];
    std::snprintf(text, sizeof text,
                  "B=%lld Hq=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld causal=%d mask=%d strided=%d nan=%d "
                  "softcap=%g alibi=%d sinks=%d",
                  (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.Lq, (long long)c.Lk,
                  (long long)c.D, (long long)c.Dv, c.causal, c.bool_mask, c.strided, c.nan_in_hidden, c.softcap,
                  c.alibi, c.sinks);
    return text;
}

// One (B, H, L, X) tensor of element type T, contiguous or (B, L, H, X).
template <typename T>
struct Tensor {
    int64_t shape[4];
    bool strided;
    std::vector<T> data;
    Tensor(int64_t B, int64_t H, int64_t L, int64_t X, bool strided_layout)
        : shape{B, H, L, X}, strided(strided_layout), data(static_cast<size_t>(B * H * L * X)) {}
    int64_t stride(int axis) const {
        const int64_t H = shape[1], L = shape[2], X = shape[3];
        const int64_t contiguous[4] = {H * L * X, L * X, X, 1}, interleaved[4] = {H * L * X, X, H * X, 1};
        return strided ? interleaved[axis] : contiguous[axis];
    }
    TensorView4 view() const {
        return TensorView4{data.data(), {shape[0], shape[1], shape[2], shape[3]}, {stride(0), stride(1), stride(2), 1}};
    }
    MutTensorView4 mut_view() {
        return MutTensorView4{data.data(), {shape[0], shape[1], shape[2], shape[3]}, {stride(0), stride(1), stride(2), 1}};
    }
};

template <typename T>
Tensor<T> rounded(const Tensor<float>& x) {
    Tensor<T> r(x.shape[0], x.shape[1], x.shape[2], x.shape[3], x.strided);
    for (size_t n = 0; n < x.data.size(); ++n) from_f32(x.data[n], &r.data[n]);
    return r;
}

template <typename T>
Tensor<float> widened(const Tensor<T>& x) {
    Tensor<float> r(x.shape[0], x.shape[1], x.shape[2], x.shape[3], x.strided);
    for (size_t n = 0; n < x.data.size(); ++n) r.data[n] = to_f32(x.data[n]);
    return r;
}

// The inputs of a case, as T (16-bit) and as their exact float32 values.
template <typename T>
struct Inputs {
    Case c;
    Tensor<T> q, k, v;
    Tensor<float> q32, k32, v32;
    std::vector<int64_t> q_offset, kv_lens;
    std::vector<unsigned char> mask;
    std::vector<float> slopes, sinks;

    static Tensor<float> random(int64_t B, int64_t H, int64_t L, int64_t X, const Case& c, std::mt19937& rng) {
        Tensor<float> x(B, H, L, X, c.strided);
        std::uniform_real_distribution<float> uniform(-c.input_scale, c.input_scale);
        for (float& e : x.data) e = uniform(rng);
        return x;
    }

    Inputs(const Case& cs, std::mt19937 rng, Tensor<float> q0, Tensor<float> k0, Tensor<float> v0)
        : c(cs), q(rounded<T>(q0)), k(rounded<T>(k0)), v(rounded<T>(v0)), q32(widened(q)), k32(widened(k)),
          v32(widened(v)) {
        kv_lens = cs.kv_lens.empty() ? std::vector<int64_t>(static_cast<size_t>(cs.B), cs.Lk) : cs.kv_lens;
        q_offset = cs.q_offset;
        if (q_offset.empty())
            for (int64_t b = 0; b < cs.B; ++b) q_offset.push_back(std::max<int64_t>(0, kv_lens[b] - cs.Lq));
        if (cs.bool_mask) {
            mask.resize(static_cast<size_t>(cs.B * cs.Hq * cs.Lq * cs.Lk));
            for (auto& m : mask) m = (rng() % 4) != 0;
        }
        if (cs.nan_in_hidden) {
            // Every key past kv_len, and keys 1 and Lk / 2 hidden from every row by the mask.
            for (int64_t b = 0; b < cs.B; ++b)
                for (int64_t j = 0; j < cs.Lk; ++j) {
                    const bool masked_everywhere = cs.bool_mask && (j == 1 || j == cs.Lk / 2);
                    const bool future = cs.causal && j >= q_offset[b] + cs.Lq;
                    if (j < kv_lens[b] && !masked_everywhere && !future) continue;
                    if (masked_everywhere)
                        for (int64_t row = 0; row < cs.Hq * cs.Lq; ++row) mask[(b * cs.Hq * cs.Lq + row) * cs.Lk + j] = 0;
                    for (int64_t g = 0; g < cs.Hkv; ++g) {
                        for (int64_t d = 0; d < cs.D; ++d) set(k, k32, b, g, j, d, kNaN);
                        for (int64_t d = 0; d < cs.Dv; ++d) set(v, v32, b, g, j, d, (d % 2) ? kNaN : kInf);
                    }
                }
        }
        if (cs.nan_value_key >= 0)
            for (int64_t b = 0; b < cs.B; ++b)
                for (int64_t g = 0; g < cs.Hkv; ++g)
                    for (int64_t d = 0; d < cs.Dv; d += 2) set(v, v32, b, g, cs.nan_value_key, d, kNaN);
        std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
        if (cs.alibi)
            for (int64_t n = 0; n < cs.B * cs.Hq; ++n) slopes.push_back(std::exp2(-0.5f * static_cast<float>(n + 1)));
        if (cs.sinks)
            for (int64_t h = 0; h < cs.Hq; ++h) sinks.push_back(2.0f * uniform(rng));
    }

    static void set(Tensor<T>& x, Tensor<float>& x32, int64_t b, int64_t h, int64_t l, int64_t d, float value) {
        const int64_t at = b * x.stride(0) + h * x.stride(1) + l * x.stride(2) + d;
        from_f32(value, &x.data[static_cast<size_t>(at)]);
        x32.data[static_cast<size_t>(at)] = to_f32(x.data[static_cast<size_t>(at)]);
    }

    // The problem over (q, k, v) of either element type, out and lse given.
    AttentionProblem problem(TensorView4 qv, TensorView4 kv, TensorView4 vv, MutTensorView4 out,
                             std::vector<float>& lse, ElementType dtype) const {
        AttentionProblem p{};
        p.q = qv, p.k = kv, p.v = vv, p.out = out;
        p.dtype = dtype;
        twinattn_test::set_case_options(p, c, lse, q_offset, kv_lens, mask, slopes, sinks);
        return p;
    }
};

template <typename T>
constexpr ElementType element_type() {
    return std::is_same<T, Float16>::value ? ElementType::Float16 : ElementType::BFloat16;
}

template <typename T>
Inputs<T> make_inputs(const Case& c) {
    std::mt19937 rng(c.seed);
    Tensor<float> q = Inputs<T>::random(c.B, c.Hq, c.Lq, c.D, c, rng);
    Tensor<float> k = Inputs<T>::random(c.B, c.Hkv, c.Lk, c.D, c, rng);
    Tensor<float> v = Inputs<T>::random(c.B, c.Hkv, c.Lk, c.Dv, c, rng);
    return Inputs<T>(c, rng, q, k, v);
}

struct Outputs16 {
    std::vector<uint16_t> out;  // bits, in the out tensor's memory order
    std::vector<float> lse;
};

// Runs `kernel` in the 16-bit type and in float32 on the converted inputs; out and lse of both.
template <typename T>
void run_both(const Inputs<T>& in, void (*kernel)(const AttentionProblem&, int), int threads, Outputs16& narrow,
              Outputs16& wide_rounded, std::vector<float>* wide_out = nullptr) {
    const Case& c = in.c;
    Tensor<T> out(c.B, c.Hq, c.Lq, c.Dv, c.strided);
    for (T& x : out.data) x.bits = 0x7e55;  // every element must be written
    Tensor<float> out32(c.B, c.Hq, c.Lq, c.Dv, c.strided);
    std::fill(out32.data.begin(), out32.data.end(), kNaN);
    narrow.lse.assign(static_cast<size_t>(c.B * c.Hq * c.Lq), kNaN);
    wide_rounded.lse = narrow.lse;
    kernel(in.problem(in.q.view(), in.k.view(), in.v.view(), out.mut_view(), narrow.lse, element_type<T>()), threads);
    kernel(in.problem(in.q32.view(), in.k32.view(), in.v32.view(), out32.mut_view(), wide_rounded.lse,
                      ElementType::Float32),
           threads);
    narrow.out.clear();
    wide_rounded.out.clear();
    for (const T& x : out.data) narrow.out.push_back(x.bits);
    for (float x : out32.data) {
        T r;
        from_f32(x, &r);
        wide_rounded.out.push_back(r.bits);
    }
    if (wide_out != nullptr) *wide_out = out32.data;
}

std::vector<Case> kernel_cases() {
    std::vector<Case> cases;
    for (bool causal : {false, true}) {
        // Decode and short chunks (split-key, direct scores), GQA 4, odd D and Dv.
        for (int64_t lq : {1, 3, 6}) {
            Case c;
            c.B = 2, c.Hq = 8, c.Hkv = 2, c.Lq = lq, c.Lk = 2500, c.D = 65, c.Dv = 33, c.causal = causal;
            c.kv_lens = {2500, 1999};
            cases.push_back(c);
        }
        // Split-key with K panels (rows > kDirectScoreRows), and prefill tiles, odd key counts.
        for (int64_t lq : {7, 13, 100}) {
            Case c;
            c.B = 1, c.Hq = 4, c.Hkv = 1, c.Lq = lq, c.Lk = 777, c.D = 64, c.Dv = 64, c.causal = causal;
            cases.push_back(c);
            c.D = 33, c.Dv = 17, c.Lk = 301, c.q_offset = {causal ? 250 : 3};
            cases.push_back(c);
        }
        // Masks with NaN / inf in hidden K and V, kv_lens, strided views, variants.
        for (int64_t lq : {1, 5, 60}) {
            Case c;
            c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = lq, c.Lk = 530, c.D = 24, c.Dv = 40, c.causal = causal;
            c.kv_lens = {530, 271}, c.bool_mask = true, c.nan_in_hidden = true, c.strided = true;
            cases.push_back(c);
            c.bool_mask = false, c.nan_in_hidden = false, c.softcap = 0.7f, c.alibi = true, c.sinks = true;
            c.input_scale = 3.0f;
            cases.push_back(c);
        }
    }
    return cases;
}

int mismatches(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    int count = 0;
    for (size_t n = 0; n < a.size(); ++n) count += a[n] != b[n];
    return count;
}

// 2 and 3: the 16-bit kernels equal the float32 kernels on the converted inputs, rounded.
template <typename T>
void test_convert_path(const char* type_name) {
    std::vector<std::string> isas = available_isas();
    for (const Case& c : kernel_cases()) {
        const Inputs<T> in = make_inputs<T>(c);
        for (const std::string& isa : isas) {
            // avx512bf16 and amxbf16 run bfloat16 prefill by dot or tile products (test 4); their
            // other bfloat16 paths, and float16, are the convert path and are checked here.
            const bool pairs = isa == "avx512bf16" || isa == "amxbf16";
            if (pairs && std::is_same<T, BFloat16>::value && c.Lq * c.Hq / c.Hkv > 48) continue;
            set_isa(isa);
            Outputs16 narrow, wide;
            run_both(in, attention_forward, 2, narrow, wide);
            const int bad = mismatches(narrow.out, wide.out);
            const bool lse_same = std::memcmp(narrow.lse.data(), wide.lse.data(), narrow.lse.size() * 4) == 0;
            if (bad != 0 || !lse_same) {
                std::fprintf(stderr, "[%s %s] %s: %d of %zu out differ from the float32 kernel rounded, lse %s\n",
                             isa.c_str(), type_name, describe(c).c_str(), bad, narrow.out.size(),
                             lse_same ? "same" : "differs");
                ++twinattn_test::failures;
            }
        }
        Outputs16 narrow, wide;
        run_both(in, attention_reference, 2, narrow, wide);
        if (mismatches(narrow.out, wide.out) != 0 ||
            std::memcmp(narrow.lse.data(), wide.lse.data(), narrow.lse.size() * 4) != 0) {
            std::fprintf(stderr, "[reference %s] %s: differs from float32 on the converted inputs\n", type_name,
                         describe(c).c_str());
            ++twinattn_test::failures;
        }
    }
    set_isa(isas.front());
}

// 4. The bfloat16 pair paths (bfloat16 prefill: avx512bf16's dot products, amxbf16's tiles)
// against the float64 reference on the same rounded inputs. Errors beyond float32 rounding (1e-4
// (1 + |ref|), as test_flash_kernel.cpp): P rounded to bfloat16 moves each weight by at most 2^-9
// of itself, so out by at most 2^-9 max|v| (the weights sum to 1 at most); out rounded to bfloat16
// adds 2^-9 |ref|. S is exact products summed in float32 (VDPBF16PS, TDPBF16PS), and lse sums the
// unrounded P: float32 tolerance. The tiles need D a multiple of 32 (others take the dot path), so
// the masked and non-finite cases come with D 40 and 64, the last one with D 16 and 32.
void test_pair_path(const std::string& isa) {
    const std::vector<std::string> isas = available_isas();
    if (std::find(isas.begin(), isas.end(), isa) == isas.end()) {
        std::printf("%s: not on this CPU, its bfloat16 prefill path is not tested here\n", isa.c_str());
        return;
    }
    std::vector<Case> cases;
    for (bool causal : {false, true}) {
        for (int64_t D : {64, 65, 128}) {
            Case c;
            c.B = 2, c.Hq = 8, c.Hkv = 2, c.Lq = 77, c.Lk = 613, c.D = D, c.Dv = D == 65 ? 33 : D, c.causal = causal;
            c.kv_lens = {613, 390};
            cases.push_back(c);
        }
        for (int64_t D : {40, 64}) {
            Case c;  // masks and NaN / inf in hidden V (past kv_len, masked, the causal future: odd ends)
            c.B = 2, c.Hq = 4, c.Hkv = 1, c.Lq = 61, c.Lk = 531, c.D = D, c.Dv = D == 40 ? 24 : 48, c.causal = causal;
            c.kv_lens = {531, 300}, c.q_offset = {101, 37}, c.nan_in_hidden = true, c.strided = true;
            cases.push_back(c);
            c.bool_mask = true;
            cases.push_back(c);
            c.bool_mask = false, c.softcap = 0.9f, c.alibi = true, c.sinks = true, c.input_scale = 2.0f;
            cases.push_back(c);
        }
    }
    // A tile whose rows all end at key 101 (48 heads of one position per tile) sees an unmasked
    // block of 101 keys: its last pair (its last 32 keys on the tiles) holds key 101, which only
    // later positions see, with NaN in V. The rows at position 100 must stay finite.
    for (int64_t D : {16, 32}) {
        Case c;
        c.Hq = 48, c.Hkv = 1, c.Lq = 4, c.Lk = 104, c.D = D, c.Dv = 20, c.causal = true, c.q_offset = {100};
        c.nan_value_key = 101;
        cases.push_back(c);
    }
    double worst = 0.0;
    int differs_from_convert = 0;
    for (const Case& c : cases) {
        const Inputs<BFloat16> in = make_inputs<BFloat16>(c);
        set_isa(isa);
        Outputs16 dot, unused;
        std::vector<float> reference;
        run_both(in, attention_forward, 2, dot, unused);
        run_both(in, attention_reference, 2, unused, unused, &reference);
        std::vector<float> reference_lse = unused.lse;
        set_isa("avx512");
        Outputs16 convert;
        run_both(in, attention_forward, 2, convert, unused);
        differs_from_convert += mismatches(dot.out, convert.out) != 0;
        float v_max = 0.0f;
        for (float x : in.v32.data)
            if (std::isfinite(x)) v_max = std::max(v_max, std::fabs(x));
        int reported = 0;
        for (size_t n = 0; n < reference.size(); ++n) {
            const double a = to_f32(BFloat16{dot.out[n]}), e = reference[n];
            const double tolerance = std::ldexp(1.0, -9) * (v_max + std::fabs(e)) + 1e-4 * (1 + std::fabs(e));
            const bool ok = std::isnan(e) ? std::isnan(a) : std::fabs(a - e) <= tolerance;
            if (std::isfinite(e)) worst = std::max(worst, std::fabs(a - e));
            if (!ok && reported++ < 3) {
                std::fprintf(stderr, "[%s] %s: out[%zu] = %.9g, reference %.9g\n", isa.c_str(), describe(c).c_str(), n, a,
                             e);
                ++twinattn_test::failures;
            }
        }
        for (size_t n = 0; n < reference_lse.size(); ++n) {
            const double a = dot.lse[n], e = reference_lse[n];
            const bool ok = std::isinf(e) || std::isnan(e) ? (a == e || (std::isnan(a) && std::isnan(e)))
                                                           : std::fabs(a - e) <= 1e-4 * (1 + std::fabs(e));
            if (!ok && reported++ < 3) {
                std::fprintf(stderr, "[%s] %s: lse[%zu] = %.9g, reference %.9g\n", isa.c_str(), describe(c).c_str(), n, a,
                             e);
                ++twinattn_test::failures;
            }
        }
    }
    // The pair path really ran: rounding P to bfloat16 changes some outputs of every case.
    CHECK(differs_from_convert == static_cast<int>(cases.size()));
    std::printf("%s: %zu bfloat16 prefill cases, worst |out - reference| = %.3g\n", isa.c_str(), cases.size(), worst);
    set_isa(isas.front());
}

// measure_peak: its messages, and a positive rate where the CPU runs the kind (no speed is
// asserted: unit tests are not timed).
void test_measure_peak() {
    const std::vector<std::string> isas = available_isas();
    const bool has_bf16 = std::find(isas.begin(), isas.end(), "avx512bf16") != isas.end();
    const bool has_amx = std::find(isas.begin(), isas.end(), "amxbf16") != isas.end();
    const bool has_fma = std::find(isas.begin(), isas.end(), "avx2") != isas.end();
    CHECK_THROWS(std::invalid_argument, measure_peak("fma64", 1, 0.01), "kind: expected \"fma32\", \"bf16dot\" or \"bf16tile\", got \"fma64\"");
    CHECK_THROWS(std::invalid_argument, measure_peak("fma64", 0, 0.01), "kind: expected");  // kind first
    if (has_fma) {
        CHECK_THROWS(std::invalid_argument, measure_peak("fma32", 0, 0.01), "num_threads: expected an int >= 1, got 0");
        CHECK(measure_peak("fma32", 2, 0.01) > 0.0);
    }
    if (has_bf16) CHECK(measure_peak("bf16dot", 1, 0.01) > 0.0);
    else CHECK_THROWS(std::invalid_argument, measure_peak("bf16dot", 1, 0.01), "kind: \"bf16dot\" needs AVX512_BF16, which this CPU lacks");
    if (has_amx) CHECK(measure_peak("bf16tile", 1, 0.01) > 0.0);
    else CHECK_THROWS(std::invalid_argument, measure_peak("bf16tile", 1, 0.01), "kind: \"bf16tile\" needs AMX-BF16");
}

}  // namespace

int main() {
    test_measure_peak();
    test_conversions();
    test_convert_path<Float16>("float16");
    test_convert_path<BFloat16>("bfloat16");
    test_pair_path("avx512bf16");
    test_pair_path("amxbf16");
    if (twinattn_test::failures != 0) std::fprintf(stderr, "%d check(s) failed\n", twinattn_test::failures);
    return twinattn_test::failures == 0 ? 0 : 1;
}
