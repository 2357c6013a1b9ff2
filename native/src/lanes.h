// lanes.h -- the per-lane step of the 32-lane rANS decoder and the dequantization, written once for
// the CPU and a CUDA device (docs/format.md, "Streams: 32 interleaved rANS lanes"; docs/cuda.md).
//
// Read me first:
//  - Everything here is a pure function of its arguments, `LCG_HD` (__host__ __device__ under nvcc,
//    nothing for the host compiler) and includes nothing but the C library: the CPU scalar decoder
//    (rans.h, tensor_codec.cpp), the AVX2 decoder's constants and the CUDA kernels
//    (cuda/kernels.h) all call these, so the CPU tests exercise the code the GPU runs.
//  - One lane step = slot lookup (the caller's: a 4096-entry slot table on the CPU, a compact
//    table on the GPU), `advance` (the state update; the GPU's decode_symbol computes it from the
//    compact table without building the slot entry), then, when `needs_word`, `refill` with the
//    lane's word. Which word a lane reads is the caller's business: the CPU reads them in lane
//    order one by one, a warp gives lane j the word at popc(ballot & lanemask_lt) past the warp's
//    cursor.
//  - The GPU converts to f16/bf16 with one instruction (cuda/kernels.h, half_bits): the same bits
//    as f32_to_f16 / f32_to_bf16 below for every f32 (tests/cuda/half_conversions.cu checks all 2^32).
//  - Bits must not depend on the compiler: dequant is a subtract, a multiply and an add that must not
//    be fused (host: -ffp-contract=off; nvcc: --fmad=false); f16/bf16 rounding is integer code, the
//    subnormal f16 case a round-half-even of an exactly scaled float (nearbyint / rintf).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LCG_HD __host__ __device__
#else
#define LCG_HD
#endif

namespace lcg::lanes {

constexpr uint32_t PROB_BITS = 12;
constexpr uint32_t PROB_SCALE = 1u << PROB_BITS;
constexpr uint32_t STATE_LOW = 1u << 15;
constexpr uint32_t LANES = 32;

// ---- the rANS lane step -------------------------------------------------------------------------

// A decode slot entry: symbol | (freq - 1) << 8 | (slot - cum) << 20.
LCG_HD inline uint32_t slot_entry(uint32_t symbol, uint32_t freq, uint32_t slot_minus_cum) {
    return symbol | ((freq - 1) << 8) | (slot_minus_cum << 20);
}
LCG_HD inline uint32_t entry_symbol(uint32_t e) { return e & 0xff; }
// The state after decoding the symbol of slot entry e (x's slot is x & (PROB_SCALE - 1)).
LCG_HD inline uint32_t advance(uint32_t x, uint32_t e) {
    return (((e >> 8) & 0xfff) + 1) * (x >> PROB_BITS) + (e >> 20);
}
LCG_HD inline bool needs_word(uint32_t x) { return x < STATE_LOW; }
LCG_HD inline uint32_t refill(uint32_t x, uint32_t word) { return (x << 16) | word; }
// A lane's initial state is valid in [STATE_LOW, STATE_LOW << 16); a valid stream ends in STATE_LOW.
LCG_HD inline bool valid_start(uint32_t x) { return x >= STATE_LOW && x < (STATE_LOW << 16); }

// ---- float bits -------------------------------------------------------------------------------

LCG_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

LCG_HD inline float round_half_even(float a) {
#if defined(__CUDA_ARCH__)
    return rintf(a);
#else
    return std::nearbyint(a);  // the default rounding mode: to nearest even
#endif
}

// Round to nearest even, as F16C's vcvtps2ph (the AVX2 path) and CUDA's __float2half_rn, except
// that every NaN becomes the same quiet NaN of its sign (the paths must agree on every bit).
LCG_HD inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000;
    u &= 0x7fffffff;
    if (u >= 0x7f800000u) {  // inf or nan
        return static_cast<uint16_t>(sign | 0x7c00 | (u > 0x7f800000u ? 0x200 : 0));
    }
    if (u >= 0x477ff000u) {  // rounds to >= 65520: overflow
        return static_cast<uint16_t>(sign | 0x7c00);
    }
    if (u < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        const float a = std::fabs(f) * 16777216.0f;  // in units of 2^-24, exact
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(round_half_even(a)));
    }
    const uint32_t mant_odd = (u >> 13) & 1;
    u += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
    return static_cast<uint16_t>(sign | (u >> 13));
}

LCG_HD inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000u) {
        return static_cast<uint16_t>((u >> 16) | 0x40);  // keep nan a nan
    }
    u += 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}

// ---- dequantization -----------------------------------------------------------------------------

// Symbol alphabet of a lossy group: with raw_bits b, q = (s - 128) * 2^b + r for symbol s != 0 and
// the element's b raw bits r (below); symbol 0 escapes a q out of that range (its value comes from
// the tensor's escape list). At fine steps q's low bits are close to uniform: sent raw they cost
// what coding them costs, and keep the alphabet (and the escapes) small.
constexpr uint8_t SYM_ZERO = 128;
constexpr uint8_t SYM_ESCAPE = 0;
constexpr uint32_t MAX_RAW_BITS = 4;

LCG_HD inline float symbol_q(uint32_t symbol, uint32_t raw_bits, uint32_t raw) {
    return static_cast<float>((static_cast<int32_t>(symbol) - SYM_ZERO) * (1 << raw_bits) + static_cast<int32_t>(raw));
}

// Raw bits of a slice: element e (from the slice's first) has its b bits at bit e * b, low bits
// first, in 4 * b bytes per 32 elements (the last 32 padded): that many bytes start the slice.
LCG_HD inline uint64_t raw_bytes(uint64_t n_elements, uint32_t raw_bits) {
    return 4ull * raw_bits * ((n_elements + LANES - 1) / LANES);
}
// The raw bits of element e; reads the two bytes from bit e * b (b <= MAX_RAW_BITS: within them).
LCG_HD inline uint32_t raw_at(const uint8_t * raw, uint64_t e, uint32_t raw_bits) {
    const uint64_t bit = e * raw_bits;
    const uint32_t two = uint32_t(raw[bit >> 3]) | uint32_t(raw[(bit >> 3) + 1]) << 8;
    return (two >> (bit & 7)) & ((1u << raw_bits) - 1);
}

// Reconstruction of q: mean + sign(q) (|q| - shrink) step, as exactly these float operations (a
// subtraction, a multiply, an add; never fused) so that the scalar, SIMD and GPU decoders give the
// same bits. shrink = shrink_u8 / 256.
LCG_HD inline float dequant(float mean, float step, float shrink, float q) {
    // branch-free: the sign of q is a coin flip
#if defined(__CUDA_ARCH__)
    const float t = q - copysignf(shrink, q) * static_cast<float>(q != 0.0f);
#else
    const float t = q - std::copysign(shrink, q) * static_cast<float>(q != 0.0f);
#endif
    return t * step + mean;
}

// ggml type ids of the float types a lossy tensor may have.
constexpr int32_t GGML_F32 = 0;
constexpr int32_t GGML_F16 = 1;
constexpr int32_t GGML_BF16 = 30;

// The bits of v in a 2-byte float type (f16 or bf16).
LCG_HD inline uint16_t f32_to_half_type(float v, int32_t ggml_type) {
    return ggml_type == GGML_F16 ? f32_to_f16(v) : f32_to_bf16(v);
}

} // namespace lcg::lanes
