#include "codec.h"

#include "rans.h"

#include <algorithm>
#include <cmath>

namespace lcg {

namespace {

constexpr uint8_t GROUP_LOSSLESS = 0;  // byte planes of each unit, entropy coded
constexpr uint8_t GROUP_LOSSY = 1;     // quantized channels
constexpr uint8_t PLANE_RANS = 0;      // a lossless byte plane: entropy coded
constexpr uint8_t PLANE_STORED = 1;    // ... or stored as is, when coding would not make it smaller
constexpr uint32_t TENSOR_DESC_BYTES = 32;
constexpr uint32_t MAX_GROUP = 32;
constexpr int64_t MAX_ESCAPE_Q = int64_t(1) << 31;

// Channels sharing one frequency table (one lane each): the fewest, from 8 up to 32, whose
// table covers ~16K symbols, so that table bytes stay near 1% of the group. At least 8, so that the
// decoder's 8-lane blocks and the AVX2 quantizer apply at any context length.
uint32_t group_size(uint32_t n_cells, uint32_t n_units) {
    uint32_t g = 8;
    while (g < MAX_GROUP && static_cast<uint64_t>(g) * n_cells < 16384) {
        g *= 2;
    }
    return std::min(g, n_units);
}

// Unit (cell, unit) of a tensor starts at cell * cell_stride + unit * unit_stride bytes.
struct Strides {
    size_t cell, unit;
    explicit Strides(const TensorDesc & t)
        : cell(t.transposed ? t.unit_bytes : static_cast<size_t>(t.n_units) * t.unit_bytes),
          unit(t.transposed ? static_cast<size_t>(t.n_cells) * t.unit_bytes : t.unit_bytes) {}
    size_t at(size_t cell_index, size_t unit_index) const { return cell_index * cell + unit_index * unit; }
};

bool is_lossy(const TensorDesc & t, int32_t level) {
    return level != LCG_LEVEL_LOSSLESS && ggml_type_info(t.ggml_type)->is_float;
}

// The part of a tensor section before its groups: sink cells kept exact, group directory.
struct TensorPlan {
    uint32_t group = 0;
    uint32_t n_groups = 0;
    std::vector<uint32_t> sink_cells;
};

// ---- encoding ----------------------------------------------------------------------------------

void encode_lossless_group(const uint8_t * base, const TensorDesc & t, uint32_t u0, uint32_t gn,
                           std::vector<uint8_t> & sym, ByteWriter & w) {
    w.u8(GROUP_LOSSLESS);
    const Strides st(t);
    const size_t n = t.n_cells;
    for (uint32_t b = 0; b < t.unit_bytes; b++) {
        uint32_t counts[256] = {0};
        for (size_t i = 0; i < n; i++) {
            const uint8_t * row = base + i * st.cell + b;
            for (uint32_t g = 0; g < gn; g++) {
                const uint8_t v = row[(u0 + g) * st.unit];
                sym[i * gn + g] = v;
                counts[v]++;
            }
        }
        rans::Table table;
        rans::build_table(counts, table);
        ByteWriter coded;
        rans::write_table(coded, table);
        rans::encode_lanes(sym.data(), n, gn, table, coded);
        // Mantissa bytes are close to uniform: their table and lane states would cost more than
        // they save on short contexts.
        if (coded.buf.size() < n * gn) {
            w.u8(PLANE_RANS);
            w.put(coded.buf.data(), coded.buf.size());
        } else {
            w.u8(PLANE_STORED);
            w.put(sym.data(), n * gn);
        }
    }
}

template <int32_t TYPE>
void load_group(const uint8_t * base, const Strides & st, size_t n, uint32_t u0, uint32_t gn, float * out) {
    if (TYPE == GGML_F16 && st.unit == 2) {  // a group's f16 values are contiguous in each row
        for (size_t i = 0; i < n; i++) {
            f16_row_to_f32(base + i * st.cell + u0 * 2, gn, out + i * gn);
        }
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const uint8_t * cell = base + i * st.cell + u0 * st.unit;
        for (uint32_t g = 0; g < gn; g++) {
            out[i * gn + g] = load_float(cell + g * st.unit, TYPE);
        }
    }
}

bool encode_lossy_group(const uint8_t * base, const TensorDesc & t, uint32_t u0, uint32_t gn, float rel_step,
                        const std::vector<uint8_t> & is_sink, std::vector<uint8_t> & sym, ByteWriter & w) {
    const Strides st(t);
    const size_t n = t.n_cells;
    std::vector<float> values(n * gn);
    switch (t.ggml_type) {
        case GGML_F16: load_group<GGML_F16>(base, st, n, u0, gn, values.data()); break;
        case GGML_BF16: load_group<GGML_BF16>(base, st, n, u0, gn, values.data()); break;
        default: load_group<GGML_F32>(base, st, n, u0, gn, values.data()); break;
    }
    double sum[MAX_GROUP] = {0}, sum_sq[MAX_GROUP] = {0};
    uint64_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if (is_sink[i]) {
            continue;
        }
        count++;
        const float * v = &values[i * gn];
        for (uint32_t g = 0; g < gn; g++) {
            sum[g] += v[g];
            sum_sq[g] += static_cast<double>(v[g]) * v[g];
        }
    }
    // One step for the whole group, from its RMS channel deviation: equal error in every channel
    // minimizes the group's squared error for its bits (measured: less KL at the same size than a
    // step per channel).
    const double n_samples = static_cast<double>(std::max<uint64_t>(count, 1));
    double mean_d[MAX_GROUP], var_sum = 0.0;
    for (uint32_t g = 0; g < gn; g++) {
        if (!std::isfinite(sum_sq[g])) {
            return false;  // inf / nan (or overflow) somewhere in this channel
        }
        mean_d[g] = sum[g] / n_samples;
        var_sum += std::max(0.0, sum_sq[g] / n_samples - mean_d[g] * mean_d[g]);
    }
    const double step = rel_step * std::sqrt(var_sum / gn);
    ChannelQuant cq[MAX_GROUP];
    float mean[MAX_GROUP], inv_step[MAX_GROUP];
    for (uint32_t g = 0; g < gn; g++) {
        cq[g] = channel_quant(mean_d[g], step);
        mean[g] = f16_to_f32(cq[g].mean_f16);
        inv_step[g] = 1.0f / f16_to_f32(cq[g].step_f16);
    }
    std::vector<Escape> escapes;
    ShrinkSum shrink_sum;
    quantize_rows(values.data(), n, gn, mean, inv_step, is_sink.data(), sym.data(), shrink_sum, escapes);
    // Four histograms break the store-to-load chains of runs of equal symbols (mostly 128).
    uint32_t counts4[4][256] = {{0}};
    const size_t n_sym = n * gn;
    size_t k = 0;
    for (; k + 4 <= n_sym; k += 4) {
        counts4[0][sym[k]]++;
        counts4[1][sym[k + 1]]++;
        counts4[2][sym[k + 2]]++;
        counts4[3][sym[k + 3]]++;
    }
    for (; k < n_sym; k++) {
        counts4[0][sym[k]]++;
    }
    uint32_t counts[256];
    for (int s = 0; s < 256; s++) {
        counts[s] = counts4[0][s] + counts4[1][s] + counts4[2][s] + counts4[3][s];
    }
    // Values of a bin lie closer to zero than its centre on average (peaked distributions):
    // the decoder reconstructs |q| - shrink, with the group's measured mean offset.
    const double shrink = shrink_sum.count
                              ? static_cast<double>(shrink_sum.fixed) / 65536.0 / static_cast<double>(shrink_sum.count)
                              : 0.0;
    const uint8_t shrink_u8 = static_cast<uint8_t>(std::clamp(std::lround(shrink * 256.0), 0L, 127L));
    w.u8(GROUP_LOSSY);
    w.u8(shrink_u8);
    for (uint32_t g = 0; g < gn; g++) {
        cq[g].shrink_u8 = shrink_u8;
        w.u16(cq[g].mean_f16);
        w.u16(cq[g].step_f16);
    }
    rans::Table table;
    rans::build_table(counts, table);
    rans::write_table(w, table);
    rans::encode_lanes(sym.data(), n, gn, table, w);
    // Escapes are stored lane by lane, each lane's in cell order.
    std::stable_sort(escapes.begin(), escapes.end(), [](const Escape & a, const Escape & b) { return a.lane < b.lane; });
    w.varint(escapes.size());
    for (const Escape & e : escapes) {
        w.varint(zigzag_encode(e.q));
    }
    return true;
}

// ---- decoding ----------------------------------------------------------------------------------

void decode_lossless_group(ByteReader & r, const TensorDesc & t, uint32_t u0, uint32_t gn, uint8_t * base) {
    const Strides st(t);
    for (uint32_t b = 0; b < t.unit_bytes; b++) {
        uint8_t * first = base + u0 * st.unit + b;
        auto put = [&](size_t i, uint32_t j, uint8_t s) { first[i * st.cell + j * st.unit] = s; };
        const uint8_t mode = r.u8();
        if (mode == PLANE_STORED) {
            const uint8_t * stored = r.take(static_cast<size_t>(t.n_cells) * gn);
            for (size_t i = 0; i < t.n_cells; i++) {
                for (uint32_t j = 0; j < gn; j++) {
                    put(i, j, stored[i * gn + j]);
                }
            }
            continue;
        }
        LCG_CHECK(mode == PLANE_RANS, LCG_ERR_CORRUPT, "byte plane mode %u", mode);
        rans::Table table;
        rans::read_table(r, table);
        rans::decode_lanes(r, table, t.n_cells, gn, put);
    }
}

template <uint32_t UNIT_BYTES>
void decode_lossy_values(ByteReader & r, const rans::Table & table, const TensorDesc & t, uint32_t u0, uint32_t gn,
                         const DequantTable * lut, uint8_t * base, std::vector<Escape> & escapes) {
    const Strides st(t);
    uint8_t * first = base + u0 * st.unit;
    rans::decode_lanes(r, table, t.n_cells, gn, [&](size_t i, uint32_t j, uint8_t s) {
        uint8_t * p = first + i * st.cell + j * st.unit;
        std::memcpy(p, &lut[j].value[s], UNIT_BYTES);
        if (s == SYM_ESCAPE) {
            escapes.push_back({j, static_cast<uint32_t>(i), 0});
        }
    });
}

void decode_lossy_group(ByteReader & r, const TensorDesc & t, uint32_t u0, uint32_t gn, uint8_t * base) {
    ChannelQuant cq[MAX_GROUP];
    DequantTable lut[MAX_GROUP];
    const uint8_t shrink_u8 = r.u8();
    LCG_CHECK(shrink_u8 < 128, LCG_ERR_CORRUPT, "reconstruction offset %u/256", shrink_u8);
    for (uint32_t g = 0; g < gn; g++) {
        cq[g].shrink_u8 = shrink_u8;
        cq[g].mean_f16 = r.u16();
        cq[g].step_f16 = r.u16();
        build_dequant(cq[g], t.ggml_type, lut[g]);
    }
    rans::Table table;
    rans::read_table(r, table);
    std::vector<Escape> escapes;
    if (t.unit_bytes == 2) {
        decode_lossy_values<2>(r, table, t, u0, gn, lut, base, escapes);
    } else {
        decode_lossy_values<4>(r, table, t, u0, gn, lut, base, escapes);
    }
    const uint64_t n_escapes = r.varint();
    LCG_CHECK(n_escapes == escapes.size(), LCG_ERR_CORRUPT, "group declares %llu escapes, its symbols %zu",
              (unsigned long long) n_escapes, escapes.size());
    std::stable_sort(escapes.begin(), escapes.end(), [](const Escape & a, const Escape & b) { return a.lane < b.lane; });
    const Strides st(t);
    for (const Escape & e : escapes) {
        const int64_t q = zigzag_decode(r.varint());
        LCG_CHECK(q >= -MAX_ESCAPE_Q && q <= MAX_ESCAPE_Q, LCG_ERR_CORRUPT, "escaped value %lld", (long long) q);
        store_float(base + st.at(e.cell, u0 + e.lane), t.ggml_type, dequant_value(cq[e.lane], q));
    }
}

// ---- layout ------------------------------------------------------------------------------------

void write_layout(ByteWriter & w, const ParsedState & st, const QuantKnobs & k) {
    w.u32(st.n_layers);
    w.u32(static_cast<uint32_t>(st.segments.size()));
    w.u32(static_cast<uint32_t>(st.tensors.size()));
    w.f32(k.k_step);
    w.f32(k.v_step);
    w.f32(k.first_layer_scale);
    w.i32(k.n_sink_tokens);
    for (const TensorDesc & t : st.tensors) {
        w.i32(t.ggml_type);
        w.u8(t.is_v);
        w.u8(t.transposed);
        w.u16(0);
        w.u32(t.layer);
        w.u32(t.n_layer);
        w.u32(t.n_cells);
        w.u32(t.n_units);
        w.u32(t.unit_bytes);
        w.u32(t.cell_group);
    }
    for (const Segment & s : st.segments) {
        w.u8(s.tensor >= 0);
        w.u64(s.size);
        if (s.tensor >= 0) {
            w.u32(static_cast<uint32_t>(s.tensor));
        }
    }
}

} // namespace

Layout read_layout(const ContainerView & c) {
    const lcg_section * sec = nullptr;
    for (const lcg_section & s : c.sections) {
        if (s.type == LCG_SECTION_LAYOUT) {
            LCG_CHECK(sec == nullptr, LCG_ERR_CORRUPT, "two layout sections");
            sec = &s;
        }
    }
    LCG_CHECK(sec != nullptr, LCG_ERR_CORRUPT, "container has no layout section");
    verify_section(c, *sec);
    ByteReader r = c.section_reader(*sec, "layout section");
    Layout L;
    L.n_layers = r.u32();
    const uint32_t n_segments = r.u32();
    const uint32_t n_tensors = r.u32();
    L.knobs.k_step = r.f32();
    L.knobs.v_step = r.f32();
    L.knobs.first_layer_scale = r.f32();
    L.knobs.n_sink_tokens = r.i32();
    LCG_CHECK(n_tensors <= r.remaining() / TENSOR_DESC_BYTES && n_segments <= r.remaining() / 9, LCG_ERR_CORRUPT,
              "layout declares %u tensors and %u segments in %zu bytes", n_tensors, n_segments, r.remaining());
    const uint64_t state_size = c.header.state_size;
    L.tensors.resize(n_tensors);
    for (uint32_t i = 0; i < n_tensors; i++) {
        TensorDesc & t = L.tensors[i];
        t.ggml_type = r.i32();
        t.is_v = r.u8() != 0;
        t.transposed = r.u8() != 0;
        r.u16();
        t.layer = r.u32();
        t.n_layer = r.u32();
        t.n_cells = r.u32();
        t.n_units = r.u32();
        t.unit_bytes = r.u32();
        t.cell_group = r.u32();
        const GgmlType * type = ggml_type_info(t.ggml_type);
        LCG_CHECK(type != nullptr && t.unit_bytes == type->type_size, LCG_ERR_CORRUPT,
                  "tensor %u has type %d with %u-byte units", i, t.ggml_type, t.unit_bytes);
        LCG_CHECK(t.n_cells > 0 && t.n_units > 0 && t.layer < t.n_layer, LCG_ERR_CORRUPT,
                  "tensor %u: %u cells, %u units, layer %u of %u", i, t.n_cells, t.n_units, t.layer, t.n_layer);
        LCG_CHECK(static_cast<uint64_t>(t.n_cells) * t.n_units <= state_size / t.unit_bytes, LCG_ERR_CORRUPT,
                  "tensor %u (%u x %u units) is larger than the %llu-byte state", i, t.n_cells, t.n_units,
                  (unsigned long long) state_size);
    }
    std::vector<uint8_t> used(n_tensors, 0);
    uint64_t at = 0;
    L.segments.resize(n_segments);
    for (uint32_t i = 0; i < n_segments; i++) {
        Segment & s = L.segments[i];
        const uint8_t is_tensor = r.u8();
        s.size = r.u64();
        s.offset = at;
        s.tensor = -1;
        LCG_CHECK(is_tensor <= 1 && s.size <= state_size - at, LCG_ERR_CORRUPT,
                  "segment %u (%llu bytes) runs past the %llu-byte state", i, (unsigned long long) s.size,
                  (unsigned long long) state_size);
        if (is_tensor) {
            const uint32_t ti = r.u32();
            LCG_CHECK(ti < n_tensors && !used[ti] && L.tensors[ti].bytes() == s.size, LCG_ERR_CORRUPT,
                      "segment %u names tensor %u inconsistently", i, ti);
            used[ti] = 1;
            s.tensor = static_cast<int32_t>(ti);
            L.tensors[ti].offset = at;
        }
        at += s.size;
    }
    LCG_CHECK(at == state_size, LCG_ERR_CORRUPT, "segments add up to %llu bytes, header says %llu",
              (unsigned long long) at, (unsigned long long) state_size);
    LCG_CHECK(std::all_of(used.begin(), used.end(), [](uint8_t u) { return u != 0; }), LCG_ERR_CORRUPT,
              "a tensor is not placed in the state");
    LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "%zu stray bytes after the layout", r.remaining());
    return L;
}

uint8_t * encode_state(const uint8_t * state, size_t size, const EncodeOptions & opt, size_t * out_size) {
    LCG_CHECK(size <= LCG_MAX_STATE_SIZE, LCG_ERR_LIMIT, "state of %zu bytes", size);
    const ParsedState st = parse_state(state, size, opt.state_kind);
    const QuantKnobs & knobs = opt.knobs;

    // Sink cells (position < n_sink_tokens) of each stream are kept exact at lossy levels.
    std::vector<std::vector<uint8_t>> is_sink(st.cell_pos.size());
    for (size_t c = 0; c < st.cell_pos.size(); c++) {
        is_sink[c].resize(st.cell_pos[c].size());
        for (size_t i = 0; i < st.cell_pos[c].size(); i++) {
            is_sink[c][i] = opt.level != LCG_LEVEL_LOSSLESS && st.cell_pos[c][i] < knobs.n_sink_tokens;
        }
    }

    std::vector<TensorPlan> plans(st.tensors.size());
    struct Work {
        uint32_t tensor, group;
    };
    std::vector<Work> work;
    for (uint32_t ti = 0; ti < st.tensors.size(); ti++) {
        const TensorDesc & t = st.tensors[ti];
        TensorPlan & p = plans[ti];
        p.group = group_size(t.n_cells, t.n_units);
        p.n_groups = (t.n_units + p.group - 1) / p.group;
        if (is_lossy(t, opt.level)) {
            for (uint32_t i = 0; i < t.n_cells; i++) {
                if (is_sink[t.cell_group][i]) {
                    p.sink_cells.push_back(i);
                }
            }
        }
        for (uint32_t g = 0; g < p.n_groups; g++) {
            work.push_back({ti, g});
        }
    }

    std::vector<std::vector<uint8_t>> coded(work.size());
    parallel_for(work.size(), opt.n_threads, [&](size_t wi) {
        const Work & job = work[wi];
        const TensorDesc & t = st.tensors[job.tensor];
        const TensorPlan & p = plans[job.tensor];
        const uint32_t u0 = job.group * p.group;
        const uint32_t gn = std::min(p.group, t.n_units - u0);
        const uint8_t * base = state + t.offset;
        std::vector<uint8_t> sym(static_cast<size_t>(t.n_cells) * gn);
        ByteWriter w;
        const bool lossy = is_lossy(t, opt.level) &&
                           encode_lossy_group(base, t, u0, gn, layer_step(knobs, t.is_v, t.layer, t.n_layer),
                                              is_sink[t.cell_group], sym, w);
        if (!lossy) {
            w.buf.clear();
            encode_lossless_group(base, t, u0, gn, sym, w);
        }
        coded[wi] = std::move(w.buf);
    });

    std::vector<SectionPayload> sections;
    {
        ByteWriter w;
        write_layout(w, st, opt.level == LCG_LEVEL_LOSSLESS ? level_knobs(LCG_LEVEL_LOSSLESS) : knobs);
        sections.push_back({LCG_SECTION_LAYOUT, 0, std::move(w.buf)});
    }
    {
        ByteWriter w;
        for (const Segment & s : st.segments) {
            if (s.tensor < 0) {
                w.put(state + s.offset, s.size);
            }
        }
        sections.push_back({LCG_SECTION_VERBATIM, 0, std::move(w.buf)});
    }
    size_t wi = 0;
    for (uint32_t ti = 0; ti < st.tensors.size(); ti++) {
        const TensorDesc & t = st.tensors[ti];
        const TensorPlan & p = plans[ti];
        ByteWriter w;
        w.u32(t.n_units);
        w.u32(p.group);
        w.u32(static_cast<uint32_t>(p.sink_cells.size()));
        for (uint32_t c : p.sink_cells) {
            w.u32(c);
        }
        const Strides st(t);
        for (uint32_t c : p.sink_cells) {
            for (uint32_t u = 0; u < t.n_units; u++) {
                w.put(state + t.offset + st.at(c, u), t.unit_bytes);
            }
        }
        w.u32(p.n_groups);
        for (uint32_t g = 0; g < p.n_groups; g++) {
            w.u32(static_cast<uint32_t>(coded[wi + g].size()));
        }
        for (uint32_t g = 0; g < p.n_groups; g++, wi++) {
            w.put(coded[wi].data(), coded[wi].size());
            std::vector<uint8_t>().swap(coded[wi]);
        }
        sections.push_back({LCG_SECTION_TENSOR, ti, std::move(w.buf)});
    }
    if (opt.user_meta_size > 0) {
        LCG_CHECK(opt.user_meta_size <= LCG_MAX_USER_META, LCG_ERR_LIMIT, "user meta of %zu bytes (at most %zu)",
                  opt.user_meta_size, static_cast<size_t>(LCG_MAX_USER_META));
        sections.push_back({LCG_SECTION_USER_META, 0,
                            std::vector<uint8_t>(opt.user_meta, opt.user_meta + opt.user_meta_size)});
    }

    ContainerHeader h;
    h.level = opt.level;
    h.state_kind = st.kind;
    h.state_size = size;
    h.kv_bytes = st.kv_bytes;
    h.n_tokens = st.n_tokens;
    h.n_cells = st.n_cells;
    return write_container(h, sections, out_size);
}

size_t decode_container(const uint8_t * data, size_t size, int32_t n_threads, uint8_t * dst, size_t dst_capacity) {
    const ContainerView c = read_container(data, size);
    for (const lcg_section & s : c.sections) {
        verify_section(c, s);
    }
    const Layout L = read_layout(c);
    LCG_CHECK(dst_capacity >= c.header.state_size, LCG_ERR_DST_TOO_SMALL,
              "destination holds %zu bytes, the state needs %llu", dst_capacity,
              (unsigned long long) c.header.state_size);

    const lcg_section * verbatim = nullptr;
    std::vector<const lcg_section *> tensor_sec(L.tensors.size(), nullptr);
    for (const lcg_section & s : c.sections) {
        if (s.type == LCG_SECTION_VERBATIM) {
            LCG_CHECK(verbatim == nullptr, LCG_ERR_CORRUPT, "two verbatim sections");
            verbatim = &s;
        } else if (s.type == LCG_SECTION_TENSOR) {
            LCG_CHECK(s.tensor < L.tensors.size() && tensor_sec[s.tensor] == nullptr, LCG_ERR_CORRUPT,
                      "tensor section names tensor %u of %zu (or twice)", s.tensor, L.tensors.size());
            tensor_sec[s.tensor] = &s;
        }
    }
    LCG_CHECK(verbatim != nullptr, LCG_ERR_CORRUPT, "container has no verbatim section");
    {
        ByteReader r = c.section_reader(*verbatim, "verbatim section");
        for (const Segment & s : L.segments) {
            if (s.tensor < 0) {
                std::memcpy(dst + s.offset, r.take(s.size), s.size);
            }
        }
        LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "%zu stray verbatim bytes", r.remaining());
    }

    struct Work {
        uint32_t tensor, group, u0, gn;
        const uint8_t * bytes;
        size_t size;
    };
    struct TensorSinks {
        std::vector<uint32_t> cells;
        const uint8_t * raw = nullptr;
    };
    std::vector<TensorSinks> sinks(L.tensors.size());
    std::vector<Work> work;
    for (uint32_t ti = 0; ti < L.tensors.size(); ti++) {
        const TensorDesc & t = L.tensors[ti];
        LCG_CHECK(tensor_sec[ti] != nullptr, LCG_ERR_CORRUPT, "tensor %u has no section", ti);
        ByteReader r = c.section_reader(*tensor_sec[ti], "tensor section");
        const uint32_t n_units = r.u32(), group = r.u32(), n_sink = r.u32();
        LCG_CHECK(n_units == t.n_units && group >= 1 && group <= MAX_GROUP, LCG_ERR_CORRUPT,
                  "tensor %u: %u units (layout: %u), group of %u", ti, n_units, t.n_units, group);
        LCG_CHECK(n_sink <= t.n_cells && n_sink <= r.remaining() / 4, LCG_ERR_CORRUPT, "tensor %u: %u sink cells",
                  ti, n_sink);
        TensorSinks & ts = sinks[ti];
        ts.cells.resize(n_sink);
        for (uint32_t k = 0; k < n_sink; k++) {
            ts.cells[k] = r.u32();
            LCG_CHECK(ts.cells[k] < t.n_cells, LCG_ERR_CORRUPT, "tensor %u: sink cell %u of %u", ti, ts.cells[k],
                      t.n_cells);
        }
        ts.raw = r.take(static_cast<size_t>(n_sink) * t.n_units * t.unit_bytes);
        const uint32_t n_groups = r.u32();
        LCG_CHECK(n_groups == (t.n_units + group - 1) / group, LCG_ERR_CORRUPT, "tensor %u: %u groups", ti,
                  n_groups);
        std::vector<uint32_t> group_bytes(n_groups);
        for (uint32_t g = 0; g < n_groups; g++) {
            group_bytes[g] = r.u32();
        }
        for (uint32_t g = 0; g < n_groups; g++) {
            const uint32_t u0 = g * group;
            work.push_back({ti, g, u0, std::min(group, t.n_units - u0), r.take(group_bytes[g]), group_bytes[g]});
        }
        LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "tensor %u: %zu stray bytes", ti, r.remaining());
    }

    parallel_for(work.size(), n_threads, [&](size_t wi) {
        const Work & job = work[wi];
        const TensorDesc & t = L.tensors[job.tensor];
        uint8_t * base = dst + t.offset;
        ByteReader r(job.bytes, job.size, LCG_ERR_CORRUPT, "coded group");
        const uint8_t mode = r.u8();
        if (mode == GROUP_LOSSY) {
            LCG_CHECK(ggml_type_info(t.ggml_type)->is_float, LCG_ERR_CORRUPT, "lossy group in a quantized tensor");
            decode_lossy_group(r, t, job.u0, job.gn, base);
        } else {
            LCG_CHECK(mode == GROUP_LOSSLESS, LCG_ERR_CORRUPT, "group coding mode %u", mode);
            decode_lossless_group(r, t, job.u0, job.gn, base);
        }
        LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "%zu stray bytes after a group", r.remaining());
        const TensorSinks & ts = sinks[job.tensor];
        const Strides st(t);
        for (size_t k = 0; k < ts.cells.size(); k++) {
            for (uint32_t g = 0; g < job.gn; g++) {
                const size_t raw = (k * t.n_units + job.u0 + g) * t.unit_bytes;
                std::memcpy(base + st.at(ts.cells[k], job.u0 + g), ts.raw + raw, t.unit_bytes);
            }
        }
    });
    return c.header.state_size;
}

} // namespace lcg
