#include "codec.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace lcg {

namespace {

constexpr uint32_t TENSOR_DESC_BYTES = 32;
constexpr size_t STATS_ID_BYTES = 32;

// ---- layout ------------------------------------------------------------------------------------

void write_layout(ByteWriter & w, uint32_t n_layers, const std::vector<TensorDesc> & tensors,
                  const std::vector<Segment> & segments, const QuantKnobs & k) {
    w.u32(n_layers);
    w.u32(static_cast<uint32_t>(segments.size()));
    w.u32(static_cast<uint32_t>(tensors.size()));
    w.f32(k.k_step);
    w.f32(k.v_step);
    w.f32(k.first_layer_scale);
    w.i32(k.n_sink_tokens);
    w.i32(k.ref_type);
    w.f32(k.ref_scale);
    for (const TensorDesc & t : tensors) {
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
    for (const Segment & s : segments) {
        w.u8(s.tensor >= 0);
        w.u64(s.size);
        if (s.tensor >= 0) {
            w.u32(static_cast<uint32_t>(s.tensor));
        }
    }
}

const lcg_section & only_section(const ContainerView & c, uint32_t type, const char * what) {
    const lcg_section * found = nullptr;
    for (const lcg_section & s : c.sections) {
        if (s.type == type) {
            LCG_CHECK(found == nullptr, LCG_ERR_CORRUPT, "two %s sections", what);
            found = &s;
        }
    }
    LCG_CHECK(found != nullptr, LCG_ERR_CORRUPT, "container has no %s section", what);
    return *found;
}

// Per tensor, its section of `type` (stats or tensor rows); every tensor has exactly one.
std::vector<const lcg_section *> tensor_sections(const ContainerView & c, uint32_t type, size_t n_tensors) {
    std::vector<const lcg_section *> out(n_tensors, nullptr);
    for (const lcg_section & s : c.sections) {
        if (s.type == type) {
            LCG_CHECK(s.tensor < n_tensors && out[s.tensor] == nullptr, LCG_ERR_CORRUPT,
                      "section names tensor %u of %zu (or twice)", s.tensor, n_tensors);
            out[s.tensor] = &s;
        }
    }
    for (size_t i = 0; i < n_tensors; i++) {
        LCG_CHECK(out[i] != nullptr, LCG_ERR_CORRUPT, "tensor %zu has no section of type %u", i, type);
    }
    return out;
}

std::vector<std::vector<uint8_t>> sink_flags(const ParsedState & st, const EncodeOptions & opt) {
    std::vector<std::vector<uint8_t>> is_sink(st.groups.size());
    for (size_t g = 0; g < st.groups.size(); g++) {
        const std::vector<int32_t> & pos = st.groups[g].pos;
        is_sink[g].resize(pos.size());
        for (size_t i = 0; i < pos.size(); i++) {
            is_sink[g][i] = opt.level != LCG_LEVEL_LOSSLESS && pos[i] < opt.knobs.n_sink_tokens;
        }
    }
    return is_sink;
}

// Error weights name every K/V tensor of the state they are given for.
void check_error_weights(const ParsedState & st, const EncodeOptions & opt) {
    LCG_CHECK(opt.error_weights.empty() || opt.error_weights.size() == st.tensors.size(), LCG_ERR_INVALID_ARGUMENT,
              "%zu error weights for a state of %zu K/V tensors (a profile of another model or state kind?)",
              opt.error_weights.size(), st.tensors.size());
}

void prepare_one(const uint8_t * state, const ParsedState & st, const EncodeOptions & opt,
                 const std::vector<std::vector<uint8_t>> & is_sink, size_t i, TensorEncoder & e) {
    const TensorDesc & t = st.tensors[i];
    QuantKnobs knobs = opt.knobs;  // the tensor's: its budget times its error weight
    if (!opt.error_weights.empty()) {
        knobs.ref_scale *= opt.error_weights[i];
    }
    prepare_tensor(state, t, opt.level == LCG_LEVEL_LOSSLESS ? nullptr : &knobs, opt.rope.pairing ? &opt.rope : nullptr,
                   is_sink[t.cell_group], st.groups[t.cell_group].pos, e);
}

std::vector<TensorEncoder> prepare_tensors(const uint8_t * state, const ParsedState & st, const EncodeOptions & opt,
                                           const std::vector<std::vector<uint8_t>> & is_sink) {
    std::vector<TensorEncoder> enc(st.tensors.size());
    parallel_for(st.tensors.size(), opt.n_threads, [&](size_t i) { prepare_one(state, st, opt, is_sink, i, enc[i]); });
    return enc;
}

// The coded rows of an object's tensors: each tensor coded into its worker's buffer (reused from
// tensor to tensor), then copied into blocks of up to 16 MiB filled in turn (alloc_filled; no
// larger than the object's K/V for small objects). A fresh buffer per tensor was faulted in 4 KiB
// pages on every encode: with the container's own, a third of a lossless encode's time. (One
// block of the K/V's size measured slower: glibc serves 16 MiB blocks again from its heap.)
class CodedRows {
public:
    CodedRows(size_t n_tensors, size_t n_workers, size_t kv_bytes)
        : scratch_(n_workers), rows_(n_tensors), block_(std::min(kv_bytes, BLOCK_BYTES)) {}

    // Worker `worker`'s buffer, emptied, for one tensor.
    ByteWriter & buffer(size_t worker) {
        scratch_[worker].buf.clear();
        return scratch_[worker];
    }
    // Keeps tensor i's rows from worker `worker`'s buffer.
    void keep(size_t i, size_t worker) {
        const std::vector<uint8_t> & bytes = scratch_[worker].buf;
        if (bytes.empty()) {  // nothing to place (and maybe no block yet)
            rows_[i] = {nullptr, 0};
            return;
        }
        uint8_t * at;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (bytes.size() > capacity_ - used_) {
                capacity_ = std::max(bytes.size(), block_);
                blocks_.emplace_back(static_cast<uint8_t *>(alloc_filled(capacity_)), std::free);
                LCG_CHECK(blocks_.back() != nullptr, LCG_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes", capacity_);
                used_ = 0;
            }
            at = blocks_.back().get() + used_;
            used_ += bytes.size();
        }
        std::memcpy(at, bytes.data(), bytes.size());
        rows_[i] = {at, bytes.size()};
    }
    // Tensor sections viewing the rows (valid while this object lives).
    void add_sections(std::vector<SectionPayload> & sections) const {
        for (uint32_t i = 0; i < rows_.size(); i++) {
            sections.push_back({LCG_SECTION_TENSOR, i, {}, rows_[i].first, rows_[i].second});
        }
    }

private:
    static constexpr size_t BLOCK_BYTES = size_t(16) << 20;
    std::vector<ByteWriter> scratch_;
    std::vector<std::pair<const uint8_t *, size_t>> rows_;
    std::mutex mutex_;
    std::vector<std::unique_ptr<uint8_t, void (*)(void *)>> blocks_;
    const size_t block_;
    size_t used_ = 0, capacity_ = 0;
};

QuantKnobs stored_knobs(const EncodeOptions & opt) {
    return opt.level == LCG_LEVEL_LOSSLESS ? level_knobs(LCG_LEVEL_LOSSLESS) : opt.knobs;
}

void add_user_meta(std::vector<SectionPayload> & sections, const uint8_t * meta, size_t size) {
    if (size > 0) {
        LCG_CHECK(size <= LCG_MAX_USER_META, LCG_ERR_LIMIT, "user meta of %zu bytes (at most %zu)", size,
                  static_cast<size_t>(LCG_MAX_USER_META));
        sections.push_back({LCG_SECTION_USER_META, 0, std::vector<uint8_t>(meta, meta + size)});
    }
}

// The layout and verbatim sections: what rebuilds a state around its K/V (whole and skeleton).
std::vector<SectionPayload> state_sections(const uint8_t * state, const ParsedState & st, const QuantKnobs & knobs) {
    ByteWriter layout, verbatim;
    write_layout(layout, st.n_layers, st.tensors, st.segments, knobs);
    for (const Segment & s : st.segments) {
        if (s.tensor < 0) {
            verbatim.put(state + s.offset, s.size);
        }
    }
    std::vector<SectionPayload> sections;
    sections.push_back({LCG_SECTION_LAYOUT, 0, std::move(layout.buf)});
    sections.push_back({LCG_SECTION_VERBATIM, 0, std::move(verbatim.buf)});
    return sections;
}

ContainerHeader state_header(const ParsedState & st, size_t size, int32_t part, int32_t level) {
    ContainerHeader h;
    h.part = part;
    h.level = level;
    h.state_kind = st.kind;
    h.state_size = size;
    h.kv_bytes = st.kv_bytes;
    h.n_tokens = st.n_tokens;
    h.n_cells = st.n_cells;
    h.n_layers = st.n_layers;
    h.n_caches = st.n_caches;
    try {
        h.pos_end = chunkable_positions(st);  // whole and skeleton: the positions of a chunkable state
    } catch (const Error &) {
        h.pos_end = 0;
    }
    return h;
}

void same_geometry(const TensorDesc & a, const TensorDesc & b, size_t i, const char * what) {
    LCG_CHECK(a.ggml_type == b.ggml_type && a.is_v == b.is_v && a.transposed == b.transposed && a.layer == b.layer &&
                  a.n_layer == b.n_layer && a.n_units == b.n_units && a.unit_bytes == b.unit_bytes &&
                  a.cell_group == b.cell_group,
              LCG_ERR_UNSUPPORTED_FORMAT,
              "tensor %zu of the %s (%s layer %u, type %d, %u units%s) does not match the state's (%s layer %u, "
              "type %d, %u units%s)",
              i, what, a.is_v ? "V" : "K", a.layer, a.ggml_type, a.n_units, a.transposed ? ", transposed" : "",
              b.is_v ? "V" : "K", b.layer, b.ggml_type, b.n_units, b.transposed ? ", transposed" : "");
}

// State cells of positions [p0, p1) of each cell group, in position order.
std::vector<std::vector<uint32_t>> rows_of(const std::vector<std::vector<uint32_t>> & cell_of_pos, uint32_t p0,
                                           uint32_t p1) {
    std::vector<std::vector<uint32_t>> rows(cell_of_pos.size());
    for (size_t g = 0; g < cell_of_pos.size(); g++) {
        rows[g].assign(cell_of_pos[g].begin() + p0, cell_of_pos[g].begin() + p1);
    }
    return rows;
}

} // namespace

ContainerView read_part(const uint8_t * data, size_t size, int32_t part, const char * what) {
    ContainerView c = read_container(data, size);
    LCG_CHECK(c.header.part == part, LCG_ERR_INVALID_ARGUMENT, "the object is not %s (part %d)", what,
              c.header.part);
    return c;
}

Layout read_layout(const ContainerView & c) {
    const lcg_section & sec = only_section(c, LCG_SECTION_LAYOUT, "layout");
    verify_section(c, sec);
    ByteReader r = c.section_reader(sec, "layout section");
    Layout L;
    L.n_layers = r.u32();
    const uint32_t n_segments = r.u32();
    const uint32_t n_tensors = r.u32();
    L.knobs.k_step = r.f32();
    L.knobs.v_step = r.f32();
    L.knobs.first_layer_scale = r.f32();
    L.knobs.n_sink_tokens = r.i32();
    L.knobs.ref_type = r.i32();
    L.knobs.ref_scale = r.f32();
    LCG_CHECK(n_tensors <= r.remaining() / TENSOR_DESC_BYTES && n_segments <= r.remaining() / 9, LCG_ERR_CORRUPT,
              "layout declares %u tensors and %u segments in %zu bytes", n_tensors, n_segments, r.remaining());
    const bool whole = c.header.part == LCG_PART_WHOLE || c.header.part == LCG_PART_SKELETON;
    LCG_CHECK(whole || n_segments == 0, LCG_ERR_CORRUPT, "a %s object with segments",
              c.header.part == LCG_PART_STATS ? "statistics" : "chunk");
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
        t.offset = 0;
        const GgmlType * type = ggml_type_info(t.ggml_type);
        LCG_CHECK(type != nullptr && t.unit_bytes == type->type_size, LCG_ERR_CORRUPT,
                  "tensor %u has type %d with %u-byte units", i, t.ggml_type, t.unit_bytes);
        LCG_CHECK(t.n_cells > 0 && t.n_units > 0 && t.layer < t.n_layer, LCG_ERR_CORRUPT,
                  "tensor %u: %u cells, %u units, layer %u of %u", i, t.n_cells, t.n_units, t.layer, t.n_layer);
        LCG_CHECK(!whole || static_cast<uint64_t>(t.n_cells) * t.n_units <= state_size / t.unit_bytes, LCG_ERR_CORRUPT,
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
    if (whole) {
        LCG_CHECK(at == state_size, LCG_ERR_CORRUPT, "segments add up to %llu bytes, header says %llu",
                  (unsigned long long) at, (unsigned long long) state_size);
        LCG_CHECK(std::all_of(used.begin(), used.end(), [](uint8_t u) { return u != 0; }), LCG_ERR_CORRUPT,
                  "a tensor is not placed in the state");
    }
    LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "%zu stray bytes after the layout", r.remaining());
    return L;
}

uint8_t * encode_whole(const uint8_t * state, size_t size, const EncodeOptions & opt, size_t * out_size) {
    LCG_CHECK(size <= LCG_MAX_STATE_SIZE, LCG_ERR_LIMIT, "state of %zu bytes", size);
    const ParsedState st = parse_state(state, size, opt.state_kind);
    check_error_weights(st, opt);
    const auto is_sink = sink_flags(st, opt);
    std::vector<TensorEncoder> enc(st.tensors.size());
    CodedRows rows(st.tensors.size(), parallel_workers(st.tensors.size(), opt.n_threads), st.kv_bytes);
    parallel_for_workers(st.tensors.size(), opt.n_threads, [&](size_t i, size_t worker) {
        const TensorDesc & t = st.tensors[i];
        prepare_one(state, st, opt, is_sink, i, enc[i]);
        std::vector<uint32_t> cells(t.n_cells);
        for (uint32_t c = 0; c < t.n_cells; c++) {
            cells[c] = c;
        }
        encode_rows(state, t, enc[i], cells, is_sink[t.cell_group], opt.slice_elements, rows.buffer(worker));
        rows.keep(i, worker);
        // A tensor's symbols serve only its rows: freed now, the next tensor's reuse the memory
        // (all held at once they were half the state's size, fresh pages on every encode).
        enc[i].sym.reset();
        enc[i].raw.reset();
        enc[i].escapes = {};
    });
    std::vector<SectionPayload> sections = state_sections(state, st, stored_knobs(opt));
    for (uint32_t i = 0; i < st.tensors.size(); i++) {
        ByteWriter w;
        write_stats(w, enc[i].stats, st.tensors[i]);
        sections.push_back({LCG_SECTION_STATS, i, std::move(w.buf)});
    }
    rows.add_sections(sections);
    add_user_meta(sections, opt.user_meta, opt.user_meta_size);
    ContainerHeader h = state_header(st, size, LCG_PART_WHOLE, opt.level);
    return write_container(h, std::move(sections), opt.n_threads, out_size, opt.out_alloc);
}

uint8_t * encode_skeleton(const uint8_t * state, size_t size, int32_t kind, size_t * out_size) {
    LCG_CHECK(size <= LCG_MAX_STATE_SIZE, LCG_ERR_LIMIT, "state of %zu bytes", size);
    const ParsedState st = parse_state(state, size, kind);
    std::vector<SectionPayload> sections = state_sections(state, st, level_knobs(LCG_LEVEL_LOSSLESS));
    ContainerHeader h = state_header(st, size, LCG_PART_SKELETON, LCG_LEVEL_LOSSLESS);
    return write_container(h, std::move(sections), 1, out_size);
}

namespace {

// The layout of a whole container or skeleton, checked against its verbatim section: everything
// the state's size rests on, before anyone allocates it.
Layout state_layout(const ContainerView & c, int32_t part) {
    static const char * const names[] = {"whole container", "skeleton", "statistics", "chunk"};
    LCG_CHECK(c.header.part == part, LCG_ERR_INVALID_ARGUMENT, "a %s object does not decode to a state on its own%s",
              names[c.header.part],
              c.header.part == LCG_PART_SKELETON ? " (it holds no K/V: lcg_skeleton_state builds the state chunks "
                                                   "decode into)"
                                                 : "");
    Layout L = read_layout(c);
    uint64_t verbatim = 0;
    for (const Segment & s : L.segments) {
        verbatim += s.tensor < 0 ? s.size : 0;
    }
    const lcg_section & v = only_section(c, LCG_SECTION_VERBATIM, "verbatim");
    LCG_CHECK(v.size == verbatim, LCG_ERR_CORRUPT, "verbatim section of %llu bytes, the layout needs %llu",
              (unsigned long long) v.size, (unsigned long long) verbatim);
    return L;
}

} // namespace

size_t decoded_size(const uint8_t * data, size_t size, int32_t part) {
    const ContainerView c = read_container(data, size);
    state_layout(c, part);
    return static_cast<size_t>(c.header.state_size);
}

namespace {

// Decoding into host memory.
struct HostSink : DecodeSink {
    uint8_t * state;
    explicit HostSink(uint8_t * state) : state(state) {}
    void copy(uint64_t dst_offset, const uint8_t * src, uint64_t size) override {
        std::memcpy(state + dst_offset, src, size);
    }
    void zero(uint64_t dst_offset, uint64_t size) override { std::memset(state + dst_offset, 0, size); }
    void tensor(size_t, ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, const TensorDesc & dst,
                const std::vector<uint32_t> & row_cell, const std::vector<int32_t> * cell_pos) override {
        decode_rows(r, obj, dec, state, dst, row_cell, cell_pos);
    }
    const uint8_t * host_state() const override { return state; }
};

} // namespace

size_t decode_whole(const uint8_t * data, size_t size, int32_t part, int32_t n_threads, uint8_t * dst,
                    size_t dst_capacity) {
    HostSink sink(dst);
    return decode_whole_to(data, size, part, n_threads, dst_capacity, sink);
}

size_t decode_whole_to(const uint8_t * data, size_t size, int32_t part, int32_t n_threads, size_t dst_capacity,
                       DecodeSink & sink) {
    const ContainerView c = read_container(data, size);
    const Layout L = state_layout(c, part);
    const size_t state_size = static_cast<size_t>(c.header.state_size);
    // Every checksum before anything is written, the sections shared among the threads.
    parallel_for(c.sections.size(), n_threads, [&](size_t i) { verify_section(c, c.sections[i]); });
    LCG_CHECK(dst_capacity >= state_size, LCG_ERR_DST_TOO_SMALL, "destination holds %zu bytes, the state needs %zu",
              dst_capacity, state_size);
    ByteReader verbatim = c.section_reader(only_section(c, LCG_SECTION_VERBATIM, "verbatim"), "verbatim section");
    for (const Segment & s : L.segments) {
        if (s.tensor < 0) {
            sink.copy(s.offset, verbatim.take(s.size), s.size);
        } else if (c.header.part == LCG_PART_SKELETON) {
            sink.zero(s.offset, s.size);
        }
    }
    if (c.header.part == LCG_PART_SKELETON) {
        return state_size;
    }
    const auto stats_sec = tensor_sections(c, LCG_SECTION_STATS, L.tensors.size());
    const auto rows_sec = tensor_sections(c, LCG_SECTION_TENSOR, L.tensors.size());
    // Cell positions (RoPE-coded keys), read from the destination's verbatim bytes when first needed
    // (a mutex, not std::call_once: a parse that throws in several workers at once hangs call_once
    // under ThreadSanitizer, and libstdc++'s throwing call_once has had bugs of its own).
    std::mutex parse_mutex;
    bool have_parsed = false;
    ParsedState parsed;
    parallel_for(L.tensors.size(), n_threads, [&](size_t i) {
        const TensorDesc & t = L.tensors[i];
        ByteReader sr = c.section_reader(*stats_sec[i], "statistics section");
        const TensorDecoder dec = prepare_decoder(read_stats(sr, t));
        LCG_CHECK(sr.remaining() == 0, LCG_ERR_CORRUPT, "tensor %zu: %zu stray statistics bytes", i, sr.remaining());
        std::vector<uint32_t> cells(t.n_cells);
        for (uint32_t k = 0; k < t.n_cells; k++) {
            cells[k] = k;
        }
        const std::vector<int32_t> * cell_pos = nullptr;
        if (dec.stats.rope.pairing && sink.host_state()) {
            {
                std::lock_guard<std::mutex> lock(parse_mutex);
                if (!have_parsed) {
                    parsed = parse_state(sink.host_state(), state_size, c.header.state_kind);
                    have_parsed = true;
                }
            }
            cell_pos = &parsed.groups.at(t.cell_group).pos;
            // the verbatim bytes are the container's to say: a cell count other than the layout's
            // read positions past the parsed ones (heap bytes leaked into the rotation)
            LCG_CHECK(cell_pos->size() == t.n_cells, LCG_ERR_CORRUPT,
                      "tensor %zu: %zu cell positions in the state, %u cells in the layout", i, cell_pos->size(),
                      t.n_cells);
        }
        ByteReader r = c.section_reader(*rows_sec[i], "tensor section");
        sink.tensor(i, r, t, dec, t, cells, cell_pos);
        LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "tensor %zu: %zu stray bytes", i, r.remaining());
    });
    return state_size;
}

namespace {

// A skeleton is written from a chunkable state holding positions 0..pos_end-1: one whose cells say
// otherwise was forged or damaged past its checksums (chunks decoded into it would be mapped by
// those positions).
ParsedState parse_skeleton_state(const uint8_t * state, size_t size, const ContainerView & c) {
    ParsedState st;
    uint32_t n = 0;
    try {
        st = parse_state(state, size, c.header.state_kind);
        n = chunkable_positions(st);
    } catch (const Error & e) {
        fail(LCG_ERR_CORRUPT, "a skeleton whose state cannot be cut into chunks: %s", e.what());
    }
    LCG_CHECK(n == c.header.pos_end, LCG_ERR_CORRUPT, "a skeleton of %u positions whose state holds %u",
              c.header.pos_end, n);
    return st;
}

} // namespace

size_t skeleton_state(const uint8_t * data, size_t size, uint32_t n_pos, uint8_t * dst, size_t dst_capacity) {
    const ContainerView c = read_part(data, size, LCG_PART_SKELETON, "a skeleton");
    if (n_pos == c.header.pos_end && n_pos > 0) {  // all its positions: the skeleton decodes in place
        if (dst == nullptr) {
            return decoded_size(data, size, LCG_PART_SKELETON);
        }
        const size_t n = decode_whole(data, size, LCG_PART_SKELETON, 1, dst, dst_capacity);
        parse_skeleton_state(dst, n, c);
        return n;
    }
    std::vector<uint8_t> full(decoded_size(data, size, LCG_PART_SKELETON));
    decode_whole(data, size, LCG_PART_SKELETON, 1, full.data(), full.size());
    const ParsedState st = parse_skeleton_state(full.data(), full.size(), c);
    const std::vector<uint8_t> prefix = prefix_state(full.data(), full.size(), st, n_pos, false);
    if (dst != nullptr) {
        LCG_CHECK(dst_capacity >= prefix.size(), LCG_ERR_DST_TOO_SMALL, "destination holds %zu bytes, the state needs %zu",
                  dst_capacity, prefix.size());
        std::memcpy(dst, prefix.data(), prefix.size());
    }
    return prefix.size();
}

std::unique_ptr<Chunker> chunker_init(const uint8_t * state, size_t size, const EncodeOptions & opt) {
    LCG_CHECK(size <= LCG_MAX_STATE_SIZE, LCG_ERR_LIMIT, "state of %zu bytes", size);
    auto ch = std::make_unique<Chunker>();
    ch->state = state;
    ch->size = size;
    ch->opt = opt;
    ch->st = parse_state(state, size, opt.state_kind);
    check_error_weights(ch->st, opt);
    ch->cell_of_pos = cell_of_position(ch->st);  // refuses a state that is not chunkable
    ch->n_pos = static_cast<uint32_t>(ch->cell_of_pos[0].size());
    ch->is_sink = sink_flags(ch->st, opt);
    if (opt.level != LCG_LEVEL_LOSSLESS && opt.knobs.anchor_tokens) {  // anchors are cells i % N == 0
        for (const std::vector<uint32_t> & cells : ch->cell_of_pos) {
            for (uint32_t p = 0; p < cells.size(); p++) {
                LCG_CHECK(cells[p] == p, LCG_ERR_UNSUPPORTED_FORMAT,
                          "anchor/delta chunks need each position in the cell of its index (position %u is in cell "
                          "%u): encode this state whole, or without the transform", p, cells[p]);
            }
        }
    }
    ch->tensors = prepare_tensors(state, ch->st, opt, ch->is_sink);
    return ch;
}

uint8_t * chunker_stats(const Chunker & ch, size_t * out_size) {
    std::vector<SectionPayload> sections;
    ByteWriter layout;
    write_layout(layout, ch.st.n_layers, ch.st.tensors, {}, stored_knobs(ch.opt));
    sections.push_back({LCG_SECTION_LAYOUT, 0, std::move(layout.buf)});
    for (uint32_t i = 0; i < ch.st.tensors.size(); i++) {
        ByteWriter w;
        write_stats(w, ch.tensors[i].stats, ch.st.tensors[i]);
        sections.push_back({LCG_SECTION_STATS, i, std::move(w.buf)});
    }
    ContainerHeader h = state_header(ch.st, 0, LCG_PART_STATS, ch.opt.level);
    h.state_size = 0;
    h.pos_end = ch.n_pos;
    return write_container(h, std::move(sections), ch.opt.n_threads, out_size);
}

uint8_t * chunker_encode(const Chunker & ch, uint32_t pos_begin, uint32_t pos_end, const uint8_t * stats_id,
                         const uint8_t * user_meta, size_t user_meta_size, size_t * out_size) {
    LCG_CHECK(pos_begin < pos_end && pos_end <= ch.n_pos, LCG_ERR_INVALID_ARGUMENT,
              "chunk of positions %u..%u of a %u-position state", pos_begin, pos_end, ch.n_pos);
    const uint32_t every = ch.opt.level != LCG_LEVEL_LOSSLESS ? ch.opt.knobs.anchor_tokens : 0;
    LCG_CHECK(every == 0 || pos_begin % every == 0, LCG_ERR_INVALID_ARGUMENT,
              "chunk of positions %u..%u: with anchor/delta every %u tokens, chunks start at a multiple of %u",
              pos_begin, pos_end, every, every);
    const auto rows = rows_of(ch.cell_of_pos, pos_begin, pos_end);
    std::vector<TensorDesc> tensors = ch.st.tensors;
    uint64_t kv_bytes = 0;
    for (TensorDesc & t : tensors) {
        t.n_cells = pos_end - pos_begin;
        kv_bytes += t.bytes();
    }
    CodedRows coded(tensors.size(), parallel_workers(tensors.size(), ch.opt.n_threads), kv_bytes);
    parallel_for_workers(tensors.size(), ch.opt.n_threads, [&](size_t i, size_t worker) {
        const TensorDesc & t = ch.st.tensors[i];
        encode_rows(ch.state, t, ch.tensors[i], rows[t.cell_group], ch.is_sink[t.cell_group], ch.opt.slice_elements,
                    coded.buffer(worker));
        coded.keep(i, worker);
    });
    std::vector<SectionPayload> sections;
    ByteWriter layout;
    write_layout(layout, ch.st.n_layers, tensors, {}, stored_knobs(ch.opt));
    sections.push_back({LCG_SECTION_LAYOUT, 0, std::move(layout.buf)});
    sections.push_back({LCG_SECTION_STATS_REF, 0, std::vector<uint8_t>(stats_id, stats_id + STATS_ID_BYTES)});
    coded.add_sections(sections);
    add_user_meta(sections, user_meta, user_meta_size);
    ContainerHeader h = state_header(ch.st, 0, LCG_PART_CHUNK, ch.opt.level);
    h.state_size = 0;
    h.kv_bytes = kv_bytes;
    h.n_cells = static_cast<uint32_t>((pos_end - pos_begin) * ch.st.groups.size());
    h.pos_begin = pos_begin;
    h.pos_end = pos_end;
    return write_container(h, std::move(sections), ch.opt.n_threads, out_size);
}

std::unique_ptr<Stats> open_stats(const uint8_t * data, size_t size, const uint8_t * id, int32_t n_threads) {
    const ContainerView c = read_part(data, size, LCG_PART_STATS, "a statistics object");
    for (const lcg_section & s : c.sections) {
        verify_section(c, s);
    }
    auto st = std::make_unique<Stats>();
    st->level = c.header.level;
    st->layout = read_layout(c);
    std::memcpy(st->id, id, STATS_ID_BYTES);
    const auto sections = tensor_sections(c, LCG_SECTION_STATS, st->layout.tensors.size());
    st->tensors.resize(st->layout.tensors.size());
    parallel_for(st->tensors.size(), n_threads, [&](size_t i) {
        ByteReader r = c.section_reader(*sections[i], "statistics section");
        st->tensors[i] = prepare_decoder(read_stats(r, st->layout.tensors[i]));
        LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "tensor %zu: %zu stray statistics bytes", i, r.remaining());
    });
    return st;
}

namespace {

// A chunk checked against its statistics and a state's layout, ready to decode tensor by tensor.
struct ChunkPlan {
    ContainerView c;
    Layout L;
    std::vector<const lcg_section *> rows_sec;   // per tensor (pointers into c.sections)
    std::vector<std::vector<uint32_t>> rows;     // per cell group: object row -> state cell
};

// Fills `p` (in place: rows_sec points into p.c) for a chunk into the state parsed as `st`.
void plan_chunk(const uint8_t * chunk, size_t chunk_size, const Stats & stats, const ParsedState & st,
                const std::vector<std::vector<uint32_t>> & cell_of_pos, ChunkPlan & p) {
    p.c = read_part(chunk, chunk_size, LCG_PART_CHUNK, "a chunk");
    const ContainerView & c = p.c;
    for (const lcg_section & s : c.sections) {
        verify_section(c, s);
    }
    p.L = read_layout(c);
    const Layout & L = p.L;
    const Layout & SL = stats.layout;
    const lcg_section & ref = only_section(c, LCG_SECTION_STATS_REF, "statistics reference");
    LCG_CHECK(ref.size == STATS_ID_BYTES && std::memcmp(chunk + ref.offset, stats.id, STATS_ID_BYTES) == 0,
              LCG_ERR_CORRUPT, "the chunk was coded with other statistics than the ones given");
    LCG_CHECK(c.header.level == stats.level, LCG_ERR_CORRUPT, "chunk of level %d with statistics of level %d",
              c.header.level, stats.level);
    const uint32_t n_pos = static_cast<uint32_t>(cell_of_pos[0].size());  // (st checked chunkable there)
    const uint32_t p0 = c.header.pos_begin, p1 = c.header.pos_end;
    LCG_CHECK(p0 < p1 && p1 <= n_pos, LCG_ERR_INVALID_ARGUMENT,
              "chunk of positions %u..%u does not fit a state of %u positions", p0, p1, n_pos);
    LCG_CHECK(L.tensors.size() == st.tensors.size() && SL.tensors.size() == st.tensors.size(),
              LCG_ERR_UNSUPPORTED_FORMAT, "chunk of %zu tensors (statistics: %zu) for a state of %zu",
              L.tensors.size(), SL.tensors.size(), st.tensors.size());
    for (size_t i = 0; i < st.tensors.size(); i++) {
        same_geometry(L.tensors[i], st.tensors[i], i, "chunk");
        same_geometry(SL.tensors[i], st.tensors[i], i, "statistics");
        LCG_CHECK(L.tensors[i].n_cells == p1 - p0, LCG_ERR_CORRUPT,
                  "tensor %zu of the chunk holds %u cells for %u positions", i, L.tensors[i].n_cells, p1 - p0);
    }
    p.rows = rows_of(cell_of_pos, p0, p1);
    p.rows_sec = tensor_sections(c, LCG_SECTION_TENSOR, L.tensors.size());
}

void decode_chunk_tensor(const ChunkPlan & p, size_t i, const Stats & stats, const ParsedState & st,
                         DecodeSink & sink) {
    ByteReader r = p.c.section_reader(*p.rows_sec[i], "tensor section");
    const uint32_t g = st.tensors[i].cell_group;
    sink.tensor(i, r, p.L.tensors[i], stats.tensors[i], st.tensors[i], p.rows[g], &st.groups[g].pos);
    LCG_CHECK(r.remaining() == 0, LCG_ERR_CORRUPT, "tensor %zu: %zu stray bytes", i, r.remaining());
}

} // namespace

void decode_chunk(const uint8_t * chunk, size_t chunk_size, const Stats & stats, int32_t n_threads, uint8_t * state,
                  size_t state_size) {
    decode_chunks(&chunk, &chunk_size, 1, stats, n_threads, state, state_size);
}

void decode_chunks(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks, const Stats & stats,
                   int32_t n_threads, uint8_t * state, size_t state_size) {
    HostSink sink(state);
    decode_chunks_to(chunks, chunk_sizes, n_chunks, stats, n_threads, state, state_size, sink);
}

void decode_chunks_to(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                      const Stats & stats, int32_t n_threads, const uint8_t * state, size_t state_size,
                      DecodeSink & sink) {
    // Any kind of state with the same memory layout: a chunk saved from llama-cpp-python loads into
    // a llama-server slot file.
    const ParsedState st = parse_state(state, state_size, LCG_KIND_AUTO);
    const auto cell_of_pos = cell_of_position(st);
    std::vector<ChunkPlan> plans(n_chunks);  // every chunk checked before any is written
    for (size_t k = 0; k < n_chunks; k++) {
        LCG_CHECK(chunks[k] != nullptr, LCG_ERR_INVALID_ARGUMENT, "chunk %zu is NULL", k);
        plan_chunk(chunks[k], chunk_sizes[k], stats, st, cell_of_pos, plans[k]);
    }
    // Tensor by tensor across the chunks: a tensor's decode tables (384 KB for a SmolLM2 layer's K
    // at 2,048 tokens, MBs for a 7B model's) are read into cache once for all the chunks, not once
    // per chunk, as they are when chunks are decoded one by one.
    parallel_for(st.tensors.size(), n_threads, [&](size_t i) {
        for (const ChunkPlan & p : plans) {
            decode_chunk_tensor(p, i, stats, st, sink);
        }
    });
}

void splice(uint8_t * state, size_t state_size, const uint8_t * src, size_t src_size, uint32_t pos_begin,
            uint32_t pos_end) {
    const ParsedState dst_st = parse_state(state, state_size, LCG_KIND_AUTO);
    const ParsedState src_st = parse_state(src, src_size, LCG_KIND_AUTO);
    const auto dst_cells = cell_of_position(dst_st);  // refuses a state that is not chunkable
    const uint32_t n_dst = static_cast<uint32_t>(dst_cells[0].size());
    LCG_CHECK(pos_begin < pos_end && pos_end <= n_dst, LCG_ERR_INVALID_ARGUMENT,
              "positions %u..%u: the state holds %u", pos_begin, pos_end, n_dst);
    LCG_CHECK(dst_st.tensors.size() == src_st.tensors.size(), LCG_ERR_UNSUPPORTED_FORMAT,
              "source of %zu tensors for a state of %zu", src_st.tensors.size(), dst_st.tensors.size());
    const auto dst_rows = rows_of(dst_cells, pos_begin, pos_end);
    // the source holds the range, not necessarily the positions before it: llama.cpp's
    // sliding-window cache reuses cells of positions out of its window
    const auto src_rows = cells_of_range(src_st, pos_begin, pos_end);
    for (size_t i = 0; i < dst_st.tensors.size(); i++) {
        const TensorDesc & d = dst_st.tensors[i], & s = src_st.tensors[i];
        same_geometry(s, d, i, "source");
        const size_t unit = d.unit_bytes, row = static_cast<size_t>(d.n_units) * unit;
        for (uint32_t k = 0; k < pos_end - pos_begin; k++) {
            const uint32_t dc = dst_rows[d.cell_group][k], sc = src_rows[s.cell_group][k];
            if (d.transposed) {
                for (uint32_t u = 0; u < d.n_units; u++) {
                    std::memcpy(state + d.offset + (static_cast<size_t>(u) * d.n_cells + dc) * unit,
                                src + s.offset + (static_cast<size_t>(u) * s.n_cells + sc) * unit, unit);
                }
            } else {
                std::memcpy(state + d.offset + dc * row, src + s.offset + sc * row, row);
            }
        }
    }
}

} // namespace lcg
