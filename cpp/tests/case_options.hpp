// What the int8 and reduced-precision tests' cases set the same way on an AttentionProblem.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "twinattn/problem.hpp"

namespace twinattn_test {

// lse (contiguous B, Hq, Lq), the positions, the (B, Hq, Lq, Lk) bool mask when c.bool_mask,
// causal, scale = 1 / sqrt(D), softcap, the (B, Hq) ALiBi slopes when c.alibi and the (Hq,)
// sinks when c.sinks. Case: a test's case struct with those fields.
template <typename Case>
void set_case_options(twinattn::AttentionProblem& p, const Case& c, std::vector<float>& lse,
                      const std::vector<int64_t>& q_offset, const std::vector<int64_t>& kv_lens,
                      const std::vector<unsigned char>& mask, const std::vector<float>& alibi_slopes,
                      const std::vector<float>& sinks) {
    using namespace twinattn;
    p.lse = contiguous_lse_view(lse.data(), c.B, c.Hq, c.Lq);
    p.q_offset = q_offset;
    p.kv_lens = kv_lens;
    p.mask = MaskView{MaskKind::None, nullptr, {}, {}};
    if (c.bool_mask)
        p.mask = MaskView{MaskKind::Bool, mask.data(), {c.B, c.Hq, c.Lq, c.Lk}, {c.Hq * c.Lq * c.Lk, c.Lq * c.Lk, c.Lk, 1}};
    p.causal = c.causal;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    p.softcap = c.softcap;
    if (c.alibi) p.alibi_slopes = ParamView2{alibi_slopes.data(), {c.B, c.Hq}, {c.Hq, 1}};
    if (c.sinks) p.sinks = ParamView1{sinks.data(), {c.Hq}, {1}};
}

}  // namespace twinattn_test
