// kernels.h -- the decode kernels' per-lane work, written once for the GPU (decode.cu) and for the
// CPU emulator of the backend (emulator.cpp) that the tests run on machines without a GPU.
//
// A warp walks a slice of a stream in steps of 32 elements. Between the warp votes (ballots) each
// lane runs plain functions of its own state: lane_decode (the lanes.h step on a compact table),
// then after the vote on `need` lane_refill (with the word lane_word_index names) and lane_store,
// then after the vote on escapes lane_record_escape, then lane_next. decode.cu calls them from one thread per lane with
// __ballot_sync between; the emulator calls them for lanes 0..31 in turn and computes each vote as
// a mask. Only the two loop skeletons (a dozen lines each) differ.
#pragma once

#include "../lanes.h"
#include "plan.h"

namespace lcg::cuda {

#if defined(__CUDA_ARCH__)
#define LCG_LDG(p) __ldg(p)
LCG_HD inline uint32_t popc32(uint32_t m) { return __popc(m); }
#else
#define LCG_LDG(p) (*(p))
inline uint32_t popc32(uint32_t m) { return static_cast<uint32_t>(__builtin_popcount(m)); }
#endif

// Device pointers of one decode.
struct Args {
    const uint8_t * container;
    const uint8_t * arena;
    const uint8_t * stats;  // the stats space
    const TensorJob * tensors;
    const SliceJob * slices;
    const BlockJob * blocks;
    const PlaneJob * planes;
    const CopyJob * copies;
    uint8_t * dst;
    uint32_t * status;      // per slice
    uint64_t * escape_at;   // element index of each escape
    const float * escape_q;
};

LCG_HD inline uint32_t load_u32(const uint8_t * p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// The slot entry of `slot` (lanes::slot_entry), as the CPU's 4096-entry table holds it.
LCG_HD inline uint32_t lookup(const Table & t, uint32_t slot) {
    uint32_t s = t.bucket[slot >> BUCKET_SHIFT];
    while (t.cum[s + 1] <= slot) {  // cum[256] = 4096 ends it
        s++;
    }
    return lanes::slot_entry(s, uint32_t(t.cum[s + 1]) - t.cum[s], slot - t.cum[s]);
}

LCG_HD inline void store_bytes(uint8_t * p, uint32_t v, uint32_t n) {
    for (uint32_t b = 0; b < n; b++) {
        p[b] = uint8_t(v >> (8 * b));
    }
}

LCG_HD inline void store_value(uint8_t * p, const TensorJob & t, float v) {
    if (t.ggml_type == lanes::GGML_F32) {
        const uint32_t u = lanes::f32_bits(v);
#if defined(__CUDA_ARCH__)
        if (t.aligned) {
            *reinterpret_cast<uint32_t *>(p) = u;
            return;
        }
#endif
        store_bytes(p, u, 4);
        return;
    }
    const uint16_t h = lanes::f32_to_half_type(v, int32_t(t.ggml_type));
#if defined(__CUDA_ARCH__)
    if (t.aligned) {
        *reinterpret_cast<uint16_t *>(p) = h;
        return;
    }
#endif
    store_bytes(p, h, 2);
}

// Row and unit of element (line o, i) of the object (TensorJob.grouped).
LCG_HD inline uint64_t row_of(const TensorJob & t, uint64_t o, uint64_t i) {
    return t.grouped ? i >> t.group_shift : t.transposed ? i : o;
}
LCG_HD inline uint64_t unit_of(const TensorJob & t, uint64_t o, uint64_t i) {
    return t.grouped ? o << t.group_shift | (i & ((1u << t.group_shift) - 1)) : t.transposed ? o : i;
}

// Element (line o, i) of the object in the destination.
LCG_HD inline uint8_t * element(const Args & a, const TensorJob & t, uint64_t o, uint64_t i) {
    const uint64_t row = row_of(t, o, i), unit = unit_of(t, o, i);
    const uint64_t cell = t.rows == ~0ull ? row : LCG_LDG(reinterpret_cast<const uint32_t *>(a.arena + t.rows) + row);
    return a.dst + t.dst + cell * t.cell_stride + unit * t.unit_stride;
}

LCG_HD inline float reconstruct(const Args & a, const TensorJob & t, uint64_t unit, float q) {
    const uint64_t g = unit >> t.group_shift;
    const float * mean = reinterpret_cast<const float *>(a.stats + t.mean);
    const float * step = reinterpret_cast<const float *>(a.stats + t.step);
    const float * shrink = reinterpret_cast<const float *>(a.stats + t.shrink);
    return lanes::dequant(LCG_LDG(mean + unit), LCG_LDG(step + g), LCG_LDG(shrink + g), q);
}

// ---- one slice ----------------------------------------------------------------------------------

struct Walk {
    SliceJob sj;
    TensorJob t;
    const Table * tables;  // the stream's
    const uint8_t * words;
    uint64_t n_words, step_o, step_i;
};

struct Lane {
    uint32_t x;
    uint64_t o, i;  // of the lane's element in this step
    uint64_t k;
    uint32_t sym;
    bool active, need;
};

LCG_HD inline Walk walk_open(const Args & a, uint32_t slice, const Table * tables) {
    Walk w;
    w.sj = a.slices[slice];
    w.t = a.tensors[w.sj.tensor];
    w.tables = tables;
    w.words = a.container + w.sj.src + 4 * lanes::LANES;
    w.n_words = (w.sj.bytes - 4 * lanes::LANES) / 2;
    w.step_o = lanes::LANES / w.t.n_inner;
    w.step_i = lanes::LANES % w.t.n_inner;
    return w;
}

LCG_HD inline void lane_open(const Args & a, const Walk & w, uint32_t lane, Lane & l) {
    l.x = load_u32(a.container + w.sj.src + 4 * lane);  // the host checked every initial state
    l.k = w.sj.k0 + lane;
    l.o = l.k / w.t.n_inner;
    l.i = l.k % w.t.n_inner;
}

// Decodes the lane's element of this step (if any): the state update, before renormalisation.
LCG_HD inline void lane_decode(const Walk & w, Lane & l) {
    l.active = l.k < w.sj.k1;
    l.need = false;
    l.sym = 0;
    if (l.active) {
        const uint64_t unit = unit_of(w.t, l.o, l.i);
        const uint32_t e = lookup(w.tables[unit >> w.t.group_shift], l.x & (lanes::PROB_SCALE - 1));
        l.x = lanes::advance(l.x, e);
        l.need = lanes::needs_word(l.x);
        l.sym = lanes::entry_symbol(e);
    }
}

// After the vote on `need` (mask) with the warp's cursor at word `pos`: the lane's word is the
// popc(mask & lanes below)-th from there.
LCG_HD inline uint64_t lane_word_index(uint64_t pos, uint32_t mask, uint32_t lane) {
    return pos + popc32(mask & ((1u << lane) - 1));
}

LCG_HD inline uint32_t word_at(const Walk & w, uint64_t at) {
    return uint32_t(LCG_LDG(w.words + 2 * at)) | uint32_t(LCG_LDG(w.words + 2 * at + 1)) << 8;
}

LCG_HD inline void lane_refill(Lane & l, uint32_t word) {
    if (l.need) {
        l.x = lanes::refill(l.x, word);
    }
}

LCG_HD inline void lane_store(const Args & a, const Walk & w, const Lane & l) {
    if (!l.active) {
        return;
    }
    uint8_t * p = element(a, w.t, l.o, l.i);
    if (w.t.lossy) {
        const uint32_t raw = w.t.raw_bits ? lanes::raw_at(a.container + w.sj.raw, l.k - w.sj.k0, w.t.raw_bits) : 0;
        store_value(p, w.t, reconstruct(a, w.t, unit_of(w.t, l.o, l.i), lanes::symbol_q(l.sym, w.t.raw_bits, raw)));
    } else {
        p[w.sj.plane] = uint8_t(l.sym);
    }
}

LCG_HD inline bool lane_escapes(const Walk & w, const Lane & l) {
    return w.t.lossy && l.active && l.sym == lanes::SYM_ESCAPE;
}

// After the vote on escapes (emask) with n_found escapes before this step: records the element of
// the lane's escape in element order (never past the declared count).
LCG_HD inline void lane_record_escape(const Args & a, const Walk & w, uint64_t n_found, uint32_t emask, uint32_t lane,
                                      const Lane & l) {
    if (lane_escapes(w, l)) {
        const uint64_t e = n_found + popc32(emask & ((1u << lane) - 1));
        if (e < w.sj.n_escapes) {
            a.escape_at[w.sj.escapes + e] = l.k;
        }
    }
}

LCG_HD inline void lane_next(const Walk & w, Lane & l) {
    l.k += lanes::LANES;
    l.i += w.step_i;
    l.o += w.step_o;
    if (l.i >= w.t.n_inner) {
        l.i -= w.t.n_inner;
        l.o++;
    }
}

// The slice's status once every step ran (all_low: every lane's state is STATE_LOW).
LCG_HD inline uint32_t walk_end(const Walk & w, uint64_t pos, bool all_low, uint64_t n_found) {
    if (pos != w.n_words) {
        return STREAM_LEFTOVER;
    }
    if (!all_low) {
        return STREAM_END_STATE;
    }
    if (w.t.lossy && n_found != w.sj.n_escapes) {
        return STREAM_ESCAPES;
    }
    return STREAM_OK;
}

// ---- after the slices -------------------------------------------------------------------------

// Escape e of a slice whose decode succeeded: writes its value over the escape symbol's.
LCG_HD inline void patch_escape(const Args & a, const SliceJob & sj, uint64_t e) {
    const TensorJob t = a.tensors[sj.tensor];
    const uint64_t k = a.escape_at[sj.escapes + e];
    if (k >= t.n_outer * t.n_inner) {
        return;  // cannot happen after a successful decode; never write out of bounds
    }
    const uint64_t o = k / t.n_inner, i = k % t.n_inner;
    store_value(element(a, t, o, i), t, reconstruct(a, t, unit_of(t, o, i), a.escape_q[sj.escapes + e]));
}

// Byte k (memory order) of a stored lossless byte plane.
LCG_HD inline void stored_plane_byte(const Args & a, const PlaneJob & pj, uint64_t k) {
    const TensorJob t = a.tensors[pj.tensor];
    element(a, t, k / t.n_inner, k % t.n_inner)[pj.plane] = a.container[pj.src + k];
}

} // namespace lcg::cuda
