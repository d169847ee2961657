// The 16-bit storage types of q, k, v and out (docs/kernels.md, "Reduced precision") and their
// exact software conversions, for the scalar path and for the few element-by-element spots of
// the vector paths (pack_keys' remainder, the split-key merge, the reference kernel).
//   float16:  IEEE binary16. To float32: exact (subnormals, inf; a NaN keeps its payload and is
//             quieted, as F16C's vcvtph2ps). From float32: round to nearest even, subnormals
//             kept, overflow to inf, NaN quieted with its payload's top bits (as vcvtps2ph).
//   bfloat16: the top half of a float32. To float32: bits << 16 (exact). From float32: round to
//             nearest even, subnormals kept (NOT vcvtneps2bf16, which flushes them):
//             NaN: (bits >> 16) | 0x0040, else (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16.
// Rust twin: rust/src/element.rs (same names in Rust's case, same rules).
//
// ODR note (flash_kernel.hpp): every function here is `static`, so each translation unit, built
// with its own -m flags, keeps its own copy and no wider instruction can leak into the portable
// path.
#pragma once

#include <cstdint>
#include <cstring>

namespace twinattn {

// Distinct types (not uint16_t) so that overloads pick the conversion by type.
struct Float16 {
    uint16_t bits;
};
struct BFloat16 {
    uint16_t bits;
};

static inline uint32_t float_bits(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
}

static inline float bits_float(uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

static inline float to_f32(float x) { return x; }

// int8 K / V (docs/kernels.md, "int8 K/V"): exact; the per-token scale is applied by the caller.
static inline float to_f32(int8_t x) { return static_cast<float>(x); }

static inline float to_f32(BFloat16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

static inline float to_f32(Float16 x) {
    const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
    const uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
    if (exponent == 0x1f)  // inf, or NaN (quieted: bit 22 set)
        return bits_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u));
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
        const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        return bits_float(sign | float_bits(magnitude));
    }
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

static inline uint16_t f32_to_bf16(float x) {
    const uint32_t bits = float_bits(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint16_t f32_to_f16(float x) {
    const uint32_t bits = float_bits(x);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u)  // NaN: quiet, top mantissa bits kept
        return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
    const uint32_t exponent = magnitude >> 23;
    if (exponent < 113) {  // below 2^-14: a float16 subnormal (or zero), round(x * 2^24)
        if (exponent < 102) return sign;  // below 2^-25: rounds to zero
        const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - exponent;  // 14 .. 24
        uint32_t result = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (result & 1u))) ++result;
        return static_cast<uint16_t>(sign | result);
    }
    const uint32_t rebiased = magnitude - (112u << 23);  // exponent - 127 + 15
    uint32_t result = rebiased >> 13;
    const uint32_t rest = rebiased & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;  // a carry may reach inf
    return static_cast<uint16_t>(sign | result);
}

static inline void from_f32(float x, float* dst) { *dst = x; }
static inline void from_f32(float x, Float16* dst) { dst->bits = f32_to_f16(x); }
static inline void from_f32(float x, BFloat16* dst) { dst->bits = f32_to_bf16(x); }

}  // namespace twinattn
