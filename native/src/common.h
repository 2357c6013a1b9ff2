// common.h -- errors, bounded byte I/O, CRC32C, half-float conversion, a parallel loop.
// Depends on nothing but the public header and lanes.h; every other stage includes it.
#pragma once

#include "lanes.h"
#include "llama_cachegen.h"

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace lcg {

// Errors travel as this exception inside the library; api.cpp turns them into status + message.
struct Error : std::runtime_error {
    int status;
    Error(int status, const std::string & msg) : std::runtime_error(msg), status(status) {}
};

[[noreturn]] void fail(int status, const char * fmt, ...) __attribute__((format(printf, 2, 3)));

#define LCG_CHECK(cond, status, ...) \
    do { if (!(cond)) ::lcg::fail((status), __VA_ARGS__); } while (0)

// Reads little-endian values from an untrusted buffer; running past its end fails with `status`
// (UNSUPPORTED_FORMAT while parsing a llama.cpp state, TRUNCATED/CORRUPT inside a container).
class ByteReader {
public:
    ByteReader(const uint8_t * data, size_t size, int status, const char * what)
        : data_(data), size_(size), status_(status), what_(what) {}

    size_t pos() const { return pos_; }
    size_t size() const { return size_; }
    size_t remaining() const { return size_ - pos_; }
    void seek(size_t pos) { pos_ = pos; }
    int status() const { return status_; }

    const uint8_t * take(size_t n) {
        LCG_CHECK(n <= remaining(), status_, "%s: needs %zu bytes at offset %zu, only %zu left",
                  what_, n, pos_, remaining());
        const uint8_t * p = data_ + pos_;
        pos_ += n;
        return p;
    }
    template <typename T> T get() {
        T v;
        std::memcpy(&v, take(sizeof(T)), sizeof(T));
        return v;
    }
    uint8_t  u8()  { return get<uint8_t>(); }
    uint16_t u16() { return get<uint16_t>(); }
    uint32_t u32() { return get<uint32_t>(); }
    int32_t  i32() { return get<int32_t>(); }
    uint64_t u64() { return get<uint64_t>(); }
    float    f32() { return get<float>(); }
    // One byte (most escapes) inline, longer ones out of line.
    uint64_t varint() {
        if (pos_ < size_ && data_[pos_] < 0x80) {
            return data_[pos_++];
        }
        return varint_long();
    }

private:
    uint64_t varint_long();

    const uint8_t * data_;
    size_t size_;
    size_t pos_ = 0;
    int status_;
    const char * what_;
};

class ByteWriter {
public:
    std::vector<uint8_t> buf;

    void put(const void * p, size_t n) {
        const uint8_t * b = static_cast<const uint8_t *>(p);
        buf.insert(buf.end(), b, b + n);
    }
    template <typename T> void put_le(T v) { put(&v, sizeof(T)); }
    void u8(uint8_t v)   { buf.push_back(v); }
    void u16(uint16_t v) { put_le(v); }
    void u32(uint32_t v) { put_le(v); }
    void i32(int32_t v)  { put_le(v); }
    void u64(uint64_t v) { put_le(v); }
    void f32(float v)    { put_le(v); }
    void varint(uint64_t v);
    // Fills in a u32 written earlier as a placeholder (a size known only once what follows is written).
    void u32_at(size_t at, uint32_t v) { std::memcpy(&buf[at], &v, sizeof(v)); }
};

// CRC32C (Castagnoli), hardware-accelerated where the CPU has SSE4.2.
uint32_t crc32c(const void * data, size_t size, uint32_t crc = 0);

// IEEE half and bfloat16 <-> float. f16 -> f32 is a lookup in a table built when the library loads.
extern const float * const f16_table;
inline float f16_to_f32(uint16_t h) { return f16_table[h]; }
inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even (the SIMD and GPU paths give the same bits): lanes.h, shared with CUDA.
using lanes::f32_to_bf16;
using lanes::f32_to_f16;

// The CPU has AVX2 and F16C (x86-64), and LCG_NO_SIMD is unset: the SIMD paths may run. They write
// the same bytes as the scalar ones (tests compare both).
extern const bool cpu_has_avx2;
// The AVX2 table lookups (the decoders' symbols, the encoder's symbol entries): the gather
// instruction, or scalar loads; both read the same tables, so the output is the same. Scalar loads
// measured faster on AMD Zen (EPYC, bench/speed.py: balanced decode 2.17 vs 2.02 GB/s per core,
// encode 870 vs 790 MB/s), so they are the default there, the gather elsewhere; LCG_GATHER=1 or
// LCG_SCALAR_LOADS=1 force one.
extern const bool use_gather;

// Appends to `at` the positions k < n with p[k] == b, in increasing order (AVX2 where the CPU has
// it: 32 bytes per compare, for rare bytes such as escape symbols).
void find_byte(const uint8_t * p, size_t n, uint8_t b, std::vector<size_t> & at);
// How many of the n bytes at p equal b (AVX2 where the CPU has it).
size_t count_byte(const uint8_t * p, size_t n, uint8_t b);

// malloc for a buffer of n bytes that the caller fills at once (a container, a decoded state):
// from 2 MiB up, aligned to 2 MiB and advised for transparent huge pages, so that filling it takes
// one page fault per 2 MiB rather than per 4 KiB (measured: faults were a third of an encode's
// time). Released with free(); NULL when out of memory.
void * alloc_filled(size_t n);

// Runs fn(i) for i in [0, n) on up to n_threads threads (<= 0: all cores). Rethrows the first error.
void parallel_for(size_t n, int n_threads, const std::function<void(size_t)> & fn);
// How many workers parallel_for(n, n_threads, ...) runs.
size_t parallel_workers(size_t n, int n_threads);
// The same, as fn(i, worker) with worker in [0, parallel_workers(n, n_threads)): one worker's
// calls run one after another (a worker may reuse a buffer of its own).
void parallel_for_workers(size_t n, int n_threads, const std::function<void(size_t, size_t)> & fn);

} // namespace lcg
