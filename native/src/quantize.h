// quantize.h -- CacheGen's lossy stage: per-channel uniform quantization of float K/V units into
// byte symbols, with steps set per layer (shallow layers finer), and its inverse as a lookup table.
#pragma once

#include "common.h"

#include <cmath>

#include <vector>

namespace lcg {

// Symbol alphabet of a lossy group (lanes.h): q = (s - 128) * 2^raw_bits + the element's raw bits;
// symbol 0 escapes a q out of that range, whose value follows in the tensor's escape list.
constexpr uint8_t SYM_ZERO = lanes::SYM_ZERO;
constexpr uint8_t SYM_ESCAPE = lanes::SYM_ESCAPE;

// How steps are chosen. A level names a llama.cpp cache type (ref_type) and each tensor's step is
// set so that its squared error is ref_scale x the error that cache type makes on that very tensor:
// the promise "about q8_0 / at most q5_1 / at most q4_0" then follows the model's own statistics
// instead of multiples of a spread tuned on one model. Fixed steps (ref_type < 0) are the expert
// knobs k_step / v_step.
struct QuantKnobs {
    float k_step;             // fixed steps: in the tensor's RMS channel deviation, at the last layer
    float v_step;
    float first_layer_scale;  // layer 0's step relative to the last layer's
    int32_t n_sink_tokens;    // cells with position < this are stored exactly
    int32_t ref_type;         // ggml type (q8_0, q5_1, q4_0) whose error steps match, or -1
    float ref_scale;          // our squared error over the reference's, per tensor
    uint32_t anchor_tokens;   // anchor/delta transform: rows per group (0: no transform)
};

// The knobs of a lossy level (LCG_LEVEL_HIGH..COMPACT); lossless gets zeros.
QuantKnobs level_knobs(int32_t level);
// The same level with fixed steps (what k_step / v_step default to when a caller sets one of them).
QuantKnobs fixed_level_knobs(int32_t level);

constexpr int32_t GGML_Q4_0 = 2;
constexpr int32_t GGML_Q5_1 = 7;
constexpr int32_t GGML_Q8_0 = 8;

// Squared error that llama.cpp's cache type ref_type (q8_0, q5_1 or q4_0) makes on n_rows rows of
// n_units values: each row Hadamard-rotated in blocks of `rot` units (0: not), as llama.cpp does
// before quantizing a cache, then quantized and dequantized in blocks of 32 with ggml's reference
// quantizers (scales rounded to f16). A row whose width is not a multiple of 32 (llama.cpp has no
// such quantized cache) has its last, partial block quantized as its values repeated to 32, with
// that block's error per value: the level keeps its meaning on such a model instead of a step.
double reference_sq_error(const float * rows, size_t n_rows, uint32_t n_units, int32_t ref_type, uint32_t rot);

// ggml's q8_0 block: an f16 scale d and 32 int8 q, value j = d * q[j] (exact in f32). A q8_0
// cache holds ~8.5 bits per value, near q8_0's promise already: the levels coarser than q8_0 code
// its values as f32 and quantize them back on decode, with ggml's reference quantizer, which gives
// the same block back from its own values.
constexpr uint32_t Q8_0_VALUES = 32;
constexpr uint32_t Q8_0_BYTES = 34;
void dequantize_q8_0_row(const uint8_t * blocks, uint32_t n_blocks, float * out);
void quantize_q8_0_row(const float * values, uint32_t n_blocks, uint8_t * blocks);  // quantize_row_q8_0_ref

// Step (in standard deviations) of a layer: linear from first_layer_scale x last to last.
float layer_step(const QuantKnobs & k, bool is_v, uint32_t layer, uint32_t n_layer);

constexpr float MIN_STEP = 6.103515625e-05f;  // smallest normal f16: the finest step a quantizer stores

// Per-channel quantizer, stored as two f16 values so that encoder and decoder use the same numbers.
struct ChannelQuant {
    uint16_t mean_f16;
    uint16_t step_f16;
};

// Rounds a channel's mean and step to f16; a step of 0 (a constant group) becomes 1 so that every
// value quantizes to q = 0, tiny steps become the smallest normal f16.
ChannelQuant channel_quant(double mean, double step);

constexpr int32_t GGML_F32 = lanes::GGML_F32;
constexpr int32_t GGML_F16 = lanes::GGML_F16;
constexpr int32_t GGML_BF16 = lanes::GGML_BF16;

// Reads / writes one float element of ggml type f32, f16 or bf16.
inline float load_float(const uint8_t * p, int32_t ggml_type) {
    if (ggml_type == GGML_F32) {
        float v;
        std::memcpy(&v, p, 4);
        return v;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return ggml_type == GGML_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
inline void store_float(uint8_t * p, int32_t ggml_type, float v) {
    if (ggml_type == GGML_F32) {
        std::memcpy(p, &v, 4);
        return;
    }
    const uint16_t h = ggml_type == GGML_F16 ? f32_to_f16(v) : f32_to_bf16(v);
    std::memcpy(p, &h, 2);
}

// Reconstruction of q, the same bits on every path (scalar, AVX2, CUDA): lanes.h.
using lanes::dequant;

// A value whose |q| > 127 * 2^raw_bits, coded as SYM_ESCAPE plus q in the tensor's escape list.
struct Escape {
    uint32_t lane;
    uint32_t cell;
    int64_t q;
};

// An escaped value (docs/format.md, "Tensor section"): |q| >= 128, since smaller ones have a
// symbol; stored as varint((|q| - 128) << 1 | sign), one byte up to |q| = 191.
constexpr int64_t MAX_ESCAPE_Q = int64_t(1) << 31;
// The quantizer clamps |q| here (past it |q| - |r| is no int64): a tensor whose values would reach
// half of it is coded losslessly instead (an f32 cache's 7.6e6 among values of 1 came back as 1.2e5).
constexpr float MAX_CODED_Q = 1e9f;
inline uint64_t escape_code(int64_t q) {
    const uint64_t magnitude = static_cast<uint64_t>(q < 0 ? -q : q);
    LCG_CHECK(magnitude >= 128 && q >= -MAX_ESCAPE_Q && q <= MAX_ESCAPE_Q, LCG_ERR_INTERNAL, "escape of %lld",
              static_cast<long long>(q));
    return (magnitude - 128) << 1 | (q < 0 ? 1u : 0u);
}
// Reads one; LCG_ERR_CORRUPT past MAX_ESCAPE_Q.
inline int64_t read_escape(ByteReader & r) {
    const uint64_t code = r.varint();
    LCG_CHECK(code >> 1 <= static_cast<uint64_t>(MAX_ESCAPE_Q - 128), LCG_ERR_CORRUPT, "escaped value code %llu",
              static_cast<unsigned long long>(code));
    const int64_t magnitude = static_cast<int64_t>(code >> 1) + 128;
    return code & 1 ? -magnitude : magnitude;
}

// What quantize_rows measured for the reconstruction offset: sum over q != 0 of |q| - |r| in
// 1/65536 steps (an integer, so that every code path and thread order gives the same sum).
struct ShrinkSum {
    int64_t fixed = 0;
    uint64_t count = 0;
};

// Channels of one quantization group (one step, one table) at most.
constexpr uint32_t MAX_GROUP = 32;

// Quantizes n rows of gn values (row i = cell i, cell-major) to symbols and (raw_bits > 0) one byte
// of raw bits each, with q = round(r), r = (value - mean) / step, ties to even. Rows with skip[i]
// become SYM_ZERO and raw 0, so do escapes' raw bits. Uses AVX2 where the CPU has it and gn is a
// multiple of 8; both paths give the same bytes.
void quantize_rows(const float * values, size_t n, uint32_t gn, const float * mean, const float * inv_step,
                   uint32_t raw_bits, const uint8_t * skip, uint8_t * sym, uint8_t * raw, ShrinkSum & shrink,
                   std::vector<Escape> & escapes);

// Converts n f16 values to float (F16C where the CPU has it).
void f16_row_to_f32(const uint8_t * src, size_t n, float * dst);

// Converts n floats to f16, rounding to nearest even (F16C where the CPU has it).
void f32_row_to_f16(const float * src, size_t n, uint8_t * dst);

// Gathers gn f16 values at src + i * stride for each of n rows into n x gn floats (F16C where the
// CPU has it).
void f16_rows_to_f32(const uint8_t * src, size_t stride, size_t n, uint32_t gn, float * dst);

} // namespace lcg
