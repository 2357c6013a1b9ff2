// emulator.cpp -- libllama_cachegen_cuda_emu.so: the CUDA backend's interface (plan.h) run on the
// CPU, for tests on machines without a GPU (LCG_CUDA_LIBRARY=<this file>; tests/test_cuda.py).
//
// "Device memory" is host memory; each kernel of decode.cu is a loop here that calls the same
// per-lane functions (kernels.h) in the same order, a warp's 32 lanes one after another with
// each vote computed as a mask between them. What it checks: the host's plans (device.cpp), the
// compact tables, the lane steps and the warp's word accounting, against the CPU decoder's bytes.
// What it cannot: CUDA itself (launches, synchronisation), the device's one-instruction f16/bf16
// conversion (it runs lanes.h's integer code; tests/cuda/half_conversions.cu compares the two on a
// GPU), and the GPU's refresh of every lane's unit fields when any lane's unit changed (here only
// that lane's: the fields are a function of the lane's element, so the bytes are the same).
#include "kernels.h"
#include "llama_cachegen.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

namespace lcg::cuda {

namespace {

template <class K>
void walk_slice(const Args & a, uint32_t s, const Walk & w) {
    Lane l[lanes::LANES];
    for (uint32_t j = 0; j < lanes::LANES; j++) {
        lane_open<K>(a, w, j, l[j]);
    }
    uint32_t pos = 0, n_found = 0;
    for (uint32_t e0 = 0; e0 < w.n; e0 += lanes::LANES) {
        uint32_t mask = 0, emask = 0;
        for (uint32_t j = 0; j < lanes::LANES; j++) {
            lane_decode(w, l[j]);
            mask |= uint32_t(l[j].need) << j;
        }
        const uint32_t count = popc32(mask);
        if (pos + count > w.n_words) {
            a.status[s] = STREAM_OVERRUN;
            return;
        }
        for (uint32_t j = 0; j < lanes::LANES; j++) {
            lane_refill(l[j], l[j].need ? word_at(w, lane_word_index(pos, mask, j)) : 0);
            lane_store<K>(a, w, l[j]);
            emask |= uint32_t(lane_escapes<K>(l[j])) << j;
        }
        pos += count;
        for (uint32_t j = 0; j < lanes::LANES; j++) {
            lane_record_escape<K>(a, w, n_found, emask, j, l[j]);
            if (lane_next(w, l[j])) {
                lane_unit_fields<K>(a, w, l[j]);
            }
        }
        n_found += popc32(emask);
    }
    bool all_low = true;
    for (uint32_t j = 0; j < lanes::LANES; j++) {
        all_low = all_low && l[j].x == lanes::STATE_LOW;
    }
    a.status[s] = walk_end(w, pos, all_low, n_found);
}

void decode_slice(const Args & a, uint32_t s, const Table * tables) {
    const Walk w = walk_open(a, s, tables);
    with_kind(w.t, [&](auto kind) { walk_slice<decltype(kind)>(a, s, w); });
}

int device_count(int * count, char *, size_t) {
    *count = 1;
    return LCG_OK;
}

int current_device(int * device, char *, size_t) {
    *device = 0;
    return LCG_OK;
}

// The emulated device's allocations (start -> size): a destination outside them is refused, as
// decode.cu refuses memory that is not the device's.
std::mutex allocations_lock;
std::map<uintptr_t, size_t> allocations;

int alloc(void ** ptr, size_t size, char * msg, size_t msg_size) {
    *ptr = std::malloc(size ? size : 1);
    if (*ptr == nullptr) {
        std::snprintf(msg, msg_size, "emulated device: out of memory");
        return LCG_ERR_OUT_OF_MEMORY;
    }
    const std::lock_guard<std::mutex> hold(allocations_lock);
    allocations[reinterpret_cast<uintptr_t>(*ptr)] = size;
    return LCG_OK;
}

void release(void * ptr) {
    const std::lock_guard<std::mutex> hold(allocations_lock);
    allocations.erase(reinterpret_cast<uintptr_t>(ptr));
    std::free(ptr);
}

// Whether ptr points into an allocation (its start only, as cudaPointerGetAttributes tells).
bool is_device_memory(const uint8_t * ptr) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(ptr);
    const std::lock_guard<std::mutex> hold(allocations_lock);
    auto it = allocations.upper_bound(at);
    return it != allocations.begin() && at - std::prev(it)->first < std::max<size_t>(std::prev(it)->second, 1);
}

int copy(void * dst, const void * src, size_t size, void *, char *, size_t) {
    if (size > 0) {  // (statistics without tables copy nothing, from a null pointer)
        std::memmove(dst, src, size);
    }
    return LCG_OK;
}

int decode(Plan * plan, void *, uint32_t * status, char * msg, size_t msg_size) {
    Plan & p = *plan;
    if (p.dst_capacity > 0 && !is_device_memory(p.dst)) {
        std::snprintf(msg, msg_size, "the destination %p is not device memory (emulated device)",
                      static_cast<void *>(p.dst));
        return LCG_ERR_INVALID_ARGUMENT;
    }
    // "Uploads" as decode.cu's: the kernels see copies of the container_size and arena_size bytes
    // the plan names, so that a plan addressing past them (or from another base) fails here too
    const std::vector<uint8_t> container(p.container, p.container + p.container_size);
    const std::vector<uint8_t> arena(p.arena, p.arena + p.arena_size);
    std::vector<uint64_t> escape_at(p.n_escapes);
    Args a;
    a.container = container.data();
    a.arena = arena.data();
    a.stats = p.device_stats ? p.device_stats : a.arena + p.stats;
    a.tensors = reinterpret_cast<const TensorJob *>(a.arena + p.tensors);
    a.slices = reinterpret_cast<const SliceJob *>(a.arena + p.slices);
    a.blocks = reinterpret_cast<const BlockJob *>(a.arena + p.blocks);
    a.planes = reinterpret_cast<const PlaneJob *>(a.arena + p.planes);
    a.copies = reinterpret_cast<const CopyJob *>(a.arena + p.copies);
    a.dst = p.dst;
    a.status = status;
    a.escape_at = escape_at.data();
    a.escape_q = reinterpret_cast<const float *>(a.arena + p.escape_values);
    const ZeroJob * zeros = reinterpret_cast<const ZeroJob *>(a.arena + p.zeros);
    for (uint32_t z = 0; z < p.n_zeros; z++) {
        std::memset(p.dst + zeros[z].dst, 0, zeros[z].size);
    }
    for (uint32_t b = 0; b < p.n_blocks; b++) {
        const BlockJob & bj = a.blocks[b];
        for (uint32_t s = bj.first; s < bj.first + bj.n_slices; s++) {
            decode_slice(a, s, reinterpret_cast<const Table *>(a.stats + bj.tables));
        }
    }
    for (uint32_t s = 0; s < p.n_slices; s++) {
        if (status[s] == STREAM_OK) {
            for (uint64_t e = 0; e < a.slices[s].n_escapes; e++) {
                patch_escape(a, a.slices[s], e);
            }
        }
    }
    for (uint32_t j = 0; j < p.n_planes; j++) {
        const TensorJob & t = a.tensors[a.planes[j].tensor];
        for (uint64_t k = 0; k < t.n_outer * t.n_inner; k++) {
            stored_plane_byte(a, a.planes[j], k);
        }
    }
    for (uint32_t c = 0; c < p.n_copies; c++) {
        std::memcpy(p.dst + a.copies[c].dst, a.container + a.copies[c].src, a.copies[c].size);
    }
    p.seconds[0] = p.seconds[1] = 0.0;
    return LCG_OK;
}

const Backend backend = {BACKEND_ABI, device_count, current_device, alloc, release, copy, decode};

} // namespace

} // namespace lcg::cuda

extern "C" __attribute__((visibility("default"))) const lcg::cuda::Backend * lcg_cuda_backend(void) {
    return &lcg::cuda::backend;
}
