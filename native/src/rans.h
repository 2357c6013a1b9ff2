// rans.h -- 32-lane interleaved rANS over bytes (alphabet of 256 symbols), several tables per stream.
//
// Read me first:
//  - A stream codes n symbols with 32 lanes: symbol k belongs to lane k % 32. Every lane has its
//    own 32-bit state, but all lanes share ONE sequence of 16-bit renormalisation words, in the
//    order the decoder needs them: step g decodes symbols 32g .. 32g+31 (lanes 0..31 in order) and
//    each lane that drops below STATE_LOW reads the next word. A CPU decodes 8 lanes per AVX2
//    vector (renormalisation = compare mask + popcount + permute), a GPU warp one lane per thread
//    (ballot + popc give each thread its word), from the same bytes.
//  - Slice bytes: 32 x u32 initial states (lane order), then the words. A valid slice ends with
//    every word read and every lane back at STATE_LOW. A stream is a directory and its slices
//    (below), each decodable on its own.
//  - rANS is LIFO: the encoder walks the symbols backwards and writes words from the back.
//  - State x in [L, L << 16), L = 2^15: at most one word per symbol; the encoder's reciprocal
//    division is exact (x < 2^31).
//  - Probabilities are 12-bit. Symbol k uses the table its caller picks (one per channel group);
//    a table whose whole mass is on one symbol costs no words at all (the state never moves).
//  - Decode slot, one u32 per 12-bit slot: symbol | (freq - 1) << 8 | (slot - cum) << 20.
//  - The decoder trusts nothing: a stream that runs past its words, has words left over or does
//    not return every lane to STATE_LOW is corrupt.
#pragma once

#include "common.h"

#include <algorithm>
#include <vector>

namespace lcg::rans {

// The lane step itself (shared with the CUDA decoder) is in lanes.h.
constexpr uint32_t PROB_BITS = lanes::PROB_BITS;
constexpr uint32_t PROB_SCALE = lanes::PROB_SCALE;
constexpr uint32_t STATE_LOW = lanes::STATE_LOW;
constexpr uint32_t LANES = lanes::LANES;
constexpr size_t STATE_BYTES = 4 * LANES;

struct Table {
    uint16_t freq[256];
    uint16_t cum[257];
    uint32_t first, last;  // range of symbols with nonzero frequency
};

// Normalizes symbol counts (at least one nonzero) to 12-bit frequencies; every symbol that
// occurs keeps a nonzero frequency.
void build_table(const uint32_t counts[256], Table & t);
void write_table(ByteWriter & w, const Table & t);
// Throws LCG_ERR_CORRUPT unless the frequencies sum to PROB_SCALE.
void read_table(ByteReader & r, Table & t);
// Bits that coding `counts` with table t costs (for the stored-or-coded choice).
double coded_bits(const uint32_t counts[256], const Table & t);

// Encoder view of one symbol: division by freq as a multiply by a 32-bit reciprocal and a shift
// (exact for x < 2^31), as in ryg_rans.
struct EncSymbol {
    uint32_t x_max;  // states at or above this emit a word first
    uint32_t rcp_freq;
    uint32_t bias;
    uint32_t cmpl_freq;  // PROB_SCALE - freq
    uint32_t rcp_shift;
};
struct EncTable {
    EncSymbol sym[256];
    // The same for the AVX2 encoder, one 64-bit entry per symbol (read once for both): rcp_freq in
    // the low half, bias | cmpl_freq << 13 | rcp_shift << 25 in the high one (x_max is freq << 19).
    uint64_t rcp_packed[256];
};
void build_enc_table(const Table & t, EncTable & e);
// 4096 decode slots; up to DECODE_SLOTS_ROOM entries after them are overwritten (the next
// table's, built after it, or room left at the end).
constexpr uint32_t DECODE_SLOTS_ROOM = 8;
void build_decode_slots(const Table & t, uint32_t * slots);

// Slices (format v3 on): a stream of n symbols is cut into slices of `slice_elements` symbols (a
// multiple of 32; the last slice may be shorter), each an independent 32-lane stream: its raw bits
// if the symbols have some (format v4), 32 x u32 initial states, then its words. A directory before the slices gives each one's byte size and,
// where the caller keeps one, a count of its own (lossy: the slice's escape symbols), so that a
// decoder can start every slice at once (CPU threads, one GPU warp per slice).
constexpr uint32_t DEFAULT_SLICE = 65536;
constexpr uint32_t MAX_SLICE = 1u << 24;  // a slice's bytes stay far below 4 GiB
constexpr size_t MIN_SLICE_BYTES = STATE_BYTES;

// The symbols of an n_outer x n_inner matrix in memory order (symbol k = outer * n_inner +
// inner) and the table of each unit: unit = outer when unit_is_outer (transposed V), else inner.
// Every symbol must have nonzero frequency in its table. Units 8u..8u+7 must share one table (the
// AVX2 encoder looks up one per 8 elements): tables cover groups of 8, 16 or 32 units.
struct SymbolMatrix {
    const uint8_t * sym;
    size_t n_outer, n_inner;
    bool unit_is_outer;
    const EncTable * const * unit_table;
    const uint8_t * raw = nullptr;  // raw_bits > 0: each element's raw bits, in the same order
    uint32_t raw_bits = 0;
};

// Codes symbols [k0, k1) (k0 a multiple of 32) as one slice appended to w, after their raw bits
// (lanes::raw_bytes of them) when m has some.
void encode_slice(const SymbolMatrix & m, size_t k0, size_t k1, ByteWriter & w);

// Codes the whole matrix as a sliced stream (u32 slice_elements, directory, slices) appended to
// w. With counted_symbol >= 0, each directory entry also counts that symbol in its slice.
void encode_stream(const SymbolMatrix & m, uint32_t slice_elements, int counted_symbol, ByteWriter & w);

// One slice of a stream, as the directory gives it (bounds checked against the stream).
struct Slice {
    const uint8_t * data;
    size_t bytes;
    size_t k0, k1;   // the symbols it codes
    uint32_t count;  // the directory's count (0 without counts)
};
// Parses a sliced stream of n symbols of `size` bytes; throws LCG_ERR_CORRUPT on a malformed one.
std::vector<Slice> read_slices(const uint8_t * data, size_t size, size_t n, bool with_counts);
// The bytes of raw bits that start slice sl of a stream with raw_bits (lanes::raw_bytes); throws
// LCG_ERR_CORRUPT when the slice cannot hold them and its lane states.
size_t slice_raw_bytes(const Slice & sl, uint32_t raw_bits);

// A stream being decoded: lane states and the word cursor, bounds-checked.
struct Cursor {
    uint32_t x[LANES];
    const uint8_t * ptr;
    const uint8_t * end;
};
// Positions on a stream of `size` bytes; throws LCG_ERR_CORRUPT on a malformed start.
Cursor open_stream(const uint8_t * data, size_t size);
// Throws unless every word was read and every lane is back at STATE_LOW.
void close_stream(const Cursor & c);
[[noreturn]] void stream_overrun();

inline uint32_t next_word(Cursor & c) {
    if (c.ptr + 2 > c.end) {
        stream_overrun();
    }
    uint16_t w;
    std::memcpy(&w, c.ptr, 2);
    c.ptr += 2;
    return w;
}

// One symbol of lane j with decode slots `slots`: returns the symbol, updates the state.
inline uint8_t decode_symbol(Cursor & c, uint32_t j, const uint32_t * slots) {
    const uint32_t e = slots[c.x[j] & (PROB_SCALE - 1)];
    uint32_t x = lanes::advance(c.x[j], e);
    if (lanes::needs_word(x)) {
        x = lanes::refill(x, next_word(c));
    }
    c.x[j] = x;
    return static_cast<uint8_t>(lanes::entry_symbol(e));
}

// Scalar decode of symbols [k0, k1) of a matrix of n_inner columns in memory order (lane k % 32
// continues from c): calls emit(outer, inner, symbol) in order, with slots_of(outer, inner) ->
// const uint32_t * the decode slots of that symbol.
template <typename SlotsOf, typename Emit>
void decode_stream(Cursor & c, size_t k0, size_t k1, size_t n_inner, SlotsOf && slots_of, Emit && emit) {
    size_t o = k0 / (n_inner ? n_inner : 1), i = k0 - o * n_inner;
    for (size_t k = k0; k < k1; k++) {
        emit(o, i, decode_symbol(c, k % LANES, slots_of(o, i)));
        if (++i == n_inner) {
            i = 0;
            o++;
        }
    }
}

} // namespace lcg::rans
