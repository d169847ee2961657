// Tests of packed and paged batches (docs/kernels.md, "Packed and paged batches"), on every
// instruction set:
//   1. attention_varlen against the reference kernel run on each sequence alone, its rows and keys
//      copied into contiguous (1, H, L, D) arrays: |fast - ref| <= 1e-4 (1 + |ref|) for out and
//      lse (the float32 bound of test_flash_kernel.cpp); sequences with no rows, decode rows,
//      prefill tiles, split-key chunks; causal (bottom-right), a window, GQA;
//   2. attention_paged over the same keys in shuffled pages of 1, 3 and 16 slots, NaN in every
//      unused slot and page, -1 past each sequence's blocks: bit-identical to attention_varlen;
//   3. a cascade: sequences whose block tables start with the same 18 blocks (288 keys, their
//      shared prefix read once), against the reference on each sequence's keys;
//   4. the checks' messages for a bad block id, a bad cu_seqlens and too many query rows.
// Twin of rust/tests/paged.rs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"
#include "twinattn/flash_attention.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

using namespace twinattn;

namespace {

constexpr double kTolerance = 1e-4;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kHq = 4, kHkv = 2, kD = 12, kDv = 8;

// Query rows and keys per sequence: none, decode, a prefill longer than a tile, split-key decode.
const std::vector<int64_t> kRows = {3, 0, 60, 1, 2};
const std::vector<int64_t> kKeys = {5, 4, 70, 1100, 9};

std::vector<int64_t> cumulative(const std::vector<int64_t>& lengths) {
    std::vector<int64_t> cu(lengths.size() + 1, 0);
    for (size_t b = 0; b < lengths.size(); ++b) cu[b + 1] = cu[b] + lengths[b];
    return cu;
}

struct Packed {
    std::vector<float> q, k, v;
    std::vector<int64_t> cu_q, cu_k;
};

Packed make_packed(std::mt19937& rng, const std::vector<int64_t>& rows = kRows,
                   const std::vector<int64_t>& keys = kKeys) {
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    Packed p;
    p.cu_q = cumulative(rows);
    p.cu_k = cumulative(keys);
    p.q.resize(static_cast<size_t>(p.cu_q.back() * kHq * kD));
    p.k.resize(static_cast<size_t>(p.cu_k.back() * kHkv * kD));
    p.v.resize(static_cast<size_t>(p.cu_k.back() * kHkv * kDv));
    for (std::vector<float>* x : {&p.q, &p.k, &p.v})
        for (float& value : *x) value = unit(rng);
    return p;
}

PackedOptions options(bool causal, int64_t window_left) {
    PackedOptions o;
    o.causal = causal;
    o.scale = 0.3f;
    o.window_left = window_left;
    return o;
}

TensorView3 view3(const std::vector<float>& data, int64_t rows, int64_t heads, int64_t dim) {
    return TensorView3{data.data(), {rows, heads, dim}, {heads * dim, dim, 1}};
}

// 1. varlen against the reference kernel on each sequence's own contiguous arrays.
void check_against_reference(const Packed& p, const std::vector<float>& out, const std::vector<float>& lse,
                             const PackedOptions& o) {
    const int64_t total_q = p.cu_q.back();
    for (size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
        const int64_t rows = p.cu_q[b + 1] - p.cu_q[b], keys = p.cu_k[b + 1] - p.cu_k[b];
        if (rows == 0) continue;
        std::vector<float> q(static_cast<size_t>(kHq * rows * kD)), k(static_cast<size_t>(kHkv * keys * kD)),
            v(static_cast<size_t>(kHkv * keys * kDv)), ref(static_cast<size_t>(kHq * rows * kDv)),
            ref_lse(static_cast<size_t>(kHq * rows));
        for (int64_t h = 0; h < kHq; ++h)
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t d = 0; d < kD; ++d)
                    q[static_cast<size_t>((h * rows + i) * kD + d)] = p.q[static_cast<size_t>(((p.cu_q[b] + i) * kHq + h) * kD + d)];
        for (int64_t h = 0; h < kHkv; ++h)
            for (int64_t j = 0; j < keys; ++j) {
                for (int64_t d = 0; d < kD; ++d)
                    k[static_cast<size_t>((h * keys + j) * kD + d)] = p.k[static_cast<size_t>(((p.cu_k[b] + j) * kHkv + h) * kD + d)];
                for (int64_t d = 0; d < kDv; ++d)
                    v[static_cast<size_t>((h * keys + j) * kDv + d)] = p.v[static_cast<size_t>(((p.cu_k[b] + j) * kHkv + h) * kDv + d)];
            }
        const std::vector<int64_t> q_offset = {keys - rows}, kv_lens = {keys};
        AttentionProblem s{};
        s.q = contiguous_view(q.data(), 1, kHq, rows, kD);
        s.k = contiguous_view(k.data(), 1, kHkv, keys, kD);
        s.v = contiguous_view(v.data(), 1, kHkv, keys, kDv);
        s.out = contiguous_mut_view(ref.data(), 1, kHq, rows, kDv);
        s.lse = contiguous_lse_view(ref_lse.data(), 1, kHq, rows);
        s.q_offset = q_offset;
        s.kv_lens = kv_lens;
        s.mask.kind = MaskKind::None;
        s.causal = o.causal;
        s.scale = o.scale;
        s.window_left = o.window_left;
        attention_reference(s, 1);
        for (int64_t h = 0; h < kHq; ++h)
            for (int64_t i = 0; i < rows; ++i) {
                const int64_t row = p.cu_q[b] + i;
                for (int64_t c = 0; c < kDv; ++c) {
                    const double want = ref[static_cast<size_t>((h * rows + i) * kDv + c)];
                    CHECK_NEAR(out[static_cast<size_t>((row * kHq + h) * kDv + c)], want, kTolerance * (1 + std::fabs(want)));
                }
                const double want_lse = ref_lse[static_cast<size_t>(h * rows + i)];
                const double got_lse = lse[static_cast<size_t>(h * total_q + row)];
                if (std::isinf(want_lse))
                    CHECK(got_lse == want_lse);
                else
                    CHECK_NEAR(got_lse, want_lse, kTolerance * (1 + std::fabs(want_lse)));
            }
    }
}

// The packed keys of p in shuffled pages of block_size slots; NaN elsewhere, -1 past the blocks.
// The first shared_blocks blocks of every sequence are the first sequence's (a cascade: the
// caller made those keys equal).
struct Pages {
    std::vector<float> k_cache, v_cache;
    std::vector<int32_t> block_table;
    std::vector<int64_t> seq_lens;
    int64_t num_blocks, max_blocks;
};

Pages make_pages(const Packed& p, int64_t block_size, std::mt19937& rng, int64_t shared_blocks = 0) {
    Pages pages;
    const size_t batch = p.cu_k.size() - 1;
    std::vector<int64_t> lengths(batch);
    for (size_t b = 0; b < batch; ++b) lengths[b] = p.cu_k[b + 1] - p.cu_k[b];
    int64_t used_total = 0;
    pages.max_blocks = 0;
    for (int64_t keys : lengths) {
        used_total += (keys + block_size - 1) / block_size;
        pages.max_blocks = std::max(pages.max_blocks, (keys + block_size - 1) / block_size + 1);
    }
    pages.num_blocks = used_total + 2;
    std::vector<int32_t> order(static_cast<size_t>(pages.num_blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    pages.k_cache.assign(static_cast<size_t>(pages.num_blocks * block_size * kHkv * kD), kNaN);
    pages.v_cache.assign(static_cast<size_t>(pages.num_blocks * block_size * kHkv * kDv), kNaN);
    pages.block_table.assign(batch * static_cast<size_t>(pages.max_blocks), -1);
    pages.seq_lens = lengths;
    size_t taken = 0;
    for (size_t b = 0; b < batch; ++b)
        for (int64_t j = 0; j < lengths[b]; ++j) {
            int32_t& entry = pages.block_table[b * static_cast<size_t>(pages.max_blocks) + static_cast<size_t>(j / block_size)];
            if (j % block_size == 0)
                entry = b > 0 && j / block_size < shared_blocks ? pages.block_table[static_cast<size_t>(j / block_size)]
                                                               : order[taken++];
            const int64_t slot = entry * block_size + j % block_size, key = p.cu_k[b] + j;
            std::memcpy(&pages.k_cache[static_cast<size_t>(slot * kHkv * kD)], &p.k[static_cast<size_t>(key * kHkv * kD)],
                        sizeof(float) * kHkv * kD);
            std::memcpy(&pages.v_cache[static_cast<size_t>(slot * kHkv * kDv)], &p.v[static_cast<size_t>(key * kHkv * kDv)],
                        sizeof(float) * kHkv * kDv);
        }
    return pages;
}

PagedProblem paged_problem(const Packed& p, const Pages& pages, int64_t block_size, std::vector<float>& out,
                           const PackedOptions& o) {
    PagedProblem problem{};
    problem.q = view3(p.q, p.cu_q.back(), kHq, kD);
    problem.k_cache = TensorView4{pages.k_cache.data(), {pages.num_blocks, block_size, kHkv, kD},
                                  {block_size * kHkv * kD, kHkv * kD, kD, 1}};
    problem.v_cache = TensorView4{pages.v_cache.data(), {pages.num_blocks, block_size, kHkv, kDv},
                                  {block_size * kHkv * kDv, kHkv * kDv, kDv, 1}};
    problem.out = MutTensorView3{out.data(), {p.cu_q.back(), kHq, kDv}, {kHq * kDv, kDv, 1}};
    problem.block_table = BlockTableView{pages.block_table.data(), {static_cast<int64_t>(pages.seq_lens.size()), pages.max_blocks},
                                         {pages.max_blocks, 1}};
    problem.seq_lens = pages.seq_lens;
    problem.cu_seqlens_q = p.cu_q;
    problem.options = o;
    return problem;
}

VarlenProblem varlen_problem(const Packed& p, std::vector<float>& out, std::vector<float>& lse, const PackedOptions& o) {
    VarlenProblem problem{};
    const int64_t total_q = p.cu_q.back();
    problem.q = view3(p.q, total_q, kHq, kD);
    problem.k = view3(p.k, p.cu_k.back(), kHkv, kD);
    problem.v = view3(p.v, p.cu_k.back(), kHkv, kDv);
    problem.out = MutTensorView3{out.data(), {total_q, kHq, kDv}, {kHq * kDv, kDv, 1}};
    problem.lse = LseView2{lse.data(), {kHq, total_q}, {total_q, 1}};
    problem.cu_seqlens_q = p.cu_q;
    problem.cu_seqlens_k = p.cu_k;
    problem.options = o;
    return problem;
}

void test_every_isa() {
    std::mt19937 rng(3);
    const Packed p = make_packed(rng);
    const int64_t total_q = p.cu_q.back();
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        for (const PackedOptions& o : {options(false, -1), options(true, -1), options(true, 7)}) {
            std::vector<float> out(static_cast<size_t>(total_q * kHq * kDv), kNaN), lse(static_cast<size_t>(kHq * total_q), kNaN);
            attention_varlen(varlen_problem(p, out, lse, o), 2);
            check_against_reference(p, out, lse, o);
            for (int64_t block_size : {1, 3, 16}) {
                const Pages pages = make_pages(p, block_size, rng);
                std::vector<float> paged(out.size(), kNaN);
                attention_paged(paged_problem(p, pages, block_size, paged, o), 2);
                CHECK(std::memcmp(paged.data(), out.data(), out.size() * sizeof(float)) == 0);
            }
        }
    }
    set_isa(available_isas().front());
}

// 3. Three sequences share their first 18 blocks of 16 keys: the shared prefix pass and each
// sequence's own keys, merged, against the reference on the sequence's keys.
void test_cascade() {
    std::mt19937 rng(7);
    Packed p = make_packed(rng, {1, 2, 1}, {300, 310, 340});
    const int64_t prefix = 18 * 16, total_q = p.cu_q.back();
    for (int64_t b = 1; b < 3; ++b)  // the same first 288 keys and values in every sequence
        for (int64_t j = 0; j < prefix; ++j) {
            std::memcpy(&p.k[static_cast<size_t>((p.cu_k[b] + j) * kHkv * kD)], &p.k[static_cast<size_t>(j * kHkv * kD)],
                        sizeof(float) * kHkv * kD);
            std::memcpy(&p.v[static_cast<size_t>((p.cu_k[b] + j) * kHkv * kDv)], &p.v[static_cast<size_t>(j * kHkv * kDv)],
                        sizeof(float) * kHkv * kDv);
        }
    const PackedOptions o = options(true, -1);
    for (const std::string& isa : available_isas()) {
        set_isa(isa);
        const Pages pages = make_pages(p, 16, rng, 18);
        std::vector<float> out(static_cast<size_t>(total_q * kHq * kDv), kNaN), lse(static_cast<size_t>(kHq * total_q), kNaN);
        PagedProblem problem = paged_problem(p, pages, 16, out, o);
        problem.lse = LseView2{lse.data(), {kHq, total_q}, {total_q, 1}};
        attention_paged(problem, 2);
        check_against_reference(p, out, lse, o);
    }
    set_isa(available_isas().front());
}

void test_checks() {
    std::mt19937 rng(5);
    const Packed p = make_packed(rng);
    const PackedOptions o = options(true, -1);
    std::vector<float> out(static_cast<size_t>(p.cu_q.back() * kHq * kDv)), lse(static_cast<size_t>(kHq * p.cu_q.back()));
    Pages pages = make_pages(p, 4, rng);
    pages.block_table[static_cast<size_t>(3 * pages.max_blocks + 2)] = static_cast<int32_t>(pages.num_blocks);
    CHECK_THROWS(std::invalid_argument, attention_paged(paged_problem(p, pages, 4, out, o), 1),
                 ("block_table: expected block ids in [0, num_blocks=" + std::to_string(pages.num_blocks) +
                  ") for the blocks sequence b uses, got block_table[3, 2]=" + std::to_string(pages.num_blocks))
                     .c_str());
    pages = make_pages(p, 4, rng);
    pages.seq_lens[0] = 2;  // 3 query rows
    CHECK_THROWS(std::invalid_argument, attention_paged(paged_problem(p, pages, 4, out, o), 1),
                 "cu_seqlens_q: expected at most seq_lens[b] query rows in sequence b, got 3 rows in sequence 0 "
                 "(seq_lens[0]=2)");
    Packed bad = p;
    std::swap(bad.cu_k[1], bad.cu_k[2]);
    CHECK_THROWS(std::invalid_argument, attention_varlen(varlen_problem(bad, out, lse, o), 1),
                 "cu_seqlens_k: expected non-decreasing values, got cu_seqlens_k[2]=5 after cu_seqlens_k[1]=9");
}

}  // namespace

int main() {
    try {
        test_every_isa();
        test_cascade();
        test_checks();
    } catch (const std::exception& error) {
        std::fprintf(stderr, "unexpected exception: %s\n", error.what());
        return 1;
    }
    if (twinattn_test::failures != 0) {
        std::fprintf(stderr, "%d failure(s)\n", twinattn_test::failures);
        return 1;
    }
    std::printf("test_paged: ok\n");
    return 0;
}
