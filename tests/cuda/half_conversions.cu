// half_conversions.cu -- the device's one-instruction f16/bf16 conversion (cuda/kernels.h,
// half_bits) against the integer code the CPU decoders use (lanes.h), over every f32 bit pattern.
// bench/gpu-check.sh builds and runs it on a GPU; exits 1 and prints the first differences if the
// two disagree anywhere.
#include "cuda/kernels.h"

#include <cstdio>

namespace {

__device__ unsigned long long n_diff[2];
__device__ uint32_t first_diff[2];

__global__ void compare(uint64_t begin) {
    const uint64_t u = begin + blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
    const float f = __uint_as_float(uint32_t(u));
    if (lcg::cuda::half_bits<lcg::lanes::GGML_F16>(f) != lcg::lanes::f32_to_f16(f)) {
        if (atomicAdd(&n_diff[0], 1ull) == 0) {
            first_diff[0] = uint32_t(u);
        }
    }
    if (lcg::cuda::half_bits<lcg::lanes::GGML_BF16>(f) != lcg::lanes::f32_to_bf16(f)) {
        if (atomicAdd(&n_diff[1], 1ull) == 0) {
            first_diff[1] = uint32_t(u);
        }
    }
}

} // namespace

int main() {
    const uint64_t per_launch = 1ull << 30;
    for (uint64_t begin = 0; begin < (1ull << 32); begin += per_launch) {
        compare<<<uint32_t(per_launch / 256), 256>>>(begin);
    }
    unsigned long long n[2];
    uint32_t first[2];
    cudaError_t err = cudaGetLastError();  // a launch that failed
    if (err == cudaSuccess) {
        err = cudaDeviceSynchronize();
    }
    if (err == cudaSuccess) {
        err = cudaMemcpyFromSymbol(n, n_diff, sizeof n);
    }
    if (err == cudaSuccess) {
        err = cudaMemcpyFromSymbol(first, first_diff, sizeof first);
    }
    if (err != cudaSuccess) {
        std::printf("half_conversions: %s\n", cudaGetErrorString(err));
        return 2;
    }
    const char * names[2] = {"f16", "bf16"};
    for (int t = 0; t < 2; t++) {
        std::printf("%s: %llu of 2^32 f32 values convert differently%s", names[t], n[t], n[t] ? "" : "\n");
        if (n[t]) {
            std::printf(" (first: 0x%08x)\n", first[t]);
        }
    }
    return n[0] || n[1] ? 1 : 0;
}
