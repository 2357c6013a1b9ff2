#include "state_format.h"

#include <algorithm>

namespace lcg {

namespace {

constexpr uint32_t IO_MAGIC = 0xaf143cd8u;       // llama_state_seq_get_data
constexpr uint32_t GGSQ_MAGIC = 0x67677371u;     // 'ggsq' sequence state file
constexpr uint32_t GGSQ_VERSION = 3;
constexpr uint32_t GGSN_MAGIC = 0x6767736eu;     // 'ggsn' session file
constexpr uint32_t GGSN_VERSION = 10;
constexpr uint32_t MAX_STREAMS = 256;            // llama.cpp's LLAMA_MAX_SEQ
constexpr uint32_t MAX_SEQ_ID = 256;
constexpr uint32_t MAX_LAYERS = 4096;
constexpr uint32_t MAX_ARCH_NAME = 256;
constexpr uint32_t CELL_EXT_BYTES = 12;          // llama_kv_cell_ext: x, y, tok (M-RoPE / PLE models)
constexpr uint64_t MAX_ROW_BYTES = 1ull << 28;

const GgmlType GGML_TYPES[] = {
    {0, "f32", 1, 4, true},     {1, "f16", 1, 2, true},     {30, "bf16", 1, 2, true},
    {2, "q4_0", 32, 18, false}, {3, "q4_1", 32, 20, false}, {6, "q5_0", 32, 22, false},
    {7, "q5_1", 32, 24, false}, {8, "q8_0", 32, 34, false}, {20, "iq4_nl", 32, 18, false},
};

// Tensors and cell positions of one KV cache, collected before being committed: a failed attempt
// (another cell-ext width, or bytes that are not a KV cache) leaves the ParsedState untouched.
struct CacheParse {
    std::vector<TensorDesc> tensors;
    std::vector<CellGroup> groups;
    uint32_t n_cells = 0;
    uint32_t n_layers = 0;
};

const GgmlType & kv_type(int32_t id, const char * what, uint32_t layer) {
    const GgmlType * t = ggml_type_info(id);
    LCG_CHECK(t != nullptr, LCG_ERR_UNSUPPORTED_FORMAT,
              "%s of layer %u has ggml type %d, which is not a KV cache type this library reads "
              "(f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl)", what, layer, id);
    return *t;
}

// A K layer, or a V layer with v_trans = 0: type, row size, one row per cell.
TensorDesc parse_rows(ByteReader & r, bool is_v, uint32_t layer, uint32_t n_layer, uint32_t n_cells) {
    const char * what = is_v ? "V" : "K";
    const GgmlType & t = kv_type(r.i32(), what, layer);
    const uint64_t row_bytes = r.u64();
    LCG_CHECK(row_bytes > 0 && row_bytes <= MAX_ROW_BYTES && row_bytes % t.type_size == 0,
              LCG_ERR_UNSUPPORTED_FORMAT, "%s row size %llu of layer %u is not a multiple of the %s block (%u bytes)",
              what, (unsigned long long) row_bytes, layer, t.name, t.type_size);
    TensorDesc d{};
    d.ggml_type = t.id;
    d.is_v = is_v;
    d.transposed = false;
    d.layer = layer;
    d.n_layer = n_layer;
    d.n_cells = n_cells;
    d.n_units = static_cast<uint32_t>(row_bytes / t.type_size);
    d.unit_bytes = t.type_size;
    d.offset = r.pos();
    r.take(d.bytes());
    return d;
}

// A V layer with v_trans = 1: type, element size, n_embd_v_gqa runs of n_cells elements.
TensorDesc parse_transposed(ByteReader & r, uint32_t layer, uint32_t n_layer, uint32_t n_cells) {
    const GgmlType & t = kv_type(r.i32(), "V", layer);
    const uint32_t elem_bytes = r.u32();
    const uint32_t n_embd = r.u32();
    LCG_CHECK(elem_bytes == t.type_size, LCG_ERR_UNSUPPORTED_FORMAT,
              "transposed V of layer %u declares %u-byte elements for type %s (%u bytes)", layer, elem_bytes,
              t.name, t.type_size);
    LCG_CHECK(n_embd > 0 && static_cast<uint64_t>(n_embd) * elem_bytes <= MAX_ROW_BYTES, LCG_ERR_UNSUPPORTED_FORMAT,
              "transposed V of layer %u has %u channels", layer, n_embd);
    TensorDesc d{};
    d.ggml_type = t.id;
    d.is_v = true;
    d.transposed = true;
    d.layer = layer;
    d.n_layer = n_layer;
    d.n_cells = n_cells;
    d.n_units = n_embd;
    d.unit_bytes = elem_bytes;
    d.offset = r.pos();
    r.take(d.bytes());
    return d;
}

// One llama_kv_cache::state_write section (docs/llama-state.md).
void parse_kv_cache(ByteReader & r, uint32_t ext_bytes, CacheParse & out) {
    const uint32_t n_stream = r.u32();
    LCG_CHECK(n_stream >= 1 && n_stream <= MAX_STREAMS, LCG_ERR_UNSUPPORTED_FORMAT,
              "KV cache declares %u streams (1..%u expected)", n_stream, MAX_STREAMS);
    for (uint32_t s = 0; s < n_stream; s++) {
        CellGroup group;
        group.stream = s;
        group.count_offset = r.pos();
        const uint32_t n_cells = r.u32();
        if (n_cells == 0) {
            continue;
        }
        LCG_CHECK(n_cells <= r.remaining() / 8, LCG_ERR_UNSUPPORTED_FORMAT,
                  "stream %u declares %u cells but only %zu bytes follow", s, n_cells, r.remaining());
        group.pos.resize(n_cells);
        group.meta_offset.resize(n_cells + 1);
        for (uint32_t i = 0; i < n_cells; i++) {
            group.meta_offset[i] = r.pos();
            group.pos[i] = r.i32();
            const uint32_t n_seq = r.u32();
            LCG_CHECK(n_seq <= MAX_SEQ_ID, LCG_ERR_UNSUPPORTED_FORMAT, "cell %u lists %u sequences", i, n_seq);
            r.take(ext_bytes);
            for (uint32_t k = 0; k < n_seq; k++) {
                const int32_t seq = r.i32();
                LCG_CHECK(seq >= 0 && static_cast<uint32_t>(seq) < MAX_SEQ_ID, LCG_ERR_UNSUPPORTED_FORMAT,
                          "cell %u has sequence id %d", i, seq);
                if (i == 0 && n_seq == 1) {
                    group.only_seq = seq;
                } else if (n_seq != 1 || seq != group.only_seq) {
                    group.only_seq = CellGroup::SEQ_MIXED;
                }
            }
            if (n_seq == 0 && group.only_seq != CellGroup::SEQ_NONE) {  // a cell of no sequence among others
                group.only_seq = CellGroup::SEQ_MIXED;
            }
        }
        group.meta_offset[n_cells] = r.pos();
        const uint32_t v_trans = r.u32();
        const uint32_t n_layer = r.u32();
        LCG_CHECK(v_trans <= 1, LCG_ERR_UNSUPPORTED_FORMAT, "v_trans is %u (0 or 1 expected)", v_trans);
        LCG_CHECK(n_layer >= 1 && n_layer <= MAX_LAYERS, LCG_ERR_UNSUPPORTED_FORMAT, "KV cache declares %u layers",
                  n_layer);
        const uint32_t cell_group = static_cast<uint32_t>(out.groups.size());
        out.groups.push_back(std::move(group));
        out.n_cells += n_cells;
        if (out.n_layers == 0) {
            out.n_layers = n_layer;
        }
        for (uint32_t l = 0; l < n_layer; l++) {
            out.tensors.push_back(parse_rows(r, false, l, n_layer, n_cells));
            out.tensors.back().cell_group = cell_group;
        }
        // Layers without V (e.g. MLA) write nothing: accept all n_layer V tensors or none.
        const size_t v_start = r.pos();
        const size_t n_k = out.tensors.size();
        try {
            for (uint32_t l = 0; l < n_layer; l++) {
                out.tensors.push_back(v_trans ? parse_transposed(r, l, n_layer, n_cells)
                                              : parse_rows(r, true, l, n_layer, n_cells));
                out.tensors.back().cell_group = cell_group;
            }
        } catch (const Error &) {
            if (out.tensors.size() > n_k) {
                throw;  // some V layers parsed: the layout is broken, not V-less
            }
            r.seek(v_start);
        }
    }
}

std::string printable(const uint8_t * p, size_t n) {
    std::string s;
    for (size_t i = 0; i < n && i < 32; i++) {
        s += (p[i] >= 0x20 && p[i] < 0x7f) ? static_cast<char>(p[i]) : '?';
    }
    return s;
}

void parse_arch(ByteReader & r) {
    const uint32_t len = r.u32();
    LCG_CHECK(len >= 1 && len <= MAX_ARCH_NAME, LCG_ERR_UNSUPPORTED_FORMAT,
              "architecture name length %u at offset %zu (1..%u expected)", len, r.pos() - 4, MAX_ARCH_NAME);
    const uint8_t * name = r.take(len);
    for (uint32_t i = 0; i < len; i++) {
        LCG_CHECK(name[i] >= 0x20 && name[i] < 0x7f, LCG_ERR_UNSUPPORTED_FORMAT,
                  "architecture name '%s' is not printable ASCII", printable(name, len).c_str());
    }
}

// 'ggsq' / 'ggsn' files: magic, version, prompt tokens.
void parse_file_header(ByteReader & r, uint32_t magic, uint32_t version, ParsedState & st) {
    const char * name = state_kind_name(st.kind);
    const uint32_t found_magic = r.u32(), found_version = r.u32();
    LCG_CHECK(found_magic == magic, LCG_ERR_UNSUPPORTED_FORMAT, "%s magic 0x%08x, expected 0x%08x", name,
              found_magic, magic);
    LCG_CHECK(found_version == version, LCG_ERR_UNSUPPORTED_FORMAT, "%s version %u; this library reads version %u",
              name, found_version, version);
    st.tokens_offset = r.pos();
    st.n_tokens = r.u32();
    LCG_CHECK(st.n_tokens <= r.remaining() / 4, LCG_ERR_UNSUPPORTED_FORMAT,
              "file declares %u prompt tokens but only %zu bytes follow", st.n_tokens, r.remaining());
    r.take(static_cast<size_t>(st.n_tokens) * 4);
}

int32_t detect_kind(const uint8_t * data, size_t size) {
    LCG_CHECK(size >= 8, LCG_ERR_UNSUPPORTED_FORMAT, "a llama.cpp state is at least 8 bytes, got %zu", size);
    uint32_t magic;
    std::memcpy(&magic, data, 4);
    switch (magic) {
        case IO_MAGIC: return LCG_KIND_SEQ_BUFFER;
        case GGSQ_MAGIC: return LCG_KIND_SEQ_FILE;
        case GGSN_MAGIC: return LCG_KIND_SESSION;
        default: break;
    }
    if (magic >= 1 && magic <= MAX_ARCH_NAME && size >= 4 + magic) {
        return LCG_KIND_FULL_BUFFER;
    }
    fail(LCG_ERR_UNSUPPORTED_FORMAT,
         "first word 0x%08x matches no llama.cpp state kind (sequence buffer magic 0xaf143cd8, "
         "'ggsq' sequence file, 'ggsn' session file, or an architecture name)", magic);
}

} // namespace

const GgmlType * ggml_type_info(int32_t id) {
    for (const GgmlType & t : GGML_TYPES) {
        if (t.id == id) {
            return &t;
        }
    }
    return nullptr;
}

const char * state_kind_name(int32_t kind) {
    switch (kind) {
        case LCG_KIND_SEQ_BUFFER: return "sequence state buffer";
        case LCG_KIND_FULL_BUFFER: return "full state buffer";
        case LCG_KIND_SEQ_FILE: return "sequence state file";
        case LCG_KIND_SESSION: return "session file";
        default: return "unknown";
    }
}

ParsedState parse_state(const uint8_t * data, size_t size, int32_t kind) {
    ParsedState st;
    st.kind = kind == LCG_KIND_AUTO ? detect_kind(data, size) : kind;
    ByteReader r(data, size, LCG_ERR_UNSUPPORTED_FORMAT, state_kind_name(st.kind));

    switch (st.kind) {
        case LCG_KIND_SEQ_BUFFER: {
            const uint32_t magic = r.u32();
            LCG_CHECK(magic == IO_MAGIC, LCG_ERR_UNSUPPORTED_FORMAT,
                      "sequence state buffer starts with 0x%08x, expected 0x%08x", magic, IO_MAGIC);
            r.i32();  // seq id it was saved from
            break;
        }
        case LCG_KIND_FULL_BUFFER:
            parse_arch(r);
            break;
        case LCG_KIND_SEQ_FILE:
            parse_file_header(r, GGSQ_MAGIC, GGSQ_VERSION, st);
            break;
        case LCG_KIND_SESSION:
            parse_file_header(r, GGSN_MAGIC, GGSN_VERSION, st);
            parse_arch(r);
            break;
        default:
            fail(LCG_ERR_INVALID_ARGUMENT, "unknown state kind %d", kind);
    }

    // MEMORY: one or more KV caches (two for interleaved SWA); what follows them (the recurrent
    // part of a hybrid model) is carried verbatim.
    std::string first_error;
    while (r.remaining() > 0) {
        const size_t start = r.pos();
        CacheParse cache;
        bool ok = false;
        for (uint32_t ext : {0u, CELL_EXT_BYTES}) {
            try {
                cache = CacheParse{};
                r.seek(start);
                parse_kv_cache(r, ext, cache);
                ok = true;
                break;
            } catch (const Error & e) {
                if (first_error.empty()) {
                    first_error = e.what();
                }
            }
        }
        if (!ok) {
            r.seek(start);
            break;
        }
        const uint32_t group_base = static_cast<uint32_t>(st.groups.size());
        for (TensorDesc & t : cache.tensors) {
            t.cell_group += group_base;
            st.kv_bytes += t.bytes();
            st.tensors.push_back(t);
        }
        for (CellGroup & g : cache.groups) {
            st.groups.push_back(std::move(g));
        }
        st.n_cells += cache.n_cells;
        if (st.n_caches++ == 0) {
            st.n_layers = cache.n_layers;
        }
    }
    st.tail_offset = r.pos();
    LCG_CHECK(st.n_caches > 0 || r.remaining() == 0, LCG_ERR_UNSUPPORTED_FORMAT,
              "%s: the %zu bytes at offset %zu are not a KV cache this library reads (%s): a buffer cut "
              "short, or the state of a model that holds none (a recurrent model, such as Mamba or RWKV)",
              state_kind_name(st.kind), r.remaining(), r.pos(), first_error.c_str());

    uint64_t at = 0;
    for (size_t i = 0; i < st.tensors.size(); i++) {
        const TensorDesc & t = st.tensors[i];
        if (t.offset > at) {
            st.segments.push_back({at, t.offset - at, -1});
        }
        st.segments.push_back({t.offset, t.bytes(), static_cast<int32_t>(i)});
        at = t.offset + t.bytes();
    }
    if (at < size) {
        st.segments.push_back({at, size - at, -1});
    }
    return st;
}

namespace {

// Every cell of one stream, and of one and the same sequence, in each cache.
void check_one_sequence(const ParsedState & st) {
    LCG_CHECK(!st.groups.empty(), LCG_ERR_UNSUPPORTED_FORMAT, "the state holds no KV cells");
    for (const CellGroup & cg : st.groups) {
        // the chunks are keyed by one sequence's tokens: another stream's cells are another text
        LCG_CHECK(cg.stream == st.groups[0].stream, LCG_ERR_UNSUPPORTED_FORMAT,
                  "streams %u and %u both hold cells (several sequences of a context with kv_unified off): "
                  "the state cannot be cut into token chunks", st.groups[0].stream, cg.stream);
        // a cell of another sequence (or shared with one) at a position of the keyed sequence's
        // would be stored as K/V of that sequence's token there (a hole seq_rm left, filled by
        // another sequence's cell, passed the positions check)
        LCG_CHECK(cg.only_seq != CellGroup::SEQ_MIXED && cg.only_seq == st.groups[0].only_seq,
                  LCG_ERR_UNSUPPORTED_FORMAT,
                  "the cells belong to several sequences, or are shared between them: the state cannot be cut "
                  "into one sequence's token chunks");
    }
}

} // namespace

uint32_t chunkable_positions(const ParsedState & st) {
    check_one_sequence(st);
    const uint32_t n = static_cast<uint32_t>(st.groups[0].pos.size());
    for (const CellGroup & cg : st.groups) {
        LCG_CHECK(cg.pos.size() == n, LCG_ERR_UNSUPPORTED_FORMAT,
                  "streams hold %u and %zu cells (several sequences, or a sliding-window cache that keeps only "
                  "recent positions): the state cannot be cut into token chunks", n, cg.pos.size());
        std::vector<uint8_t> seen(n, 0);
        for (int32_t p : cg.pos) {
            LCG_CHECK(p >= 0 && static_cast<uint32_t>(p) < n && !seen[p], LCG_ERR_UNSUPPORTED_FORMAT,
                      "a stream's %u cells do not hold positions 0..%u once each (found position %d): "
                      "the state cannot be cut into token chunks", n, n - 1, p);
            seen[p] = 1;
        }
    }
    return n;
}

std::vector<std::vector<uint32_t>> cell_of_position(const ParsedState & st) {
    chunkable_positions(st);  // every position 0..n-1 once: the map below is written within its n cells
    std::vector<std::vector<uint32_t>> out(st.groups.size());
    for (size_t g = 0; g < st.groups.size(); g++) {
        const std::vector<int32_t> & pos = st.groups[g].pos;
        out[g].resize(pos.size());
        for (uint32_t i = 0; i < pos.size(); i++) {
            out[g][static_cast<uint32_t>(pos[i])] = i;
        }
    }
    return out;
}

std::vector<std::vector<uint32_t>> cells_of_range(const ParsedState & st, uint32_t pos_begin, uint32_t pos_end) {
    check_one_sequence(st);
    const uint32_t none = UINT32_MAX;
    std::vector<std::vector<uint32_t>> out(st.groups.size());
    for (size_t g = 0; g < st.groups.size(); g++) {
        const std::vector<int32_t> & pos = st.groups[g].pos;
        out[g].assign(pos_end - pos_begin, none);
        for (uint32_t i = 0; i < pos.size(); i++) {
            if (pos[i] < 0 || static_cast<uint32_t>(pos[i]) < pos_begin || static_cast<uint32_t>(pos[i]) >= pos_end) {
                continue;
            }
            uint32_t & cell = out[g][static_cast<uint32_t>(pos[i]) - pos_begin];
            LCG_CHECK(cell == none, LCG_ERR_UNSUPPORTED_FORMAT, "a stream holds position %d twice", pos[i]);
            cell = i;
        }
        for (uint32_t k = 0; k < pos_end - pos_begin; k++) {
            LCG_CHECK(out[g][k] != none, LCG_ERR_UNSUPPORTED_FORMAT,
                      "a stream of %zu cells lacks position %u of positions %u..%u", pos.size(), pos_begin + k,
                      pos_begin, pos_end - 1);
        }
    }
    return out;
}

std::vector<uint8_t> prefix_state(const uint8_t * data, size_t size, const ParsedState & st, uint32_t n_pos,
                                  bool copy_kv) {
    const uint32_t n = chunkable_positions(st);
    LCG_CHECK(n_pos >= 1 && n_pos <= n, LCG_ERR_INVALID_ARGUMENT, "prefix of %u positions of a %u-position state",
              n_pos, n);
    LCG_CHECK(n_pos == n || st.tail_offset == size, LCG_ERR_UNSUPPORTED_FORMAT,
              "the state carries %zu bytes after its KV caches (a recurrent part): only its full length loads",
              size - static_cast<size_t>(st.tail_offset));
    std::vector<uint8_t> out;
    out.reserve(size);
    uint64_t at = 0;
    auto copy_to = [&](uint64_t end) {
        out.insert(out.end(), data + at, data + end);
        at = end;
    };
    auto put_u32 = [&](uint32_t v) {
        uint8_t b[4];
        std::memcpy(b, &v, 4);
        out.insert(out.end(), b, b + 4);
    };
    if (st.kind == LCG_KIND_SEQ_FILE || st.kind == LCG_KIND_SESSION) {
        LCG_CHECK(st.n_tokens >= n_pos, LCG_ERR_UNSUPPORTED_FORMAT, "file holds %u prompt tokens for %u positions",
                  st.n_tokens, n_pos);
        copy_to(st.tokens_offset);
        put_u32(n_pos);
        out.insert(out.end(), data + st.tokens_offset + 4, data + st.tokens_offset + 4 + 4ull * n_pos);
        at = st.tokens_offset + 4 + 4ull * st.n_tokens;
    }
    size_t ti = 0;
    for (uint32_t g = 0; g < st.groups.size(); g++) {
        const CellGroup & cg = st.groups[g];
        std::vector<uint32_t> keep;
        for (uint32_t i = 0; i < cg.pos.size(); i++) {
            if (static_cast<uint32_t>(cg.pos[i]) < n_pos) {
                keep.push_back(i);
            }
        }
        copy_to(cg.count_offset);
        put_u32(static_cast<uint32_t>(keep.size()));
        for (uint32_t i : keep) {
            out.insert(out.end(), data + cg.meta_offset[i], data + cg.meta_offset[i + 1]);
        }
        at = cg.meta_offset.back();
        for (; ti < st.tensors.size() && st.tensors[ti].cell_group == g; ti++) {
            const TensorDesc & t = st.tensors[ti];
            copy_to(t.offset);  // the layer's type and size fields
            const size_t unit = t.unit_bytes, row = static_cast<size_t>(t.n_units) * unit;
            const size_t start = out.size();
            out.resize(start + keep.size() * row, 0);
            if (copy_kv) {
                uint8_t * dst = out.data() + start;
                for (size_t k = 0; k < keep.size(); k++) {
                    if (t.transposed) {
                        for (uint32_t u = 0; u < t.n_units; u++) {
                            std::memcpy(dst + (u * keep.size() + k) * unit,
                                        data + t.offset + (static_cast<size_t>(u) * t.n_cells + keep[k]) * unit, unit);
                        }
                    } else {
                        std::memcpy(dst + k * row, data + t.offset + keep[k] * row, row);
                    }
                }
            }
            at = t.offset + t.bytes();
        }
    }
    copy_to(size);
    return out;
}

} // namespace lcg
