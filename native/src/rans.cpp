#include "rans.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
            const EncSymbol & es = e.sym[s] = enc_symbol(t.cum[s], t.freq[s]);
            const uint64_t packed = es.bias | es.cmpl_freq << 13 | es.rcp_shift << 25;
            e.rcp_packed[s] = es.rcp_freq | packed << 32;
        }
    }
}

namespace {

// One symbol: the scalar step (ryg_rans's RansEncPutSymbol on lane j's state).
inline void put_symbol(uint32_t & x, const EncSymbol & e, uint16_t *& ptr) {
    if (x >= e.x_max) {
        *--ptr = static_cast<uint16_t>(x);
        x >>= 16;
    }
    const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(x) * e.rcp_freq) >> 32) >> e.rcp_shift;
    x = x + e.bias + q * e.cmpl_freq;
}

#if defined(__x86_64__)
// For an emit mask of 8 lanes: the emitting lanes in ascending order, right-aligned in 8 places
// (the words are stored as 8 at ptr - 8; the places below the emitted ones are overwritten later).
struct EmitTable {
    alignas(32) int32_t idx[256][8];
    EmitTable() {
        for (int m = 0; m < 256; m++) {
            const int cnt = __builtin_popcount(m);
            int at = 8 - cnt;
            for (int j = 0; j < 8; j++) {
                idx[m][j] = 0;
            }
            for (int j = 0; j < 8; j++) {
                if (m & (1 << j)) {
                    idx[m][at++] = j;
                }
            }
        }
    }
};
const EmitTable emit_table;

// Full steps [k_begin, k_end) (multiples of 32), last step first, when every 8 consecutive
// elements share a table (n_inner % 8 == 0): 4 vectors of 8 lanes, lanes 24..31 first, each
// vector's words written as one block below ptr, as the scalar loop writes them one by one.
template <bool GATHER>
__attribute__((target("avx2"))) void encode_steps_avx2(const SymbolMatrix & m, size_t k_begin, size_t k_end,
                                                       uint32_t * x, uint16_t *& ptr) {
    __m256i X[4];
    for (int v = 0; v < 4; v++) {
        X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + 8 * v));
    }
    const __m256i one = _mm256_set1_epi32(1), full = _mm256_set1_epi32(int(PROB_SCALE));
    const __m256i mask13 = _mm256_set1_epi32(0x1fff), mask12 = _mm256_set1_epi32(0xfff);
    const __m128i gather_order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pack16 = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8,
                                            9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    size_t o = k_end / m.n_inner, i = k_end % m.n_inner;  // of the element after the vector
    for (size_t k = k_end; k > k_begin;) {
        for (int v = 3; v >= 0; v--) {
            k -= 8;
            if (i == 0) {
                i = m.n_inner;
                o--;
            }
            i -= 8;
            const EncTable & t = *m.unit_table[m.unit_is_outer ? o : i];
            // The entries of lanes 0, 1, 4, 5 and of 2, 3, 6, 7 (two 4-entry gathers, or eight
            // scalar loads): their halves, picked by one shuffle each, give rcp and packed in lane order.
            __m256 g0, g1;
            if constexpr (GATHER) {
                const __m128i sym8 =
                    _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(m.sym + k)), gather_order);
                const long long * table = reinterpret_cast<const long long *>(t.rcp_packed);
                g0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm_cvtepu8_epi32(sym8), 8));
                g1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm_cvtepu8_epi32(_mm_srli_si128(sym8, 4)), 8));
            } else {
                uint64_t w;
                std::memcpy(&w, m.sym + k, 8);
                auto entry = [&](int lane) { return static_cast<long long>(t.rcp_packed[(w >> (8 * lane)) & 0xff]); };
                g0 = _mm256_castsi256_ps(_mm256_setr_epi64x(entry(0), entry(1), entry(4), entry(5)));
                g1 = _mm256_castsi256_ps(_mm256_setr_epi64x(entry(2), entry(3), entry(6), entry(7)));
            }
            const __m256i rcp = _mm256_castps_si256(_mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(2, 0, 2, 0)));
            const __m256i pk = _mm256_castps_si256(_mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(3, 1, 3, 1)));
            const __m256i bias = _mm256_and_si256(pk, mask13);
            const __m256i cmpl = _mm256_and_si256(_mm256_srli_epi32(pk, 13), mask12);
            const __m256i shift = _mm256_srli_epi32(pk, 25);
            // x >= freq << 19, as signed compares (freq = 4096 gives INT_MAX: never)
            const __m256i x_max1 = _mm256_sub_epi32(_mm256_slli_epi32(_mm256_sub_epi32(full, cmpl), 19), one);
            __m256i xv = X[v];
            const __m256i need = _mm256_cmpgt_epi32(xv, x_max1);
            const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
            const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i *>(emit_table.idx[mask]));
            const __m256i words = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(xv, idx), pack16);
            _mm_storeu_si128(reinterpret_cast<__m128i *>(ptr - 8),
                             _mm256_castsi256_si128(_mm256_permute4x64_epi64(words, 0xd8)));
            ptr -= __builtin_popcount(mask);
            xv = _mm256_blendv_epi8(xv, _mm256_srli_epi32(xv, 16), need);
            // q = (x * rcp_freq) >> 32 >> rcp_shift: high halves of even and odd lanes' products
            const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(xv, rcp), 32);
            const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xv, 32), _mm256_srli_epi64(rcp, 32));
            const __m256i q = _mm256_srlv_epi32(_mm256_blend_epi32(even, odd, 0xaa), shift);
            X[v] = _mm256_add_epi32(_mm256_add_epi32(xv, bias), _mm256_mullo_epi32(q, cmpl));
        }
    }
    for (int v = 0; v < 4; v++) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(x + 8 * v), X[v]);
    }
}
#endif

} // namespace

// Packs n raw-bit bytes (each below 2^b) into lanes::raw_bytes(n, b) bytes at out, element e at bit
// e * b: 8 elements at a time into b bytes, by three shift-or-mask steps that close the gaps
// between 1, 2 then 4 elements (out has 16 bytes of room past its end).
namespace {

#if defined(__x86_64__)
// pack_raw_bits' 32 elements into 4b bytes at a time: pairs joined by multiply-adds, then 64-bit halves;
// the two 128-bit halves' 2b bytes stored one after the other (16-byte stores: out has room).
// Returns the elements done.
__attribute__((target("avx2"))) size_t pack_raw_bits_avx2(const uint8_t * raw, size_t n, uint32_t b, uint8_t * out) {
    const __m256i pair = _mm256_set1_epi16(static_cast<int16_t>(1 | (1 << b) << 8));  // bytes 1, 2^b
    const __m256i quad = _mm256_set1_epi32(1 | (1 << 2 * b) << 16);                   // words 1, 2^2b
    alignas(32) int8_t pick[32];  // per 128 bits: bytes 0..b-1 of each 64-bit half to the front
    for (uint32_t j = 0; j < 32; j++) {
        const uint32_t at = j % 16;
        pick[j] = static_cast<int8_t>(at < b ? at : at < 2 * b ? 8 + at - b : -1);
    }
    const __m256i compact = _mm256_load_si256(reinterpret_cast<const __m256i *>(pick));
    size_t e = 0;
    for (; e + 32 <= n; e += 32) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(raw + e));
        x = _mm256_madd_epi16(_mm256_maddubs_epi16(x, pair), quad);       // 4 elements per 32 bits
        x = _mm256_or_si256(x, _mm256_srli_epi64(x, static_cast<int>(32 - 4 * b)));  // 8 per 64 bits
        x = _mm256_shuffle_epi8(x, compact);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(out + e / 8 * b), _mm256_castsi256_si128(x));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(out + e / 8 * b + 2 * b), _mm256_extracti128_si256(x, 1));
    }
    return e;
}
#endif

void pack_raw_bits(const uint8_t * raw, size_t n, uint32_t b, uint8_t * out) {
    auto unit_mask = [](uint32_t bits, uint32_t unit) {  // the low `bits` of every `unit`-bit unit
        uint64_t m = 0;
        for (uint32_t at = 0; at < 64; at += unit) {
            m |= ((uint64_t(1) << bits) - 1) << at;
        }
        return m;
    };
    const uint64_t m1 = unit_mask(2 * b, 16), m2 = unit_mask(4 * b, 32), m3 = unit_mask(8 * b, 64);
    size_t e = 0;
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        e = pack_raw_bits_avx2(raw, n, b, out);
    }
#endif
    for (; e + 8 <= n; e += 8) {
        uint64_t x;
        std::memcpy(&x, raw + e, 8);
        x = (x | x >> (8 - b)) & m1;
        x = (x | x >> (16 - 2 * b)) & m2;
        x = (x | x >> (32 - 4 * b)) & m3;
        std::memcpy(out + e / 8 * b, &x, 8);  // its b bytes; the rest is written over next
    }
    const size_t bytes = lanes::raw_bytes(n, b);
    std::memset(out + e / 8 * b, 0, bytes - e / 8 * b);
    for (; e < n; e++) {
        const uint64_t bit = e * b;
        out[bit >> 3] = static_cast<uint8_t>(out[bit >> 3] | raw[e] << (bit & 7));
        if ((bit & 7) + b > 8) {
            out[(bit >> 3) + 1] = static_cast<uint8_t>(out[(bit >> 3) + 1] | raw[e] >> (8 - (bit & 7)));
        }
    }
}

} // namespace

void encode_slice(const SymbolMatrix & m, size_t k0, size_t k1, ByteWriter & w) {
    if (m.raw_bits) {
        const size_t bytes = lanes::raw_bytes(k1 - k0, m.raw_bits);
        const size_t at = w.buf.size();
        w.buf.resize(at + bytes + 16);
        pack_raw_bits(m.raw + k0, k1 - k0, m.raw_bits, &w.buf[at]);
        w.buf.resize(at + bytes);
    }
    constexpr size_t SLACK = 8;  // the vector path stores 8 words below its cursor
    std::vector<uint16_t> words(SLACK + k1 - k0);
    uint16_t * const end = words.data() + words.size();
    uint16_t * ptr = end;
    uint32_t x[LANES];
    for (uint32_t j = 0; j < LANES; j++) {
        x[j] = STATE_LOW;
    }
    // The last, partial step first, one symbol at a time (rANS codes backwards).
    const size_t k_full = k0 + (k1 - k0) / LANES * LANES;
    size_t k = k1;
    auto scalar_until = [&](size_t k_stop) {
        size_t o = k / m.n_inner, i = k % m.n_inner;
        for (; k > k_stop; k--) {
            if (i-- == 0) {
                i = m.n_inner - 1;
                o--;
            }
            put_symbol(x[(k - 1) % LANES], m.unit_table[m.unit_is_outer ? o : i]->sym[m.sym[k - 1]], ptr);
        }
    };
    scalar_until(k_full);
#if defined(__x86_64__)
    if (cpu_has_avx2 && m.n_inner % 8 == 0) {
        if (use_gather) {
            encode_steps_avx2<true>(m, k0, k_full, x, ptr);
        } else {
            encode_steps_avx2<false>(m, k0, k_full, x, ptr);
        }
        k = k0;
    }
#endif
    scalar_until(k0);
    for (uint32_t j = 0; j < LANES; j++) {
        w.u32(x[j]);
    }
    w.put(ptr, 2 * static_cast<size_t>(end - ptr));
}

void encode_stream(const SymbolMatrix & m, uint32_t slice_elements, int counted_symbol, ByteWriter & w) {
    const size_t n = m.n_outer * m.n_inner;
    const size_t n_slices = (n + slice_elements - 1) / slice_elements;
    const size_t entry = counted_symbol >= 0 ? 8 : 4;
    w.u32(slice_elements);
    // The directory is filled in once the slices, written straight after it, are sized.
    const size_t directory = w.buf.size();
    w.buf.resize(directory + n_slices * entry);
    for (size_t s = 0; s < n_slices; s++) {
        const size_t k0 = s * slice_elements, k1 = std::min(n, k0 + slice_elements);
        const size_t start = w.buf.size();
        encode_slice(m, k0, k1, w);
        const size_t bytes = w.buf.size() - start;
        LCG_CHECK(bytes <= UINT32_MAX, LCG_ERR_LIMIT, "a slice of %zu bytes", bytes);
        w.u32_at(directory + s * entry, static_cast<uint32_t>(bytes));
        if (counted_symbol >= 0) {
            const size_t count = count_byte(m.sym + k0, k1 - k0, static_cast<uint8_t>(counted_symbol));
            w.u32_at(directory + s * entry + 4, static_cast<uint32_t>(count));
        }
    }
}

void build_decode_slots(const Table & t, uint32_t * slots) {
    // 8 entries at a time (wide tables hold many short runs): a run's last write spills into the
    // next run's slots, written after it, and the table's last into DECODE_SLOTS_ROOM.
    for (uint32_t s = t.first; s <= t.last; s++) {
        const uint32_t f = t.freq[s];
        uint32_t * run = slots + t.cum[s];
        for (uint32_t k = 0; k < f; k += 8) {
            for (uint32_t j = 0; j < 8; j++) {
                run[k + j] = lanes::slot_entry(s, f, k + j);
            }
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

size_t slice_raw_bytes(const Slice & sl, uint32_t raw_bits) {
    const size_t bytes = lanes::raw_bytes(sl.k1 - sl.k0, raw_bits);
    LCG_CHECK(sl.bytes >= bytes + STATE_BYTES, LCG_ERR_CORRUPT,
              "rANS slice of %zu bytes holds no %zu bytes of raw bits and lane states", sl.bytes, bytes);
    return bytes;
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
