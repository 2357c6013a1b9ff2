// rope.h -- the RoPE transform of lossy K tensors: llama.cpp stores keys rotated by their position
// (RoPE), which smears each channel pair's steady mean into variance; the encoder rotates each
// pair back (by -pos x theta_i) before quantizing and the decoder rotates the decoded values
// forward again. The rotation is orthonormal, so a tensor's squared error is unchanged; what
// shrinks is each channel's spread, hence the bits (docs/format.md, "Stats section").
#pragma once

#include "common.h"

#include <vector>

namespace lcg {

// Which channels form a rotated pair, per head: llama.cpp's LLAMA_ROPE_TYPE_NORM rotates (2i,
// 2i + 1), NEOX (i, i + n_dims / 2), for i < n_dims / 2.
constexpr uint8_t ROPE_ADJACENT = 1;
constexpr uint8_t ROPE_HALVES = 2;

// A tensor's rotation: pair i of every head turns by pos x theta_i, theta_i = scale x base^(-2i /
// n_dims). pairing 0: none.
struct Rope {
    uint8_t pairing = 0;
    uint16_t head_dim = 0;
    uint16_t n_dims = 0;  // rotated channels at the start of each head (even, <= head_dim)
    float base = 0.0f;
    float scale = 0.0f;
};

// What the caller knows of the model: the pairing and dims, and up to two bases (e.g. Gemma 3's
// global and sliding-window layers); the encoder picks per tensor the one that shrinks the
// channels' spread most, or none.
struct RopeHint {
    uint8_t pairing = 0;
    uint16_t head_dim = 0;
    uint16_t n_dims = 0;
    float bases[2] = {0.0f, 0.0f};
    float scale = 1.0f;
};

// Whether a rope's fields describe a rotation of a tensor of n_units channels (its checks, as a
// message, when not).
bool rope_fits(const Rope & r, uint32_t n_units);

// cos and sin of pos x theta_i for each position and pair index i < n_dims / 2, row-major by
// position; also each channel's partner and pair index for one head.
struct RopeTable {
    uint32_t n_pairs = 0;
    std::vector<float> cos, sin;  // n_pos x n_pairs
    std::vector<uint16_t> partner, pair;  // per channel of a head (partner == channel: not rotated)
    std::vector<int8_t> sign;             // -1 for a pair's first channel, +1 for its second
};
RopeTable rope_table(const Rope & r, const int32_t * pos, size_t n_pos);

// The Rope of hint h that best suits an f32 sample (n_rows x n_units, row-major, positions pos):
// the candidate base whose rotated-back sample has the smallest summed channel variance, if that is
// at least 2% below the unrotated sample's; else pairing 0.
Rope choose_rope(const RopeHint & h, const float * rows, const int32_t * pos, size_t n_rows, uint32_t n_units);

// Absolute channel paired with channel u (u itself when not rotated).
inline uint32_t rope_partner(const RopeTable & tab, uint32_t head_dim, uint32_t u) {
    return u - u % head_dim + tab.partner[u % head_dim];
}

// Rotates back (encoder) channels [u0, u0 + gn) of n rows, cell-major in `vals` (row i at table
// row i), given their partners' values in the same layout.
void rotate_back(const RopeTable & tab, uint32_t head_dim, uint32_t u0, uint32_t gn, size_t n,
                 const float * partner_vals, float * vals);

// Rotates decoded rows forward (decoder): object row r, at table row r, lies at base + row_cell[r]
// x cell_stride, its n_units values of ggml type f32/f16/bf16 `unit` bytes apart.
void rotate_forward(const RopeTable & tab, uint32_t head_dim, uint32_t n_units, int32_t ggml_type, uint8_t * base,
                    size_t cell_stride, size_t unit, const std::vector<uint32_t> & row_cell);

} // namespace lcg
