// decode.cu -- libllama_cachegen_cuda.so: the kernels that decode an object's slices into a
// llama.cpp state in device memory, and the runtime calls around them (docs/cuda.md).
//
// Read me first:
//  - One warp per 32-lane slice of a stream, thread j = lane j (docs/format.md, "Streams"); a
//    block holds up to BLOCK_WARPS slices of one stream. Per step each thread decodes its element
//    (kernels.h, on the lanes.h arithmetic), then ballot(state < 2^15) and popc(ballot &
//    lanemask_lt) give each thread the offset of its word; the warp advances by popc(ballot).
//    Every bound check is warp-uniform, so a bad slice stops its warp, reports itself and never
//    reads or writes out of bounds.
//  - The per-lane work between the votes is kernels.h, which emulator.cpp runs on the CPU for
//    the tests; only the loop skeletons and the runtime calls here are GPU-only.
//  - Tables (compact, plan.h) are read from global memory through the L1 cache.
//  - The slice loop is a template per Kind (kernels.h), picked once per warp: a step branches on
//    nothing the tensor fixes, indexes are 32-bit, and a lane reloads its unit's table, mean, step
//    and shrink only when its unit changes (once per line in grouped and transposed tensors).
//  - Escapes: the decode kernel records each escape symbol's element index (ballot + popc keep
//    element order), a second kernel writes the escaped values; exact rows and verbatim bytes are
//    copied last, so they overwrite what they must.
//  - The host checked every destination range; the kernels trust the plan, not the streams.
#include "kernels.h"
#include "llama_cachegen.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

namespace lcg::cuda {

namespace {

constexpr unsigned FULL_MASK = 0xffffffffu;
// Blocks per SM the decode kernel is built for: 4 x 8 warps = half an H100/H200 SM's warps, which
// caps registers at 64 per thread (measured on an H100, docs/cuda.md: 3 blocks, 76 registers and
// no spill, ran at 167 GB/s balanced; 5 and 6 blocks spilled and ran at 172 and 133; 4: 226). The
// tables stay in global memory and reach the warps through the L1 cache: measured on an H200,
// staging a block's tables in shared memory (82 KB for a 1,024-channel K) left fewer blocks per
// SM or less L1 and was slower (121-134 GB/s balanced) than none (161 GB/s, before the kinds).
constexpr int MIN_BLOCKS = 4;

// One block = up to BLOCK_WARPS slices of one stream, a warp each (emulator.cpp: the same steps
// on the CPU). Words: each lane holds word base + lane and base + 32 + lane of the slice; the
// warp's cursor stays within 32 of base, so every word a step needs (at most 32) is in those 64
// and reaches its lane by shuffle, while the load of the next 32 is in flight for several steps.
template <class K>
__device__ void walk_slice(const Args & a, uint32_t slice, const Walk & w, uint32_t lane) {
    auto load = [&](uint32_t at) { return at < w.n_words ? word_at(w, at) : 0u; };
    Lane l;
    lane_open<K>(a, w, lane, l);
    uint32_t pos = 0, base = 0, n_found = 0;
    uint32_t buf0 = load(lane), buf1 = load(32 + lane);
    uint32_t status = STREAM_OK;
    for (uint32_t e0 = 0; e0 < w.n; e0 += lanes::LANES) {
        lane_decode(w, l);
        const uint32_t mask = __ballot_sync(FULL_MASK, l.need);
        const uint32_t count = __popc(mask);
        if (pos + count > w.n_words) {  // warp-uniform
            status = STREAM_OVERRUN;
            break;
        }
        const uint32_t at = lane_word_index(pos, mask, lane) - base;  // < 64
        const uint32_t w0 = __shfl_sync(FULL_MASK, buf0, at % 32), w1 = __shfl_sync(FULL_MASK, buf1, at % 32);
        lane_refill(l, at < 32 ? w0 : w1);
        pos += count;
        if (pos - base >= 32) {  // warp-uniform
            base += 32;
            buf0 = buf1;
            buf1 = load(base + 32 + lane);
        }
        lane_store<K>(a, w, l);
        if (K::LOSSY) {
            const uint32_t emask = __ballot_sync(FULL_MASK, lane_escapes<K>(l));
            if (emask) {  // warp-uniform
                lane_record_escape<K>(a, w, n_found, emask, lane, l);
                n_found += __popc(emask);
            }
        }
        if (__any_sync(FULL_MASK, lane_next(w, l))) {  // warp-uniform
            lane_unit_fields<K>(a, w, l);
        }
    }
    if (status == STREAM_OK) {
        status = walk_end(w, pos, __all_sync(FULL_MASK, l.x == lanes::STATE_LOW), n_found);
    }
    if (lane == 0) {
        a.status[slice] = status;
    }
}

__global__ void __launch_bounds__(32 * BLOCK_WARPS, MIN_BLOCKS) decode_slices(Args a) {
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const BlockJob bj = a.blocks[blockIdx.x];
    if (warp >= bj.n_slices) {
        return;
    }
    const uint32_t slice = bj.first + warp;
    const Walk w = walk_open(a, slice, reinterpret_cast<const Table *>(a.stats + bj.tables));
    with_kind(w.t, [&](auto kind) { walk_slice<decltype(kind)>(a, slice, w, lane); });
}

// Escaped values of each slice (one block per slice), once its decode succeeded.
__global__ void patch_escapes(Args a) {
    const SliceJob sj = a.slices[blockIdx.x];
    if (a.status[blockIdx.x] != STREAM_OK) {
        return;
    }
    for (uint64_t e = threadIdx.x; e < sj.n_escapes; e += blockDim.x) {
        patch_escape(a, sj, e);
    }
}

// Stored byte planes (lossless): blockIdx.y = the plane job.
__global__ void stored_planes(Args a, uint32_t first) {
    const PlaneJob pj = a.planes[first + blockIdx.y];
    const TensorJob & t = a.tensors[pj.tensor];
    const uint64_t n = t.n_outer * t.n_inner;
    for (uint64_t k = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; k < n; k += uint64_t(gridDim.x) * blockDim.x) {
        stored_plane_byte(a, pj, k);
    }
}

// Container bytes to the destination, one warp per job (most are an exact row's few bytes).
__global__ void copy_runs(Args a, uint32_t n_copies) {
    const uint32_t job = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (job >= n_copies) {
        return;
    }
    const CopyJob c = a.copies[job];
    for (uint64_t b = threadIdx.x % 32; b < c.size; b += 32) {
        a.dst[c.dst + b] = a.container[c.src + b];
    }
}

int fail(int status, cudaError_t err, const char * what, char * msg, size_t msg_size) {
    std::snprintf(msg, msg_size, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    cudaGetLastError();  // the runtime keeps a failed call's error for the next cudaGetLastError: a later
                         // decode's launch check would report it (a sticky error stays all the same)
    return status;
}

int status_of(cudaError_t err) {
    switch (err) {
        case cudaErrorMemoryAllocation: return LCG_ERR_OUT_OF_MEMORY;
        case cudaErrorInvalidValue:
        case cudaErrorInvalidDevicePointer:
        case cudaErrorInvalidResourceHandle: return LCG_ERR_INVALID_ARGUMENT;
        case cudaErrorNoDevice:
        case cudaErrorInsufficientDriver: return LCG_ERR_NO_DEVICE;
        default: return LCG_ERR_INTERNAL;
    }
}

#define LCG_CUDA_TRY(call, what)                                                                                       \
    do {                                                                                                               \
        const cudaError_t err_ = (call);                                                                               \
        if (err_ != cudaSuccess) {                                                                                     \
            return fail(status_of(err_), err_, what, msg, msg_size);                                                   \
        }                                                                                                              \
    } while (0)

int device_count(int * count, char * msg, size_t msg_size) {
    *count = 0;
    const cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) {
        *count = 0;
        cudaGetLastError();  // not sticky: clear it
        return fail(LCG_ERR_NO_DEVICE, err,
                    err == cudaErrorInsufficientDriver ? "cudaGetDeviceCount (no CUDA driver, or one older than the "
                                                         "runtime this backend was built with)"
                                                       : "cudaGetDeviceCount",
                    msg, msg_size);
    }
    return LCG_OK;
}

int current_device(int * device, char * msg, size_t msg_size) {
    LCG_CUDA_TRY(cudaGetDevice(device), "cudaGetDevice");
    return LCG_OK;
}

int alloc(void ** ptr, size_t size, char * msg, size_t msg_size) {
    LCG_CUDA_TRY(cudaMalloc(ptr, std::max<size_t>(size, 1)), "cudaMalloc");
    return LCG_OK;
}

void release(void * ptr) { cudaFree(ptr); }

int copy(void * dst, const void * src, size_t size, void * stream, char * msg, size_t msg_size) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    LCG_CUDA_TRY(cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, s), "cudaMemcpyAsync");
    LCG_CUDA_TRY(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return LCG_OK;
}

// Device scratch and events of one decode, released in stream order whatever happens.
struct Scratch {
    cudaStream_t stream;
    void * ptr[4] = {nullptr, nullptr, nullptr, nullptr};
    cudaEvent_t event[3] = {nullptr, nullptr, nullptr};
    ~Scratch() {
        for (void * p : ptr) {
            if (p) {
                cudaFreeAsync(p, stream);
            }
        }
        for (cudaEvent_t e : event) {
            if (e) {
                cudaEventDestroy(e);
            }
        }
    }
};

// The destination is the caller's pointer. A kernel writing through pageable host memory or
// another device's faults, and a fault ends every later CUDA call of the process: refused here.
int check_destination(const Plan & p, char * msg, size_t msg_size) {
    if (p.dst_capacity == 0) {
        return LCG_OK;
    }
    cudaPointerAttributes at{};
    LCG_CUDA_TRY(cudaPointerGetAttributes(&at, p.dst), "cudaPointerGetAttributes");
    int device = 0;
    LCG_CUDA_TRY(cudaGetDevice(&device), "cudaGetDevice");
    if (at.type == cudaMemoryTypeDevice && at.device != device) {
        std::snprintf(msg, msg_size, "the destination is memory of device %d, the current device is %d", at.device,
                      device);
        return LCG_ERR_INVALID_ARGUMENT;
    }
    if (at.type == cudaMemoryTypeUnregistered || at.devicePointer != p.dst) {
        std::snprintf(msg, msg_size, "the destination %p is not device memory (pageable host memory?)",
                      static_cast<void *>(p.dst));
        return LCG_ERR_INVALID_ARGUMENT;
    }
    return LCG_OK;  // this device's, managed, or pinned host memory mapped at the same address
}

int decode(Plan * plan, void * stream_ptr, uint32_t * status, char * msg, size_t msg_size) {
    const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    Plan & p = *plan;
    const int checked = check_destination(p, msg, msg_size);
    if (checked != LCG_OK) {
        return checked;
    }
    Scratch s{stream};
    for (cudaEvent_t & e : s.event) {
        LCG_CUDA_TRY(cudaEventCreate(&e), "cudaEventCreate");
    }
    LCG_CUDA_TRY(cudaEventRecord(s.event[0], stream), "cudaEventRecord");
    uint8_t *container, *arena;
    uint32_t * d_status;
    uint64_t * escape_at;
    LCG_CUDA_TRY(cudaMallocAsync(&s.ptr[0], std::max<uint64_t>(p.container_size, 1), stream), "cudaMallocAsync");
    LCG_CUDA_TRY(cudaMallocAsync(&s.ptr[1], std::max<uint64_t>(p.arena_size, 1), stream), "cudaMallocAsync");
    LCG_CUDA_TRY(cudaMallocAsync(&s.ptr[2], std::max<uint64_t>(p.n_slices, 1) * 4, stream), "cudaMallocAsync");
    LCG_CUDA_TRY(cudaMallocAsync(&s.ptr[3], std::max<uint64_t>(p.n_escapes, 1) * 8, stream), "cudaMallocAsync");
    container = static_cast<uint8_t *>(s.ptr[0]);
    arena = static_cast<uint8_t *>(s.ptr[1]);
    d_status = static_cast<uint32_t *>(s.ptr[2]);
    escape_at = static_cast<uint64_t *>(s.ptr[3]);
    LCG_CUDA_TRY(cudaMemcpyAsync(container, p.container, p.container_size, cudaMemcpyHostToDevice, stream),
                 "uploading the container");
    LCG_CUDA_TRY(cudaMemcpyAsync(arena, p.arena, p.arena_size, cudaMemcpyHostToDevice, stream), "uploading the plan");
    LCG_CUDA_TRY(cudaEventRecord(s.event[1], stream), "cudaEventRecord");
    const ZeroJob * zeros = reinterpret_cast<const ZeroJob *>(p.arena + p.zeros);
    for (uint32_t z = 0; z < p.n_zeros; z++) {
        LCG_CUDA_TRY(cudaMemsetAsync(p.dst + zeros[z].dst, 0, zeros[z].size, stream), "cudaMemsetAsync");
    }
    Args a;
    a.container = container;
    a.arena = arena;
    a.stats = p.device_stats ? p.device_stats : arena + p.stats;
    a.tensors = reinterpret_cast<const TensorJob *>(arena + p.tensors);
    a.slices = reinterpret_cast<const SliceJob *>(arena + p.slices);
    a.blocks = reinterpret_cast<const BlockJob *>(arena + p.blocks);
    a.dst = p.dst;
    a.status = d_status;
    a.escape_at = escape_at;
    a.escape_q = reinterpret_cast<const float *>(arena + p.escape_values);
    a.planes = reinterpret_cast<const PlaneJob *>(arena + p.planes);
    a.copies = reinterpret_cast<const CopyJob *>(arena + p.copies);
    if (p.n_blocks > 0) {
        decode_slices<<<p.n_blocks, 32 * BLOCK_WARPS, 0, stream>>>(a);
        LCG_CUDA_TRY(cudaGetLastError(), "launching decode_slices");
        patch_escapes<<<p.n_slices, 128, 0, stream>>>(a);
        LCG_CUDA_TRY(cudaGetLastError(), "launching patch_escapes");
    }
    for (uint32_t j = 0; j < p.n_planes; j += 65535) {  // gridDim.y is at most 65535
        const uint32_t batch = std::min<uint32_t>(65535, p.n_planes - j);
        stored_planes<<<dim3(256, batch), 256, 0, stream>>>(a, j);
        LCG_CUDA_TRY(cudaGetLastError(), "launching stored_planes");
    }
    if (p.n_copies > 0) {
        copy_runs<<<(p.n_copies + 3) / 4, 128, 0, stream>>>(a, p.n_copies);
        LCG_CUDA_TRY(cudaGetLastError(), "launching copy_runs");
    }
    LCG_CUDA_TRY(cudaEventRecord(s.event[2], stream), "cudaEventRecord");
    if (p.n_slices > 0) {
        LCG_CUDA_TRY(cudaMemcpyAsync(status, d_status, p.n_slices * 4ull, cudaMemcpyDeviceToHost, stream),
                     "reading the slice status");
    }
    LCG_CUDA_TRY(cudaStreamSynchronize(stream), "decoding on the device");
    float ms[2] = {0.0f, 0.0f};
    LCG_CUDA_TRY(cudaEventElapsedTime(&ms[0], s.event[0], s.event[1]), "cudaEventElapsedTime");
    LCG_CUDA_TRY(cudaEventElapsedTime(&ms[1], s.event[1], s.event[2]), "cudaEventElapsedTime");
    p.seconds[0] = ms[0] * 1e-3;
    p.seconds[1] = ms[1] * 1e-3;
    return LCG_OK;
}

const Backend backend = {BACKEND_ABI, device_count, current_device, alloc, release, copy, decode};

} // namespace

} // namespace lcg::cuda

extern "C" __attribute__((visibility("default"))) const lcg::cuda::Backend * lcg_cuda_backend(void) {
    return &lcg::cuda::backend;
}
