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
    uint32_t cell_group;  // index into ParsedState::cell_pos (its stream's cell positions)

    uint64_t bytes() const { return static_cast<uint64_t>(n_cells) * n_units * unit_bytes; }
};

struct Segment {
    uint64_t offset;  // in the state buffer
    uint64_t size;
    int32_t tensor;   // index into tensors, or -1 for verbatim bytes
};

struct ParsedState {
    int32_t kind = LCG_KIND_AUTO;
    uint32_t n_tokens = 0;   // prompt tokens of file kinds
    uint32_t n_caches = 0;   // KV caches found (2 for interleaved-SWA models)
    uint32_t n_cells = 0;    // over all streams and caches
    uint32_t n_layers = 0;   // of the first cache
    uint64_t kv_bytes = 0;
    std::vector<Segment> segments;
    std::vector<TensorDesc> tensors;
    std::vector<std::vector<int32_t>> cell_pos;  // per (cache, stream) with cells: cell positions
};

// Parses a state of the given kind (LCG_KIND_AUTO: detect). Throws LCG_ERR_UNSUPPORTED_FORMAT
// with what was found when the bytes are not a layout this library reads.
ParsedState parse_state(const uint8_t * data, size_t size, int32_t kind);

const char * state_kind_name(int32_t kind);

} // namespace lcg
