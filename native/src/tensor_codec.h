// tensor_codec.h -- one K/V tensor: its statistics (quantizer and frequency tables, computed once
// over the whole state) and its coded rows (any subset of cells, e.g. one token chunk).
// Byte layouts: docs/format.md, "Stats section" and "Tensor section".
#pragma once

#include "quantize.h"
#include "rans.h"
#include "rope.h"
#include "state_format.h"

#include <memory>
#include <vector>

namespace lcg {

// How a tensor is coded, shared by every object (whole container or chunk) that codes its rows.
struct TensorStats {
    bool lossy = false;
    // Lossy over a q8_0 tensor's values (coded as f32, one unit per value), quantized back on decode
    bool requantized = false;
    // Lossy transform (docs/format.md, "Stats section"): with anchor_tokens = N > 0, object row r
    // with r % N != 0 codes its difference from row r - r % N (CacheGen's anchor/delta grouping).
    uint32_t anchor_tokens = 0;
    // Lossy K: values coded rotated back by their position (rope.h); pairing 0: not.
    Rope rope;
    uint32_t group = 8;  // units per frequency table (and per quantizer step)
    uint32_t raw_bits = 0;  // lossy: q's low bits sent raw (lanes.h), 0..MAX_RAW_BITS
    uint32_t n_groups = 0;
    // lossy: per unit mean, per group step and reconstruction offset (f16 / u8 as stored)
    std::vector<uint16_t> mean_f16, step_f16;
    std::vector<uint8_t> shrink_u8;
    // lossless: per byte plane, stored as is (1) or coded (0)
    std::vector<uint8_t> plane_stored;
    // lossy: n_groups tables; lossless: n_groups tables per coded plane, plane-major
    std::vector<rans::Table> tables;
};

void write_stats(ByteWriter & w, const TensorStats & s, const TensorDesc & t);

TensorStats read_stats(ByteReader & r, const TensorDesc & t);

// An element of an object: its row (object row, a cell of the state) and unit.
struct RowUnit {
    uint32_t row, unit;
};

// The order an object codes its elements in (docs/format.md, "Rows of an object, and their
// order"): n_lines lines of line_len elements. Lossless tensors and transposed ones (units whose
// cells are side by side) code in memory order; a lossy row-major tensor whose units are a whole
// number of groups codes group by group (GROUPS: a group's rows one after another), so that one
// frequency table serves a long run instead of every table taking turns along each row.
struct Lines {
    enum Kind : uint8_t { ROWS, UNITS, GROUPS } kind;
    uint32_t shift;  // GROUPS: log2 of the group
    size_t n_lines, line_len;

    Lines(const TensorDesc & obj, const TensorStats & s) {
        shift = static_cast<uint32_t>(__builtin_ctz(s.group));  // 8, 16 or 32 (read_stats checks)
        kind = obj.transposed ? UNITS : s.lossy && obj.n_units % s.group == 0 ? GROUPS : ROWS;
        n_lines = kind == ROWS ? obj.n_cells : kind == UNITS ? obj.n_units : obj.n_units >> shift;
        line_len = kind == ROWS ? obj.n_units : kind == UNITS ? obj.n_cells : static_cast<size_t>(obj.n_cells) << shift;
    }
    RowUnit at(size_t line, size_t i) const {
        switch (kind) {
            case ROWS: return {static_cast<uint32_t>(line), static_cast<uint32_t>(i)};
            case UNITS: return {static_cast<uint32_t>(i), static_cast<uint32_t>(line)};
            default: return {static_cast<uint32_t>(i >> shift), static_cast<uint32_t>(line << shift | (i & mask()))};
        }
    }
    RowUnit at(size_t k) const { return at(k / line_len, k % line_len); }
    uint64_t index(uint32_t row, uint32_t unit) const {
        switch (kind) {
            case ROWS: return static_cast<uint64_t>(row) * line_len + unit;
            case UNITS: return static_cast<uint64_t>(unit) * line_len + row;
            default: return (unit >> shift) * line_len + (static_cast<uint64_t>(row) << shift) + (unit & mask());
        }
    }
    uint32_t mask() const { return (1u << shift) - 1; }
};

// Everything the encoder derives from the whole tensor once, to code any subset of its cells.
struct TensorEncoder {
    TensorStats stats;
    // lossy: one symbol per element, in the coding order of the whole tensor (docs/format.md, "Rows
    // of an object"; each written once: no zeroing), and with raw_bits each element's raw bits
    std::unique_ptr<uint8_t[]> sym, raw;
    std::vector<std::pair<uint64_t, int64_t>> escapes;  // lossy: (element index in that order, q), sorted
    std::vector<rans::EncTable> enc;                  // one per table
};

// Builds the statistics (and, lossy, the symbols) of tensor t of `state`. Lossy with knobs (NULL:
// lossless) when the tensor is f32/f16/bf16 and its values are finite; cells with is_sink[cell]
// are kept exact. With knobs->anchor_tokens, state row (cell) i is coded from cell i - i % N: an
// object decodes the same only when its rows are the state's cells in order from a multiple of N.
// With a rope hint (NULL: none), a K tensor may be coded rotated back by its cells' positions `pos`.
void prepare_tensor(const uint8_t * state, const TensorDesc & t, const QuantKnobs * knobs, const RopeHint * rope,
                    const std::vector<uint8_t> & is_sink, const std::vector<int32_t> & pos, TensorEncoder & e);

// Codes the rows `cells` (state cell indices, in object row order) of tensor t, its streams cut
// into slices of slice_elements symbols (a positive multiple of 32).
void encode_rows(const uint8_t * state, const TensorDesc & t, const TensorEncoder & e,
                 const std::vector<uint32_t> & cells, const std::vector<uint8_t> & is_sink, uint32_t slice_elements,
                 ByteWriter & w);

// Statistics in decode-ready form: tables expanded to decode slots (16 KiB each), values as floats.
// Built once per statistics object, shared by every chunk that names it.
struct TensorDecoder {
    TensorStats stats;
    std::vector<uint32_t> slots;  // 4096 per table, in stats.tables order
    std::vector<float> mean;      // lossy: per unit
    std::vector<float> step, shrink;  // lossy: per group
};
TensorDecoder prepare_decoder(TensorStats stats);

// Decodes one tensor section (m = obj.n_cells rows) into the destination tensor `dst` of the
// state at `state`: object row r goes to dst cell row_cell[r], whose position is cell_pos[dst cell]
// (needed by rope-coded tensors only: NULL refuses them).
void decode_rows(ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, uint8_t * state,
                 const TensorDesc & dst, const std::vector<uint32_t> & row_cell, const std::vector<int32_t> * cell_pos);

} // namespace lcg
