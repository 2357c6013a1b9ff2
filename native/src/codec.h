// codec.h -- the objects of format v4 (docs/format.md): whole containers, skeletons, statistics
// and chunks, built from a parsed state by tensor_codec and laid out by container.
#pragma once

#include "container.h"
#include "quantize.h"
#include "state_format.h"
#include "tensor_codec.h"

#include <memory>

namespace lcg {

struct EncodeOptions {
    int32_t level;
    int32_t state_kind;
    int32_t n_threads;
    QuantKnobs knobs;
    uint32_t slice_elements;  // symbols per stream slice
    RopeHint rope;            // pairing 0: keys coded as stored
    const uint8_t * user_meta;
    size_t user_meta_size;
    OutputAlloc out_alloc;  // where a whole container goes (lcg_encode)
    std::vector<float> error_weights;  // per K/V tensor of the state, or empty (all 1)
};

// The LAYOUT section: the tensors an object codes and, for whole containers and skeletons, the
// segments that rebuild the state (offsets are positions in the decoded state).
struct Layout {
    QuantKnobs knobs;
    uint32_t n_layers = 0;
    std::vector<TensorDesc> tensors;
    std::vector<Segment> segments;
};
// Reads and validates the layout against the header (its checksum verified first).
Layout read_layout(const ContainerView & c);

// Returns a malloc'ed container of *out_size bytes.
uint8_t * encode_whole(const uint8_t * state, size_t size, const EncodeOptions & opt, size_t * out_size);
uint8_t * encode_skeleton(const uint8_t * state, size_t size, int32_t kind, size_t * out_size);

// Size of the state an object of `part` (a whole container, or a skeleton) decodes to, after
// validating its layout; another part is refused (a skeleton taken for a whole container would
// give a state of zero K/V without a word).
size_t decoded_size(const uint8_t * data, size_t size, int32_t part);
// Verifies every checksum, then rebuilds the state into dst (a skeleton's K/V left zero).
size_t decode_whole(const uint8_t * data, size_t size, int32_t part, int32_t n_threads, uint8_t * dst,
                    size_t dst_capacity);

// Where a decode writes: host memory (decode_whole, decode_chunk) or a CUDA device (device.cpp).
// The walkers below check everything the host can (checksums, layout, sizes, destination bounds),
// then call copy/zero for the state's verbatim segments and tensor() once per tensor, from up to
// n_threads threads at once; tensor() must consume its section reader to the end.
struct DecodeSink {
    virtual ~DecodeSink() = default;
    virtual void copy(uint64_t dst_offset, const uint8_t * src, uint64_t size) = 0;
    virtual void zero(uint64_t dst_offset, uint64_t size) = 0;
    // Tensor i: its section `r`, coded as `obj`, goes to `dst` (offset in the state), object row r
    // to cell row_cell[r], at position (*cell_pos)[row_cell[r]] (NULL where the walker cannot tell:
    // RoPE-coded keys are then refused).
    virtual void tensor(size_t i, ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec,
                        const TensorDesc & dst, const std::vector<uint32_t> & row_cell,
                        const std::vector<int32_t> * cell_pos) = 0;
    // The destination when it is host memory (its cells' positions can then be read once the
    // verbatim segments are in), else NULL.
    virtual const uint8_t * host_state() const { return nullptr; }
};
size_t decode_whole_to(const uint8_t * data, size_t size, int32_t part, int32_t n_threads, size_t dst_capacity,
                       DecodeSink & sink);
// Writes the state of a skeleton's first n_pos positions, K/V zero, into dst (NULL: only its size)
// and returns its size. All positions decode straight into dst; a prefix is built aside first.
size_t skeleton_state(const uint8_t * data, size_t size, uint32_t n_pos, uint8_t * dst, size_t dst_capacity);

// Chunk encoding of one state at one level: parsed and quantized once, then cut at will.
struct Chunker {
    const uint8_t * state;
    size_t size;
    EncodeOptions opt;
    ParsedState st;
    uint32_t n_pos;
    std::vector<std::vector<uint8_t>> is_sink;        // per cell group
    std::vector<std::vector<uint32_t>> cell_of_pos;   // per cell group
    std::vector<TensorEncoder> tensors;
};
std::unique_ptr<Chunker> chunker_init(const uint8_t * state, size_t size, const EncodeOptions & opt);
uint8_t * chunker_stats(const Chunker & ch, size_t * out_size);
uint8_t * chunker_encode(const Chunker & ch, uint32_t pos_begin, uint32_t pos_end, const uint8_t * stats_id,
                         const uint8_t * user_meta, size_t user_meta_size, size_t * out_size);

// The container at data, which must be of `part` (else LCG_ERR_INVALID_ARGUMENT naming `what`).
ContainerView read_part(const uint8_t * data, size_t size, int32_t part, const char * what);

// A statistics object opened for decoding: checked once, tables expanded once, shared by chunks.
struct Stats {
    int32_t level;
    Layout layout;
    uint8_t id[32];
    std::vector<TensorDecoder> tensors;
};
std::unique_ptr<Stats> open_stats(const uint8_t * data, size_t size, const uint8_t * id, int32_t n_threads);
void decode_chunk(const uint8_t * chunk, size_t chunk_size, const Stats & stats, int32_t n_threads, uint8_t * state,
                  size_t state_size);
// Several chunks of one statistics object at once, tensor by tensor across them; all are checked
// before any is written.
void decode_chunks(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks, const Stats & stats,
                   int32_t n_threads, uint8_t * state, size_t state_size);
// The same with the state's layout read from `state` (host bytes: only what is not K/V is read) and
// the writes going to `sink`.
void decode_chunks_to(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                      const Stats & stats, int32_t n_threads, const uint8_t * state, size_t state_size,
                      DecodeSink & sink);
void splice(uint8_t * state, size_t state_size, const uint8_t * src, size_t src_size, uint32_t pos_begin,
            uint32_t pos_end);

} // namespace lcg
