// What the storage-type loads and stores (element.hpp) of the SIMD vector types share: float32
// is the plain load / store, and the tails of the narrower types (float16, bfloat16, int8) go
// through a zeroed buffer of one vector. simd_avx2.hpp, simd_avx512.hpp and simd_neon.hpp each
// derive from StorageOps<itself> and write only their whole-vector conversions (the
// intrinsics), with `using` to keep these overloads beside them. The scalar type converts lane
// by lane and needs none of this.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace twinattn {

// (R = V: V::Reg is looked up at the call, once V is complete.)
template <typename V>
struct StorageOps {
    template <typename R = V>
    static typename R::Reg load_as_f32(const float* p) { return V::load(p); }
    template <typename R = V>
    static void store_from_f32(float* p, typename R::Reg x) { V::store(p, x); }
    // float32 tails are the masked ones of V; narrower ones go through a zeroed buffer (lanes
    // past n are 0; memory past n never touched).
    template <typename T, typename R = V>
    static typename R::Reg load_tail_as_f32(const T* p, int64_t n) {
        if constexpr (std::is_same_v<T, float>) {
            return V::load_tail(p, n);
        } else {
            T buffer[V::kWidth] = {};
            std::memcpy(buffer, p, static_cast<size_t>(n) * sizeof(T));
            return V::load_as_f32(buffer);
        }
    }
    template <typename T, typename R = V>
    static void store_tail_from_f32(T* p, typename R::Reg x, int64_t n) {
        if constexpr (std::is_same_v<T, float>) {
            V::store_tail(p, x, n);
        } else {
            T buffer[V::kWidth];
            V::store_from_f32(buffer, x);
            std::memcpy(p, buffer, static_cast<size_t>(n) * sizeof(T));
        }
    }
};

}  // namespace twinattn
