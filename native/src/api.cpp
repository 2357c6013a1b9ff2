// api.cpp -- the C entry points: argument checks, and every C++ exception turned into a status.
#include "codec.h"
#include "device.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <new>

using namespace lcg;

namespace {

thread_local std::string last_error;

int set_error(int status, const char * msg) {
    last_error = msg;
    return status;
}

template <typename F> int guarded(F && fn) {
    last_error.clear();
    try {
        fn();
        return LCG_OK;
    } catch (const Error & e) {
        return set_error(e.status, e.what());
    } catch (const std::bad_alloc &) {
        return set_error(LCG_ERR_OUT_OF_MEMORY, "out of memory");
    } catch (const std::exception & e) {
        return set_error(LCG_ERR_INTERNAL, e.what());
    } catch (...) {
        return set_error(LCG_ERR_INTERNAL, "unknown exception");
    }
}

bool knob_ok(float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; }

lcg_encode_params default_params() {
    lcg_encode_params p;
    std::memset(&p, 0, sizeof(p));
    p.struct_size = sizeof(p);
    p.level = LCG_LEVEL_BALANCED;
    p.state_kind = LCG_KIND_AUTO;
    p.n_threads = 0;
    p.error_scale = -1.0f;
    p.k_step = -1.0f;
    p.v_step = -1.0f;
    p.first_layer_scale = -1.0f;
    p.n_sink_tokens = -1;
    return p;
}

// The size of each struct at 0.5, the first version whose callers pass theirs: the least a caller
// may pass (the fields after these, added later, take defaults or go unreported for such callers).
constexpr size_t PARAMS_SIZE_0_5 = offsetof(lcg_encode_params, reserved1) + sizeof(uint32_t);
constexpr size_t INFO_SIZE_0_5 = offsetof(lcg_info, reserved) + sizeof(lcg_info::reserved);
// Past any struct's plausible growth: a size left unset, which would read or write far past the
// caller's memory.
constexpr size_t MAX_STRUCT_SIZE = 4096;

void check_struct_size(const char * name, size_t size, size_t least) {
    LCG_CHECK(size != 0, LCG_ERR_INVALID_ARGUMENT, "the size of %s is 0: pass sizeof(%s)", name, name);
    LCG_CHECK(size >= least, LCG_ERR_INVALID_ARGUMENT,
              "the size of %s is %zu, less than 0.5's %zu: a caller's header older than 0.5", name, size, least);
    LCG_CHECK(size <= MAX_STRUCT_SIZE, LCG_ERR_INVALID_ARGUMENT,
              "the size of %s is %zu: more than %zu, not a size of this struct", name, size, MAX_STRUCT_SIZE);
}

// Writes `out` into the caller's struct of `size` bytes (checked): its fields this library does not
// know are written 0, and this library's fields past its size are not written.
template <typename T> void put_struct(T * dst, size_t size, const T & out) {
    std::memcpy(dst, &out, std::min(size, sizeof(out)));
    if (size > sizeof(out)) {
        std::memset(reinterpret_cast<uint8_t *>(dst) + sizeof(out), 0, size - sizeof(out));
    }
}

// Checked encode options from the caller's parameters (NULL: the defaults).
EncodeOptions options(const lcg_encode_params * params) {
    // struct_size first: a caller's struct smaller than ours would be read past its end, and a
    // larger one's fields past ours would be ignored, when they may ask for something
    lcg_encode_params p = default_params();
    if (params) {
        const size_t size = params->struct_size;
        check_struct_size("lcg_encode_params", size, PARAMS_SIZE_0_5);
        const uint8_t * caller = reinterpret_cast<const uint8_t *>(params);
        for (size_t i = sizeof(p); i < size; i++) {
            LCG_CHECK(caller[i] == 0, LCG_ERR_INVALID_ARGUMENT,
                      "lcg_encode_params byte %zu (of %zu) is set: a field this library (%d.%d) does not know", i,
                      size, LCG_VERSION_MAJOR, LCG_VERSION_MINOR);
        }
        std::memcpy(&p, params, std::min(size, sizeof(p)));  // fields past the caller's: defaults
    }
    LCG_CHECK(p.reserved0 == 0 && p.reserved1 == 0, LCG_ERR_INVALID_ARGUMENT,
              "lcg_encode_params.reserved0/1 must be 0 (start from lcg_encode_params_init)");
    LCG_CHECK(p.level >= LCG_LEVEL_LOSSLESS && p.level <= LCG_LEVEL_COMPACT, LCG_ERR_INVALID_ARGUMENT,
              "unknown level %d", p.level);
    LCG_CHECK(p.state_kind >= LCG_KIND_AUTO && p.state_kind <= LCG_KIND_SESSION, LCG_ERR_INVALID_ARGUMENT,
              "unknown state kind %d", p.state_kind);
    LCG_CHECK(p.user_meta != nullptr || p.user_meta_size == 0, LCG_ERR_INVALID_ARGUMENT,
              "user_meta is NULL with a size of %zu", p.user_meta_size);
    EncodeOptions opt;
    opt.level = p.level;
    opt.state_kind = p.state_kind;
    opt.n_threads = p.n_threads;
    opt.knobs = level_knobs(p.level);
    // Negative takes the preset; anything else (NaN included) is the caller's and gets checked.
    // A step given by the caller switches the level to fixed steps.
    if (!(p.k_step < 0.0f) || !(p.v_step < 0.0f)) {
        const QuantKnobs fixed = fixed_level_knobs(p.level);
        opt.knobs.k_step = fixed.k_step;
        opt.knobs.v_step = fixed.v_step;
        opt.knobs.ref_type = -1;
        opt.knobs.ref_scale = 0.0f;
    }
    if (!(p.k_step < 0.0f)) opt.knobs.k_step = p.k_step;
    if (!(p.v_step < 0.0f)) opt.knobs.v_step = p.v_step;
    if (!(p.error_scale < 0.0f) && opt.knobs.ref_type >= 0) opt.knobs.ref_scale = p.error_scale;
    if (!(p.first_layer_scale < 0.0f)) opt.knobs.first_layer_scale = p.first_layer_scale;
    if (p.n_sink_tokens >= 0) opt.knobs.n_sink_tokens = p.n_sink_tokens;
    if (p.level != LCG_LEVEL_LOSSLESS) {
        LCG_CHECK(knob_ok(opt.knobs.k_step, 1e-4f, 64.0f) && knob_ok(opt.knobs.v_step, 1e-4f, 64.0f),
                  LCG_ERR_INVALID_ARGUMENT, "k_step %g / v_step %g: expected 0.0001..64 standard deviations",
                  opt.knobs.k_step, opt.knobs.v_step);
        LCG_CHECK(knob_ok(opt.knobs.first_layer_scale, 0.01f, 100.0f), LCG_ERR_INVALID_ARGUMENT,
                  "first_layer_scale %g: expected 0.01..100", opt.knobs.first_layer_scale);
        LCG_CHECK(opt.knobs.ref_type < 0 || knob_ok(opt.knobs.ref_scale, 1e-6f, 1e6f), LCG_ERR_INVALID_ARGUMENT,
                  "error_scale %g: expected 1e-6..1e6", opt.knobs.ref_scale);
    }
    LCG_CHECK(p.error_weights != nullptr || p.n_error_weights == 0, LCG_ERR_INVALID_ARGUMENT,
              "error_weights is NULL with a count of %u", p.n_error_weights);
    for (uint32_t i = 0; i < p.n_error_weights; i++) {
        LCG_CHECK(knob_ok(p.error_weights[i], 1.0f / 256, 256.0f), LCG_ERR_INVALID_ARGUMENT,
                  "error_weights[%u] %g: expected 1/256..256", i, p.error_weights[i]);
    }
    if (p.n_error_weights) {
        opt.error_weights.assign(p.error_weights, p.error_weights + p.n_error_weights);
    }
    LCG_CHECK(p.transform == LCG_TRANSFORM_NONE || p.transform == LCG_TRANSFORM_ANCHOR_DELTA,
              LCG_ERR_INVALID_ARGUMENT, "unknown transform %d", p.transform);
    LCG_CHECK(p.anchor_tokens == 0 || (p.anchor_tokens >= 2 && p.anchor_tokens <= 255), LCG_ERR_INVALID_ARGUMENT,
              "anchor_tokens %u: expected 2..255", p.anchor_tokens);
    LCG_CHECK(p.anchor_tokens == 0 || p.transform == LCG_TRANSFORM_ANCHOR_DELTA, LCG_ERR_INVALID_ARGUMENT,
              "anchor_tokens %u without the anchor/delta transform", p.anchor_tokens);
    if (p.transform == LCG_TRANSFORM_ANCHOR_DELTA) {
        opt.knobs.anchor_tokens = p.anchor_tokens ? p.anchor_tokens : 10;
    }
    if (p.rope_pairing != LCG_ROPE_NONE && p.level != LCG_LEVEL_LOSSLESS) {
        LCG_CHECK(p.transform == LCG_TRANSFORM_NONE, LCG_ERR_INVALID_ARGUMENT, "RoPE with the anchor/delta transform");
        opt.rope.pairing = static_cast<uint8_t>(p.rope_pairing);
        opt.rope.head_dim = p.rope_head_dim;
        opt.rope.n_dims = p.rope_n_dims;
        opt.rope.bases[0] = p.rope_bases[0];
        opt.rope.bases[1] = p.rope_bases[1];
        opt.rope.scale = p.rope_freq_scale == 0.0f ? 1.0f : p.rope_freq_scale;
        const Rope first{opt.rope.pairing, opt.rope.head_dim, opt.rope.n_dims, p.rope_bases[0], opt.rope.scale};
        LCG_CHECK(rope_fits(first, first.head_dim) && (p.rope_bases[1] == 0.0f || (std::isfinite(p.rope_bases[1]) &&
                                                                                 p.rope_bases[1] > 1.0f)),
                  LCG_ERR_INVALID_ARGUMENT,
                  "RoPE pairing %d, head of %u, %u rotated, bases %g / %g, scale %g: expected pairing 1 or 2, an "
                  "even n_dims <= head_dim, bases > 1 (the second may be 0), scale > 0",
                  p.rope_pairing, p.rope_head_dim, p.rope_n_dims, p.rope_bases[0], p.rope_bases[1],
                  p.rope_freq_scale);
    }
    opt.slice_elements = p.slice_elements ? p.slice_elements : rans::DEFAULT_SLICE;
    LCG_CHECK(opt.slice_elements % rans::LANES == 0 && opt.slice_elements <= rans::MAX_SLICE, LCG_ERR_INVALID_ARGUMENT,
              "slice_elements %u: expected a multiple of %u up to %u", opt.slice_elements, rans::LANES, rans::MAX_SLICE);
    opt.user_meta = static_cast<const uint8_t *>(p.user_meta);
    opt.user_meta_size = p.user_meta_size;
    opt.out_alloc = {p.out_alloc, p.out_alloc_ctx};
    return opt;
}

} // namespace

extern "C" {

uint32_t lcg_version_number(void) { return LCG_VERSION_NUMBER; }

uint32_t lcg_format_version(void) { return LCG_FORMAT_VERSION; }

const char * lcg_status_name(int status) {
    switch (status) {
        case LCG_OK: return "LCG_OK";
        case LCG_ERR_INVALID_ARGUMENT: return "LCG_ERR_INVALID_ARGUMENT";
        case LCG_ERR_UNSUPPORTED_FORMAT: return "LCG_ERR_UNSUPPORTED_FORMAT";
        case LCG_ERR_NOT_A_CONTAINER: return "LCG_ERR_NOT_A_CONTAINER";
        case LCG_ERR_UNSUPPORTED_VERSION: return "LCG_ERR_UNSUPPORTED_VERSION";
        case LCG_ERR_TRUNCATED: return "LCG_ERR_TRUNCATED";
        case LCG_ERR_CHECKSUM: return "LCG_ERR_CHECKSUM";
        case LCG_ERR_CORRUPT: return "LCG_ERR_CORRUPT";
        case LCG_ERR_LIMIT: return "LCG_ERR_LIMIT";
        case LCG_ERR_DST_TOO_SMALL: return "LCG_ERR_DST_TOO_SMALL";
        case LCG_ERR_OUT_OF_MEMORY: return "LCG_ERR_OUT_OF_MEMORY";
        case LCG_ERR_INTERNAL: return "LCG_ERR_INTERNAL";
        case LCG_ERR_NO_DEVICE: return "LCG_ERR_NO_DEVICE";
        default: return "LCG_ERR_UNKNOWN";
    }
}

const char * lcg_last_error(void) { return last_error.c_str(); }

int lcg_encode_params_init(lcg_encode_params * params, size_t struct_size) {
    return guarded([&] {
        LCG_CHECK(params != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        check_struct_size("lcg_encode_params", struct_size, PARAMS_SIZE_0_5);
        lcg_encode_params p = default_params();
        p.struct_size = static_cast<uint32_t>(struct_size);
        put_struct(params, struct_size, p);
    });
}

int lcg_encode(const void * state, size_t state_size, const lcg_encode_params * params, void ** out,
               size_t * out_size) {
    return guarded([&] {
        LCG_CHECK(state != nullptr && out != nullptr && out_size != nullptr, LCG_ERR_INVALID_ARGUMENT,
                  "state, out and out_size must not be NULL");
        *out = encode_whole(static_cast<const uint8_t *>(state), state_size, options(params), out_size);
    });
}

int lcg_decoded_size(const void * container, size_t container_size, size_t * state_size) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && state_size != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        *state_size = decoded_size(static_cast<const uint8_t *>(container), container_size, LCG_PART_WHOLE);
    });
}

int lcg_decode(const void * container, size_t container_size, int32_t n_threads, void * dst, size_t dst_capacity,
               size_t * written) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && (dst != nullptr || dst_capacity == 0), LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument");
        const size_t n = decode_whole(static_cast<const uint8_t *>(container), container_size, LCG_PART_WHOLE,
                                      n_threads, static_cast<uint8_t *>(dst), dst_capacity);
        if (written) {
            *written = n;
        }
    });
}

int lcg_inspect(const void * container, size_t container_size, lcg_info * info, size_t info_size) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && info != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        check_struct_size("lcg_info", info_size, INFO_SIZE_0_5);
        const ContainerView c = read_container(static_cast<const uint8_t *>(container), container_size);
        const Layout L = read_layout(c);
        lcg_info out{};
        out.format_version = c.header.format_version;
        out.part = c.header.part;
        out.level = c.header.level;
        out.state_kind = c.header.state_kind;
        out.n_sections = c.header.n_sections;
        out.n_tensors = static_cast<uint32_t>(L.tensors.size());
        out.n_cells = c.header.n_cells;
        out.n_layers = c.header.n_layers;
        out.n_caches = c.header.n_caches;
        out.n_tokens = c.header.n_tokens;
        out.state_size = c.header.state_size;
        out.container_size = container_size;
        out.kv_bytes = c.header.kv_bytes;
        out.k_step = L.knobs.k_step;
        out.v_step = L.knobs.v_step;
        out.first_layer_scale = L.knobs.first_layer_scale;
        out.n_sink_tokens = L.knobs.n_sink_tokens;
        out.ref_type = L.knobs.ref_type;
        out.error_scale = L.knobs.ref_scale;
        out.pos_begin = c.header.pos_begin;
        out.pos_end = c.header.pos_end;
        out.chunkable = (c.header.part == LCG_PART_WHOLE || c.header.part == LCG_PART_SKELETON) && c.header.pos_end > 0;
        for (const lcg_section & s : c.sections) {
            if (s.type == LCG_SECTION_STATS_REF && s.size == sizeof(out.stats_id)) {
                verify_section(c, s);
                std::memcpy(out.stats_id, c.data + s.offset, sizeof(out.stats_id));
            }
        }
        put_struct(info, info_size, out);
    });
}

int lcg_inspect_sections(const void * container, size_t container_size, lcg_section * sections, uint32_t capacity,
                         uint32_t * n_sections) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && n_sections != nullptr && (sections != nullptr || capacity == 0),
                  LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        const ContainerView c = read_container(static_cast<const uint8_t *>(container), container_size);
        *n_sections = static_cast<uint32_t>(c.sections.size());
        for (uint32_t i = 0; i < capacity && i < c.sections.size(); i++) {
            sections[i] = c.sections[i];
        }
    });
}

int lcg_user_meta(const void * container, size_t container_size, const void ** meta, size_t * meta_size) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && meta != nullptr && meta_size != nullptr, LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument");
        const ContainerView c = read_container(static_cast<const uint8_t *>(container), container_size);
        *meta = nullptr;
        *meta_size = 0;
        for (const lcg_section & s : c.sections) {
            if (s.type == LCG_SECTION_USER_META) {
                verify_section(c, s);
                *meta = c.data + s.offset;
                *meta_size = s.size;
            }
        }
    });
}

int lcg_inspect_state(const void * state, size_t state_size, int32_t state_kind, lcg_info * info,
                      size_t info_size) {
    return guarded([&] {
        LCG_CHECK(state != nullptr && info != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        LCG_CHECK(state_kind >= LCG_KIND_AUTO && state_kind <= LCG_KIND_SESSION, LCG_ERR_INVALID_ARGUMENT,
                  "unknown state kind %d", state_kind);
        check_struct_size("lcg_info", info_size, INFO_SIZE_0_5);
        const ParsedState st = parse_state(static_cast<const uint8_t *>(state), state_size, state_kind);
        lcg_info out{};
        out.state_kind = st.kind;
        out.n_tensors = static_cast<uint32_t>(st.tensors.size());
        out.n_cells = st.n_cells;
        out.n_layers = st.n_layers;
        out.n_caches = st.n_caches;
        out.n_tokens = st.n_tokens;
        out.state_size = state_size;
        out.kv_bytes = st.kv_bytes;
        out.has_tail = st.tail_offset < state_size;
        out.k_type = out.v_type = -1;
        for (const TensorDesc & t : st.tensors) {
            int32_t & type = t.is_v ? out.v_type : out.k_type;
            type = type < 0 ? t.ggml_type : type;
        }
        try {
            out.pos_end = chunkable_positions(st);
            out.chunkable = 1;
        } catch (const Error &) {
            out.chunkable = 0;
        }
        put_struct(info, info_size, out);
    });
}

int lcg_encode_skeleton(const void * state, size_t state_size, int32_t state_kind, void ** out, size_t * out_size) {
    return guarded([&] {
        LCG_CHECK(state != nullptr && out != nullptr && out_size != nullptr, LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument");
        LCG_CHECK(state_kind >= LCG_KIND_AUTO && state_kind <= LCG_KIND_SESSION, LCG_ERR_INVALID_ARGUMENT,
                  "unknown state kind %d", state_kind);
        *out = encode_skeleton(static_cast<const uint8_t *>(state), state_size, state_kind, out_size);
    });
}

int lcg_skeleton_state(const void * skeleton, size_t skeleton_size, uint32_t n_pos, void * dst, size_t dst_capacity,
                       size_t * written) {
    return guarded([&] {
        LCG_CHECK(skeleton != nullptr && (written != nullptr || dst != nullptr), LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument (written answers the size query of a NULL dst)");
        const size_t n = skeleton_state(static_cast<const uint8_t *>(skeleton), skeleton_size, n_pos,
                                        static_cast<uint8_t *>(dst), dst_capacity);
        if (written != nullptr) {
            *written = n;
        }
    });
}

struct lcg_chunker {
    std::unique_ptr<Chunker> impl;
};

int lcg_chunker_init(const void * state, size_t state_size, const lcg_encode_params * params, lcg_chunker ** out) {
    return guarded([&] {
        LCG_CHECK(state != nullptr && out != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        auto ch = std::make_unique<lcg_chunker>();
        ch->impl = chunker_init(static_cast<const uint8_t *>(state), state_size, options(params));
        *out = ch.release();
    });
}

int lcg_chunker_stats(lcg_chunker * chunker, void ** out, size_t * out_size) {
    return guarded([&] {
        LCG_CHECK(chunker != nullptr && out != nullptr && out_size != nullptr, LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument");
        *out = chunker_stats(*chunker->impl, out_size);
    });
}

int lcg_chunker_encode(lcg_chunker * chunker, uint32_t pos_begin, uint32_t pos_end, const uint8_t * stats_id,
                       const void * user_meta, size_t user_meta_size, void ** out, size_t * out_size) {
    return guarded([&] {
        LCG_CHECK(chunker != nullptr && stats_id != nullptr && out != nullptr && out_size != nullptr &&
                      (user_meta != nullptr || user_meta_size == 0),
                  LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        *out = chunker_encode(*chunker->impl, pos_begin, pos_end, stats_id, static_cast<const uint8_t *>(user_meta),
                              user_meta_size, out_size);
    });
}

void lcg_chunker_free(lcg_chunker * chunker) { delete chunker; }

struct lcg_stats {
    std::unique_ptr<Stats> impl;
    DeviceStats device;  // tables copied to each device on first use
};

int lcg_stats_open(const void * stats, size_t stats_size, const uint8_t * stats_id, int32_t n_threads,
                   lcg_stats ** out) {
    return guarded([&] {
        LCG_CHECK(stats != nullptr && stats_id != nullptr && out != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        auto handle = std::make_unique<lcg_stats>();
        handle->impl = open_stats(static_cast<const uint8_t *>(stats), stats_size, stats_id, n_threads);
        *out = handle.release();
    });
}

void lcg_stats_free(lcg_stats * stats) { delete stats; }

int lcg_decode_chunk(const void * chunk, size_t chunk_size, const lcg_stats * stats, int32_t n_threads, void * state,
                     size_t state_size) {
    return guarded([&] {
        LCG_CHECK(chunk != nullptr && stats != nullptr && state != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        decode_chunk(static_cast<const uint8_t *>(chunk), chunk_size, *stats->impl, n_threads,
                     static_cast<uint8_t *>(state), state_size);
    });
}

int lcg_decode_chunks(const void * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                      const lcg_stats * stats, int32_t n_threads, void * state, size_t state_size) {
    return guarded([&] {
        LCG_CHECK((chunks != nullptr && chunk_sizes != nullptr) || n_chunks == 0, LCG_ERR_INVALID_ARGUMENT,
                  "NULL chunk list");
        LCG_CHECK(stats != nullptr && state != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        decode_chunks(reinterpret_cast<const uint8_t * const *>(chunks), chunk_sizes, n_chunks, *stats->impl,
                      n_threads, static_cast<uint8_t *>(state), state_size);
    });
}

int lcg_splice(void * state, size_t state_size, const void * src, size_t src_size, uint32_t pos_begin,
               uint32_t pos_end) {
    return guarded([&] {
        LCG_CHECK(state != nullptr && src != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        splice(static_cast<uint8_t *>(state), state_size, static_cast<const uint8_t *>(src), src_size, pos_begin,
               pos_end);
    });
}

void lcg_free(void * ptr) { std::free(ptr); }

int lcg_cuda_available(void) {
    try {
        return cuda_device_count();
    } catch (...) {
        return 0;
    }
}

int lcg_decode_device(const void * container, size_t container_size, void * device_dst, size_t dst_capacity,
                      void * cuda_stream) {
    return guarded([&] {
        LCG_CHECK(container != nullptr && (device_dst != nullptr || dst_capacity == 0), LCG_ERR_INVALID_ARGUMENT,
                  "NULL argument");
        decode_whole_device(static_cast<const uint8_t *>(container), container_size, static_cast<uint8_t *>(device_dst),
                            dst_capacity, cuda_stream);
    });
}

int lcg_decode_chunk_device(const void * chunk, size_t chunk_size, const lcg_stats * stats, const void * state,
                            size_t state_size, void * device_state, void * cuda_stream) {
    return guarded([&] {
        LCG_CHECK(chunk != nullptr && stats != nullptr && state != nullptr && device_state != nullptr,
                  LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        const uint8_t * const one = static_cast<const uint8_t *>(chunk);
        decode_chunks_device(&one, &chunk_size, 1, *stats->impl, const_cast<lcg_stats *>(stats)->device,
                             static_cast<const uint8_t *>(state), state_size, static_cast<uint8_t *>(device_state),
                             cuda_stream);
    });
}

int lcg_decode_chunks_device(const void * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                             const lcg_stats * stats, const void * state, size_t state_size, void * device_state,
                             void * cuda_stream) {
    return guarded([&] {
        LCG_CHECK(chunks != nullptr && chunk_sizes != nullptr && stats != nullptr && state != nullptr &&
                      device_state != nullptr,
                  LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        decode_chunks_device(reinterpret_cast<const uint8_t * const *>(chunks), chunk_sizes, n_chunks, *stats->impl,
                             const_cast<lcg_stats *>(stats)->device, static_cast<const uint8_t *>(state), state_size,
                             static_cast<uint8_t *>(device_state), cuda_stream);
    });
}

int lcg_device_alloc(size_t size, void ** device_ptr) {
    return guarded([&] {
        LCG_CHECK(device_ptr != nullptr, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        *device_ptr = device_alloc(size);
    });
}

void lcg_device_free(void * device_ptr) { device_free(device_ptr); }

void lcg_device_last_timing(double * upload_s, double * kernels_s) {
    const DeviceTiming t = device_last_timing();
    if (upload_s) {
        *upload_s = t.upload_s;
    }
    if (kernels_s) {
        *kernels_s = t.kernels_s;
    }
}

int lcg_device_copy(void * dst, const void * src, size_t size, void * cuda_stream) {
    return guarded([&] {
        LCG_CHECK((dst != nullptr && src != nullptr) || size == 0, LCG_ERR_INVALID_ARGUMENT, "NULL argument");
        if (size > 0) {
            device_copy(dst, src, size, cuda_stream);
        }
    });
}

} // extern "C"
