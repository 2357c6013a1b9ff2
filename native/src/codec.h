// codec.h -- the pipeline: state segments -> per-(tensor, channel group) coded streams -> container,
// and back. Tensor section layout in docs/format.md.
#pragma once

#include "container.h"
#include "quantize.h"
#include "state_format.h"

namespace lcg {

struct EncodeOptions {
    int32_t level;
    int32_t state_kind;
    int32_t n_threads;
    QuantKnobs knobs;
    const uint8_t * user_meta;
    size_t user_meta_size;
};

// Returns a malloc'ed container of *out_size bytes.
uint8_t * encode_state(const uint8_t * state, size_t size, const EncodeOptions & opt, size_t * out_size);

// Verifies every checksum, then rebuilds the state into dst.
size_t decode_container(const uint8_t * data, size_t size, int32_t n_threads, uint8_t * dst, size_t dst_capacity);

// The LAYOUT section: how segments and tensors rebuild the state, and the knobs used.
struct Layout {
    QuantKnobs knobs;
    uint32_t n_layers = 0;
    std::vector<TensorDesc> tensors;
    std::vector<Segment> segments;  // offsets are positions in the decoded state
};
// Reads and validates the layout against the header (its checksum verified first).
Layout read_layout(const ContainerView & c);

} // namespace lcg
