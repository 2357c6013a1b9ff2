#include "rans.h"

#include <algorithm>

namespace lcg::rans {

namespace {

// Encoder view of one symbol: division by freq as a multiply by a 32-bit reciprocal and a
// shift (exact for x < 2^31), as in ryg_rans.
struct EncSymbol {
    uint32_t x_max;      // states at or above this must emit a word first
    uint32_t rcp_freq;
    uint32_t bias;
    uint32_t cmpl_freq;  // PROB_SCALE - freq
    uint32_t rcp_shift;
};

EncSymbol enc_symbol(uint32_t cum, uint32_t freq) {
    EncSymbol s;
    s.x_max = ((STATE_LOW >> PROB_BITS) << 16) * freq;
    s.cmpl_freq = PROB_SCALE - freq;
    if (freq < 2) {
        s.rcp_freq = ~0u;
        s.rcp_shift = 0;
        s.bias = cum + PROB_SCALE - 1;
    } else {
        uint32_t shift = 0;
        while (freq > (1u << shift)) {
            shift++;
        }
        s.rcp_freq = static_cast<uint32_t>(((1ull << (shift + 31)) + freq - 1) / freq);
        s.rcp_shift = shift - 1;
        s.bias = cum;
    }
    return s;
}

} // namespace

void build_decode_slots(const Table & t, uint32_t * slots) {
    for (uint32_t s = t.first; s <= t.last; s++) {
        for (uint32_t k = 0; k < t.freq[s]; k++) {
            slots[t.cum[s] + k] = s | (static_cast<uint32_t>(t.freq[s]) << 8) | (k << 20);
        }
    }
}


void build_table(const uint32_t counts[256], Table & t) {
    uint64_t total = 0;
    for (int s = 0; s < 256; s++) {
        total += counts[s];
    }
    LCG_CHECK(total > 0, LCG_ERR_INTERNAL, "frequency table of no symbols");
    std::memset(t.freq, 0, sizeof(t.freq));
    int64_t sum = 0;
    t.first = 256;
    t.last = 0;
    for (uint32_t s = 0; s < 256; s++) {
        if (counts[s]) {
            const uint64_t f = (static_cast<uint64_t>(counts[s]) * PROB_SCALE + total / 2) / total;
            t.freq[s] = static_cast<uint16_t>(std::max<uint64_t>(1, f));
            sum += t.freq[s];
            t.first = std::min(t.first, s);
            t.last = std::max(t.last, s);
        }
    }
    // Rounding leaves the sum a little off: settle the difference on the most frequent symbols,
    // where it costs least.
    while (sum != PROB_SCALE) {
        uint32_t best = t.first;
        for (uint32_t s = t.first; s <= t.last; s++) {
            if (t.freq[s] > t.freq[best]) {
                best = s;
            }
        }
        if (sum > PROB_SCALE) {
            LCG_CHECK(t.freq[best] > 1, LCG_ERR_INTERNAL, "cannot normalize frequency table");
            const int64_t step = std::max<int64_t>(1, std::min<int64_t>(sum - PROB_SCALE, t.freq[best] / 2));
            t.freq[best] = static_cast<uint16_t>(t.freq[best] - step);
            sum -= step;
        } else {
            t.freq[best] = static_cast<uint16_t>(t.freq[best] + (PROB_SCALE - sum));
            sum = PROB_SCALE;
        }
    }
    t.cum[0] = 0;
    for (int s = 0; s < 256; s++) {
        t.cum[s + 1] = static_cast<uint16_t>(t.cum[s] + t.freq[s]);
    }
}

void write_table(ByteWriter & w, const Table & t) {
    w.u8(static_cast<uint8_t>(t.first));
    w.u8(static_cast<uint8_t>(t.last));
    if (t.constant()) {
        return;
    }
    for (uint32_t s = t.first; s <= t.last; s++) {
        w.varint(t.freq[s]);
    }
}

void read_table(ByteReader & r, Table & t) {
    std::memset(t.freq, 0, sizeof(t.freq));
    t.first = r.u8();
    t.last = r.u8();
    LCG_CHECK(t.first <= t.last, LCG_ERR_CORRUPT, "frequency table range %u..%u is empty", t.first, t.last);
    if (t.constant()) {
        t.freq[t.first] = PROB_SCALE;
    } else {
        uint32_t sum = 0;
        for (uint32_t s = t.first; s <= t.last; s++) {
            const uint64_t f = r.varint();
            LCG_CHECK(f < PROB_SCALE, LCG_ERR_CORRUPT, "symbol %u has frequency %llu", s, (unsigned long long) f);
            t.freq[s] = static_cast<uint16_t>(f);
            sum += static_cast<uint32_t>(f);
        }
        LCG_CHECK(sum == PROB_SCALE, LCG_ERR_CORRUPT, "frequency table sums to %u, expected %u", sum, PROB_SCALE);
    }
    t.cum[0] = 0;
    for (int s = 0; s < 256; s++) {
        t.cum[s + 1] = static_cast<uint16_t>(t.cum[s] + t.freq[s]);
    }
}

void encode_lanes(const uint8_t * symbols, size_t n, uint32_t n_lanes, const Table & t, ByteWriter & w) {
    if (t.constant() || n == 0) {
        return;
    }
    EncSymbol enc[256];
    for (uint32_t s = t.first; s <= t.last; s++) {
        if (t.freq[s]) {
            enc[s] = enc_symbol(t.cum[s], t.freq[s]);
        }
    }
    // Each lane fills its own region of one word buffer from the back (a symbol emits at most one
    // word), so that the words end up in the order the decoder reads them. Lanes advance together
    // for instruction-level parallelism.
    const size_t cap = n + 1;
    std::vector<uint16_t> words(cap * n_lanes);
    uint16_t * ptr[MAX_LANES];
    uint32_t x[MAX_LANES];
    for (uint32_t j = 0; j < n_lanes; j++) {
        ptr[j] = words.data() + cap * (j + 1);
        x[j] = STATE_LOW;
    }
    for (size_t i = n; i-- > 0;) {
        const uint8_t * row = symbols + i * n_lanes;
        for (uint32_t j = 0; j < n_lanes; j++) {
            const EncSymbol & e = enc[row[j]];
            uint32_t xj = x[j];
            if (xj >= e.x_max) {
                *--ptr[j] = static_cast<uint16_t>(xj);
                xj >>= 16;
            }
            const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(xj) * e.rcp_freq) >> 32) >> e.rcp_shift;
            x[j] = xj + e.bias + q * e.cmpl_freq;
        }
    }
    for (uint32_t j = 0; j < n_lanes; j++) {
        const size_t n_words = static_cast<size_t>(words.data() + cap * (j + 1) - ptr[j]);
        w.varint(4 + 2 * n_words);
    }
    for (uint32_t j = 0; j < n_lanes; j++) {
        const size_t n_words = static_cast<size_t>(words.data() + cap * (j + 1) - ptr[j]);
        w.u32(x[j]);
        w.put(ptr[j], 2 * n_words);
    }
}

void open_lanes(ByteReader & r, uint32_t n_lanes, LaneCursor * lanes) {
    size_t lane_bytes[MAX_LANES];
    for (uint32_t j = 0; j < n_lanes; j++) {
        lane_bytes[j] = r.varint();
        LCG_CHECK(lane_bytes[j] >= 4 && lane_bytes[j] % 2 == 0, LCG_ERR_CORRUPT, "lane %u has %zu bytes", j,
                  lane_bytes[j]);
    }
    for (uint32_t j = 0; j < n_lanes; j++) {
        const uint8_t * p = r.take(lane_bytes[j]);
        std::memcpy(&lanes[j].x, p, 4);
        lanes[j].ptr = p + 4;
        lanes[j].end = p + lane_bytes[j];
        LCG_CHECK(lanes[j].x >= STATE_LOW && lanes[j].x < (STATE_LOW << 16), LCG_ERR_CORRUPT,
                  "lane %u starts in state %u", j, lanes[j].x);
    }
}

void close_lanes(const LaneCursor * lanes, uint32_t n_lanes) {
    for (uint32_t j = 0; j < n_lanes; j++) {
        LCG_CHECK(lanes[j].ptr == lanes[j].end && lanes[j].x == STATE_LOW, LCG_ERR_CORRUPT,
                  "lane %u does not end where its bytes do (corrupt stream)", j);
    }
}

void lane_overrun(uint32_t lane) {
    fail(LCG_ERR_CORRUPT, "lane %u runs past its bytes (corrupt stream)", lane);
}

} // namespace lcg::rans
