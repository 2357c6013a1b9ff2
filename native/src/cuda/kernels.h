// kernels.h -- the decode kernels' per-lane work, written once for the GPU (decode.cu) and for the
// CPU emulator of the backend (emulator.cpp) that the tests run on machines without a GPU.
//
// A warp walks a slice of a stream in steps of 32 elements. Between the warp votes (ballots) each
// lane runs plain functions of its own state: lane_decode (decode_symbol: a compact table's lookup
// and the state update), then after the vote on `need` lane_refill (with the word lane_word_index
// names) and lane_store, then after the vote on escapes lane_record_escape, then lane_next (and
// lane_unit_fields where a lane's unit changed). decode.cu calls them from one thread per lane with
// __ballot_sync between; the emulator calls them for lanes 0..31 in turn and computes each vote as
// a mask. Only the two loop skeletons (a few dozen lines each) differ. Both are instantiated per
// Kind (lossy or not, value type, raw bits): the GPU's step runs ~160 instructions per warp where
// one loop for every kind ran ~280 (measured, docs/cuda.md).
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

// Decodes one symbol from state x with table t: lookup then lanes::advance, fused (the slot entry
// is never built: that costs the GPU a dozen instructions per element). Returns the symbol.
LCG_HD inline uint32_t decode_symbol(const Table * t, uint32_t & x) {
    const uint32_t slot = x & (lanes::PROB_SCALE - 1);
    uint32_t s = LCG_LDG(t->bucket + (slot >> BUCKET_SHIFT));
    uint32_t lo = LCG_LDG(t->cum + s), hi = LCG_LDG(t->cum + s + 1);
    while (hi <= slot) {  // cum[256] = 4096 ends it
        s++;
        lo = hi;
        hi = LCG_LDG(t->cum + s + 1);
    }
    x = (hi - lo) * (x >> lanes::PROB_BITS) + slot - lo;
    return s;
}

LCG_HD inline void store_bytes(uint8_t * p, uint32_t v, uint32_t n) {
    for (uint32_t b = 0; b < n; b++) {
        p[b] = uint8_t(v >> (8 * b));
    }
}

// What a slice's tensor is, fixed at compile time: the slice loop is instantiated per kind, so
// that a step branches on none of these (with_kind picks the instance).
template <bool LOSSY_, int32_t TYPE_, bool RAW_>
struct Kind {
    static constexpr bool LOSSY = LOSSY_;  // else byte planes
    static constexpr int32_t TYPE = TYPE_;  // lossy: the ggml type of the values
    static constexpr bool RAW = RAW_;       // lossy: raw_bits > 0
};

// Calls f(Kind<...>{}) for t's kind.
template <class F>
LCG_HD inline void with_kind(const TensorJob & t, F && f) {
    if (!t.lossy) {
        f(Kind<false, 0, false>{});
    } else if (t.ggml_type == lanes::GGML_F16) {
        t.raw_bits ? f(Kind<true, lanes::GGML_F16, true>{}) : f(Kind<true, lanes::GGML_F16, false>{});
    } else if (t.ggml_type == lanes::GGML_BF16) {
        t.raw_bits ? f(Kind<true, lanes::GGML_BF16, true>{}) : f(Kind<true, lanes::GGML_BF16, false>{});
    } else {
        t.raw_bits ? f(Kind<true, lanes::GGML_F32, true>{}) : f(Kind<true, lanes::GGML_F32, false>{});
    }
}

// v in a 2-byte float type: lanes::f32_to_half_type's bits. The device converts in one
// instruction (cvt.rn, IEEE round to nearest even, as that integer code) and gives NaN the same
// bits; bench/gpu-check.sh compares the two over every f32 on the GPU.
template <int32_t TYPE>
LCG_HD inline uint16_t half_bits(float v) {
#if defined(__CUDA_ARCH__)
    const uint32_t u = lanes::f32_bits(v);
    uint16_t h;
    if (TYPE == lanes::GGML_F16) {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return v != v ? uint16_t(((u >> 16) & 0x8000) | 0x7e00) : h;
    }
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return v != v ? uint16_t((u >> 16) | 0x40) : h;
#else
    return lanes::f32_to_bf16(v);  // (no bf16 conversion before sm_80)
#endif
#else
    return lanes::f32_to_half_type(v, TYPE);
#endif
}

template <int32_t TYPE>
LCG_HD inline void store_value(uint8_t * p, bool aligned, float v) {
    if (TYPE == lanes::GGML_F32) {
        const uint32_t u = lanes::f32_bits(v);
#if defined(__CUDA_ARCH__)
        if (aligned) {
            *reinterpret_cast<uint32_t *>(p) = u;
            return;
        }
#endif
        store_bytes(p, u, 4);
        return;
    }
    const uint16_t h = half_bits<TYPE>(v);
#if defined(__CUDA_ARCH__)
    if (aligned) {
        *reinterpret_cast<uint16_t *>(p) = h;
        return;
    }
#endif
    store_bytes(p, h, 2);
}

// Row and unit of element (line o, i) of the object (TensorJob.grouped), in 64 bits or, within a
// slice (Lane), 32.
template <class I>
LCG_HD inline I row_of(const TensorJob & t, I o, I i) {
    return t.grouped ? i >> t.group_shift : t.transposed ? i : o;
}
template <class I>
LCG_HD inline I unit_of(const TensorJob & t, I o, I i) {
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

// Indexes within a slice are 32-bit (the host refuses lines or slices past 2^31 elements):
// 64-bit arithmetic costs the GPU two to four instructions per operation, per element.
struct Walk {
    SliceJob sj;
    TensorJob t;
    const Table * tables;  // the stream's
    const uint8_t * words;
    uint32_t n_words;
    uint32_t n, n_inner, step_o, step_i;  // elements in the slice; per step: lines and index
    bool unit_per_line;                   // a lane's unit changes with its line only (below)
};

// A lane's element of the current step, and what belongs to its unit, cached: in grouped and
// transposed tensors a lane keeps its unit along a line (32 is a multiple of the group, and of
// the group's elements in a line), so the table, mean, step and shrink are looked up once per line
// instead of once per element.
struct Lane {
    uint32_t x;
    uint32_t o, i;  // line and index in it of the lane's element in this step
    uint32_t e;     // the element, from the slice's first
    const Table * table;
    float mean, step, shrink;
    uint64_t unit_at;  // destination offset of the unit's element in cell 0
    uint32_t sym;
    bool active, need;
};

LCG_HD inline Walk walk_open(const Args & a, uint32_t slice, const Table * tables) {
    Walk w;
    w.sj = a.slices[slice];
    w.t = a.tensors[w.sj.tensor];
    w.tables = tables;
    w.words = a.container + w.sj.src + 4 * lanes::LANES;
    w.n_words = uint32_t((w.sj.bytes - 4 * lanes::LANES) / 2);
    w.n = uint32_t(w.sj.k1 - w.sj.k0);
    w.n_inner = uint32_t(w.t.n_inner);
    w.step_o = lanes::LANES / w.n_inner;
    w.step_i = lanes::LANES % w.n_inner;
    w.unit_per_line = w.t.grouped || w.t.transposed;
    return w;
}

// The cached fields of the lane's unit (past the slice's end: never read).
template <class K>
LCG_HD inline void lane_unit_fields(const Args & a, const Walk & w, Lane & l) {
    if (l.e >= w.n) {
        return;
    }
    const uint32_t unit = unit_of(w.t, l.o, l.i), g = unit >> w.t.group_shift;
    l.table = w.tables + g;
    l.unit_at = w.t.dst + unit * w.t.unit_stride;
    if (K::LOSSY) {
        l.mean = LCG_LDG(reinterpret_cast<const float *>(a.stats + w.t.mean) + unit);
        l.step = LCG_LDG(reinterpret_cast<const float *>(a.stats + w.t.step) + g);
        l.shrink = LCG_LDG(reinterpret_cast<const float *>(a.stats + w.t.shrink) + g);
    }
}

template <class K>
LCG_HD inline void lane_open(const Args & a, const Walk & w, uint32_t lane, Lane & l) {
    l.x = load_u32(a.container + w.sj.src + 4 * lane);  // the host checked every initial state
    l.e = lane;
    const uint64_t k = w.sj.k0 + lane;
    l.o = uint32_t(k / w.t.n_inner);
    l.i = uint32_t(k % w.t.n_inner);
    lane_unit_fields<K>(a, w, l);
}

// Decodes the lane's element of this step (if any): the state update, before renormalisation.
LCG_HD inline void lane_decode(const Walk & w, Lane & l) {
    l.active = l.e < w.n;
    l.need = false;
    l.sym = 0;
    if (l.active) {
        l.sym = decode_symbol(l.table, l.x);
        l.need = lanes::needs_word(l.x);
    }
}

// After the vote on `need` (mask) with the warp's cursor at word `pos`: the lane's word is the
// popc(mask & lanes below)-th from there.
LCG_HD inline uint32_t lane_word_index(uint32_t pos, uint32_t mask, uint32_t lane) {
    return pos + popc32(mask & ((1u << lane) - 1));
}

LCG_HD inline uint32_t word_at(const Walk & w, uint32_t at) {
    return uint32_t(LCG_LDG(w.words + 2 * at)) | uint32_t(LCG_LDG(w.words + 2 * at + 1)) << 8;
}

LCG_HD inline void lane_refill(Lane & l, uint32_t word) {
    if (l.need) {
        l.x = lanes::refill(l.x, word);
    }
}

template <class K>
LCG_HD inline void lane_store(const Args & a, const Walk & w, const Lane & l) {
    if (!l.active) {
        return;
    }
    const uint32_t row = row_of(w.t, l.o, l.i);
    const uint32_t cell = w.t.rows == ~0ull ? row : LCG_LDG(reinterpret_cast<const uint32_t *>(a.arena + w.t.rows) + row);
    uint8_t * p = a.dst + l.unit_at + cell * w.t.cell_stride;
    if (K::LOSSY) {
        const uint32_t raw = K::RAW ? lanes::raw_at(a.container + w.sj.raw, l.e, w.t.raw_bits) : 0;
        const float q = lanes::symbol_q(l.sym, K::RAW ? w.t.raw_bits : 0, raw);
        store_value<K::TYPE>(p, w.t.aligned, lanes::dequant(l.mean, l.step, l.shrink, q));
    } else {
        p[w.sj.plane] = uint8_t(l.sym);
    }
}

template <class K>
LCG_HD inline bool lane_escapes(const Lane & l) {
    return K::LOSSY && l.active && l.sym == lanes::SYM_ESCAPE;
}

// After the vote on escapes (emask) with n_found escapes before this step: records the element of
// the lane's escape in element order (never past the declared count).
template <class K>
LCG_HD inline void lane_record_escape(const Args & a, const Walk & w, uint32_t n_found, uint32_t emask, uint32_t lane,
                                      const Lane & l) {
    if (lane_escapes<K>(l)) {
        const uint32_t e = n_found + popc32(emask & ((1u << lane) - 1));
        if (e < w.sj.n_escapes) {
            a.escape_at[w.sj.escapes + e] = w.sj.k0 + l.e;
        }
    }
}

// Moves the lane to its element of the next step; true when its unit changed (then the caller
// calls lane_unit_fields: on the GPU behind a warp vote, so that the steps that need no new
// fields, nearly all in grouped and transposed tensors, branch past it).
LCG_HD inline bool lane_next(const Walk & w, Lane & l) {
    l.e += lanes::LANES;
    l.i += w.step_i;
    l.o += w.step_o;
    if (l.i >= w.n_inner) {
        l.i -= w.n_inner;
        l.o++;
        return true;
    }
    return w.step_o != 0 || !w.unit_per_line;
}

// The slice's status once every step ran (all_low: every lane's state is STATE_LOW).
LCG_HD inline uint32_t walk_end(const Walk & w, uint32_t pos, bool all_low, uint32_t n_found) {
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
    uint8_t * p = element(a, t, o, i);
    const float v = reconstruct(a, t, unit_of(t, o, i), a.escape_q[sj.escapes + e]);
    if (t.ggml_type == lanes::GGML_F16) {
        store_value<lanes::GGML_F16>(p, t.aligned, v);
    } else if (t.ggml_type == lanes::GGML_BF16) {
        store_value<lanes::GGML_BF16>(p, t.aligned, v);
    } else {
        store_value<lanes::GGML_F32>(p, t.aligned, v);
    }
}

// Byte k (memory order) of a stored lossless byte plane.
LCG_HD inline void stored_plane_byte(const Args & a, const PlaneJob & pj, uint64_t k) {
    const TensorJob t = a.tensors[pj.tensor];
    element(a, t, k / t.n_inner, k % t.n_inner)[pj.plane] = a.container[pj.src + k];
}

} // namespace lcg::cuda
