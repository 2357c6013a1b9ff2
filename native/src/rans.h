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
//  - Lanes are decoded in blocks of 8 (then 4, then 1): emit order is lane block by lane block.
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

constexpr uint32_t MAX_LANES = 256;

// Codes n symbols per lane (n_lanes <= MAX_LANES) and appends the lane sizes and bytes to w.
void encode_lanes(const uint8_t * symbols, size_t n, uint32_t n_lanes, const Table & t, ByteWriter & w);

// Decoder slot entry: symbol (8 bits) | freq (12 bits) | slot - cum (12 bits).
void build_decode_slots(const Table & t, uint32_t * slots);

// The lanes of one coded block, positioned on their bytes and checked to lie inside r.
struct LaneCursor {
    uint32_t x;
    const uint8_t * ptr;
    const uint8_t * end;
};
void open_lanes(ByteReader & r, uint32_t n_lanes, LaneCursor * lanes);
// Throws unless every lane consumed exactly its bytes and returned to the initial state.
void close_lanes(const LaneCursor * lanes, uint32_t n_lanes);
[[noreturn]] void lane_overrun(uint32_t lane);

// Inverse of encode_lanes: calls emit(i, j, symbol) for i in [0, n), j in [0, n_lanes), in that
// order (i outer), so that a caller can write each value straight to its place.
template <uint32_t LANES, typename Emit>
inline void decode_lanes_fixed(const uint32_t * slots, LaneCursor * lanes, size_t n, Emit && emit) {
    uint32_t x[LANES];
    const uint8_t * ptr[LANES];
    for (uint32_t j = 0; j < LANES; j++) {
        x[j] = lanes[j].x;
        ptr[j] = lanes[j].ptr;
    }
    for (size_t i = 0; i < n; i++) {
        for (uint32_t j = 0; j < LANES; j++) {
            const uint32_t e = slots[x[j] & (PROB_SCALE - 1)];
            emit(i, j, static_cast<uint8_t>(e));
            x[j] = ((e >> 8) & 0xfff) * (x[j] >> PROB_BITS) + (e >> 20);
        }
        for (uint32_t j = 0; j < LANES; j++) {
            if (x[j] < STATE_LOW) {
                if (ptr[j] >= lanes[j].end) {
                    lane_overrun(j);
                }
                uint16_t word;
                std::memcpy(&word, ptr[j], 2);
                ptr[j] += 2;
                x[j] = (x[j] << 16) | word;
            }
        }
    }
    for (uint32_t j = 0; j < LANES; j++) {
        lanes[j].x = x[j];
        lanes[j].ptr = ptr[j];
    }
}

template <typename Emit>
void decode_lanes(ByteReader & r, const Table & t, size_t n, uint32_t n_lanes, Emit && emit) {
    LCG_CHECK(n_lanes >= 1 && n_lanes <= MAX_LANES, LCG_ERR_CORRUPT, "%u lanes", n_lanes);
    if (t.constant() || n == 0) {
        for (size_t i = 0; i < n; i++) {
            for (uint32_t j = 0; j < n_lanes; j++) {
                emit(i, j, static_cast<uint8_t>(t.first));
            }
        }
        return;
    }
    uint32_t slots[PROB_SCALE];
    build_decode_slots(t, slots);
    LaneCursor lanes[MAX_LANES];
    open_lanes(r, n_lanes, lanes);
    // Blocks of 8 lanes keep the states in registers; the remainder goes 4, then 1 at a time.
    uint32_t j0 = 0;
    for (; j0 + 8 <= n_lanes; j0 += 8) {
        decode_lanes_fixed<8>(slots, lanes + j0, n, [&](size_t i, uint32_t j, uint8_t s) { emit(i, j0 + j, s); });
    }
    for (; j0 + 4 <= n_lanes; j0 += 4) {
        decode_lanes_fixed<4>(slots, lanes + j0, n, [&](size_t i, uint32_t j, uint8_t s) { emit(i, j0 + j, s); });
    }
    for (; j0 < n_lanes; j0++) {
        decode_lanes_fixed<1>(slots, lanes + j0, n, [&](size_t i, uint32_t, uint8_t s) { emit(i, j0, s); });
    }
    close_lanes(lanes, n_lanes);
}

} // namespace lcg::rans
