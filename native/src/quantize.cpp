#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lcg {

namespace {

// Squared error relative to the reference cache type's, per level. Measured with `eval`-style runs
// (teacher-forced KL over 256 tokens against the untouched state) on SmolLM2 (the repo's three
// texts at 2,048 tokens; asyncio's source, a German man page, `man bash` at 300-4,096), Gemma 3
// 270M (interleaved sliding window, one KV head of 256 channels) and Qwen2.5-Coder 0.5B, texts that
// are not in the repo. A single text's KL over 256 tokens moves by +-20% between nearby scales.
// `balanced` keeps that margin below q5_1 on the tightest case (SmolLM2 on German: 0.78 of q5_1's
// KL at 2.55, 0.94 at 3.4). `compact` is tightest where attention copies (repeated text, tables):
// there Gemma 3's KL jumps once the error passes q4_0's own (1,400 tokens, three such texts: 0.55-0.81
// of q4_0's KL at 1.0, 1.13-1.20 at 1.25, 1.24-4.5 at 2.0), while SmolLM2 stays 3-8x below q4_0's at
// 2.0, so it takes q4_0's own squared error. `high` sits at the model's noise floor (a smaller scale
// does not lower its KL there): it takes q8_0's own squared error.
constexpr float REF_SCALE_HIGH = 1.0f;
constexpr float REF_SCALE_BALANCED = 2.5f;
constexpr float REF_SCALE_COMPACT = 1.0f;

// In-place orthonormal Walsh-Hadamard transform of n (a power of two) values.
__attribute__((always_inline)) inline void hadamard(float * x, uint32_t n) {
    for (uint32_t h = 1; h < n; h *= 2) {
        for (uint32_t i = 0; i < n; i += 2 * h) {
            for (uint32_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(n));
    for (uint32_t i = 0; i < n; i++) {
        x[i] *= scale;
    }
}

inline float f16_round(float v) { return f16_to_f32(f32_to_f16(v)); }

// Squared error of one block of 32 through ggml's reference quantizer of `type`
// (quantize_row_q8_0_ref, quantize_row_q5_1_ref, quantize_row_q4_0_ref) and back.
// Four partial sums (j mod 4): four dependency chains instead of one.
__attribute__((always_inline)) inline double block_sq_error(const float * x, int32_t type) {
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    if (type == GGML_Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            amax = std::max(amax, std::fabs(x[j]));
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f, dh = f16_round(d);
        for (int j = 0; j < 32; j++) {
            const double e = x[j] - std::round(x[j] * id) * dh;
            part[j & 3] += e * e;
        }
    } else if (type == GGML_Q5_1) {
        float lo = x[0], hi = x[0];
        for (int j = 1; j < 32; j++) {
            lo = std::min(lo, x[j]);
            hi = std::max(hi, x[j]);
        }
        const float d = (hi - lo) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f, dh = f16_round(d), mh = f16_round(lo);
        for (int j = 0; j < 32; j++) {
            const int q = std::min(31, static_cast<int>((x[j] - lo) * id + 0.5f));
            const double e = x[j] - (q * dh + mh);
            part[j & 3] += e * e;
        }
    } else {  // q4_0
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) {
            if (amax < std::fabs(x[j])) {
                amax = std::fabs(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f, dh = f16_round(d);
        for (int j = 0; j < 32; j++) {
            const int q = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
            const double e = x[j] - (q - 8) * dh;
            part[j & 3] += e * e;
        }
    }
    return (part[0] + part[1]) + (part[2] + part[3]);
}

} // namespace

QuantKnobs level_knobs(int32_t level) {
    QuantKnobs k = fixed_level_knobs(level);
    switch (level) {
        case LCG_LEVEL_HIGH: k.ref_type = GGML_Q8_0; k.ref_scale = REF_SCALE_HIGH; break;
        case LCG_LEVEL_BALANCED: k.ref_type = GGML_Q5_1; k.ref_scale = REF_SCALE_BALANCED; break;
        case LCG_LEVEL_COMPACT: k.ref_type = GGML_Q4_0; k.ref_scale = REF_SCALE_COMPACT; break;
        default: break;
    }
    return k;
}

QuantKnobs fixed_level_knobs(int32_t level) {
    switch (level) {
        // Tuned on SmolLM2-135M, 2,048 tokens (bench/): a uniform step over layers measured as good
        // as or better than finer shallow layers at equal size, so the presets keep the ramp flat.
        case LCG_LEVEL_HIGH: return {0.115f, 0.115f, 1.0f, 4, -1, 0.0f, 0};
        case LCG_LEVEL_BALANCED: return {0.40f, 0.40f, 1.0f, 4, -1, 0.0f, 0};
        case LCG_LEVEL_COMPACT: return {0.72f, 0.72f, 1.0f, 4, -1, 0.0f, 0};
        default: return {0.0f, 0.0f, 1.0f, 0, -1, 0.0f, 0};
    }
}

float layer_step(const QuantKnobs & k, bool is_v, uint32_t layer, uint32_t n_layer) {
    const float last = is_v ? k.v_step : k.k_step;
    const float t = n_layer > 1 ? static_cast<float>(layer) / static_cast<float>(n_layer - 1) : 1.0f;
    return last * (k.first_layer_scale + (1.0f - k.first_layer_scale) * t);
}

namespace {

#if defined(__x86_64__)
// hadamard() for n a multiple of 8, the same additions in the same stages: the first three inside
// each vector of 8 (a lane and its partner, swapped in by a permute), the rest between vectors.
__attribute__((target("avx2"))) void hadamard_avx2(float * x, uint32_t n) {
    for (uint32_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 partner = _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1));  // h = 1
        v = _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), 0xaa);
        partner = _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2));  // h = 2
        v = _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), 0xcc);
        partner = _mm256_permute2f128_ps(v, v, 1);  // h = 4
        v = _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), 0xf0);
        _mm256_storeu_ps(x + i, v);
    }
    for (uint32_t h = 8; h < n; h *= 2) {
        for (uint32_t i = 0; i < n; i += 2 * h) {
            for (uint32_t j = i; j < i + h; j += 8) {
                const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
            }
        }
    }
    const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(n)));
    for (uint32_t i = 0; i < n; i += 8) {
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
    }
}
#endif

#if defined(__x86_64__)
// The largest (smallest) of 8 lanes, in every lane.
__attribute__((target("avx2"), always_inline)) inline __m256 max_all_lanes(__m256 a) {
    a = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 1));
    a = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
}
__attribute__((target("avx2"), always_inline)) inline __m256 min_all_lanes(__m256 a) {
    a = _mm256_min_ps(a, _mm256_permute2f128_ps(a, a, 1));
    a = _mm256_min_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_min_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
}

// block_sq_error, 8 values at a time with the same float operations per value, the squares added
// into the same four partial sums (lane j of a 4-double vector is part[j & 3]) in the same order.
__attribute__((target("avx2"))) double block_sq_error_avx2(const float * x, int32_t type) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
    }
    __m256 e[4];
    if (type == GGML_Q8_0 || type == GGML_Q4_0) {
        __m256 amax = _mm256_andnot_ps(sign, v[0]);
        for (int k = 1; k < 4; k++) {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
        }
        const float a = _mm256_cvtss_f32(max_all_lanes(amax));
        if (type == GGML_Q8_0) {
            const float d = a / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256 idv = _mm256_set1_ps(id), dh = _mm256_set1_ps(f16_round(d));
            const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
            for (int k = 0; k < 4; k++) {
                // roundf: half-way cases away from zero
                const __m256 r = _mm256_mul_ps(v[k], idv);
                const __m256 t = _mm256_round_ps(r, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(r, t)), half, _CMP_GE_OQ);
                const __m256 q = _mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, r))));
                e[k] = _mm256_sub_ps(v[k], _mm256_mul_ps(q, dh));
            }
        } else {
            // the value of the first largest |x|, as the scalar loop keeps it (+0 when all are zero)
            float max = 0.0f;
            for (int j = 0; j < 32 && a != 0.0f; j++) {
                if (std::fabs(x[j]) == a) {
                    max = x[j];
                    break;
                }
            }
            const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256 idv = _mm256_set1_ps(id), dh = _mm256_set1_ps(f16_round(d));
            const __m256i fifteen = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_min_epi32(
                    fifteen, _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(v[k], idv), _mm256_set1_ps(8.5f))));
                e[k] = _mm256_sub_ps(v[k], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)), dh));
            }
        }
    } else {  // q5_1
        __m256 lo = v[0], hi = v[0];
        for (int k = 1; k < 4; k++) {
            lo = _mm256_min_ps(lo, v[k]);
            hi = _mm256_max_ps(hi, v[k]);
        }
        const float l = _mm256_cvtss_f32(min_all_lanes(lo)), h = _mm256_cvtss_f32(max_all_lanes(hi));
        const float d = (h - l) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 idv = _mm256_set1_ps(id), lov = _mm256_set1_ps(l);
        const __m256 dh = _mm256_set1_ps(f16_round(d)), mh = _mm256_set1_ps(f16_round(l));
        const __m256i thirty_one = _mm256_set1_epi32(31);
        for (int k = 0; k < 4; k++) {
            const __m256i q = _mm256_min_epi32(
                thirty_one,
                _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v[k], lov), idv), _mm256_set1_ps(0.5f))));
            e[k] = _mm256_sub_ps(v[k], _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), dh), mh));
        }
    }
    __m256d part = _mm256_setzero_pd();
    for (int k = 0; k < 4; k++) {
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e[k]));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e[k], 1));
        part = _mm256_add_pd(part, _mm256_mul_pd(lo, lo));
        part = _mm256_add_pd(part, _mm256_mul_pd(hi, hi));
    }
    alignas(32) double p[4];
    _mm256_store_pd(p, part);
    return (p[0] + p[1]) + (p[2] + p[3]);
}
#endif

// Element-wise float work and double sums in a fixed order: the AVX2 build gives the same result.
template <bool AVX2>
__attribute__((always_inline)) inline double reference_sq_error_body(const float * rows, size_t n_rows,
                                                                     uint32_t n_units, int32_t ref_type,
                                                                     uint32_t rot) {
    std::vector<float> row(n_units);
    float tail[32];
    double err = 0.0;
    for (size_t r = 0; r < n_rows; r++) {
        std::memcpy(row.data(), rows + r * n_units, n_units * sizeof(float));
        for (uint32_t b = 0; rot && b < n_units; b += rot) {
#if defined(__x86_64__)
            if (AVX2) {
                hadamard_avx2(row.data() + b, rot);
                continue;
            }
#endif
            hadamard(row.data() + b, rot);
        }
        for (uint32_t b = 0; b < n_units; b += 32) {
            const uint32_t len = std::min(32u, n_units - b);
            const float * x = row.data() + b;
            if (len < 32) {  // a row's partial last block: its values repeated, its share of the error
                for (uint32_t j = 0; j < 32; j++) {
                    tail[j] = x[j % len];
                }
                x = tail;
            }
            double e;
#if defined(__x86_64__)
            if (AVX2) {
                e = block_sq_error_avx2(x, ref_type);
            } else
#endif
            {
                e = block_sq_error(x, ref_type);
            }
            err += len < 32 ? e * len / 32.0 : e;
        }
    }
    return err;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) double reference_sq_error_avx2(const float * rows, size_t n_rows, uint32_t n_units,
                                                                int32_t ref_type, uint32_t rot) {
    return reference_sq_error_body<true>(rows, n_rows, n_units, ref_type, rot);
}
#endif

} // namespace

double reference_sq_error(const float * rows, size_t n_rows, uint32_t n_units, int32_t ref_type, uint32_t rot) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        return reference_sq_error_avx2(rows, n_rows, n_units, ref_type, rot);
    }
#endif
    return reference_sq_error_body<false>(rows, n_rows, n_units, ref_type, rot);
}

void dequantize_q8_0_row(const uint8_t * blocks, uint32_t n_blocks, float * out) {
    for (uint32_t b = 0; b < n_blocks; b++, blocks += Q8_0_BYTES, out += Q8_0_VALUES) {
        uint16_t dh;
        std::memcpy(&dh, blocks, 2);
        const float d = f16_to_f32(dh);
        for (uint32_t j = 0; j < Q8_0_VALUES; j++) {
            out[j] = d * static_cast<float>(static_cast<int8_t>(blocks[2 + j]));
        }
    }
}

namespace {

// One block as quantize_row_q8_0_ref makes it; a forged container's inf and NaN give q = 0.
void quantize_q8_0_block(const float * x, uint8_t * block) {
    float amax = 0.0f;
    for (uint32_t j = 0; j < Q8_0_VALUES; j++) {
        amax = std::max(amax, std::fabs(x[j]));
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = f32_to_f16(d);
    std::memcpy(block, &dh, 2);
    for (uint32_t j = 0; j < Q8_0_VALUES; j++) {
        const float q = std::round(x[j] * id);  // within [-127, 127] for finite values
        const float kept = std::isfinite(q) ? std::clamp(q, -127.0f, 127.0f) : 0.0f;
        block[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(kept));
    }
}

#if defined(__x86_64__)
// quantize_q8_0_block, 8 values at a time, the same bytes: roundf (halves away from zero) from the
// exact fraction r - trunc(r); blocks with a NaN, or whose scale or its inverse is not finite, take
// the scalar path.
__attribute__((target("avx2,f16c"))) void quantize_q8_0_row_avx2(const float * values, uint32_t n_blocks,
                                                                  uint8_t * blocks) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (uint32_t b = 0; b < n_blocks; b++, blocks += Q8_0_BYTES, values += Q8_0_VALUES) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(values + 8 * k);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
        }
        const float a = _mm256_cvtss_f32(max_all_lanes(amax));
        const float d = a / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        if (!std::isfinite(a) || !std::isfinite(id) || _mm256_movemask_ps(nan) != 0) {
            quantize_q8_0_block(values, blocks);
            continue;
        }
        const uint16_t dh = f32_to_f16(d);
        std::memcpy(blocks, &dh, 2);
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 r = _mm256_mul_ps(v[k], idv);
            const __m256 t = _mm256_round_ps(r, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(r, t)), half, _CMP_GE_OQ);
            const __m256 step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, r)));  // 0 or +-1
            q[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
        }
        // 32 int32 to int8 (|q| <= 127: no saturation), back in order after the lane-wise packs
        const __m256i q16 = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(blocks + 2), q8);
    }
}
#endif

} // namespace

void quantize_q8_0_row(const float * values, uint32_t n_blocks, uint8_t * blocks) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        quantize_q8_0_row_avx2(values, n_blocks, blocks);
        return;
    }
#endif
    for (uint32_t b = 0; b < n_blocks; b++) {
        quantize_q8_0_block(values + b * Q8_0_VALUES, blocks + b * Q8_0_BYTES);
    }
}

ChannelQuant channel_quant(double mean, double step) {
    float s = static_cast<float>(step);
    if (!(s >= MIN_STEP)) {
        s = step > 0.0 ? MIN_STEP : 1.0f;
    }
    ChannelQuant cq;
    cq.mean_f16 = f32_to_f16(std::isfinite(mean) ? static_cast<float>(mean) : 0.0f);
    cq.step_f16 = f32_to_f16(std::min(s, 65504.0f));
    return cq;
}


namespace {

// f16 <-> f32 one value at a time: the portable path, and the F16C loops' tails.
void f16_row_to_f32_scalar(const uint8_t * src, size_t n, float * dst) {
    for (size_t k = 0; k < n; k++) {
        uint16_t h;
        std::memcpy(&h, src + 2 * k, 2);
        dst[k] = f16_to_f32(h);
    }
}

void f32_row_to_f16_scalar(const float * src, size_t n, uint8_t * dst) {
    for (size_t k = 0; k < n; k++) {
        const uint16_t h = f32_to_f16(src[k]);
        std::memcpy(dst + 2 * k, &h, 2);
    }
}

// Rounds to nearest even without a libm call: exact for |v| < 2^22.
inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

// Escapes: |q| > 127 * 2^raw_bits, i.e. |r| at or past this (the largest q a symbol holds, and a half).
inline float escape_limit(uint32_t raw_bits) { return static_cast<float>(127 << raw_bits) + 0.5f; }

void quantize_value(float r, uint32_t raw_bits, uint32_t lane, uint32_t cell, uint8_t & s, uint8_t * raw,
                    ShrinkSum & shrink, std::vector<Escape> & escapes) {
    const float a = std::fabs(r);
    if (a < escape_limit(raw_bits)) {
        const float qf = round_even(r);
        const int32_t q = static_cast<int32_t>(qf);
        s = static_cast<uint8_t>((q >> raw_bits) + SYM_ZERO);  // a floor: the raw bits add up from it
        if (raw) {
            *raw = static_cast<uint8_t>(q & ((1 << raw_bits) - 1));
        }
        if (qf != 0.0f) {
            shrink.fixed += static_cast<int32_t>(round_even((std::fabs(qf) - a) * 65536.0f));
            shrink.count++;
        }
        return;
    }
    const float clamped = std::min(a, MAX_CODED_Q);
    const int64_t q = static_cast<int64_t>(std::nearbyint(r < 0 ? -clamped : clamped));
    s = SYM_ESCAPE;
    if (raw) {
        *raw = 0;  // not read: the escape list holds the whole q
    }
    escapes.push_back({lane, cell, q});
    // from the clamped value: |q| - a for a far past MAX_CODED_Q is no int64 (undefined behaviour)
    shrink.fixed += static_cast<int64_t>(std::nearbyint((static_cast<double>(std::llabs(q)) - clamped) * 65536.0));
    shrink.count++;
}

// One row (cell) of gn values; the scalar reference.
void quantize_row_scalar(const float * v, uint32_t gn, const float * mean, const float * inv_step, uint32_t raw_bits,
                         uint32_t cell, uint8_t * out, uint8_t * raw, ShrinkSum & shrink,
                         std::vector<Escape> & escapes) {
    for (uint32_t g = 0; g < gn; g++) {
        quantize_value((v[g] - mean[g]) * inv_step[g], raw_bits, g, cell, out[g], raw ? raw + g : nullptr, shrink,
                       escapes);
    }
}

#if defined(__x86_64__)
// Adds 8 signed (acc32) and 8 unsigned (count32) 32-bit lanes into 4-lane 64-bit sums; zeroes them.
__attribute__((target("avx2"), always_inline)) inline void flush_sums(__m256i & acc, __m256i & acc32, __m256i & count,
                                                                      __m256i & count32) {
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc32)));
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc32, 1)));
    count = _mm256_add_epi64(count, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(count32)));
    count = _mm256_add_epi64(count, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(count32, 1)));
    acc32 = count32 = _mm256_setzero_si256();
}

// The same for all rows, 8 values at a time (gn a multiple of 8, at most MAX_GROUP); a lane
// holding an escape goes the scalar way. One loop over the rows with the group's means and steps
// held in registers: a group is often a single vector per row (8 channels).
__attribute__((target("avx2"))) void quantize_rows_avx2(const float * values, size_t n, uint32_t gn,
                                                         const float * mean, const float * inv_step,
                                                         uint32_t raw_bits, const uint8_t * skip, uint8_t * sym,
                                                         uint8_t * raw, ShrinkSum & shrink,
                                                         std::vector<Escape> & escapes) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 limit = _mm256_set1_ps(escape_limit(raw_bits));
    const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(raw_bits));
    const __m256i raw_mask = _mm256_set1_epi32((1 << raw_bits) - 1);
    const __m256 fixed_scale = _mm256_set1_ps(65536.0f);
    const __m256i bias = _mm256_set1_epi32(SYM_ZERO);
    // byte 0 of each 32-bit lane to the front of its 128-bit half, then the two halves together
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    const uint32_t n_vec = gn / 8;
    __m256 m[MAX_GROUP / 8], is[MAX_GROUP / 8];
    for (uint32_t j = 0; j < n_vec; j++) {
        m[j] = _mm256_loadu_ps(mean + 8 * j);
        is[j] = _mm256_loadu_ps(inv_step + 8 * j);
    }
    // Per lane: offsets (each at most 32768 in magnitude, up to MAX_GROUP / 8 per row) and nonzero
    // counts in 32 bits, moved to 64-bit sums every FLUSH_ROWS rows (2^30 at most by then).
    constexpr size_t FLUSH_ROWS = 8192;
    __m256i acc = _mm256_setzero_si256(), count = _mm256_setzero_si256();
    __m256i acc32 = _mm256_setzero_si256(), count32 = _mm256_setzero_si256();
    for (size_t i = 0; i < n; i++) {
        if (i % FLUSH_ROWS == FLUSH_ROWS - 1) {
            flush_sums(acc, acc32, count, count32);
        }
        uint8_t * out = sym + i * gn;
        uint8_t * out_raw = raw ? raw + i * gn : nullptr;
        if (skip[i]) {
            std::memset(out, SYM_ZERO, gn);
            if (out_raw) {
                std::memset(out_raw, 0, gn);
            }
            continue;
        }
        const float * v = values + i * gn;
        for (uint32_t j = 0; j < n_vec; j++) {
            const __m256 r = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + 8 * j), m[j]), is[j]);
            const __m256 a = _mm256_andnot_ps(sign, r);
            const __m256 escaped = _mm256_cmp_ps(a, limit, _CMP_NLT_UQ);
            const __m256 qf = _mm256_round_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i qi = _mm256_cvtps_epi32(qf);
            const __m256i q = _mm256_add_epi32(_mm256_sra_epi32(qi, shift), bias);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, pick), join);
            _mm_storel_epi64(reinterpret_cast<__m128i *>(out + 8 * j), _mm256_castsi256_si128(bytes));
            if (out_raw) {
                const __m256i low = _mm256_and_si256(qi, raw_mask);
                const __m256i raw_bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(low, pick), join);
                _mm_storel_epi64(reinterpret_cast<__m128i *>(out_raw + 8 * j), _mm256_castsi256_si128(raw_bytes));
            }
            const __m256 nonzero = _mm256_andnot_ps(escaped, _mm256_cmp_ps(qf, _mm256_setzero_ps(), _CMP_NEQ_OQ));
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_andnot_ps(sign, qf), a), fixed_scale);
            const __m256i fixed = _mm256_and_si256(
                _mm256_cvtps_epi32(_mm256_round_ps(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                _mm256_castps_si256(nonzero));
            acc32 = _mm256_add_epi32(acc32, fixed);
            count32 = _mm256_sub_epi32(count32, _mm256_castps_si256(nonzero));  // a set lane is -1
            for (uint32_t e = static_cast<uint32_t>(_mm256_movemask_ps(escaped)); e != 0; e &= e - 1) {
                const uint32_t k = 8 * j + static_cast<uint32_t>(__builtin_ctz(e));
                quantize_value((v[k] - mean[k]) * inv_step[k], raw_bits, k, static_cast<uint32_t>(i), out[k],
                               out_raw ? out_raw + k : nullptr, shrink, escapes);
            }
        }
    }
    flush_sums(acc, acc32, count, count32);
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), acc);
    shrink.fixed += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), count);
    shrink.count += static_cast<uint64_t>(lanes[0] + lanes[1] + lanes[2] + lanes[3]);
}

__attribute__((target("avx2,f16c"))) void f16_row_to_f32_f16c(const uint8_t * src, size_t n, float * dst) {
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 2 * k))));
    }
    f16_row_to_f32_scalar(src + 2 * k, n - k, dst + k);
}

__attribute__((target("avx2,f16c"))) void f32_row_to_f16_f16c(const float * src, size_t n, uint8_t * dst) {
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + 2 * k), h);
    }
    f32_row_to_f16_scalar(src + k, n - k, dst + 2 * k);
}

// One dispatch for all the rows; the row conversion inlines into the loop.
__attribute__((target("avx2,f16c"))) void f16_rows_to_f32_f16c(const uint8_t * src, size_t stride, size_t n,
                                                                uint32_t gn, float * dst) {
    for (size_t i = 0; i < n; i++) {
        f16_row_to_f32_f16c(src + i * stride, gn, dst + i * gn);
    }
}
#endif

} // namespace

void quantize_rows(const float * values, size_t n, uint32_t gn, const float * mean, const float * inv_step,
                   uint32_t raw_bits, const uint8_t * skip, uint8_t * sym, uint8_t * raw, ShrinkSum & shrink,
                   std::vector<Escape> & escapes) {
    if (!raw_bits) {
        raw = nullptr;
    }
#if defined(__x86_64__)
    if (cpu_has_avx2 && gn % 8 == 0 && gn <= MAX_GROUP) {
        return quantize_rows_avx2(values, n, gn, mean, inv_step, raw_bits, skip, sym, raw, shrink, escapes);
    }
#endif
    for (size_t i = 0; i < n; i++) {
        uint8_t * out = sym + i * gn;
        uint8_t * out_raw = raw ? raw + i * gn : nullptr;
        if (skip[i]) {
            std::memset(out, SYM_ZERO, gn);
            if (out_raw) {
                std::memset(out_raw, 0, gn);
            }
        } else {
            quantize_row_scalar(values + i * gn, gn, mean, inv_step, raw_bits, static_cast<uint32_t>(i), out, out_raw,
                                shrink, escapes);
        }
    }
}

void f16_row_to_f32(const uint8_t * src, size_t n, float * dst) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        f16_row_to_f32_f16c(src, n, dst);
        return;
    }
#endif
    f16_row_to_f32_scalar(src, n, dst);
}

void f32_row_to_f16(const float * src, size_t n, uint8_t * dst) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        f32_row_to_f16_f16c(src, n, dst);
        return;
    }
#endif
    f32_row_to_f16_scalar(src, n, dst);
}

void f16_rows_to_f32(const uint8_t * src, size_t stride, size_t n, uint32_t gn, float * dst) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        f16_rows_to_f32_f16c(src, stride, n, gn, dst);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) {
        f16_row_to_f32(src + i * stride, gn, dst + i * gn);
    }
}

} // namespace lcg
