// device.h -- decoding into CUDA device memory, the host half: loads the backend
// (libllama_cachegen_cuda.so, beside this library) on first use, checks and parses objects on the
// CPU exactly as the CPU decoder does, and hands the kernels a plan (cuda/plan.h). Nothing here
// needs a GPU, a driver or the CUDA toolkit to build or load (docs/cuda.md).
#pragma once

#include "codec.h"

#include <map>
#include <mutex>
#include <string>

namespace lcg {

// Usable CUDA devices: 0 without the backend (a build with LCG_CUDA=OFF, or LCG_NO_CUDA set), a
// driver or a device; *why then says which.
int cuda_device_count(std::string * why = nullptr);

// Device copies of an opened statistics object's tables and quantizers, one per device, made on
// the first chunk decoded on that device and freed with the handle.
class DeviceStats {
public:
    DeviceStats() = default;
    DeviceStats(const DeviceStats &) = delete;
    DeviceStats & operator=(const DeviceStats &) = delete;
    ~DeviceStats();

    struct Tensor {
        uint64_t tables, mean, step, shrink;  // offsets in the stats space (cuda/plan.h)
    };
    struct Copy {
        const uint8_t * base = nullptr;  // device memory
        std::vector<Tensor> tensors;
    };
    // The copy on the current device, made if needed.
    const Copy & on_current_device(const Stats & stats);

private:
    std::mutex mu_;
    std::map<int, Copy> copies_;
};

// Decodes a whole container (or skeleton) from host memory into device memory; checks as
// decode_whole does. Returns the state's size. Waits for the work on `stream` (a cudaStream_t;
// NULL: the default stream).
size_t decode_whole_device(const uint8_t * data, size_t size, uint8_t * device_dst, size_t dst_capacity,
                           void * stream);

// Decodes chunks into device_state, a device copy of the host state `state` (state_size bytes;
// only its parts other than K/V payloads are read, for the layout and the cells of each position),
// in one upload and one launch. Chunks sharing a position are refused (they would race).
void decode_chunks_device(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                          const Stats & stats, DeviceStats & cache, const uint8_t * state, size_t state_size,
                          uint8_t * device_state, void * stream);

// The device time of this thread's last device decode: upload of object and plan, kernels.
struct DeviceTiming {
    double upload_s = 0.0, kernels_s = 0.0;
};
DeviceTiming device_last_timing();

void * device_alloc(size_t size);
void device_free(void * ptr);
// Any direction between host and device memory; waits for it.
void device_copy(void * dst, const void * src, size_t size, void * stream);

} // namespace lcg
