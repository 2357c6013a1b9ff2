// container.h -- the llama-cachegen container: header, section table with CRC32C per section,
// payloads (byte layout in docs/format.md).
#pragma once

#include "common.h"

#include <vector>

namespace lcg {

constexpr uint32_t CONTAINER_MAGIC = 0x4347434cu;  // "LCGC"
constexpr uint32_t HEADER_SIZE = 64;
constexpr uint32_t SECTION_ENTRY_SIZE = 32;
// A container may not declare a state over this many times its own size (plus 1 MiB): keeps a
// forged header from making a reader allocate terabytes. Real lossy levels stay below 100x.
constexpr uint64_t MAX_EXPANSION = 1024;

struct ContainerHeader {
    uint32_t format_version = LCG_FORMAT_VERSION;
    int32_t part = LCG_PART_WHOLE;
    int32_t level = 0;
    int32_t state_kind = 0;
    uint32_t n_sections = 0;
    uint64_t state_size = 0;  // whole / skeleton: bytes of the decoded state; else 0
    uint64_t kv_bytes = 0;    // K/V payload bytes the object restores (skeleton: of the state)
    uint32_t n_tokens = 0;
    uint32_t n_cells = 0;
    uint32_t pos_begin = 0, pos_end = 0;  // chunk: positions [begin, end)
    uint32_t n_layers = 0;                // of the first KV cache
    uint32_t n_caches = 0;
};

struct SectionPayload {
    uint32_t type;
    uint32_t tensor;
    std::vector<uint8_t> bytes;      // the payload, unless `view` is set
    const uint8_t * view = nullptr;  // else: view_size bytes that stay alive until written
    size_t view_size = 0;

    const uint8_t * data() const { return view ? view : bytes.data(); }
    size_t size() const { return view ? view_size : bytes.size(); }
};

// The caller's allocator for a container (lcg_encode_params.out_alloc); fn NULL: alloc_filled.
struct OutputAlloc {
    void * (*fn)(void * ctx, size_t size) = nullptr;
    void * ctx = nullptr;
};

// Lays out header, table and payloads in one buffer from `alloc` (or alloc_filled, released with
// free()), on up to n_threads threads. Each owned payload is released once copied, so that the
// sections and the container are not all held at once (an encode's peak memory).
uint8_t * write_container(ContainerHeader header, std::vector<SectionPayload> && sections, int n_threads,
                          size_t * out_size, const OutputAlloc & alloc = {});

struct ContainerView {
    ContainerHeader header;
    std::vector<lcg_section> sections;
    const uint8_t * data;
    size_t size;

    ByteReader section_reader(const lcg_section & s, const char * what) const {
        return ByteReader(data + s.offset, s.size, LCG_ERR_CORRUPT, what);
    }
};

// Checks magic, version, header checksum, that every section lies inside the buffer and that no two
// overlap (so that verifying every section is linear in the container's size).
ContainerView read_container(const uint8_t * data, size_t size);
// Checks one section's CRC32C.
void verify_section(const ContainerView & c, const lcg_section & s);

} // namespace lcg
