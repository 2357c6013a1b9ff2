// plan.h -- what the host hands the CUDA backend (libllama_cachegen_cuda.so) to decode one object.
//
// The host (device.cpp, in the main library) does everything that needs no GPU: it verifies the
// checksums and the layout, parses each tensor section (exact rows, stream bounds and initial lane
// states, escape values), checks every destination range, and lays the jobs below out in one
// "arena" of plain structs. The backend uploads the container and the arena, runs the kernels on
// the caller's stream and reports per slice what the host cannot know in advance (a slice that
// runs past its words, has words left or holds another number of escapes than declared). Plain structs only:
// the two libraries share nothing else, and the main library loads the backend with dlopen.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lcg::cuda {

constexpr uint32_t BACKEND_ABI = 3;

// A frequency table as the kernels read it: cumulative frequencies, and per bucket of 32 slots the
// symbol that holds the bucket's first slot; a lookup walks up from there. 644 bytes instead of
// the CPU's 16 KiB slot table, so a tensor's tables stay in the L1 cache; both give the same
// symbol, frequency and cumulative frequency for every slot (kernels.h, decode_symbol).
constexpr uint32_t BUCKET_SHIFT = 5;
struct Table {
    uint16_t cum[258];  // cum[s] for s = 0..256 (cum[256] = 4096), then one pad
    uint8_t bucket[4096 >> BUCKET_SHIFT];
};
static_assert(sizeof(Table) == 644, "Table layout");

// One K/V tensor of the object and where it goes.
struct TensorJob {
    uint64_t dst;                    // byte offset of the tensor in the destination state
    uint64_t cell_stride;            // bytes between cells, in the destination
    uint64_t unit_stride;            // bytes between units, in the destination
    uint64_t rows;                   // arena offset of the u32 object row -> cell map; ~0: identity
    uint64_t n_outer, n_inner;       // the object's elements in coding order (docs/format.md): lines
    uint64_t mean, step, shrink;     // lossy: stats-space offsets of the f32 arrays (per unit, group, group)
    uint32_t transposed;
    uint32_t ggml_type;              // lossy: f32, f16 or bf16
    uint32_t unit_bytes;
    uint32_t group_shift;            // units per table = 1 << group_shift
    uint32_t lossy;
    uint32_t aligned;                // the destination allows unit-sized stores
    uint32_t raw_bits;               // lossy: q's low bits sent raw (lanes.h)
    uint32_t grouped;                // lines are groups: element (o, i) is row i >> group_shift of unit
                                     // o << group_shift | i's low bits; else (o, i) is (row, unit) or,
                                     // transposed, (unit, row)
};

// One slice of a stream (docs/format.md, "Streams"): 32 lanes, one warp decodes it.
struct SliceJob {
    uint64_t raw;        // container offset of its raw bits (lossy with raw_bits; the slice's start)
    uint64_t src;        // container offset: 32 x u32 initial states, then the words
    uint64_t bytes;      // of the states and words
    uint64_t k0, k1;     // the elements it codes, in its tensor's memory order
    uint64_t escapes;    // index of its first escape in the escape arrays
    uint64_t n_escapes;  // declared by the stream's directory
    uint32_t tensor;
    uint32_t plane;      // lossless: the byte plane it codes
};

// Up to BLOCK_WARPS consecutive slices of one stream, one warp each, in one thread block.
constexpr uint32_t BLOCK_WARPS = 8;
struct BlockJob {
    uint64_t tables;  // stats-space offset of the stream's first table
    uint32_t first;   // its first slice job
    uint32_t n_slices;
};

// A stored lossless byte plane: n_outer x n_inner bytes in memory order.
struct PlaneJob {
    uint64_t src;
    uint32_t tensor;
    uint32_t plane;
};

// Container bytes to the destination: verbatim segments and exact (sink) rows, done last.
struct CopyJob {
    uint64_t src, dst, size;
};

struct ZeroJob {
    uint64_t dst, size;
};

struct Plan {
    const uint8_t * container;  // host memory
    uint64_t container_size;
    const uint8_t * arena;      // host memory: every array below
    uint64_t arena_size;
    // The stats space (tables, means, steps, shrinks): device memory the host keeps (an opened
    // lcg_stats), or NULL when it is the arena from offset `stats`.
    const uint8_t * device_stats;
    uint64_t stats;
    uint64_t tensors, slices, blocks, planes, copies, zeros, escape_values;  // arena offsets
    uint32_t n_tensors, n_slices, n_blocks, n_planes, n_copies, n_zeros;
    uint64_t n_escapes;         // escape_values: one f32 q per escape, slices' escapes in order
    uint8_t * dst;              // device memory
    uint64_t dst_capacity;
    double seconds[2];          // set by the backend: uploading the container and plan, the kernels
};

// What the decode kernel says about a slice.
enum StreamStatus : uint32_t {
    STREAM_OK = 0,
    STREAM_OVERRUN = 1,    // a lane needed a word past the end
    STREAM_LEFTOVER = 2,   // words left after the last symbol
    STREAM_END_STATE = 3,  // a lane did not end in STATE_LOW
    STREAM_ESCAPES = 4,    // another number of escape symbols than the section declares
};

// The backend's entry points. Each int function returns an lcg_status and, on error, writes a
// message into msg.
struct Backend {
    uint32_t abi;  // BACKEND_ABI
    int (*device_count)(int * count, char * msg, size_t msg_size);
    int (*current_device)(int * device, char * msg, size_t msg_size);
    int (*alloc)(void ** ptr, size_t size, char * msg, size_t msg_size);
    void (*free)(void * ptr);
    // Any direction (unified addressing), ordered on `stream` and waited for.
    int (*copy)(void * dst, const void * src, size_t size, void * stream, char * msg, size_t msg_size);
    // Runs the plan on `stream` and waits for it; status gets n_slices StreamStatus (host memory),
    // plan->seconds the time of its phases.
    int (*decode)(Plan * plan, void * stream, uint32_t * status, char * msg, size_t msg_size);
};

} // namespace lcg::cuda

// The one symbol libllama_cachegen_cuda.so exports.
extern "C" const lcg::cuda::Backend * lcg_cuda_backend(void);
