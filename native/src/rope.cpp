#include "rope.h"

#include "quantize.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lcg {

bool rope_fits(const Rope & r, uint32_t n_units) {
    return (r.pairing == ROPE_ADJACENT || r.pairing == ROPE_HALVES) && r.head_dim >= 2 && r.n_dims >= 2 &&
           r.n_dims % 2 == 0 && r.n_dims <= r.head_dim && n_units % r.head_dim == 0 && std::isfinite(r.base) &&
           r.base > 1.0f && std::isfinite(r.scale) && r.scale > 0.0f;
}

RopeTable rope_table(const Rope & r, const int32_t * pos, size_t n_pos) {
    RopeTable tab;
    tab.n_pairs = r.n_dims / 2u;
    tab.partner.resize(r.head_dim);
    tab.pair.resize(r.head_dim);
    tab.sign.resize(r.head_dim);
    for (uint32_t d = 0; d < r.head_dim; d++) {
        tab.partner[d] = static_cast<uint16_t>(d);
        tab.pair[d] = 0;
        tab.sign[d] = 0;
        if (d >= r.n_dims) {
            continue;
        }
        const bool adjacent = r.pairing == ROPE_ADJACENT;
        const bool first = adjacent ? d % 2 == 0 : d < tab.n_pairs;
        tab.pair[d] = static_cast<uint16_t>(adjacent ? d / 2 : d % tab.n_pairs);
        tab.partner[d] = static_cast<uint16_t>(adjacent ? d ^ 1u : (first ? d + tab.n_pairs : d - tab.n_pairs));
        tab.sign[d] = first ? 1 : -1;
    }
    // pos x theta_i in double, as (hi x 64 + lo) x theta_i by angle addition: two short tables of
    // cos/sin per pair instead of a call per (position, pair). Each value depends on its position
    // alone (not on the others in the table): a chunk decodes to the same bytes as the whole.
    constexpr int64_t SPLIT = 64;
    auto hi_of = [](int64_t p) { return p >= 0 ? p / SPLIT : -((-p + SPLIT - 1) / SPLIT); };
    // the hi values the positions use, not their span: a state's positions are its own to name
    // (a forged pair at INT32_MIN and INT32_MAX took a minute and a GiB for a 1 KB container)
    std::vector<int64_t> his(n_pos);
    for (size_t k = 0; k < n_pos; k++) {
        his[k] = hi_of(pos[k]);
    }
    std::sort(his.begin(), his.end());
    his.erase(std::unique(his.begin(), his.end()), his.end());
    std::vector<uint32_t> h_of(n_pos);
    for (size_t k = 0; k < n_pos; k++) {
        h_of[k] = static_cast<uint32_t>(std::lower_bound(his.begin(), his.end(), hi_of(pos[k])) - his.begin());
    }
    tab.cos.resize(n_pos * tab.n_pairs);
    tab.sin.resize(n_pos * tab.n_pairs);
    std::vector<double> c_lo(SPLIT), s_lo(SPLIT), c_hi(his.size()), s_hi(his.size());
    for (uint32_t i = 0; i < tab.n_pairs; i++) {
        const double theta = static_cast<double>(r.scale) *
                             std::pow(static_cast<double>(r.base), -2.0 * i / static_cast<double>(r.n_dims));
        for (int64_t k = 0; k < SPLIT; k++) {
            c_lo[k] = std::cos(static_cast<double>(k) * theta);
            s_lo[k] = std::sin(static_cast<double>(k) * theta);
        }
        for (size_t h = 0; h < his.size(); h++) {
            c_hi[h] = std::cos(static_cast<double>(his[h] * SPLIT) * theta);
            s_hi[h] = std::sin(static_cast<double>(his[h] * SPLIT) * theta);
        }
        for (size_t k = 0; k < n_pos; k++) {
            const int64_t lo = pos[k] - hi_of(pos[k]) * SPLIT;
            const uint32_t h = h_of[k];
            tab.cos[k * tab.n_pairs + i] = static_cast<float>(c_hi[h] * c_lo[lo] - s_hi[h] * s_lo[lo]);
            tab.sin[k * tab.n_pairs + i] = static_cast<float>(s_hi[h] * c_lo[lo] + c_hi[h] * s_lo[lo]);
        }
    }
    return tab;
}

namespace {

// Summed channel variance of an n_rows x n_units sample, rotated back by r (pairing 0: as is).
double rotated_variance(const Rope & r, const float * rows, const int32_t * pos, size_t n_rows, uint32_t n_units) {
    std::vector<float> v(rows, rows + n_rows * n_units);
    if (r.pairing) {  // the whole row as one group of n_units channels
        const RopeTable tab = rope_table(r, pos, n_rows);
        std::vector<float> partner(v.size());
        for (size_t k = 0; k < n_rows; k++) {
            for (uint32_t u = 0; u < n_units; u++) {
                partner[k * n_units + u] = rows[k * n_units + rope_partner(tab, r.head_dim, u)];
            }
        }
        rotate_back(tab, r.head_dim, 0, n_units, n_rows, partner.data(), v.data());
    }
    double var = 0.0;
    for (uint32_t u = 0; u < n_units; u++) {
        double sum = 0.0, sum_sq = 0.0;
        for (size_t k = 0; k < n_rows; k++) {
            sum += v[k * n_units + u];
            sum_sq += static_cast<double>(v[k * n_units + u]) * v[k * n_units + u];
        }
        var += std::max(0.0, sum_sq / n_rows - (sum / n_rows) * (sum / n_rows));
    }
    return var;
}

// out[d] = x[d] c[d] + x[partner d] s[d] over one head; the partners of whole vectors of 8 are a
// permute (adjacent pairs) or the vector half a rotation away (halves).
void rotate_head_scalar(const RopeTable & tab, uint32_t head_dim, const float * x, const float * c, const float * s,
                        float * out, uint32_t d0) {
    for (uint32_t d = d0; d < head_dim; d++) {
        out[d] = x[d] * c[d] + x[tab.partner[d]] * s[d];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void rotate_head_avx2(const RopeTable & tab, uint32_t head_dim, const float * x,
                                                          const float * c, const float * s, float * out) {
    const uint32_t half = tab.n_pairs, n_dims = 2 * half;
    const bool adjacent = tab.partner[0] == 1;  // (halves of 2 channels are adjacent too)
    uint32_t d = 0;
    if (adjacent || half % 8 == 0) {
        for (; d + 8 <= n_dims; d += 8) {
            const __m256 v = _mm256_loadu_ps(x + d);
            const __m256 p = adjacent ? _mm256_permute_ps(v, 0xb1) : _mm256_loadu_ps(x + (d < half ? d + half : d - half));
            _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + d)),
                                                    _mm256_mul_ps(p, _mm256_loadu_ps(s + d))));
        }
    }
    rotate_head_scalar(tab, head_dim, x, c, s, out, d);
}
#endif

void rotate_head(const RopeTable & tab, uint32_t head_dim, const float * x, const float * c, const float * s,
                 float * out) {
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        return rotate_head_avx2(tab, head_dim, x, c, s, out);
    }
#endif
    rotate_head_scalar(tab, head_dim, x, c, s, out, 0);
}

} // namespace

Rope choose_rope(const RopeHint & h, const float * rows, const int32_t * pos, size_t n_rows, uint32_t n_units) {
    Rope best;
    if (n_rows < 2) {
        return best;
    }
    double best_var = 0.98 * rotated_variance(best, rows, pos, n_rows, n_units);
    for (float base : h.bases) {
        const Rope r{h.pairing, h.head_dim, h.n_dims, base, h.scale};
        if (!rope_fits(r, n_units)) {
            continue;
        }
        const double var = rotated_variance(r, rows, pos, n_rows, n_units);
        if (var < best_var) {
            best_var = var;
            best = r;
        }
    }
    return best;
}

void rotate_back(const RopeTable & tab, uint32_t head_dim, uint32_t u0, uint32_t gn, size_t n,
                 const float * partner_vals, float * vals) {
    for (uint32_t g = 0; g < gn; g++) {
        const uint32_t d = (u0 + g) % head_dim;
        const float sign = tab.sign[d];
        if (!sign) {
            continue;
        }
        const uint32_t i = tab.pair[d];
        for (size_t k = 0; k < n; k++) {
            const size_t at = k * tab.n_pairs + i;
            vals[k * gn + g] = vals[k * gn + g] * tab.cos[at] + sign * partner_vals[k * gn + g] * tab.sin[at];
        }
    }
}

void rotate_forward(const RopeTable & tab, uint32_t head_dim, uint32_t n_units, int32_t ggml_type, uint8_t * base,
                    size_t cell_stride, size_t unit, const std::vector<uint32_t> & row_cell) {
    // Each row in floats (read whole before any write: a value needs its partner's old value), and
    // its position's factors per channel of a head: out = v x c[d] + v[partner] x s[d].
    std::vector<float> v(n_units), out(n_units), c(head_dim), s(head_dim);
    for (size_t row = 0; row < row_cell.size(); row++) {
        uint8_t * p = base + row_cell[row] * cell_stride;
        const float * cos = &tab.cos[row * tab.n_pairs];
        const float * sin = &tab.sin[row * tab.n_pairs];
        for (uint32_t d = 0; d < head_dim; d++) {
            c[d] = tab.sign[d] ? cos[tab.pair[d]] : 1.0f;
            s[d] = tab.sign[d] ? -tab.sign[d] * sin[tab.pair[d]] : 0.0f;
        }
        if (ggml_type == GGML_F16) {
            f16_row_to_f32(p, n_units, v.data());
        } else {
            for (uint32_t u = 0; u < n_units; u++) {
                v[u] = load_float(p + u * unit, ggml_type);
            }
        }
        for (uint32_t h = 0; h < n_units; h += head_dim) {
            rotate_head(tab, head_dim, &v[h], c.data(), s.data(), &out[h]);
        }
        if (ggml_type == GGML_F16) {
            f32_row_to_f16(out.data(), n_units, p);
        } else {
            for (uint32_t u = 0; u < n_units; u++) {
                store_float(p + u * unit, ggml_type, out[u]);
            }
        }
    }
}

} // namespace lcg
