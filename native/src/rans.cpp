#include "rans.h"

#include <algorithm>
#include <cmath>

namespace lcg::rans {

namespace {

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

void build_enc_table(const Table & t, EncTable & e) {
    for (uint32_t s = t.first; s <= t.last; s++) {
        if (t.freq[s]) {
            e.sym[s] = enc_symbol(t.cum[s], t.freq[s]);
        }
    }
}

void build_decode_slots(const Table & t, uint32_t * slots) {
    for (uint32_t s = t.first; s <= t.last; s++) {
        for (uint32_t k = 0; k < t.freq[s]; k++) {
            slots[t.cum[s] + k] = lanes::slot_entry(s, t.freq[s], k);
        }
    }
}

double coded_bits(const uint32_t counts[256], const Table & t) {
    double bits = 0.0;
    for (uint32_t s = t.first; s <= t.last; s++) {
        if (counts[s]) {
            bits += counts[s] * (PROB_BITS - std::log2(static_cast<double>(t.freq[s])));
        }
    }
    return bits;
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
    if (t.first == t.last) {
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
    if (t.first == t.last) {
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

std::vector<Slice> read_slices(const uint8_t * data, size_t size, size_t n, bool with_counts) {
    ByteReader r(data, size, LCG_ERR_CORRUPT, "rANS stream");
    const uint32_t slice_elements = r.u32();
    LCG_CHECK(slice_elements > 0 && slice_elements % LANES == 0, LCG_ERR_CORRUPT,
              "rANS stream slices of %u symbols (expected a positive multiple of %u)", slice_elements, LANES);
    const size_t n_slices = (n + slice_elements - 1) / slice_elements;
    const size_t entry = with_counts ? 8 : 4;
    // Every slice holds at least its lane states: bound the directory before allocating it.
    LCG_CHECK(n_slices <= r.remaining() / (entry + MIN_SLICE_BYTES), LCG_ERR_CORRUPT,
              "rANS stream of %zu slices in %zu bytes", n_slices, r.remaining());
    std::vector<Slice> slices(n_slices);
    size_t total = 0;
    for (size_t s = 0; s < n_slices; s++) {
        Slice & sl = slices[s];
        sl.bytes = r.u32();
        sl.count = with_counts ? r.u32() : 0;
        sl.k0 = s * slice_elements;
        sl.k1 = std::min(n, sl.k0 + slice_elements);
        LCG_CHECK(sl.bytes >= MIN_SLICE_BYTES && sl.bytes % 2 == 0 && sl.count <= sl.k1 - sl.k0, LCG_ERR_CORRUPT,
                  "rANS slice %zu: %zu bytes, count %u", s, sl.bytes, sl.count);
        total += sl.bytes;
    }
    LCG_CHECK(total == r.remaining(), LCG_ERR_CORRUPT, "rANS slices of %zu bytes in a stream with %zu left", total,
              r.remaining());
    const uint8_t * p = r.take(total);
    for (Slice & sl : slices) {
        sl.data = p;
        p += sl.bytes;
    }
    return slices;
}

Cursor open_stream(const uint8_t * data, size_t size) {
    LCG_CHECK(size >= STATE_BYTES && size % 2 == 0, LCG_ERR_CORRUPT, "rANS stream of %zu bytes", size);
    Cursor c;
    for (uint32_t j = 0; j < LANES; j++) {
        std::memcpy(&c.x[j], data + 4 * j, 4);
        LCG_CHECK(lanes::valid_start(c.x[j]), LCG_ERR_CORRUPT, "lane %u starts in state %u",
                  j, c.x[j]);
    }
    c.ptr = data + STATE_BYTES;
    c.end = data + size;
    return c;
}

void close_stream(const Cursor & c) {
    LCG_CHECK(c.ptr == c.end, LCG_ERR_CORRUPT, "rANS stream has %zu bytes left over (corrupt stream)",
              static_cast<size_t>(c.end - c.ptr));
    for (uint32_t j = 0; j < LANES; j++) {
        LCG_CHECK(c.x[j] == STATE_LOW, LCG_ERR_CORRUPT, "lane %u does not end in the initial state (corrupt stream)",
                  j);
    }
}

void stream_overrun() { fail(LCG_ERR_CORRUPT, "rANS stream runs past its bytes (corrupt stream)"); }

} // namespace lcg::rans
