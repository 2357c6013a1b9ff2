#include "tensor_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <unordered_map>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lcg {

namespace {

constexpr uint8_t CODING_LOSSLESS = 0;
constexpr uint8_t CODING_LOSSY = 1;
constexpr uint8_t CODING_LOSSY_Q8_0 = 2;  // lossy over a q8_0 tensor's values, quantized back on decode
// How values are transformed before quantization (docs/format.md, "Stats section"): u16 =
// id | rows per group << 8. Unknown ids are refused, so that a newer writer's transform is never
// misread.
constexpr uint16_t TRANSFORM_NONE = 0;
constexpr uint16_t TRANSFORM_ANCHOR_DELTA = 1;
constexpr uint16_t TRANSFORM_ROPE = 2;

// Units per table: the fewest, from 8 up to 32, whose table covers ~16K symbols of the whole
// state, so that tables stay near 1% of the coded size. A multiple of 8: an AVX2 vector of 8
// consecutive units always uses one table.
uint32_t group_size(uint32_t n_cells) {
    uint32_t g = 8;
    while (g < MAX_GROUP && static_cast<uint64_t>(g) * n_cells < 16384) {
        g *= 2;
    }
    return g;
}

// A q8_0 tensor is coded lossily at the levels whose reference is coarser than q8_0 (at `high` it
// stays exact: the cache is at q8_0's quality already), as its values (q8_0_values): f32, one unit
// per value. llama.cpp never transposes a quantized V.
bool requantizable(const TensorDesc & t, const QuantKnobs & k) {
    return t.ggml_type == GGML_Q8_0 && !t.transposed && (k.ref_type == GGML_Q5_1 || k.ref_type == GGML_Q4_0) &&
           t.n_units <= UINT32_MAX / Q8_0_VALUES;
}

TensorDesc q8_0_values(const TensorDesc & t) {
    TensorDesc v = t;
    v.ggml_type = GGML_F32;
    v.unit_bytes = 4;
    v.n_units = t.n_units * Q8_0_VALUES;
    v.offset = 0;
    return v;
}

// Element (cell, unit) of a tensor lies at cell * cell + unit * unit bytes from its start.
struct Strides {
    size_t cell, unit;
    Strides(const TensorDesc & t)
        : cell(t.transposed ? t.unit_bytes : static_cast<size_t>(t.n_units) * t.unit_bytes),
          unit(t.transposed ? static_cast<size_t>(t.n_cells) * t.unit_bytes : t.unit_bytes) {}
};


#if defined(__x86_64__)
// Transposed f16 units [u0, u0 + gn) (gn a multiple of 8) into cell-major floats: 8 units x 8 cells
// at a time, a 16-bit 8x8 transpose then an exact conversion, the same floats as the scalar loop.
__attribute__((target("avx2,f16c"))) void load_transposed_f16_avx2(const uint8_t * base, size_t n_cells,
                                                                    size_t unit_stride, uint32_t u0, uint32_t gn,
                                                                    float * out) {
    for (uint32_t g0 = 0; g0 < gn; g0 += 8) {
        const uint8_t * src = base + (u0 + g0) * unit_stride;
        size_t i = 0;
        for (; i + 8 <= n_cells; i += 8) {
            __m128i r[8];
            for (int k = 0; k < 8; k++) {
                r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + k * unit_stride + 2 * i));
            }
            const __m128i t0 = _mm_unpacklo_epi16(r[0], r[1]), t1 = _mm_unpackhi_epi16(r[0], r[1]);
            const __m128i t2 = _mm_unpacklo_epi16(r[2], r[3]), t3 = _mm_unpackhi_epi16(r[2], r[3]);
            const __m128i t4 = _mm_unpacklo_epi16(r[4], r[5]), t5 = _mm_unpackhi_epi16(r[4], r[5]);
            const __m128i t6 = _mm_unpacklo_epi16(r[6], r[7]), t7 = _mm_unpackhi_epi16(r[6], r[7]);
            const __m128i v0 = _mm_unpacklo_epi32(t0, t2), v1 = _mm_unpackhi_epi32(t0, t2);
            const __m128i v2 = _mm_unpacklo_epi32(t1, t3), v3 = _mm_unpackhi_epi32(t1, t3);
            const __m128i v4 = _mm_unpacklo_epi32(t4, t6), v5 = _mm_unpackhi_epi32(t4, t6);
            const __m128i v6 = _mm_unpacklo_epi32(t5, t7), v7 = _mm_unpackhi_epi32(t5, t7);
            const __m128i cell[8] = {_mm_unpacklo_epi64(v0, v4), _mm_unpackhi_epi64(v0, v4),
                                     _mm_unpacklo_epi64(v1, v5), _mm_unpackhi_epi64(v1, v5),
                                     _mm_unpacklo_epi64(v2, v6), _mm_unpackhi_epi64(v2, v6),
                                     _mm_unpacklo_epi64(v3, v7), _mm_unpackhi_epi64(v3, v7)};
            for (int k = 0; k < 8; k++) {
                _mm256_storeu_ps(out + (i + k) * gn + g0, _mm256_cvtph_ps(cell[k]));
            }
        }
        for (; i < n_cells; i++) {
            for (uint32_t g = 0; g < 8; g++) {
                out[i * gn + g0 + g] = load_float(src + g * unit_stride + 2 * i, GGML_F16);
            }
        }
    }
}

// Cell-major symbols of a group (gn a multiple of 8) into the transposed tensor's unit-major
// symbols: 8 cells x 8 units at a time, a byte 8x8 transpose.
__attribute__((target("avx2"))) void store_transposed_symbols_avx2(const uint8_t * gsym, size_t n, uint32_t gn,
                                                                    uint8_t * dst) {
    for (uint32_t g0 = 0; g0 < gn; g0 += 8) {
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m128i r[8];
            for (int k = 0; k < 8; k++) {
                r[k] = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(gsym + (i + k) * gn + g0));
            }
            const __m128i t0 = _mm_unpacklo_epi8(r[0], r[1]), t1 = _mm_unpacklo_epi8(r[2], r[3]);
            const __m128i t2 = _mm_unpacklo_epi8(r[4], r[5]), t3 = _mm_unpacklo_epi8(r[6], r[7]);
            const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
            const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
            const __m128i unit[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                                     _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
            for (int k = 0; k < 4; k++) {  // units g0 + 2k (low half) and g0 + 2k + 1 (high half)
                _mm_storel_epi64(reinterpret_cast<__m128i *>(dst + (g0 + 2 * k) * n + i), unit[k]);
                _mm_storel_epi64(reinterpret_cast<__m128i *>(dst + (g0 + 2 * k + 1) * n + i),
                                 _mm_unpackhi_epi64(unit[k], unit[k]));
            }
        }
        for (; i < n; i++) {
            for (uint32_t g = g0; g < g0 + 8; g++) {
                dst[g * n + i] = gsym[i * gn + g];
            }
        }
    }
}
#endif

// Units [u0, u0 + gn) of every cell of t, cell-major, as floats. With `blocks`, t is the values of
// that q8_0 tensor (q8_0_values) and base its blocks: a group's units lie in one block (a group
// of 8, 16 or 32 starts at a multiple of itself), read from it without a copy of the tensor.
void load_values(const uint8_t * base, const TensorDesc & t, uint32_t u0, uint32_t gn, float * out,
                 const TensorDesc * blocks = nullptr) {
    if (blocks) {
        const size_t row = static_cast<size_t>(blocks->n_units) * Q8_0_BYTES;
        const uint8_t * block = base + (u0 / Q8_0_VALUES) * Q8_0_BYTES;
        for (size_t i = 0; i < t.n_cells; i++, block += row) {
            uint16_t dh;
            std::memcpy(&dh, block, 2);
            const float d = f16_to_f32(dh);
            const int8_t * q = reinterpret_cast<const int8_t *>(block + 2 + u0 % Q8_0_VALUES);
            for (uint32_t g = 0; g < gn; g++) {
                out[i * gn + g] = d * static_cast<float>(q[g]);
            }
        }
        return;
    }
    const Strides st(t);
#if defined(__x86_64__)
    if (t.transposed && t.ggml_type == GGML_F16 && gn % 8 == 0 && cpu_has_avx2) {
        return load_transposed_f16_avx2(base, t.n_cells, st.unit, u0, gn, out);
    }
#endif
    if (t.transposed) {  // each unit's cells are contiguous: convert a run, then interleave
        std::vector<float> run(t.n_cells);
        for (uint32_t g = 0; g < gn; g++) {
            const uint8_t * src = base + (u0 + g) * st.unit;
            if (t.ggml_type == GGML_F16) {
                f16_row_to_f32(src, t.n_cells, run.data());
            } else {
                for (size_t i = 0; i < t.n_cells; i++) {
                    run[i] = load_float(src + i * t.unit_bytes, t.ggml_type);
                }
            }
            for (size_t i = 0; i < t.n_cells; i++) {
                out[i * gn + g] = run[i];
            }
        }
        return;
    }
    if (t.ggml_type == GGML_F16) {
        return f16_rows_to_f32(base + u0 * 2, st.cell, t.n_cells, gn, out);
    }
    for (size_t i = 0; i < t.n_cells; i++) {
        for (uint32_t g = 0; g < gn; g++) {
            out[i * gn + g] = load_float(base + i * st.cell + (u0 + g) * st.unit, t.ggml_type);
        }
    }
}

// Rotation llama.cpp applies to a quantized cache before quantizing (llama-kv-cache.cpp): K in
// blocks of the largest power of two from 64 dividing the head size, V in blocks of 64. The state
// does not give the head size: the largest such power dividing the row, up to 256, stands in.
uint32_t reference_rotation(const TensorDesc & t) {
    if (t.n_units % 64 != 0) {
        return 0;
    }
    uint32_t rot = 64;
    while (!t.is_v && rot < 256 && t.n_units % (2 * rot) == 0) {
        rot *= 2;
    }
    return rot;
}

// Up to 256 of a tensor's non-sink rows, evenly spread, as floats (n_rows x n_units), and their
// cells: statistics of the whole tensor (an average) are pinned well by such a sample.
std::vector<float> sample_rows(const uint8_t * base, const TensorDesc & t, const std::vector<uint8_t> & is_sink,
                               std::vector<uint32_t> & sampled, const TensorDesc * blocks) {
    constexpr size_t MAX_SAMPLE = 256;
    const Strides st(t);
    std::vector<uint32_t> cells;
    for (uint32_t i = 0; i < t.n_cells; i++) {
        if (!is_sink[i]) {
            cells.push_back(i);
        }
    }
    sampled.clear();
    if (cells.empty()) {
        return {};
    }
    const size_t stride = (cells.size() + MAX_SAMPLE - 1) / MAX_SAMPLE;
    for (size_t r = 0; r * stride < cells.size(); r++) {
        sampled.push_back(cells[r * stride]);
    }
    const size_t n_rows = sampled.size();
    std::vector<float> rows(n_rows * t.n_units);
    if (blocks) {  // as load_values
        for (size_t r = 0; r < n_rows; r++) {
            const size_t row = static_cast<size_t>(blocks->n_units) * Q8_0_BYTES;
            dequantize_q8_0_row(base + sampled[r] * row, blocks->n_units, &rows[r * t.n_units]);
        }
    } else if (t.transposed) {  // unit by unit: each unit's cells are one contiguous run
        for (uint32_t u = 0; u < t.n_units; u++) {
            const uint8_t * unit = base + u * st.unit;
            for (size_t r = 0; r < n_rows; r++) {
                rows[r * t.n_units + u] = load_float(unit + sampled[r] * st.cell, t.ggml_type);
            }
        }
    } else {
        for (size_t r = 0; r < n_rows; r++) {
            const uint8_t * cell = base + sampled[r] * st.cell;
            float * row = &rows[r * t.n_units];
            if (t.ggml_type == GGML_F16) {
                f16_row_to_f32(cell, t.n_units, row);
                continue;
            }
            for (uint32_t u = 0; u < t.n_units; u++) {
                row[u] = load_float(cell + u * st.unit, t.ggml_type);
            }
        }
    }
    return rows;
}

// A tensor's reference error counts at most this multiple of the reference's error on the same rows
// less each channel's mean. llama.cpp's block quantizers spend their range on a channel's steady
// value (Qwen2.5's key biases: its q5_1 and q4_0 caches give KL 0.2-9 per token), which our
// quantizer subtracts; budgeted by that error, Qwen2.5 0.5B's first keys took steps 3-10x a healthy
// layer's, and `balanced` KL 0.09 where q8_0's is 0.012. Healthy keys measure 1.9-3.9x (SmolLM2,
// Gemma 3, Qwen2.5's other layers), values 1.0-1.3x: a guard above both leaves their steps as they were.
constexpr double MEAN_GUARD = 8.0;

// The error budget of a tensor under knobs with a reference type: ref_scale x the squared error
// of that llama.cpp cache type on a sample of its non-sink rows (rotated by rot first), per non-sink
// row, at most MEAN_GUARD x that error on the rows less their channel means (`guarded`: it was).
double reference_budget(const TensorDesc & t, const QuantKnobs & k, const std::vector<float> & rows, uint32_t rot,
                        bool & guarded) {
    const uint32_t n = t.n_units;
    const size_t n_rows = rows.size() / n;
    guarded = false;
    if (n_rows == 0) {
        return 0.0;
    }
    const double err = reference_sq_error(rows.data(), n_rows, n, k.ref_type, rot);
    std::vector<double> mean(n, 0.0);
    for (size_t r = 0; r < n_rows; r++) {
        for (uint32_t u = 0; u < n; u++) {
            mean[u] += rows[r * n + u];
        }
    }
    for (double & m : mean) {
        m /= static_cast<double>(n_rows);
    }
    std::vector<float> centered(rows.size());
    for (size_t r = 0; r < n_rows; r++) {
        for (uint32_t u = 0; u < n; u++) {
            centered[r * n + u] = static_cast<float>(rows[r * n + u] - mean[u]);
        }
    }
    const double err_centered = reference_sq_error(centered.data(), n_rows, n, k.ref_type, rot);
    // sampled rows all alike (a period of the text that the sample's stride meets) tell nothing
    // of the others' variation: no guard then
    guarded = err_centered > 0.0 && err > MEAN_GUARD * err_centered;
    return k.ref_scale * (guarded ? MEAN_GUARD * err_centered : err) / static_cast<double>(n_rows);
}

// Rotates back channels [u0, u0 + gn) of every cell, loaded in v (load_values), by the tensor's
// rope; `partner` is scratch of the same size.
void rotate_group(const uint8_t * base, const TensorDesc & t, const Rope & rope, const RopeTable & tab, uint32_t u0,
                  uint32_t gn, float * v, float * partner) {
    const size_t n = t.n_cells;
    // Partners inside the group (adjacent pairs) are copied, runs of them outside loaded.
    for (uint32_t g = 0; g < gn;) {
        const uint32_t p = rope_partner(tab, rope.head_dim, u0 + g);
        if (p >= u0 && p < u0 + gn) {
            for (size_t k = 0; k < n; k++) {
                partner[k * gn + g] = v[k * gn + (p - u0)];
            }
            g++;
            continue;
        }
        uint32_t len = 1;
        while (g + len < gn && rope_partner(tab, rope.head_dim, u0 + g + len) == p + len &&
               (p + len < u0 || p + len >= u0 + gn)) {
            len++;
        }
        std::vector<float> run(n * len);
        load_values(base, t, p, len, run.data());
        for (size_t k = 0; k < n; k++) {
            for (uint32_t j = 0; j < len; j++) {
                partner[k * gn + g + j] = run[k * len + j];
            }
        }
        g += len;
    }
    rotate_back(tab, rope.head_dim, u0, gn, n, partner, v);
}

// The value a decoder writes for element (step, shrink, mean, symbol q) of a tensor of `type`.
float decoded_value(int32_t type, float mean, float step, float shrink, float q) {
    uint8_t out[4];
    store_float(out, type, dequant(mean, step, shrink, q));
    return load_float(out, type);
}

// Anchor/delta, second pass over one channel group (values cell-major, gn per row): each delta row
// (not an anchor, not exact) codes its difference from its anchor row as the decoder will have it
// (decoded, or exact when the anchor is a sink row), so that errors do not add up.
void code_deltas(const TensorDesc & t, uint32_t every, const float * values, size_t n, uint32_t gn,
                 const float * mean, const float * inv_step, float step, float shrink, uint32_t raw_bits,
                 const std::vector<uint8_t> & is_sink, const std::vector<uint8_t> & skip_deltas, uint8_t * gsym,
                 uint8_t * graw, std::vector<Escape> & escapes) {
    std::vector<float> delta(n * gn, 0.0f);
    std::vector<uint8_t> skip(n);
    for (size_t i = 0; i < n; i++) {
        skip[i] = is_sink[i] || !skip_deltas[i];  // the rows the first pass left out, but sinks
        if (skip[i]) {
            continue;
        }
        const size_t a = i - i % every;
        for (uint32_t g = 0; g < gn; g++) {
            const size_t at = a * gn + g;
            const float anchor = is_sink[a] ? values[at]
                                            : decoded_value(t.ggml_type, mean[g], step, shrink,
                                                            lanes::symbol_q(gsym[at], raw_bits, graw ? graw[at] : 0));
            delta[i * gn + g] = values[i * gn + g] - anchor + mean[g];
        }
    }
    // Escaped anchors decode to their escape value, not symbol 0's: take it from the first pass.
    for (const Escape & x : escapes) {
        const size_t a = x.cell;
        for (size_t i = a + 1; i < std::min(n, a + every); i++) {
            if (!skip[i]) {
                const float anchor = decoded_value(t.ggml_type, mean[x.lane], step, shrink, static_cast<float>(x.q));
                delta[i * gn + x.lane] = values[i * gn + x.lane] - anchor + mean[x.lane];
            }
        }
    }
    std::vector<uint8_t> dsym(n * gn), draw(graw ? n * gn : 0);
    ShrinkSum unused;  // the stored offset is the anchors'
    quantize_rows(delta.data(), n, gn, mean, inv_step, raw_bits, skip.data(), dsym.data(), draw.data(), unused,
                  escapes);
    for (size_t i = 0; i < n; i++) {
        if (!skip[i]) {
            std::memcpy(gsym + i * gn, dsym.data() + i * gn, gn);
            if (graw) {
                std::memcpy(graw + i * gn, draw.data() + i * gn, gn);
            }
        }
    }
}

// Sums and sums of squares per channel of a group's cell-major values, and the group's largest
// |value|, sinks left out. Even and odd rows add into separate sums (two dependency chains),
// joined at the end in both builds, so the AVX2 one gives the same doubles.
void group_moments_scalar(const float * v, size_t n, uint32_t gn, const uint8_t * is_sink, double * sum,
                          double * sum_sq, float * max_abs) {
    double part[2][2][MAX_GROUP] = {};
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        if (is_sink[i]) {
            continue;
        }
        for (uint32_t g = 0; g < gn; g++) {
            const double x = v[i * gn + g];
            part[i & 1][0][g] += x;
            part[i & 1][1][g] += x * x;
            m = std::max(m, std::fabs(v[i * gn + g]));
        }
    }
    *max_abs = m;
    for (uint32_t g = 0; g < gn; g++) {
        sum[g] = part[0][0][g] + part[1][0][g];
        sum_sq[g] = part[0][1][g] + part[1][1][g];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"), always_inline)) inline void moments_row_avx2(const float * v, uint8_t sink,
                                                                          __m256d * s, __m256d * q, __m256 & m) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(sink ? 0 : -1));
    const __m256 x8 = _mm256_and_ps(_mm256_loadu_ps(v), keep);
    m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x8));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x8));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x8, 1));
    s[0] = _mm256_add_pd(s[0], lo);
    s[1] = _mm256_add_pd(s[1], hi);
    q[0] = _mm256_add_pd(q[0], _mm256_mul_pd(lo, lo));
    q[1] = _mm256_add_pd(q[1], _mm256_mul_pd(hi, hi));
}

// gn a multiple of 8 (no FMA: a fused x * x + s would round differently from the scalar build). A
// sink row adds zeros, as skipping it would.
__attribute__((target("avx2"))) void group_moments_avx2(const float * v, size_t n, uint32_t gn,
                                                         const uint8_t * is_sink, double * sum, double * sum_sq,
                                                         float * max_abs) {
    __m256 m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // by row parity
    for (uint32_t g = 0; g < gn; g += 8) {
        __m256d s[2][2], q[2][2];  // [row parity][channels g..g+3, g+4..g+7]
        for (int p = 0; p < 2; p++) {
            s[p][0] = s[p][1] = q[p][0] = q[p][1] = _mm256_setzero_pd();
        }
        size_t i = 0;
        for (; i + 2 <= n; i += 2) {
            moments_row_avx2(v + i * gn + g, is_sink[i], s[0], q[0], m[0]);
            moments_row_avx2(v + (i + 1) * gn + g, is_sink[i + 1], s[1], q[1], m[1]);
        }
        if (i < n) {
            moments_row_avx2(v + i * gn + g, is_sink[i], s[0], q[0], m[0]);
        }
        _mm256_storeu_pd(sum + g, _mm256_add_pd(s[0][0], s[1][0]));
        _mm256_storeu_pd(sum + g + 4, _mm256_add_pd(s[0][1], s[1][1]));
        _mm256_storeu_pd(sum_sq + g, _mm256_add_pd(q[0][0], q[1][0]));
        _mm256_storeu_pd(sum_sq + g + 4, _mm256_add_pd(q[0][1], q[1][1]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(m[0], m[1]));
    *max_abs = *std::max_element(lanes, lanes + 8);
}
#endif

void group_moments(const float * v, size_t n, uint32_t gn, const uint8_t * is_sink, double * sum, double * sum_sq,
                   float * max_abs) {
#if defined(__x86_64__)
    if (cpu_has_avx2 && gn % 8 == 0) {
        return group_moments_avx2(v, n, gn, is_sink, sum, sum_sq, max_abs);
    }
#endif
    group_moments_scalar(v, n, gn, is_sink, sum, sum_sq, max_abs);
}

// The largest finite value of a lossy tensor's type.
double max_finite(int32_t ggml_type) {
    return ggml_type == GGML_F16 ? 65504.0 : ggml_type == GGML_BF16 ? 3.3895313892515355e38 : FLT_MAX;
}

// Orders escapes collected group by group (keyed by their index in the coding order `lines`) into
// that order: a stable counting sort by line leaves each line's escapes in collection order,
// already sorted unless anchor/delta coded a group's rows in two passes.
void sort_escapes(const Lines & lines, std::vector<std::pair<uint64_t, int64_t>> & esc) {
    std::vector<size_t> start(lines.n_lines + 1, 0);
    for (const auto & x : esc) {
        start[x.first / lines.line_len + 1]++;
    }
    for (size_t o = 0; o < lines.n_lines; o++) {
        start[o + 1] += start[o];
    }
    std::vector<std::pair<uint64_t, int64_t>> sorted(esc.size());
    for (const auto & x : esc) {
        sorted[start[x.first / lines.line_len]++] = x;
    }
    if (!std::is_sorted(sorted.begin(), sorted.end())) {
        std::sort(sorted.begin(), sorted.end());
    }
    esc.swap(sorted);
}

// Copies n rows of gn bytes from src (packed) to dst (rows `stride` apart); GN: gn as a constant
// (0: not one).
template <uint32_t GN>
void copy_rows(const uint8_t * src, size_t n, uint32_t gn, uint8_t * dst, size_t stride) {
    const uint32_t size = GN ? GN : gn;
    for (size_t i = 0; i < n; i++) {
        std::memcpy(dst + i * stride, src + i * size, size);
    }
}

// A group's cell-major bytes (symbols or raw bits: n rows of gn) into their places in the tensor's
// memory order (grouped tensors quantize into theirs).
void place_group(const uint8_t * g, const TensorDesc & t, size_t n, uint32_t u0, uint32_t gn, uint8_t * dst) {
#if defined(__x86_64__)
    if (t.transposed && gn % 8 == 0 && cpu_has_avx2) {
        return store_transposed_symbols_avx2(g, n, gn, &dst[static_cast<size_t>(u0) * n]);
    }
#endif
    if (t.transposed) {
        for (uint32_t j = 0; j < gn; j++) {
            uint8_t * line = &dst[static_cast<size_t>(u0 + j) * n];
            for (size_t i = 0; i < n; i++) {
                line[i] = g[i * gn + j];
            }
        }
        return;
    }
    switch (gn) {  // a constant size: a move per row, not a call (4% of an encode)
        case 8: return copy_rows<8>(g, n, gn, &dst[u0], t.n_units);
        case 16: return copy_rows<16>(g, n, gn, &dst[u0], t.n_units);
        case 32: return copy_rows<32>(g, n, gn, &dst[u0], t.n_units);
        default: return copy_rows<0>(g, n, gn, &dst[u0], t.n_units);
    }
}

// How many of q's low bits go raw (0..MAX_RAW_BITS): the b with the fewest estimated bits per value
// over a sample of the tensor's q (~8K of the sampled rows' values, about their sample means):
// the entropy of q >> b, Miller-Madow corrected (a sample's plug-in entropy runs low by about the
// symbols seen / (2 n ln 2), more for finer symbols), plus b raw bits, plus 16 bits per escape
// (|q| > 127 * 2^b). Low bits are close to uniform where a value's bulk spans many steps (SmolLM2 at
// `high`: 1-3 raw bits, 1.4% smaller), not where a few far values inflate the
// deviations the steps follow (Cauchy-like tails: a rule on the deviation sent 4 raw bits of a
// bulk a few steps wide, 25-30% larger). Where some bits go raw, one more costs ~0.005 bits per
// value and, where it reaches `widest` (the largest |q| the tensor's values can take, which a
// sample misses), keeps the tensor off the decoder's escape path.
uint32_t choose_raw_bits(const std::vector<float> & sample, uint32_t n_units, uint32_t group,
                         const std::vector<double> & group_step, double widest) {
    const size_t n_rows = sample.size() / n_units;
    if (n_rows == 0) {
        return 0;
    }
    std::vector<double> mean(n_units, 0.0);
    for (size_t r = 0; r < n_rows; r++) {
        for (uint32_t u = 0; u < n_units; u++) {
            mean[u] += sample[r * n_units + u];
        }
    }
    constexpr int32_t REACH = 127 << lanes::MAX_RAW_BITS;  // |q| past this escapes at any b
    std::vector<uint32_t> hist(2 * REACH + 1, 0);
    uint64_t n = 0, far = 0;
    const size_t stride = std::max<size_t>(1, sample.size() / 8192) | 1;  // odd: every unit in turn
    for (size_t k = 0; k < sample.size(); k += stride) {
        const uint32_t u = static_cast<uint32_t>(k % n_units);
        const double step = group_step[u / group];
        if (!(step > 0.0)) {
            continue;
        }
        const double q = std::nearbyint((sample[k] - mean[u] / static_cast<double>(n_rows)) / step);
        n++;
        if (std::fabs(q) > REACH) {
            far++;
        } else {
            hist[static_cast<size_t>(q + REACH)]++;
        }
    }
    if (n == 0) {
        return 0;
    }
    uint32_t best = 0;
    double best_bits = 0.0;
    std::vector<uint32_t> sym(256);
    for (uint32_t b = 0; b <= lanes::MAX_RAW_BITS; b++) {
        std::fill(sym.begin(), sym.end(), 0u);
        uint64_t escapes = far;
        for (int32_t q = -REACH; q <= REACH; q++) {
            const uint32_t c = hist[static_cast<size_t>(q + REACH)];
            if (std::abs(q) > (127 << b)) {
                escapes += c;
            } else {
                sym[static_cast<size_t>((q >> b) + SYM_ZERO)] += c;
            }
        }
        sym[SYM_ESCAPE] += static_cast<uint32_t>(escapes);
        double h = 0.0;
        uint32_t seen = 0;
        for (uint32_t c : sym) {
            if (c) {
                const double p = static_cast<double>(c) / static_cast<double>(n);
                h -= p * std::log2(p);
                seen++;
            }
        }
        h += (seen - 1) / (2.0 * static_cast<double>(n) * std::log(2.0));
        const double bits = h + b + 16.0 * static_cast<double>(escapes) / static_cast<double>(n);
        if (b == 0 || bits < best_bits) {
            best = b;
            best_bits = bits;
        }
    }
    if (best >= 1 && best < lanes::MAX_RAW_BITS && widest > static_cast<double>(127u << best) &&
        widest <= static_cast<double>(127u << (best + 1))) {
        best++;
    }
    return best;
}

// Quantizes the whole tensor, group by group; false when a value is not finite. Every group of a
// tensor gets one step, rel x the tensor's RMS channel deviation: equal error in every channel
// minimizes the squared error for the bits, and on the logits it measured far better than error
// in proportion to each group's spread, which spends the most where a channel varies the most
// (SmolLM2, 2,048 tokens, bench/channel_transform.py: at equal squared error 2% fewer bits and
// 32-59% less KL). Keys coded rotated back by RoPE keep a step per group, rel x the group's
// deviation as stored: with one step their KL doubled at `compact` for the same squared error
// (SmolLM2, 384 tokens: 0.069 against 0.032 without RoPE; 0.039 with per-group steps). rel is the
// knobs' fixed step, or the one whose squared error (a uniform quantizer's step^2 / 12 per value)
// meets the reference budget. With `blocks`, t is the values of that q8_0 tensor at base
// (load_values); a quantized cache holds them rotated: the reference quantizes them as they are.
bool prepare_lossy(const uint8_t * base, const TensorDesc & t, const QuantKnobs & k, const RopeHint * hint,
                   const std::vector<uint8_t> & is_sink, const std::vector<int32_t> & pos,
                   const TensorDesc * blocks, TensorEncoder & e) {
    TensorStats & s = e.stats;
    std::vector<uint32_t> sampled;
    const std::vector<float> sample = sample_rows(base, t, is_sink, sampled, blocks);
    // RoPE: keys only (V is not rotated), rows not coded against each other.
    RopeTable tab;
    if (hint && !t.is_v && !t.transposed && !k.anchor_tokens && !sampled.empty()) {
        std::vector<int32_t> sample_pos(sampled.size());
        for (size_t r = 0; r < sampled.size(); r++) {
            sample_pos[r] = pos[sampled[r]];
        }
        s.rope = choose_rope(*hint, sample.data(), sample_pos.data(), sampled.size(), t.n_units);
        if (s.rope.pairing) {
            tab = rope_table(s.rope, pos.data(), pos.size());
        }
    }
    const size_t n = t.n_cells;
    s.lossy = true;  // (prepare_tensor starts again lossless if this fails)
    const Lines lines(t, s);  // the order of e.sym and e.raw
    s.mean_f16.resize(t.n_units);
    s.step_f16.resize(s.n_groups);
    s.shrink_u8.resize(s.n_groups);
    e.sym.reset(new uint8_t[n * t.n_units]);
    // One group's values, cell-major, loaded twice (statistics, then quantization) rather than the
    // whole tensor's floats held at once (twice an f16 tensor's size per encoding thread: 400 MB for
    // one K tensor of a 7B model's 100K-token context); measured as fast. Loaded before use.
    std::unique_ptr<float[]> values(new float[n * s.group]);
    std::unique_ptr<float[]> partner(s.rope.pairing ? new float[n * s.group] : nullptr);
    std::vector<double> mean_d(t.n_units), group_var(s.n_groups);
    std::vector<float> group_max(s.n_groups);
    uint64_t count = 0;
    for (size_t i = 0; i < n; i++) {
        count += !is_sink[i];
    }
    const double n_samples = static_cast<double>(std::max<uint64_t>(count, 1));
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        const uint32_t u0 = gi * s.group, gn = std::min(s.group, t.n_units - u0);
        float * v = values.get();
        load_values(base, t, u0, gn, v, blocks);
        double sum[MAX_GROUP] = {0}, sum_sq[MAX_GROUP] = {0};
        group_moments(v, n, gn, is_sink.data(), sum, sum_sq, &group_max[gi]);
        double var_sum = 0.0;
        for (uint32_t g = 0; g < gn; g++) {
            if (!std::isfinite(sum_sq[g])) {
                return false;
            }
            mean_d[u0 + g] = sum[g] / n_samples;
            var_sum += std::max(0.0, sum_sq[g] / n_samples - mean_d[u0 + g] * mean_d[u0 + g]);
        }
        // The steps follow the values as stored, so that the error falls on the channels as it does
        // without the transform (measured on SmolLM2: steps from the rotated-back spread moved the
        // error onto channels that matter more, twice the KL at the same squared error); the
        // rotated-back values only give the means the symbols gather around.
        group_var[gi] = var_sum / gn;
        if (s.rope.pairing) {
            rotate_group(base, t, s.rope, tab, u0, gn, v, partner.get());
            group_moments(v, n, gn, is_sink.data(), sum, sum_sq, &group_max[gi]);
            for (uint32_t g = 0; g < gn; g++) {
                mean_d[u0 + g] = sum[g] / n_samples;
            }
        }
    }
    double per_row = 0.0;  // sum over units of var: a step of rel * sd costs rel^2 / 12 of it
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        per_row += group_var[gi] * std::min(s.group, t.n_units - gi * s.group);
    }
    const double tensor_sd = std::sqrt(per_row / t.n_units);
    double rel = layer_step(k, t.is_v, t.layer, t.n_layer);
    bool finest = false;
    if (k.ref_type >= 0) {
        bool guarded = false;
        const double budget = reference_budget(t, k, sample, blocks ? 0 : reference_rotation(t), guarded);
        if (guarded && blocks) {
            // a q8_0 tensor's values go back into q8_0 blocks, whose range a channel's steady value
            // spends as llama.cpp's q4_0 would (what the guard is for): requantized, Qwen2.5 0.5B's
            // first keys took its KL from 0.02 to 2.6 at `compact` (the budget was f16's, whose KL
            // is 0.02). Such a tensor stays exact.
            return false;
        }
        const double ramp = layer_step(k, t.is_v, t.layer, t.n_layer) / (t.is_v ? k.v_step : k.k_step);
        rel = per_row > 0.0 ? std::sqrt(12.0 * budget / per_row) * ramp : 1.0;
        // a budget of 0 (every sampled row quantizes exactly) for a tensor that varies: the finest
        // step, never the step 1 that channel_quant gives a constant group
        finest = per_row > 0.0 && !(rel > 0.0);
    }
    double widest = 0.0;  // the largest |q| a group's values can reach
    std::vector<double> group_step(s.n_groups);  // rel x the tensor's (RoPE: the group's) deviation
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        const uint32_t u0 = gi * s.group, u1 = std::min(t.n_units, u0 + s.group);
        double mean_max = 0.0;
        for (uint32_t u = u0; u < u1; u++) {
            mean_max = std::max(mean_max, std::fabs(mean_d[u]));
        }
        group_step[gi] = finest ? MIN_STEP : rel * (s.rope.pairing ? std::sqrt(group_var[gi]) : tensor_sd);
        if (group_step[gi] > 0.0) {
            widest = std::max(widest, (k.anchor_tokens ? 2.0 : 1.0) * (group_max[gi] + mean_max) / group_step[gi]);
        }
    }
    if (widest >= 0.5 * MAX_CODED_Q) {
        return false;
    }
    s.raw_bits = choose_raw_bits(sample, t.n_units, s.group, group_step, widest);
    std::vector<uint8_t> gsym, graw;  // a group's symbols and raw bits, when not in place
    if (lines.kind != Lines::GROUPS) {
        gsym.resize(n * s.group);
        graw.resize(s.raw_bits ? n * s.group : 0);
    }
    if (s.raw_bits) {
        e.raw.reset(new uint8_t[n * t.n_units]);
    }
    std::vector<uint32_t> counts(static_cast<size_t>(s.n_groups) * 256, 0);
    std::vector<Escape> escapes;  // a group's, in the order found
    s.anchor_tokens = k.anchor_tokens;
    std::vector<uint8_t> skip_deltas;  // anchor/delta: rows the first pass leaves out
    if (s.anchor_tokens) {
        skip_deltas.resize(n);
        for (size_t i = 0; i < n; i++) {
            skip_deltas[i] = is_sink[i] || i % s.anchor_tokens != 0;
        }
    }
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        const uint32_t u0 = gi * s.group, gn = std::min(s.group, t.n_units - u0);
        float mean[MAX_GROUP], inv_step[MAX_GROUP];
        for (uint32_t g = 0; g < gn; g++) {
            const ChannelQuant cq = channel_quant(mean_d[u0 + g], group_step[gi]);
            s.mean_f16[u0 + g] = cq.mean_f16;
            s.step_f16[gi] = cq.step_f16;
            mean[g] = f16_to_f32(cq.mean_f16);
            inv_step[g] = 1.0f / f16_to_f32(cq.step_f16);
            // past f16's range a mean is inf and a step is clamped: an f32 cache of such values
            // decoded to inf and NaN at every lossy level; coded losslessly instead
            if (!std::isfinite(mean[g]) || group_step[gi] > 65504.0) {
                return false;
            }
        }
        // A decoded value lies within a step of its value (rounding to q moves it by half a step,
        // the shrink by at most half); anchor/delta also stores differences from the anchors, up
        // to twice the largest value plus the mean. Past the type's largest finite value a
        // decoder would write inf (and NaN under anchor/delta): such a tensor is coded losslessly.
        double reach = group_max[gi] + 2.0 * f16_to_f32(s.step_f16[gi]);
        for (uint32_t g = 0; s.anchor_tokens && g < gn; g++) {
            reach = std::max(reach, 2.0 * group_max[gi] + std::fabs(mean[g]) + 2.0 * f16_to_f32(s.step_f16[gi]));
        }
        if (s.rope.pairing) {  // rotated forward, a pair's values mix: |a cos - b sin| <= sqrt(2) max
            reach *= std::sqrt(2.0);
        }
        if (reach >= max_finite(t.ggml_type)) {
            return false;
        }
        load_values(base, t, u0, gn, values.get(), blocks);
        if (s.rope.pairing) {
            rotate_group(base, t, s.rope, tab, u0, gn, values.get(), partner.get());
        }
        escapes.clear();
        ShrinkSum shrink;
        // The group's symbols and raw bits, cell-major: grouped, straight into their place.
        const bool in_place = lines.kind == Lines::GROUPS;
        uint8_t * sym = in_place ? &e.sym[static_cast<size_t>(u0) * n] : gsym.data();
        uint8_t * raw = !s.raw_bits ? nullptr : in_place ? &e.raw[static_cast<size_t>(u0) * n] : graw.data();
        // Anchor/delta: anchor rows (and all rows without the transform) first.
        quantize_rows(values.get(), n, gn, mean, inv_step, s.raw_bits,
                      s.anchor_tokens ? skip_deltas.data() : is_sink.data(), sym, raw, shrink, escapes);
        // Values of a bin lie closer to zero than its centre on average (peaked distributions):
        // the decoder reconstructs |q| - shrink, with the group's measured mean offset (anchor
        // rows' offset under anchor/delta: the deltas are coded against the anchors' decoded values).
        const double mean_shrink =
            shrink.count ? static_cast<double>(shrink.fixed) / 65536.0 / static_cast<double>(shrink.count) : 0.0;
        s.shrink_u8[gi] = static_cast<uint8_t>(std::clamp(std::lround(mean_shrink * 256.0), 0L, 127L));
        if (s.anchor_tokens) {
            code_deltas(t, s.anchor_tokens, values.get(), n, gn, mean, inv_step, f16_to_f32(s.step_f16[gi]),
                        s.shrink_u8[gi] / 256.0f, s.raw_bits, is_sink, skip_deltas, sym, raw, escapes);
        }
        // Eight histograms, summed: a group's symbols are few and often equal, and increments of
        // one counter wait on each other (8 apart, the wait hides behind the other seven).
        uint32_t part[8][256] = {};
        const size_t n_sym = n * gn;
        size_t x = 0;
        for (; x + 8 <= n_sym; x += 8) {
            uint64_t w;
            std::memcpy(&w, &sym[x], 8);
            for (int j = 0; j < 8; j++) {
                part[j][(w >> (8 * j)) & 0xff]++;
            }
        }
        for (; x < n_sym; x++) {
            part[0][sym[x]]++;
        }
        uint32_t * c = &counts[static_cast<size_t>(gi) * 256];
        for (int b = 0; b < 256; b++) {
            c[b] = ((part[0][b] + part[1][b]) + (part[2][b] + part[3][b])) +
                   ((part[4][b] + part[5][b]) + (part[6][b] + part[7][b]));
        }
        if (!in_place) {
            place_group(sym, t, n, u0, gn, e.sym.get());
            if (raw) {
                place_group(raw, t, n, u0, gn, e.raw.get());
            }
        }
        if (gi == 0) {  // room for as many escapes in every group as in the first, and a quarter more
            e.escapes.reserve(std::min<size_t>(escapes.size() * s.n_groups * 5 / 4, n * t.n_units));
        }
        for (const Escape & x : escapes) {
            e.escapes.push_back({lines.index(x.cell, u0 + x.lane), x.q});
        }
    }
    sort_escapes(lines, e.escapes);
    s.tables.resize(s.n_groups);
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        rans::build_table(&counts[static_cast<size_t>(gi) * 256], s.tables[gi]);
    }
    return true;
}

// Adds the ub byte planes of n_lines runs of n side-by-side elements (runs `stride` bytes apart)
// to part[b][k % 4][byte] (1024 counters per plane); 2-byte elements four at a time from one
// 8-byte load. One call per group: a K group's runs are one row's 8 to 32 units.
void count_planes(const uint8_t * p, size_t n_lines, size_t stride, size_t n, uint32_t ub, uint32_t * part) {
    for (size_t line = 0; line < n_lines; line++, p += stride) {
        size_t k = 0;
        if (ub == 2) {
            for (; k + 4 <= n; k += 4) {
                uint64_t w;
                std::memcpy(&w, p + 2 * k, 8);
                for (uint32_t j = 0; j < 4; j++) {
                    part[j * 256 + ((w >> (16 * j)) & 0xff)]++;
                    part[1024 + j * 256 + ((w >> (16 * j + 8)) & 0xff)]++;
                }
            }
        }
        for (; k < n; k++) {
            for (uint32_t b = 0; b < ub; b++) {
                part[static_cast<size_t>(b) * 1024 + (k & 3) * 256 + p[k * ub + b]]++;
            }
        }
    }
}

void prepare_lossless(const uint8_t * base, const TensorDesc & t, TensorEncoder & e) {
    TensorStats & s = e.stats;
    const Strides st(t);
    s.plane_stored.assign(t.unit_bytes, 0);
    // Histograms of every plane, group by group: four per plane (by unit mod 4), summed, because
    // the high bytes of neighbours are often equal and one counter's increments would wait on
    // each other.
    const uint32_t ub = t.unit_bytes;
    std::vector<uint32_t> plane_counts(static_cast<size_t>(ub) * s.n_groups * 256);  // [b][gi][symbol]
    std::vector<uint32_t> part(static_cast<size_t>(ub) * 4 * 256);
    for (uint32_t gi = 0; gi < s.n_groups; gi++) {
        std::fill(part.begin(), part.end(), 0u);
        const uint32_t u0 = gi * s.group, u1 = std::min(t.n_units, u0 + s.group);
        if (!t.transposed) {  // in memory order: runs of side-by-side elements
            count_planes(base + u0 * st.unit, t.n_cells, st.cell, u1 - u0, ub, part.data());
        } else {
            count_planes(base + u0 * st.unit, u1 - u0, st.unit, t.n_cells, ub, part.data());
        }
        for (uint32_t b = 0; b < ub; b++) {
            uint32_t * c = &plane_counts[(static_cast<size_t>(b) * s.n_groups + gi) * 256];
            const uint32_t * p = &part[static_cast<size_t>(b) * 1024];
            for (int x = 0; x < 256; x++) {
                c[x] = p[x] + p[256 + x] + p[512 + x] + p[768 + x];
            }
        }
    }
    for (uint32_t b = 0; b < t.unit_bytes; b++) {
        std::vector<rans::Table> tables(s.n_groups);
        double bits = 8.0 * rans::STATE_BYTES;
        for (uint32_t gi = 0; gi < s.n_groups; gi++) {
            const uint32_t * counts = &plane_counts[(static_cast<size_t>(b) * s.n_groups + gi) * 256];
            rans::build_table(counts, tables[gi]);
            bits += rans::coded_bits(counts, tables[gi]) +
                    8.0 * (2 + 1.5 * (tables[gi].last - tables[gi].first + 1));
        }
        // Mantissa bytes are close to uniform: their tables would cost more than coding saves.
        if (bits >= 8.0 * static_cast<double>(t.n_cells) * t.n_units) {
            s.plane_stored[b] = 1;
        } else {
            s.tables.insert(s.tables.end(), tables.begin(), tables.end());
        }
    }
}

// ---- decoding, lossy --------------------------------------------------------------------------

// Asks for a lossy tensor's decode slots ahead, line by line: a chunk decodes few rows per table,
// and its random lookups would otherwise miss on every line of tables another tensor evicted
// (measured on SmolLM2, balanced: 256-token chunks 609 -> 868 MB/s, a whole state 1.66 -> 1.85
// GB/s; lossless, with its larger plane tables, lost 10% and does without).
void prefetch_tables(const std::vector<uint32_t> & slots) {
    const char * p = reinterpret_cast<const char *>(slots.data());
    for (size_t at = 0; at < slots.size() * sizeof(uint32_t); at += 64) {
        __builtin_prefetch(p + at, 0, 2);
    }
}

// Where object element k goes and how it is rebuilt.
struct LossyDst {
    const TensorDesc * obj;
    const uint32_t * slots;  // n_groups x 4096
    const float * mean;      // per unit
    const float * step;      // per group
    const float * shrink;    // per group
    uint32_t group;
    uint32_t raw_bits;
    uint8_t * base;  // destination tensor
    Strides dst;
    const uint32_t * row_cell;
};

// The slice being decoded: its raw bits (raw_bits > 0) and first element.
struct SliceRaw {
    const uint8_t * raw;
    size_t k0;
};

inline uint8_t * element_ptr(const LossyDst & d, RowUnit ru) {
    return d.base + d.row_cell[ru.row] * d.dst.cell + ru.unit * d.dst.unit;
}

// Element ru of the object reconstructed from q; `type` is the object's (a constant where the
// caller knows it: no switch per value).
inline void store_value(const LossyDst & d, int32_t type, RowUnit ru, float q) {
    const uint32_t gi = ru.unit >> __builtin_ctz(d.group);  // 8, 16 or 32 (read_stats checks)
    store_float(element_ptr(d, ru), type, dequant(d.mean[ru.unit], d.step[gi], d.shrink[gi], q));
}

// The scalar reference for elements [k0, k1) of slice sr in coding order `lines` (lane k % 32
// continues from c), line by line.
template <int32_t TYPE>
void decode_lossy_lines(rans::Cursor & c, const LossyDst & d, const Lines & lines, SliceRaw sr, size_t k0, size_t k1,
                        std::vector<uint64_t> & esc) {
    const TensorDesc & t = *d.obj;
    std::vector<const uint32_t *> slots(t.n_units);
    std::vector<float> step(t.n_units), shrink(t.n_units);
    for (uint32_t u = 0; u < t.n_units; u++) {
        slots[u] = d.slots + (u / d.group) * rans::PROB_SCALE;
        step[u] = d.step[u / d.group];
        shrink[u] = d.shrink[u / d.group];
    }
    size_t k = k0, i = k0 % lines.line_len;
    for (size_t o = k0 / lines.line_len; o < lines.n_lines && k < k1; o++, i = 0) {
        const size_t i_end = std::min(lines.line_len, i + (k1 - k));
        for (; i < i_end; i++, k++) {
            const RowUnit ru = lines.at(o, i);
            const uint8_t s = rans::decode_symbol(c, k % rans::LANES, slots[ru.unit]);
            if (s == SYM_ESCAPE) {
                esc.push_back(k);
            }
            const uint32_t raw = d.raw_bits ? lanes::raw_at(sr.raw, k - sr.k0, d.raw_bits) : 0;
            store_float(element_ptr(d, ru), TYPE,
                        dequant(d.mean[ru.unit], step[ru.unit], shrink[ru.unit], lanes::symbol_q(s, d.raw_bits, raw)));
        }
    }
}

void decode_lossy_scalar(rans::Cursor & c, const LossyDst & d, const Lines & lines, SliceRaw sr, size_t k0, size_t k1,
                         std::vector<uint64_t> & esc) {
    switch (d.obj->ggml_type) {
        case GGML_F16: return decode_lossy_lines<GGML_F16>(c, d, lines, sr, k0, k1, esc);
        case GGML_BF16: return decode_lossy_lines<GGML_BF16>(c, d, lines, sr, k0, k1, esc);
        default: return decode_lossy_lines<GGML_F32>(c, d, lines, sr, k0, k1, esc);
    }
}

#if defined(__x86_64__)
struct PermTable {
    alignas(32) int32_t idx[256][8];
    PermTable() {
        for (int m = 0; m < 256; m++) {
            for (int j = 0; j < 8; j++) {
                idx[m][j] = __builtin_popcount(m & ((1 << j) - 1));
            }
        }
    }
};
const PermTable perm_table;

// For each 8-bit mask, the positions of its set bits, in order (the rest: 0).
struct CompressTable {
    alignas(32) int32_t idx[256][8];
    CompressTable() {
        for (int m = 0; m < 256; m++) {
            int n = 0;
            for (int j = 0; j < 8; j++) {
                idx[m][j] = 0;
                if (m & (1 << j)) {
                    idx[m][n++] = j;
                }
            }
        }
    }
};
const CompressTable compress_table;

// One step of 8 lanes (x) with decode slots `slots`: the state update and the renormalisation
// from ptr (8 words may be read, popcount(need) are taken: the caller leaves 64 bytes of room);
// returns the symbols.
template <bool GATHER>
__attribute__((target("avx2,f16c"), always_inline)) inline __m256i lanes8_step(__m256i & x, const uint32_t * slots,
                                                                          const uint8_t *& ptr) {
    const __m256i slot = _mm256_and_si256(x, _mm256_set1_epi32(rans::PROB_SCALE - 1));
    __m256i e;
    if (GATHER) {
        e = _mm256_i32gather_epi32(reinterpret_cast<const int *>(slots), slot, 4);
    } else {  // eight scalar loads: faster than the gather instruction on some CPUs
        alignas(32) uint32_t at[8];
        _mm256_store_si256(reinterpret_cast<__m256i *>(at), slot);
        e = _mm256_setr_epi32(slots[at[0]], slots[at[1]], slots[at[2]], slots[at[3]], slots[at[4]], slots[at[5]],
                              slots[at[6]], slots[at[7]]);
    }
    const __m256i freq = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 8), _mm256_set1_epi32(0xfff)),
                                          _mm256_set1_epi32(1));
    __m256i xv = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(x, rans::PROB_BITS)),
                                  _mm256_srli_epi32(e, 20));
    const __m256i need = _mm256_cmpgt_epi32(_mm256_set1_epi32(rans::STATE_LOW), xv);
    // Branch-free: whether a vector needs words is close to a coin flip at low rates.
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(ptr)));
    const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i *>(perm_table.idx[mask]));
    const __m256i w = _mm256_permutevar8x32_epi32(words, idx);
    x = _mm256_blendv_epi8(xv, _mm256_or_si256(_mm256_slli_epi32(xv, 16), w), need);
    ptr += 2 * __builtin_popcount(mask);
    return _mm256_and_si256(e, _mm256_set1_epi32(0xff));
}

// Symbols [k0, k1) of a slice (k0 a multiple of 32) of a lossless plane in memory order `lines`
// into out[k - k0], when 8 consecutive elements share a table (line_len % 8 == 0); `slots` holds
// the plane's tables, unit u uses table u / group. Returns the element reached (a multiple of 32),
// as decode_lossy_avx2.
template <bool GATHER>
__attribute__((target("avx2,f16c"))) size_t decode_symbols_avx2(rans::Cursor & c, const Lines & lines,
                                                            const uint32_t * slots, uint32_t group, size_t k0,
                                                            size_t k1, uint8_t * out) {
    __m256i x[4];
    for (int v = 0; v < 4; v++) {
        x[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c.x + 8 * v));
    }
    // byte 0 of each 32-bit lane to the front of its 128-bit half, then the two halves together
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                                          -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    const size_t n_i = lines.line_len;
    size_t o = k0 / n_i, i = k0 % n_i;  // of the next vector's first element
    size_t k = k0;
    const size_t n_full = k0 + (k1 - k0) / rans::LANES * rans::LANES;
    const uint8_t * ptr = c.ptr;  // a local: stores to the destination cannot alias it
    while (k < n_full && c.end - ptr >= 2 * static_cast<ptrdiff_t>(rans::LANES)) {
        for (int v = 0; v < 4; v++) {
            const size_t unit = lines.kind == Lines::UNITS ? o : i;
            if ((i += 8) == n_i) {
                i = 0;
                o++;
            }
            const __m256i s = lanes8_step<GATHER>(x[v], slots + unit / group * rans::PROB_SCALE, ptr);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(s, pick), join);
            _mm_storel_epi64(reinterpret_cast<__m128i *>(out + (k - k0) + 8 * v), _mm256_castsi256_si128(bytes));
        }
        k += rans::LANES;
    }
    c.ptr = ptr;
    for (int v = 0; v < 4; v++) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(c.x + 8 * v), x[v]);
    }
    return k;
}

// Elements [k0, k1) of a slice (k0 a multiple of 32) in coding order `lines` into f16 (TYPE
// GGML_F16) or f32 destination rows at consecutive cells from row_cell[0]; 8 consecutive elements
// of the object share a row (ROWS: units % 8 == 0; GROUPS always) or a unit (UNITS: cells % 8 ==
// 0). Returns the element reached: a multiple of 32, where the scalar decoder takes over (the
// last, partial step, or the last 32 words, which are read with bounds checks).
// ESCAPES: some table of the tensor gives the escape symbol (else no symbol can be one, and the
// bookkeeping, 7 of the ~45 instructions of a vector, is left out). RAW: d.raw_bits > 0, slice sr's.
template <int32_t TYPE, bool GATHER, bool ESCAPES, bool RAW>
__attribute__((target("avx2,f16c"))) size_t decode_lossy_avx2(rans::Cursor & c, const LossyDst & d,
                                                               const Lines & lines, SliceRaw sr, size_t k0, size_t k1,
                                                               uint32_t * esc, size_t & n_esc) {
    constexpr size_t SIZE = TYPE == GGML_F16 ? 2 : 4;  // of an element
    const TensorDesc & t = *d.obj;
    const uint32_t c0 = d.row_cell[0];
    __m256i x[4];
    for (int v = 0; v < 4; v++) {
        x[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c.x + 8 * v));
    }
    const __m256i sym_zero = _mm256_set1_epi32(SYM_ZERO), zero = _mm256_setzero_si256();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const uint32_t b = d.raw_bits;
    const __m128i raw_shift = _mm_cvtsi32_si128(static_cast<int>(b));
    const __m256i raw_lane = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(b));
    const __m256i raw_mask = _mm256_set1_epi32((1 << b) - 1);
    // row and unit of the next vector's first element
    const RowUnit first = lines.at(k0);
    uint32_t row = first.row, unit = first.unit;
    const uint32_t group_mask = lines.mask();
    size_t k = k0;
    const size_t n_full = k0 + (k1 - k0) / rans::LANES * rans::LANES;
    const uint8_t * ptr = c.ptr;  // a local: stores to the destination cannot alias it
    while (k < n_full && c.end - ptr >= 2 * static_cast<ptrdiff_t>(rans::LANES)) {
        for (int v = 0; v < 4; v++) {
            const uint32_t gi = unit / d.group;
            __m256 mean;
            uint8_t * out;
            if (lines.kind == Lines::UNITS) {
                mean = _mm256_set1_ps(d.mean[unit]);
                out = d.base + unit * d.dst.unit + (c0 + row) * SIZE;
                if ((row += 8) == t.n_cells) {
                    row = 0;
                    unit++;
                }
            } else {
                mean = _mm256_loadu_ps(d.mean + unit);
                out = d.base + (c0 + row) * d.dst.cell + unit * SIZE;
                unit += 8;
                if (lines.kind == Lines::ROWS) {
                    if (unit == t.n_units) {
                        unit = 0;
                        row++;
                    }
                } else if ((unit & group_mask) == 0) {  // GROUPS: the group's next row, or the next group
                    unit -= group_mask + 1;
                    if (++row == t.n_cells) {
                        row = 0;
                        unit += group_mask + 1;
                    }
                }
            }
            const __m256i s = lanes8_step<GATHER>(x[v], d.slots + gi * rans::PROB_SCALE, ptr);
            __m256i qi = _mm256_sub_epi32(s, sym_zero);
            if (RAW) {  // 8 elements' raw bits start at a byte: b bytes from (k - slice start) / 8 * b
                uint32_t word;
                std::memcpy(&word, sr.raw + (k - sr.k0 + 8 * v) / 8 * b, 4);
                const __m256i r = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), raw_lane),
                                                   raw_mask);
                qi = _mm256_or_si256(_mm256_sll_epi32(qi, raw_shift), r);
            }
            const __m256 q = _mm256_cvtepi32_ps(qi);
            const __m256 nonzero = _mm256_cmp_ps(q, _mm256_setzero_ps(), _CMP_NEQ_OQ);
            const __m256 sh = _mm256_and_ps(nonzero, _mm256_or_ps(_mm256_and_ps(q, sign), _mm256_set1_ps(d.shrink[gi])));
            const __m256 val = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, sh), _mm256_set1_ps(d.step[gi])), mean);
            if (TYPE == GGML_F16) {
                _mm_storeu_si128(reinterpret_cast<__m128i *>(out), _mm256_cvtps_ph(val, _MM_FROUND_TO_NEAREST_INT));
            } else {
                _mm256_storeu_ps(reinterpret_cast<float *>(out), val);
            }
            if (!ESCAPES) {
                continue;
            }
            // Escapes' offsets from k0, branch-free (at high, a vector in four holds one): all 8
            // stored, the count advanced by how many there are.
            const int escapes = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(s, zero)));
            const __m256i lane = _mm256_load_si256(reinterpret_cast<const __m256i *>(compress_table.idx[escapes]));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(esc + n_esc),
                                _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(k - k0 + 8 * v))));
            n_esc += static_cast<size_t>(__builtin_popcount(escapes));
        }
        k += rans::LANES;
    }
    c.ptr = ptr;
    for (int v = 0; v < 4; v++) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(c.x + 8 * v), x[v]);
    }
    return k;
}
#endif

void decode_lossy(ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, uint8_t * base,
                  const TensorDesc & dst, const std::vector<uint32_t> & row_cell) {
    const size_t n = static_cast<size_t>(obj.n_cells) * obj.n_units;
    const uint32_t stream_bytes = r.u32();
    const std::vector<rans::Slice> slices = rans::read_slices(r.take(stream_bytes), stream_bytes, n, true);
    const uint32_t b = dec.stats.raw_bits;
    const Lines lines(obj, dec.stats);
    const LossyDst d{&obj, dec.slots.data(), dec.mean.data(), dec.step.data(), dec.shrink.data(), dec.stats.group,
                     b, base, Strides(dst), row_cell.data()};
    bool vector_ok = false;
#if defined(__x86_64__)
    bool contiguous = true;
    for (size_t i = 1; i < row_cell.size() && contiguous; i++) {
        contiguous = row_cell[i] == row_cell[0] + i;
    }
    vector_ok = cpu_has_avx2 && contiguous && (obj.ggml_type == GGML_F16 || obj.ggml_type == GGML_F32) &&
                (lines.kind == Lines::UNITS ? obj.n_cells % 8 == 0 : obj.n_units % 8 == 0);
    bool escapes = false;  // whether any table gives the escape symbol
    for (const rans::Table & tab : dec.stats.tables) {
        escapes |= tab.freq[SYM_ESCAPE] != 0;
    }
    using VectorDecode =
        size_t (*)(rans::Cursor &, const LossyDst &, const Lines &, SliceRaw, size_t, size_t, uint32_t *, size_t &);
    static constexpr VectorDecode vector_decoders[2][2][2][2] = {  // [f32][gather][escapes][raw bits]
        {{{decode_lossy_avx2<GGML_F16, false, false, false>, decode_lossy_avx2<GGML_F16, false, false, true>},
          {decode_lossy_avx2<GGML_F16, false, true, false>, decode_lossy_avx2<GGML_F16, false, true, true>}},
         {{decode_lossy_avx2<GGML_F16, true, false, false>, decode_lossy_avx2<GGML_F16, true, false, true>},
          {decode_lossy_avx2<GGML_F16, true, true, false>, decode_lossy_avx2<GGML_F16, true, true, true>}}},
        {{{decode_lossy_avx2<GGML_F32, false, false, false>, decode_lossy_avx2<GGML_F32, false, false, true>},
          {decode_lossy_avx2<GGML_F32, false, true, false>, decode_lossy_avx2<GGML_F32, false, true, true>}},
         {{decode_lossy_avx2<GGML_F32, true, false, false>, decode_lossy_avx2<GGML_F32, true, false, true>},
          {decode_lossy_avx2<GGML_F32, true, true, false>, decode_lossy_avx2<GGML_F32, true, true, true>}}}};
    const VectorDecode vector_decode = vector_decoders[obj.ggml_type == GGML_F32][use_gather][escapes][b != 0];
#endif
    prefetch_tables(dec.slots);
    std::vector<uint64_t> esc;
    uint64_t declared = 0;  // each slice's count is checked against its symbols below
    for (const rans::Slice & sl : slices) {
        declared += sl.count;
    }
    esc.reserve(std::min<uint64_t>(declared, n));
    // the AVX2 decoder's escape offsets within a slice: at most one per symbol, 8 written at a time
    std::unique_ptr<uint32_t[]> slice_esc;
    if (vector_ok) {
        size_t most = 0;
        for (const rans::Slice & sl : slices) {
            most = std::max<size_t>(most, sl.k1 - sl.k0);
        }
        slice_esc.reset(new uint32_t[most + 8]);
    }
    for (const rans::Slice & sl : slices) {
        const size_t raw_bytes = rans::slice_raw_bytes(sl, b);  // the slice starts with them
        const SliceRaw sr{sl.data, sl.k0};
        rans::Cursor c = rans::open_stream(sl.data + raw_bytes, sl.bytes - raw_bytes);
        const size_t before = esc.size();
        size_t k = sl.k0;
#if defined(__x86_64__)
        if (vector_ok) {
            size_t n_esc = 0;
            k = vector_decode(c, d, lines, sr, k, sl.k1, slice_esc.get(), n_esc);
            for (size_t e = 0; e < n_esc; e++) {
                esc.push_back(sl.k0 + slice_esc[e]);
            }
        }
#endif
        decode_lossy_scalar(c, d, lines, sr, k, sl.k1, esc);
        rans::close_stream(c);
        LCG_CHECK(esc.size() - before == sl.count, LCG_ERR_CORRUPT, "rANS slice declares %u escapes, its symbols %zu",
                  sl.count, esc.size() - before);
    }
    const uint64_t n_escapes = r.varint();
    LCG_CHECK(n_escapes == esc.size(), LCG_ERR_CORRUPT, "tensor declares %llu escapes, its symbols %zu",
              (unsigned long long) n_escapes, esc.size());
    // Escapes in coding order: a division only where one starts a new line.
    const size_t n_i = lines.line_len;
    size_t o = 0, line = 0;  // the line of the last escape and its first element
    auto walk = [&](auto && put) {
        for (uint64_t k_esc : esc) {
            if (k_esc - line >= n_i) {
                o = k_esc / n_i;
                line = o * n_i;
            }
            put(lines.at(o, k_esc - line), static_cast<float>(read_escape(r)));
        }
    };
    if (obj.ggml_type == GGML_F16) {  // the common type, a constant
        walk([&](RowUnit ru, float q) { store_value(d, GGML_F16, ru, q); });
    } else {
        walk([&](RowUnit ru, float q) { store_value(d, obj.ggml_type, ru, q); });
    }
}

// Element k of n gets byte b from planes[b][k]: the byte planes of a lossless tensor back into
// elements of unit_bytes bytes at out (SSE2 unpacks for 2 and 4 bytes, a plain loop otherwise).
void interleave_planes(const uint8_t * const * planes, uint32_t unit_bytes, size_t n, uint8_t * out) {
    size_t k = 0;
#if defined(__x86_64__)
    auto load = [&](uint32_t b) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(planes[b] + k)); };
    auto store = [&](size_t at, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i *>(out + at), v); };
    if (unit_bytes == 2) {
        for (; k + 16 <= n; k += 16) {
            const __m128i p0 = load(0), p1 = load(1);
            store(2 * k, _mm_unpacklo_epi8(p0, p1));
            store(2 * k + 16, _mm_unpackhi_epi8(p0, p1));
        }
    } else if (unit_bytes == 4) {
        for (; k + 16 <= n; k += 16) {
            const __m128i p0 = load(0), p1 = load(1), p2 = load(2), p3 = load(3);
            const __m128i lo01 = _mm_unpacklo_epi8(p0, p1), hi01 = _mm_unpackhi_epi8(p0, p1);
            const __m128i lo23 = _mm_unpacklo_epi8(p2, p3), hi23 = _mm_unpackhi_epi8(p2, p3);
            store(4 * k, _mm_unpacklo_epi16(lo01, lo23));
            store(4 * k + 16, _mm_unpackhi_epi16(lo01, lo23));
            store(4 * k + 32, _mm_unpacklo_epi16(hi01, hi23));
            store(4 * k + 48, _mm_unpackhi_epi16(hi01, hi23));
        }
    }
#endif
    for (; k < n; k++) {
        for (uint32_t b = 0; b < unit_bytes; b++) {
            out[k * unit_bytes + b] = planes[b][k];
        }
    }
}

// The inverse of interleave_planes: byte b of each of n elements at `elements` into planes[b].
void deinterleave_planes(const uint8_t * elements, uint32_t unit_bytes, size_t n, uint8_t * const * planes) {
    size_t k = 0;
#if defined(__x86_64__)
    if (unit_bytes == 2) {  // 16 elements: low bytes masked, high bytes shifted down, each packed
        const __m128i low = _mm_set1_epi16(0xff);
        for (; k + 16 <= n; k += 16) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(elements + 2 * k));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(elements + 2 * k + 16));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(planes[0] + k),
                             _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(planes[1] + k),
                             _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
    }
#endif
    for (; k < n; k++) {
        for (uint32_t b = 0; b < unit_bytes; b++) {
            planes[b][k] = elements[k * unit_bytes + b];
        }
    }
}

void decode_lossless(ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, uint8_t * base,
                     const TensorDesc & dst, const std::vector<uint32_t> & row_cell) {
    const TensorStats & s = dec.stats;
    const size_t n = static_cast<size_t>(obj.n_cells) * obj.n_units;
    const Strides ds(dst);
    const Lines order(obj, s);  // memory order: lossless
    const size_t n_i = order.line_len;
    // Bytes of plane b of elements [k0, k1) (memory order) into their places.
    auto put_plane = [&](uint32_t b, const uint8_t * bytes, size_t k0, size_t k1) {
        size_t o = k0 / n_i, i = k0 % n_i;
        for (size_t k = k0; k < k1; k++) {
            const RowUnit ru = order.at(o, i);
            base[row_cell[ru.row] * ds.cell + ru.unit * ds.unit + b] = bytes[k - k0];
            if (++i == n_i) {
                i = 0;
                o++;
            }
        }
    };
    // Where each outer line's elements lie side by side in the destination (always for rows; for
    // transposed units, where the cells are a run), the planes are decoded whole and interleaved
    // line by line at the end (a byte-by-byte put_plane was most of the lossless decode time).
    bool lines = true;
    for (size_t i = 1; i < row_cell.size() && lines && obj.transposed; i++) {
        lines = row_cell[i] == row_cell[0] + i;
    }
    std::vector<const uint8_t *> plane(obj.unit_bytes);
    std::unique_ptr<uint8_t[]> planes_buf;  // the coded planes, decoded (lines)
    if (lines) {
        const size_t coded = static_cast<size_t>(std::count(s.plane_stored.begin(), s.plane_stored.end(), 0));
        planes_buf.reset(new uint8_t[coded * n]);
    }
    uint8_t * next_plane = planes_buf.get();
    bool vector_ok = false;
#if defined(__x86_64__)
    vector_ok = cpu_has_avx2 && n_i % 8 == 0;
#endif
    const uint32_t * slots = dec.slots.data();
    std::vector<uint8_t> symbols;
    for (uint32_t b = 0; b < obj.unit_bytes; b++) {
        if (s.plane_stored[b]) {
            plane[b] = r.take(n);
            if (!lines) {
                put_plane(b, plane[b], 0, n);
            }
            continue;
        }
        if (lines) {
            plane[b] = next_plane;
            next_plane += n;
        }
        const uint32_t stream_bytes = r.u32();
        for (const rans::Slice & sl : rans::read_slices(r.take(stream_bytes), stream_bytes, n, false)) {
            rans::Cursor c = rans::open_stream(sl.data, sl.bytes);
            uint8_t * out = lines ? const_cast<uint8_t *>(plane[b]) + sl.k0 : nullptr;
            if (!lines) {
                symbols.resize(sl.k1 - sl.k0);
                out = symbols.data();
            }
            size_t k = sl.k0;
#if defined(__x86_64__)
            if (vector_ok) {
                k = use_gather ? decode_symbols_avx2<true>(c, order, slots, s.group, k, sl.k1, out)
                               : decode_symbols_avx2<false>(c, order, slots, s.group, k, sl.k1, out);
            }
#endif
            rans::decode_stream(
                c, k, sl.k1, n_i,
                [&](size_t o, size_t i) { return slots + (order.at(o, i).unit / s.group) * rans::PROB_SCALE; },
                [&](size_t o, size_t i, uint8_t v) { out[o * n_i + i - sl.k0] = v; });
            rans::close_stream(c);
            if (!lines) {
                put_plane(b, out, sl.k0, sl.k1);
            }
        }
        slots += static_cast<size_t>(s.n_groups) * rans::PROB_SCALE;
    }
    if (!lines) {
        return;
    }
    std::vector<const uint8_t *> at(obj.unit_bytes);
    for (size_t o = 0; o < order.n_lines; o++) {
        for (uint32_t b = 0; b < obj.unit_bytes; b++) {
            at[b] = plane[b] + o * n_i;
        }
        const RowUnit first = order.at(o, 0);
        interleave_planes(at.data(), obj.unit_bytes, n_i, base + row_cell[first.row] * ds.cell + first.unit * ds.unit);
    }
}

} // namespace

void write_stats(ByteWriter & w, const TensorStats & s, const TensorDesc & t) {
    w.u8(s.requantized ? CODING_LOSSY_Q8_0 : s.lossy ? CODING_LOSSY : CODING_LOSSLESS);
    w.u8(static_cast<uint8_t>(s.group));
    if (s.rope.pairing) {
        w.u16(TRANSFORM_ROPE);
        w.u8(s.rope.pairing);
        w.u16(s.rope.head_dim);
        w.u16(s.rope.n_dims);
        w.f32(s.rope.base);
        w.f32(s.rope.scale);
    } else {
        w.u16(s.anchor_tokens ? static_cast<uint16_t>(TRANSFORM_ANCHOR_DELTA | s.anchor_tokens << 8) : TRANSFORM_NONE);
    }
    if (s.lossy) {
        w.u8(static_cast<uint8_t>(s.raw_bits));
        for (uint32_t gi = 0; gi < s.n_groups; gi++) {
            w.u16(s.step_f16[gi]);
            w.u8(s.shrink_u8[gi]);
        }
        for (uint16_t m : s.mean_f16) {
            w.u16(m);
        }
    } else {
        for (uint8_t stored : s.plane_stored) {
            w.u8(stored);
        }
    }
    for (const rans::Table & table : s.tables) {
        rans::write_table(w, table);
    }
}

TensorStats read_stats(ByteReader & r, const TensorDesc & stored) {
    TensorStats s;
    const uint8_t coding = r.u8();
    s.group = r.u8();
    const uint16_t transform = r.u16();
    LCG_CHECK(coding <= CODING_LOSSY_Q8_0 && (s.group == 8 || s.group == 16 || s.group == 32), LCG_ERR_CORRUPT,
              "tensor statistics: coding %u, group of %u units", coding, s.group);
    s.requantized = coding == CODING_LOSSY_Q8_0;
    LCG_CHECK(!s.requantized || (stored.ggml_type == GGML_Q8_0 && !stored.transposed &&
                                 stored.n_units <= UINT32_MAX / Q8_0_VALUES),
              LCG_ERR_CORRUPT, "tensor statistics: q8_0 values coded for a %s tensor%s",
              ggml_type_info(stored.ggml_type)->name, stored.transposed ? " (transposed)" : "");
    const TensorDesc t = s.requantized ? q8_0_values(stored) : stored;  // what is coded
    if (transform == TRANSFORM_ROPE) {
        s.rope.pairing = r.u8();
        s.rope.head_dim = r.u16();
        s.rope.n_dims = r.u16();
        s.rope.base = r.f32();
        s.rope.scale = r.f32();
        LCG_CHECK(coding == CODING_LOSSY && !t.is_v && !t.transposed && rope_fits(s.rope, t.n_units), LCG_ERR_CORRUPT,
                  "tensor statistics: RoPE pairing %u, head of %u, %u rotated, base %g, scale %g for %s of %u units",
                  s.rope.pairing, s.rope.head_dim, s.rope.n_dims, s.rope.base, s.rope.scale, t.is_v ? "V" : "K",
                  t.n_units);
    } else {
        s.anchor_tokens = transform >> 8;
        LCG_CHECK(transform == TRANSFORM_NONE || ((transform & 0xff) == TRANSFORM_ANCHOR_DELTA &&
                                                  coding != CODING_LOSSLESS && s.anchor_tokens >= 2),
                  LCG_ERR_CORRUPT, "tensor statistics: unknown transform %u", transform);
    }
    s.lossy = coding != CODING_LOSSLESS;
    LCG_CHECK(!s.lossy || ggml_type_info(t.ggml_type)->is_float, LCG_ERR_CORRUPT, "lossy statistics for a %s tensor",
              ggml_type_info(t.ggml_type)->name);
    s.n_groups = (t.n_units + s.group - 1) / s.group;
    size_t n_tables = s.n_groups;
    if (s.lossy) {
        s.raw_bits = r.u8();
        LCG_CHECK(s.raw_bits <= lanes::MAX_RAW_BITS, LCG_ERR_CORRUPT, "tensor statistics: %u raw bits (at most %u)",
                  s.raw_bits, lanes::MAX_RAW_BITS);
        LCG_CHECK(s.n_groups <= r.remaining() / 3 && t.n_units <= r.remaining() / 2, LCG_ERR_CORRUPT,
                  "tensor statistics for %u units in %zu bytes", t.n_units, r.remaining());
        s.step_f16.resize(s.n_groups);
        s.shrink_u8.resize(s.n_groups);
        // An encoder writes finite steps and means only (a tensor whose would not be is coded
        // losslessly): with them a reconstruction is never NaN, whose payload the decoders would
        // not agree on (F16C keeps it, the scalar and GPU code make one quiet NaN).
        auto finite = [](uint16_t h) { return (h & 0x7c00) != 0x7c00; };
        for (uint32_t gi = 0; gi < s.n_groups; gi++) {
            s.step_f16[gi] = r.u16();
            s.shrink_u8[gi] = r.u8();
            LCG_CHECK(finite(s.step_f16[gi]), LCG_ERR_CORRUPT, "tensor statistics: step 0x%04x is not finite",
                      s.step_f16[gi]);
            LCG_CHECK(s.shrink_u8[gi] < 128, LCG_ERR_CORRUPT, "reconstruction offset %u/256", s.shrink_u8[gi]);
        }
        s.mean_f16.resize(t.n_units);
        for (uint32_t u = 0; u < t.n_units; u++) {
            s.mean_f16[u] = r.u16();
            LCG_CHECK(finite(s.mean_f16[u]), LCG_ERR_CORRUPT, "tensor statistics: mean 0x%04x is not finite",
                      s.mean_f16[u]);
        }
    } else {
        s.plane_stored.resize(t.unit_bytes);
        size_t coded = 0;
        for (uint32_t b = 0; b < t.unit_bytes; b++) {
            s.plane_stored[b] = r.u8();
            LCG_CHECK(s.plane_stored[b] <= 1, LCG_ERR_CORRUPT, "byte plane mode %u", s.plane_stored[b]);
            coded += s.plane_stored[b] == 0;
        }
        n_tables = coded * s.n_groups;
    }
    LCG_CHECK(n_tables <= r.remaining() / 2, LCG_ERR_CORRUPT, "tensor statistics declare %zu tables in %zu bytes",
              n_tables, r.remaining());
    s.tables.resize(n_tables);
    for (rans::Table & table : s.tables) {
        rans::read_table(r, table);
    }
    return s;
}

namespace {

void build_encoder_tables(TensorEncoder & e) {
    e.enc.resize(e.stats.tables.size());
    for (size_t i = 0; i < e.stats.tables.size(); i++) {
        rans::build_enc_table(e.stats.tables[i], e.enc[i]);
    }
}

TensorEncoder lossless_encoder(const uint8_t * base, const TensorDesc & t) {
    TensorEncoder e;
    e.stats.group = group_size(t.n_cells);
    e.stats.n_groups = (t.n_units + e.stats.group - 1) / e.stats.group;
    prepare_lossless(base, t, e);
    build_encoder_tables(e);
    return e;
}

// Bytes of e's statistics and of all of t's rows coded with them.
size_t coded_size(const uint8_t * state, const TensorDesc & t, const TensorEncoder & e,
                  const std::vector<uint8_t> & is_sink) {
    ByteWriter w;
    write_stats(w, e.stats, t);
    std::vector<uint32_t> cells(t.n_cells);
    for (uint32_t c = 0; c < t.n_cells; c++) {
        cells[c] = c;
    }
    encode_rows(state, t, e, cells, is_sink, rans::DEFAULT_SLICE, w);
    return w.buf.size();
}

// Up to this many cells a lossy tensor is also coded exactly, and kept so when that is no larger: a
// few rows' values save less than their groups' steps, means and tables cost (SmolLM2 states of 1-8
// tokens came out larger than lossless at every lossy level).
constexpr uint32_t FEW_CELLS = 32;
// A q8_0 tensor coded as its values pays an f16 mean per value: 33 cells of 64 values each came out
// 7% larger than lossless (random values; SmolLM2's 33 tokens were 1.5% smaller).
constexpr uint32_t FEW_Q8_0_CELLS = 128;

// Whether the exact rows of q8_0 tensor t come back as they are through the decoder's quantizer:
// blocks that ggml's reference quantizer made do; other blocks (a NaN or inf scale, a q of -128)
// would not, and the tensor is coded losslessly.
bool exact_rows_requantize(const uint8_t * base, const TensorDesc & t, const std::vector<uint8_t> & is_sink) {
    const size_t row_bytes = static_cast<size_t>(t.n_units) * Q8_0_BYTES;
    std::vector<float> values(static_cast<size_t>(t.n_units) * Q8_0_VALUES);
    std::vector<uint8_t> again(row_bytes);
    for (uint32_t i = 0; i < t.n_cells; i++) {
        if (!is_sink[i]) {
            continue;
        }
        dequantize_q8_0_row(base + i * row_bytes, t.n_units, values.data());
        quantize_q8_0_row(values.data(), t.n_units, again.data());
        if (std::memcmp(again.data(), base + i * row_bytes, row_bytes) != 0) {
            return false;
        }
    }
    return true;
}

} // namespace

void prepare_tensor(const uint8_t * state, const TensorDesc & t, const QuantKnobs * knobs, const RopeHint * rope,
                    const std::vector<uint8_t> & is_sink, const std::vector<int32_t> & pos, TensorEncoder & e) {
    const uint8_t * base = state + t.offset;
    TensorStats & s = e.stats;
    s.group = group_size(t.n_cells);
    if (knobs != nullptr && requantizable(t, *knobs)) {
        const TensorDesc vt = q8_0_values(t);
        s.n_groups = (vt.n_units + s.group - 1) / s.group;
        s.requantized = exact_rows_requantize(base, t, is_sink) &&
                        prepare_lossy(base, vt, *knobs, nullptr, is_sink, pos, &t, e);
        s.lossy = s.requantized;
    } else {
        s.n_groups = (t.n_units + s.group - 1) / s.group;
        s.lossy = knobs != nullptr && ggml_type_info(t.ggml_type)->is_float &&
                  prepare_lossy(base, t, *knobs, rope, is_sink, pos, nullptr, e);
    }
    if (!s.lossy) {
        e = lossless_encoder(base, t);
        return;
    }
    build_encoder_tables(e);
    if (t.n_cells <= (s.requantized ? FEW_Q8_0_CELLS : FEW_CELLS)) {
        TensorEncoder exact = lossless_encoder(base, t);
        if (coded_size(state, t, exact, is_sink) <= coded_size(state, t, e, is_sink)) {
            e = std::move(exact);
        }
    }
}

void encode_rows(const uint8_t * state, const TensorDesc & stored, const TensorEncoder & e,
                 const std::vector<uint32_t> & cells, const std::vector<uint8_t> & is_sink, uint32_t slice_elements,
                 ByteWriter & w) {
    const TensorStats & s = e.stats;
    const TensorDesc t = s.requantized ? q8_0_values(stored) : stored;  // what is coded
    const uint8_t * base = state + stored.offset;
    const Strides st(stored);
    TensorDesc obj = t;
    obj.n_cells = static_cast<uint32_t>(cells.size());
    const size_t n = static_cast<size_t>(obj.n_cells) * t.n_units;
    // Sink rows are kept exact (lossy levels only).
    std::vector<uint32_t> sinks;
    if (s.lossy) {
        for (uint32_t r = 0; r < cells.size(); r++) {
            if (is_sink[cells[r]]) {
                sinks.push_back(r);
            }
        }
    }
    w.u32(static_cast<uint32_t>(sinks.size()));
    for (uint32_t r : sinks) {
        w.u32(r);
    }
    std::vector<float> values(s.requantized ? t.n_units : 0);
    for (uint32_t r : sinks) {
        if (s.requantized) {  // exact: the block quantizer gives these blocks back from their values
            dequantize_q8_0_row(base + cells[r] * st.cell, stored.n_units, values.data());
            w.put(reinterpret_cast<const uint8_t *>(values.data()), values.size() * sizeof(float));
            continue;
        }
        for (uint32_t u = 0; u < t.n_units; u++) {
            w.put(base + cells[r] * st.cell + u * st.unit, t.unit_bytes);
        }
    }
    // Lossless: room for the planes (what is coded is close to their size), so that the buffer is
    // not copied as it grows. (Lossy sizes vary too much with the level to guess.)
    if (!s.lossy) {
        w.buf.reserve(w.buf.size() + n * t.unit_bytes + 4096);
    }
    // The object's symbols (or byte planes) in its memory order, from the state's; a whole lossy
    // object codes the encoder's own symbols.
    std::unique_ptr<uint8_t[]> sym, raw;  // each byte written before it is coded: not zeroed
    const uint8_t * symbols = nullptr;
    const uint8_t * raws = nullptr;
    bool contiguous = true;
    for (size_t r = 1; r < cells.size() && contiguous; r++) {
        contiguous = cells[r] == cells[0] + r;
    }
    const Lines lines(obj, s), whole(t, s);  // the object's coding order, and e.sym's
    // Each line's table (a unit's, a group's) or, in memory order, each unit's along a row.
    std::vector<const rans::EncTable *> unit_table(lines.kind == Lines::GROUPS ? lines.n_lines : t.n_units);
    auto coded = [&](const rans::EncTable * tables) {
        for (size_t u = 0; u < unit_table.size(); u++) {
            unit_table[u] = &tables[lines.kind == Lines::GROUPS ? u : u / s.group];
        }
        // The stream goes straight into w after its byte count, filled in when it is known.
        const size_t at = w.buf.size();
        w.u32(0);
        // Lossy slices count their escape symbols in the stream's directory.
        rans::encode_stream({symbols, lines.n_lines, lines.line_len, lines.kind != Lines::ROWS, unit_table.data(), raws,
                             s.raw_bits},
                            slice_elements, s.lossy ? SYM_ESCAPE : -1, w);
        const size_t bytes = w.buf.size() - at - 4;
        LCG_CHECK(bytes <= UINT32_MAX, LCG_ERR_LIMIT, "a stream of %zu bytes (at most 4 GiB per tensor)", bytes);
        w.u32_at(at, static_cast<uint32_t>(bytes));
    };
    if (s.lossy) {
        // The encoder's bytes (symbols, raw bits) of the object's elements in its coding order.
        auto object_order = [&](const uint8_t * all, std::unique_ptr<uint8_t[]> & own) -> const uint8_t * {
            const bool run = contiguous && !cells.empty();
            if (run && (lines.kind == Lines::ROWS || cells.size() == t.n_cells)) {
                // rows of the state, or all of it: a run of the encoder's bytes
                return &all[lines.kind == Lines::ROWS ? static_cast<size_t>(cells[0]) * t.n_units : 0];
            }
            own.reset(new uint8_t[n]);
            if (run) {  // each line (a unit, a group) holds the run of cells side by side
                const size_t per_row = lines.line_len / cells.size();  // 1 or a group
                for (size_t o = 0; o < lines.n_lines; o++) {
                    std::memcpy(&own[o * lines.line_len], &all[o * whole.line_len + cells[0] * per_row], lines.line_len);
                }
                return own.get();
            }
            for (size_t o = 0, k = 0; o < lines.n_lines; o++) {
                for (size_t i = 0; i < lines.line_len; i++, k++) {
                    const RowUnit ru = lines.at(o, i);
                    own[k] = all[whole.index(cells[ru.row], ru.unit)];
                }
            }
            return own.get();
        };
        symbols = object_order(e.sym.get(), sym);
        raws = s.raw_bits ? object_order(e.raw.get(), raw) : nullptr;
        coded(e.enc.data());
        // The escaped values, in the object's order. A whole object's are the encoder's, in order.
        if (contiguous && cells.size() == t.n_cells && (cells.empty() || cells[0] == 0)) {
            w.varint(e.escapes.size());
            for (const auto & x : e.escapes) {
                w.varint(escape_code(x.second));
            }
            return;
        }
        // Otherwise each escape symbol's value is the entry after the previous one when the rows
        // run in coding order (chunks of contiguous cells), else found by binary search.
        std::vector<size_t> escaped;
        find_byte(symbols, n, SYM_ESCAPE, escaped);
        w.varint(escaped.size());
        auto entry = e.escapes.begin();
        for (size_t j = 0; j < escaped.size(); j++) {
            const RowUnit ru = lines.at(escaped[j]);
            const uint64_t at = whole.index(cells[ru.row], ru.unit);
            if (j == 0 || entry + 1 == e.escapes.end() || (++entry)->first != at) {
                entry = std::lower_bound(e.escapes.begin(), e.escapes.end(), std::make_pair(at, INT64_MIN));
            }
            w.varint(escape_code(entry->second));
        }
        return;
    }
    // Every byte plane of the object in memory order, split off line by line where a line's
    // elements lie side by side in the state (rows; transposed units over a run of cells).
    const uint32_t ub = t.unit_bytes;
    sym.reset(new uint8_t[n * ub]);
    std::vector<uint8_t *> plane(ub);
    for (uint32_t b = 0; b < ub; b++) {
        plane[b] = &sym[b * n];
    }
    const size_t n_i = lines.line_len;
    std::vector<uint8_t *> at(ub);
    for (size_t o = 0; o < lines.n_lines; o++) {
        for (uint32_t b = 0; b < ub; b++) {
            at[b] = plane[b] + o * n_i;
        }
        if (!t.transposed) {
            deinterleave_planes(base + cells[o] * st.cell, ub, n_i, at.data());
        } else if (contiguous && !cells.empty()) {
            deinterleave_planes(base + o * st.unit + cells[0] * st.cell, ub, n_i, at.data());
        } else {
            for (size_t i = 0; i < n_i; i++) {
                for (uint32_t b = 0; b < ub; b++) {
                    at[b][i] = base[o * st.unit + cells[i] * st.cell + b];
                }
            }
        }
    }
    const rans::EncTable * enc = e.enc.data();
    for (uint32_t b = 0; b < ub; b++) {
        if (s.plane_stored[b]) {
            w.put(plane[b], n);
        } else {
            symbols = plane[b];
            coded(enc);
            enc += s.n_groups;
        }
    }
}

TensorDecoder prepare_decoder(TensorStats stats) {
    TensorDecoder d;
    d.stats = std::move(stats);
    const TensorStats & s = d.stats;
    d.slots.resize(s.tables.size() * rans::PROB_SCALE + rans::DECODE_SLOTS_ROOM);
    for (size_t i = 0; i < s.tables.size(); i++) {
        rans::build_decode_slots(s.tables[i], &d.slots[i * rans::PROB_SCALE]);
    }
    if (s.lossy) {
        d.mean.resize(s.mean_f16.size());
        for (size_t u = 0; u < s.mean_f16.size(); u++) {
            d.mean[u] = f16_to_f32(s.mean_f16[u]);
        }
        d.step.resize(s.n_groups);
        d.shrink.resize(s.n_groups);
        for (uint32_t gi = 0; gi < s.n_groups; gi++) {
            d.step[gi] = f16_to_f32(s.step_f16[gi]);
            d.shrink[gi] = static_cast<float>(s.shrink_u8[gi]) * (1.0f / 256.0f);
        }
    }
    return d;
}

namespace {

// decode_rows of a tensor coded as it is stored (any coding but CODING_LOSSY_Q8_0).
void decode_coded_rows(ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, uint8_t * state,
                       const TensorDesc & dst, const std::vector<uint32_t> & row_cell,
                       const std::vector<int32_t> * cell_pos) {
    uint8_t * base = state + dst.offset;
    const Strides ds(dst);
    const uint32_t n_sink = r.u32();
    LCG_CHECK(n_sink <= obj.n_cells && n_sink <= r.remaining() / 4, LCG_ERR_CORRUPT, "%u exact rows of %u", n_sink,
              obj.n_cells);
    std::vector<uint32_t> sinks(n_sink);
    for (uint32_t & row : sinks) {
        row = r.u32();
        LCG_CHECK(row < obj.n_cells, LCG_ERR_CORRUPT, "exact row %u of %u", row, obj.n_cells);
    }
    const uint8_t * raw = r.take(static_cast<size_t>(n_sink) * obj.n_units * obj.unit_bytes);
    if (dec.stats.lossy) {
        decode_lossy(r, obj, dec, base, dst, row_cell);
    } else {
        decode_lossless(r, obj, dec, base, dst, row_cell);
    }
    // RoPE: every row rotated forward by its position, then the exact rows put over theirs.
    if (dec.stats.rope.pairing) {
        LCG_CHECK(cell_pos != nullptr, LCG_ERR_UNSUPPORTED_FORMAT,
                  "RoPE-coded keys decode on the CPU only (encode without rope= for a device)");
        std::vector<int32_t> pos(obj.n_cells);
        for (uint32_t row = 0; row < obj.n_cells; row++) {
            pos[row] = (*cell_pos)[row_cell[row]];
        }
        const RopeTable tab = rope_table(dec.stats.rope, pos.data(), pos.size());
        rotate_forward(tab, dec.stats.rope.head_dim, obj.n_units, obj.ggml_type, base, ds.cell, ds.unit, row_cell);
    }
    for (uint32_t i = 0; i < n_sink; i++) {
        for (uint32_t u = 0; u < obj.n_units; u++) {
            std::memcpy(base + row_cell[sinks[i]] * ds.cell + u * ds.unit,
                        raw + (static_cast<size_t>(i) * obj.n_units + u) * obj.unit_bytes, obj.unit_bytes);
        }
    }
    // Anchor/delta: a delta row decoded its difference from its anchor row (exact rows stay).
    if (const uint32_t every = dec.stats.anchor_tokens) {
        std::vector<uint8_t> exact(obj.n_cells, 0);
        for (uint32_t row : sinks) {
            exact[row] = 1;
        }
        for (uint32_t row = 0; row < obj.n_cells; row++) {
            if (row % every == 0 || exact[row]) {
                continue;
            }
            uint8_t * p = base + row_cell[row] * ds.cell;
            const uint8_t * a = base + row_cell[row - row % every] * ds.cell;
            for (uint32_t u = 0; u < obj.n_units; u++) {
                const size_t at = u * ds.unit;
                store_float(p + at, obj.ggml_type,
                            load_float(p + at, obj.ggml_type) - dec.mean[u] + load_float(a + at, obj.ggml_type));
            }
        }
    }
}

} // namespace

void decode_rows(ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, uint8_t * state,
                 const TensorDesc & dst, const std::vector<uint32_t> & row_cell, const std::vector<int32_t> * cell_pos) {
    if (!dec.stats.requantized) {
        decode_coded_rows(r, obj, dec, state, dst, row_cell, cell_pos);
        return;
    }
    // A q8_0 tensor's values: the object's rows decoded as f32, then quantized into their blocks.
    const TensorDesc coded = q8_0_values(obj);
    // not zeroed: the slices cover every element (read_slices), or decoding throws
    std::unique_ptr<float[]> values(new float[static_cast<size_t>(obj.n_cells) * coded.n_units]);
    std::vector<uint32_t> rows(obj.n_cells);
    for (uint32_t row = 0; row < obj.n_cells; row++) {
        rows[row] = row;
    }
    decode_coded_rows(r, coded, dec, reinterpret_cast<uint8_t *>(values.get()), coded, rows, nullptr);
    const Strides ds(dst);
    for (uint32_t row = 0; row < obj.n_cells; row++) {
        quantize_q8_0_row(&values[static_cast<size_t>(row) * coded.n_units], obj.n_units,
                          state + dst.offset + row_cell[row] * ds.cell);
    }
}

} // namespace lcg
