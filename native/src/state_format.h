// state_format.h -- reads llama.cpp state layouts (docs/llama-state.md) into segments:
// verbatim byte ranges and K/V tensors. Rebuilding the state is concatenating the segments.
#pragma once

#include "common.h"

#include <vector>

namespace lcg {

// ggml element types a KV cache may hold, as (block elements, block bytes).
struct GgmlType {
    int32_t id;
    const char * name;
    uint32_t block_size;
    uint32_t type_size;
    bool is_float;  // f32 / f16 / bf16: may be coded lossily
};
// nullptr for types a KV cache cannot hold.
const GgmlType * ggml_type_info(int32_t id);

// One K or V tensor of one layer of one stream: n_cells x n_units units of unit_bytes each.
// A unit is one element for float types and one quantization block otherwise.
// Unit (cell i, unit u) starts at offset + (transposed ? u * n_cells + i : i * n_units + u) * unit_bytes.
struct TensorDesc {
    int32_t ggml_type;
    bool is_v;
    bool transposed;      // V stored channel-major (llama.cpp v_trans = 1)
    uint32_t layer;       // index within its cache
    uint32_t n_layer;     // layers of its cache
    uint32_t n_cells;
    uint32_t n_units;
    uint32_t unit_bytes;
    uint64_t offset;      // in the state buffer
    uint32_t cell_group;  // index into ParsedState::groups (its stream's cells)

    uint64_t bytes() const { return static_cast<uint64_t>(n_cells) * n_units * unit_bytes; }
};

struct Segment {
    uint64_t offset;  // in the state buffer
    uint64_t size;
    int32_t tensor;   // index into tensors, or -1 for verbatim bytes
};

// The cells of one stream of one KV cache: where their count and metadata lie in the state, and
// their positions in state order.
struct CellGroup {
    uint32_t stream;                    // its index among the cache's streams
    uint64_t count_offset;              // of the u32 cell_count
    std::vector<uint64_t> meta_offset;  // n_cells + 1: where each cell's metadata starts (and the end)
    std::vector<int32_t> pos;
    // The sequence every cell belongs to alone (a whole-context state lists each cell's ids), or
    // SEQ_NONE (a sequence's state lists none), or SEQ_MIXED (cells of several sequences, shared
    // cells or a cell of none)
    int32_t only_seq = SEQ_NONE;
    static constexpr int32_t SEQ_NONE = -1, SEQ_MIXED = -2;
};

struct ParsedState {
    int32_t kind = LCG_KIND_AUTO;
    uint32_t n_tokens = 0;   // prompt tokens of file kinds
    uint64_t tokens_offset = 0;  // of the u32 n_tokens field in file kinds
    uint32_t n_caches = 0;   // KV caches found (2 for interleaved-SWA models)
    uint32_t n_cells = 0;    // over all streams and caches
    uint32_t n_layers = 0;   // of the first cache
    uint64_t kv_bytes = 0;
    std::vector<Segment> segments;
    std::vector<TensorDesc> tensors;
    std::vector<CellGroup> groups;  // per (cache, stream) with cells
    uint64_t tail_offset = 0;        // bytes after the last KV cache (a hybrid model's recurrent part)
};

// Parses a state of the given kind (LCG_KIND_AUTO: detect). Throws LCG_ERR_UNSUPPORTED_FORMAT
// with what was found when the bytes are not a layout this library reads.
ParsedState parse_state(const uint8_t * data, size_t size, int32_t kind);

const char * state_kind_name(int32_t kind);

// Number of positions n when one stream holds cells (in each cache), they are exactly the
// positions 0..n-1, each once, and every cell is of one and the same sequence: such a state can be
// cut into token chunks. Throws LCG_ERR_UNSUPPORTED_FORMAT saying why otherwise (several sequences
// in a stream or in several streams, a sliding-window cache holding only recent positions).
uint32_t chunkable_positions(const ParsedState & st);

// The state of the first n_pos positions of a chunkable state: the same bytes with every stream cut
// to its cells of position < n_pos (and a file's prompt tokens to n_pos). K/V rows are copied when
// copy_kv, else left zero.
std::vector<uint8_t> prefix_state(const uint8_t * data, size_t size, const ParsedState & st, uint32_t n_pos,
                                  bool copy_kv);

// Per stream (cell group) of a chunkable state: the state's cell index holding each position.
// Throws as chunkable_positions for a state that is not chunkable (a caller's state, or a
// skeleton from a store, whose cells hold positions past their count).
std::vector<std::vector<uint32_t>> cell_of_position(const ParsedState & st);

// Per stream (cell group): the cell index holding each position of [pos_begin, pos_end), in a
// state whose streams need hold only that range of one sequence: llama.cpp lets a sliding-window
// cache reuse the cells of positions out of its window (after a restored state reaches the window,
// the next positions computed take them), so it no longer holds positions 0..n-1. Throws
// LCG_ERR_UNSUPPORTED_FORMAT when a stream lacks a position of the range or holds one twice, or the
// cells are of several sequences or streams.
std::vector<std::vector<uint32_t>> cells_of_range(const ParsedState & st, uint32_t pos_begin, uint32_t pos_end);

} // namespace lcg
