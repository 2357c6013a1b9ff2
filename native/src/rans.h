// rans.h -- interleaved-lane rANS entropy coder over bytes (alphabet of 256 symbols).
//
// Read me first:
//  - A coded block holds n_lanes independent lanes. Symbol i of lane j is symbols[i * n_lanes + j]:
//    with one lane per channel, a lane is one channel's run of cells. Lanes share one frequency
//    table but have separate byte ranges, so a CPU decodes them in lock-step (instruction-level
//    parallelism, SIMD) and a GPU with one lane per thread, from the same bytes.
//  - rANS is LIFO: the encoder walks each lane backwards and emits 16-bit words that the decoder
//    reads forwards. State x lives in [L, L << 16) with L = 2^15, so at most one word moves per
//    symbol and the encoder's reciprocal division is exact (x < 2^31).
//  - Probabilities are 12-bit. A table whose whole mass is on one symbol is "constant": its lanes
//    carry no bytes at all.
//  - The decoder trusts nothing: a lane that runs past its bytes, has bytes left over or does not
//    return to the initial state is reported as corrupt.
#pragma once

#include "common.h"

namespace lcg::rans {

constexpr uint32_t PROB_BITS = 12;
constexpr uint32_t PROB_SCALE = 1u << PROB_BITS;
constexpr uint32_t STATE_LOW = 1u << 15;

struct Table {
    uint16_t freq[256];
    uint16_t cum[257];
    uint32_t first, last;  // range of symbols with nonzero frequency

    bool constant() const { return first == last; }
};

// Normalizes symbol counts (at least one nonzero) to 12-bit frequencies; every symbol that
// occurs keeps a nonzero frequency.
void build_table(const uint32_t counts[256], Table & t);
void write_table(ByteWriter & w, const Table & t);
// Throws LCG_ERR_CORRUPT unless the frequencies sum to PROB_SCALE.
void read_table(ByteReader & r, Table & t);

// Codes n symbols per lane (n_lanes <= 256) and appends the lane sizes and bytes to w.
void encode_lanes(const uint8_t * symbols, size_t n, uint32_t n_lanes, const Table & t, ByteWriter & w);
// Inverse of encode_lanes: reads the lanes from r and writes n * n_lanes symbols.
void decode_lanes(ByteReader & r, const Table & t, size_t n, uint32_t n_lanes, uint8_t * symbols);

} // namespace lcg::rans
