#include "common.h"

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lcg {

void fail(int status, const char * fmt, ...) {
    char msg[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(msg, sizeof(msg), fmt, args);
    va_end(args);
    throw Error(status, msg);
}

uint64_t ByteReader::varint_long() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        const uint8_t b = u8();
        v |= static_cast<uint64_t>(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            return v;
        }
    }
    fail(status_, "%s: varint longer than 10 bytes at offset %zu", what_, pos_);
}

void ByteWriter::varint(uint64_t v) {
    while (v >= 0x80) {
        buf.push_back(static_cast<uint8_t>(v | 0x80));
        v >>= 7;
    }
    buf.push_back(static_cast<uint8_t>(v));
}

// ---- CRC32C ----------------------------------------------------------------------------------

static uint32_t crc32c_table[8][256];

static void crc32c_init_table() {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
        }
        crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) {
            crc32c_table[t][i] = (crc32c_table[t - 1][i] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][i] & 0xff];
        }
    }
}

// Slicing-by-8 fallback for CPUs without the crc32 instruction.
static uint32_t crc32c_soft(const uint8_t * p, size_t n, uint32_t c) {
    static std::once_flag once;
    std::call_once(once, crc32c_init_table);
    while (n >= 8) {
        uint64_t w;
        std::memcpy(&w, p, 8);
        w ^= c;
        c = crc32c_table[7][w & 0xff] ^ crc32c_table[6][(w >> 8) & 0xff] ^
            crc32c_table[5][(w >> 16) & 0xff] ^ crc32c_table[4][(w >> 24) & 0xff] ^
            crc32c_table[3][(w >> 32) & 0xff] ^ crc32c_table[2][(w >> 40) & 0xff] ^
            crc32c_table[1][(w >> 48) & 0xff] ^ crc32c_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) {
        c = (c >> 8) ^ crc32c_table[0][(c ^ *p++) & 0xff];
    }
    return c;
}

#if defined(__x86_64__)
// The CRC register is linear over GF(2) in itself and the data, so the register after bytes A then
// B is shift(register after A, |B|) ^ (register after B from 0), shift being what |B| zero bytes do
// to a register: a 32x32 bit matrix (column i: the image of bit i), the one-bit step squared.
static uint32_t gf2_apply(const uint32_t * column, uint32_t v) {
    uint32_t r = 0;
    for (int i = 0; v != 0; i++, v >>= 1) {
        r ^= (v & 1) ? column[i] : 0;
    }
    return r;
}

struct ZeroShift {
    uint32_t column[32];
    explicit ZeroShift(int log2_bytes) {
        column[0] = 0x82f63b78u;  // the reflected CRC32C polynomial: one zero bit
        for (int i = 1; i < 32; i++) {
            column[i] = 1u << (i - 1);
        }
        for (int k = 0; k < 3 + log2_bytes; k++) {  // 2^3 bits, then 2^log2_bytes bytes
            uint32_t squared[32];
            for (int i = 0; i < 32; i++) {
                squared[i] = gf2_apply(column, column[i]);
            }
            std::memcpy(column, squared, sizeof(column));
        }
    }
};

// The crc32 instruction's 3-cycle latency would leave one chain at a third of its throughput:
// three blocks run side by side and are joined by the shift above.
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(const uint8_t * p, size_t n, uint32_t c) {
    constexpr size_t BLOCK = 16384;
    static const ZeroShift shift(14);  // BLOCK zero bytes
    while (n >= 3 * BLOCK) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < BLOCK; i += 8) {
            uint64_t w[3];
            std::memcpy(&w[0], p + i, 8);
            std::memcpy(&w[1], p + BLOCK + i, 8);
            std::memcpy(&w[2], p + 2 * BLOCK + i, 8);
            a = _mm_crc32_u64(a, w[0]);
            b = _mm_crc32_u64(b, w[1]);
            d = _mm_crc32_u64(d, w[2]);
        }
        c = gf2_apply(shift.column, gf2_apply(shift.column, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
            static_cast<uint32_t>(d);
        p += 3 * BLOCK;
        n -= 3 * BLOCK;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        std::memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    c = static_cast<uint32_t>(c64);
    while (n--) {
        c = _mm_crc32_u8(c, *p++);
    }
    return c;
}
#endif

uint32_t crc32c(const void * data, size_t size, uint32_t crc) {
    const uint8_t * p = static_cast<const uint8_t *>(data);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
    c = has_sse42 ? crc32c_hw(p, size, c) : crc32c_soft(p, size, c);
#else
    c = crc32c_soft(p, size, c);
#endif
    return ~c;
}

// ---- half floats -----------------------------------------------------------------------------

static float f16_to_f32_exact(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else {  // subnormal: value = mant * 2^-24
        float f = std::ldexp(static_cast<float>(mant), -24);
        std::memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static const float * build_f16_table() {
    static float table[65536];
    for (uint32_t h = 0; h < 65536; h++) {
        table[h] = f16_to_f32_exact(static_cast<uint16_t>(h));
    }
    return table;
}

const float * const f16_table = build_f16_table();

// Round to nearest even, with overflow to infinity and gradual underflow (as F16C does).
#if defined(__x86_64__)
const bool cpu_has_avx2 =
    __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && std::getenv("LCG_NO_SIMD") == nullptr;
const bool use_gather = std::getenv("LCG_GATHER") != nullptr ||
                        (std::getenv("LCG_SCALAR_LOADS") == nullptr && !__builtin_cpu_is("amd"));
#else
const bool cpu_has_avx2 = false;
const bool use_gather = false;
#endif

#if defined(__x86_64__)
__attribute__((target("avx2"))) static size_t find_byte_avx2(const uint8_t * p, size_t n, uint8_t b,
                                                             std::vector<size_t> & at) {
    const __m256i needle = _mm256_set1_epi8(static_cast<char>(b));
    size_t k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + k));
        for (uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, needle))); m != 0;
             m &= m - 1) {
            at.push_back(k + static_cast<size_t>(__builtin_ctz(m)));
        }
    }
    return k;
}

// Counts over whole 32-byte blocks; *done: how many bytes that was.
__attribute__((target("avx2"))) static size_t count_byte_avx2(const uint8_t * p, size_t n, uint8_t b,
                                                              size_t * done) {
    const __m256i needle = _mm256_set1_epi8(static_cast<char>(b));
    size_t count = 0, k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + k));
        const uint32_t equal = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, needle)));
        count += static_cast<size_t>(__builtin_popcount(equal));
    }
    *done = k;
    return count;
}
#endif

size_t count_byte(const uint8_t * p, size_t n, uint8_t b) {
    size_t count = 0, k = 0;
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        count = count_byte_avx2(p, n, b, &k);
    }
#endif
    for (; k < n; k++) {
        count += p[k] == b;
    }
    return count;
}

void find_byte(const uint8_t * p, size_t n, uint8_t b, std::vector<size_t> & at) {
    size_t k = 0;
#if defined(__x86_64__)
    if (cpu_has_avx2) {
        k = find_byte_avx2(p, n, b, at);
    }
#endif
    for (; k < n; k++) {
        if (p[k] == b) {
            at.push_back(k);
        }
    }
}

// ---- memory ----------------------------------------------------------------------------------

void * alloc_filled(size_t n) {
    constexpr size_t HUGE_PAGE = size_t(2) << 20;
    if (n < HUGE_PAGE) {
        return std::malloc(n);
    }
    const size_t rounded = (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void * p = std::aligned_alloc(HUGE_PAGE, rounded);
#if defined(MADV_HUGEPAGE)
    if (p != nullptr) {
        madvise(p, rounded, MADV_HUGEPAGE);  // advice only: where it is refused, 4 KiB pages
    }
#endif
    return p;
}

// ---- threads ---------------------------------------------------------------------------------

size_t parallel_workers(size_t n, int n_threads) {
    if (n_threads <= 0) {
        n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
    return std::min<size_t>(static_cast<size_t>(n_threads), n);
}

void parallel_for_workers(size_t n, int n_threads, const std::function<void(size_t, size_t)> & fn) {
    const size_t n_workers = parallel_workers(n, n_threads);
    if (n_workers <= 1) {
        for (size_t i = 0; i < n; i++) {
            fn(i, 0);
        }
        return;
    }
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&](size_t worker) {
        for (size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
            try {
                fn(i, worker);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mutex);
                if (!error) {
                    error = std::current_exception();
                }
                failed = true;
            }
        }
    };
    std::vector<std::thread> threads;
    threads.reserve(n_workers - 1);
    for (size_t t = 1; t < n_workers; t++) {
        try {
            threads.emplace_back(work, t);
        } catch (...) {
            break;  // no more threads (EAGAIN at a pids limit, no memory): those started and this one do the work
        }
    }
    work(0);
    for (auto & t : threads) {
        t.join();
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

void parallel_for(size_t n, int n_threads, const std::function<void(size_t)> & fn) {
    parallel_for_workers(n, n_threads, [&](size_t i, size_t) { fn(i); });
}

} // namespace lcg
