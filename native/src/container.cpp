#include "container.h"

#include <cstdlib>
#include <memory>

namespace lcg {

namespace {

const char * section_type_name(uint32_t type) {
    switch (type) {
        case LCG_SECTION_LAYOUT: return "layout";
        case LCG_SECTION_VERBATIM: return "verbatim";
        case LCG_SECTION_TENSOR: return "tensor";
        case LCG_SECTION_USER_META: return "user meta";
        case LCG_SECTION_STATS: return "statistics";
        case LCG_SECTION_STATS_REF: return "statistics reference";
        default: return "unknown";
    }
}

} // namespace

uint8_t * write_container(ContainerHeader h, std::vector<SectionPayload> && sections, int n_threads,
                          size_t * out_size, const OutputAlloc & alloc) {
    h.n_sections = static_cast<uint32_t>(sections.size());
    const size_t table_end = HEADER_SIZE + static_cast<size_t>(SECTION_ENTRY_SIZE) * sections.size();
    std::vector<uint64_t> offset(sections.size()), size(sections.size());
    size_t total = table_end;
    for (size_t i = 0; i < sections.size(); i++) {
        offset[i] = total;
        size[i] = sections[i].size();
        total += size[i];
    }
    // The caller's memory stays the caller's if this fails.
    std::unique_ptr<uint8_t, void (*)(void *)> owned(
        static_cast<uint8_t *>(alloc.fn ? alloc.fn(alloc.ctx, total) : alloc_filled(total)),
        alloc.fn ? [](void *) {} : std::free);
    uint8_t * out = owned.get();
    LCG_CHECK(out != nullptr, LCG_ERR_OUT_OF_MEMORY, "cannot allocate a %zu-byte container", total);
    // Each payload checksummed and copied in one visit, the sections shared among the threads.
    std::vector<uint32_t> crc(sections.size());
    parallel_for(sections.size(), n_threads, [&](size_t i) {
        SectionPayload & s = sections[i];
        crc[i] = crc32c(s.data(), s.size());
        if (s.size() > 0) {
            std::memcpy(out + offset[i], s.data(), s.size());
        }
        std::vector<uint8_t>().swap(s.bytes);
    });
    ByteWriter head;
    head.u32(CONTAINER_MAGIC);
    head.u16(static_cast<uint16_t>(h.format_version));
    head.u16(HEADER_SIZE);
    head.u8(static_cast<uint8_t>(h.part));
    head.u8(static_cast<uint8_t>(h.level));
    head.u8(static_cast<uint8_t>(h.state_kind));
    head.u8(0);  // flags
    head.u32(h.n_sections);
    head.u64(h.state_size);
    head.u64(h.kv_bytes);
    head.u32(h.n_tokens);
    head.u32(h.n_cells);
    head.u32(h.pos_begin);
    head.u32(h.pos_end);
    head.u32(h.n_layers);
    head.u32(h.n_caches);
    head.u32(0);  // reserved
    ByteWriter table;
    for (size_t i = 0; i < sections.size(); i++) {
        table.u32(sections[i].type);
        table.u32(sections[i].tensor);
        table.u64(offset[i]);
        table.u64(size[i]);
        table.u32(crc[i]);
        table.u32(0);
    }
    std::memcpy(out, head.buf.data(), head.buf.size());
    uint32_t header_crc = crc32c(head.buf.data(), head.buf.size());
    header_crc = crc32c(table.buf.data(), table.buf.size(), header_crc);
    std::memcpy(out + HEADER_SIZE - 4, &header_crc, 4);
    std::memcpy(out + HEADER_SIZE, table.buf.data(), table.buf.size());
    *out_size = total;
    return owned.release();
}

ContainerView read_container(const uint8_t * data, size_t size) {
    ContainerView c;
    c.data = data;
    c.size = size;
    uint32_t magic = 0;
    if (size >= 4) {
        std::memcpy(&magic, data, 4);
    }
    LCG_CHECK(size >= 4 && magic == CONTAINER_MAGIC, LCG_ERR_NOT_A_CONTAINER,
              "not a llama-cachegen container: starts with 0x%08x, expected 0x%08x ('LCGC')", magic, CONTAINER_MAGIC);
    ByteReader r(data, size, LCG_ERR_TRUNCATED, "container header");
    r.u32();
    ContainerHeader & h = c.header;
    h.format_version = r.u16();
    LCG_CHECK(h.format_version == LCG_FORMAT_VERSION, LCG_ERR_UNSUPPORTED_VERSION,
              "container format version %u; this library reads version %u%s", h.format_version, LCG_FORMAT_VERSION,
              h.format_version < LCG_FORMAT_VERSION ? " (written by an older llama-cachegen: encode the state again)" : "");
    const uint32_t header_size = r.u16();
    LCG_CHECK(header_size == HEADER_SIZE, LCG_ERR_CORRUPT, "header size %u, expected %u", header_size, HEADER_SIZE);
    h.part = r.u8();
    h.level = r.u8();
    h.state_kind = r.u8();
    r.u8();  // flags
    h.n_sections = r.u32();
    h.state_size = r.u64();
    h.kv_bytes = r.u64();
    h.n_tokens = r.u32();
    h.n_cells = r.u32();
    h.pos_begin = r.u32();
    h.pos_end = r.u32();
    h.n_layers = r.u32();
    h.n_caches = r.u32();
    r.u32();
    const uint32_t stored_crc = r.u32();
    LCG_CHECK(h.n_sections <= LCG_MAX_SECTIONS, LCG_ERR_LIMIT, "container declares %u sections (at most %u)",
              h.n_sections, LCG_MAX_SECTIONS);
    const uint8_t * table = r.take(static_cast<size_t>(h.n_sections) * SECTION_ENTRY_SIZE);
    uint32_t crc = crc32c(data, HEADER_SIZE - 4);
    crc = crc32c(table, static_cast<size_t>(h.n_sections) * SECTION_ENTRY_SIZE, crc);
    LCG_CHECK(crc == stored_crc, LCG_ERR_CHECKSUM, "header checksum 0x%08x does not match the stored 0x%08x",
              crc, stored_crc);
    LCG_CHECK(h.part >= LCG_PART_WHOLE && h.part <= LCG_PART_CHUNK, LCG_ERR_CORRUPT, "object part %d", h.part);
    LCG_CHECK(h.pos_begin <= h.pos_end, LCG_ERR_CORRUPT, "positions %u..%u", h.pos_begin, h.pos_end);
    LCG_CHECK(h.level >= LCG_LEVEL_LOSSLESS && h.level <= LCG_LEVEL_COMPACT, LCG_ERR_CORRUPT, "level %d", h.level);
    LCG_CHECK(h.state_kind >= LCG_KIND_SEQ_BUFFER && h.state_kind <= LCG_KIND_SESSION, LCG_ERR_CORRUPT,
              "state kind %d", h.state_kind);
    LCG_CHECK(h.state_size <= LCG_MAX_STATE_SIZE, LCG_ERR_LIMIT, "container declares a %llu-byte state",
              (unsigned long long) h.state_size);
    // A skeleton omits the K/V payloads: its state is bounded by the layout check instead.
    LCG_CHECK(h.part == LCG_PART_SKELETON || h.state_size <= MAX_EXPANSION * size + (1u << 20), LCG_ERR_LIMIT,
              "container of %zu bytes declares a %llu-byte state (more than %llux expansion)", size,
              (unsigned long long) h.state_size, (unsigned long long) MAX_EXPANSION);
    c.sections.resize(h.n_sections);
    ByteReader tr(table, static_cast<size_t>(h.n_sections) * SECTION_ENTRY_SIZE, LCG_ERR_CORRUPT, "section table");
    for (uint32_t i = 0; i < h.n_sections; i++) {
        lcg_section & s = c.sections[i];
        s.type = tr.u32();
        s.tensor = tr.u32();
        s.offset = tr.u64();
        s.size = tr.u64();
        s.crc32c = tr.u32();
        tr.u32();
        LCG_CHECK(s.offset <= size && s.size <= size - s.offset, LCG_ERR_TRUNCATED,
                  "%s section %u spans bytes %llu..%llu of a %zu-byte container", section_type_name(s.type), i,
                  (unsigned long long) s.offset, (unsigned long long) (s.offset + s.size), size);
    }
    // Sections lie back to back after the table, in order: no overlaps, nothing hidden between them.
    uint64_t at = HEADER_SIZE + static_cast<uint64_t>(h.n_sections) * SECTION_ENTRY_SIZE;
    for (uint32_t i = 0; i < h.n_sections; i++) {
        LCG_CHECK(c.sections[i].offset == at, LCG_ERR_CORRUPT, "section %u starts at %llu, expected %llu", i,
                  (unsigned long long) c.sections[i].offset, (unsigned long long) at);
        at += c.sections[i].size;
    }
    LCG_CHECK(at == size, LCG_ERR_CORRUPT, "container of %zu bytes has %llu bytes of sections", size,
              (unsigned long long) at);
    return c;
}

void verify_section(const ContainerView & c, const lcg_section & s) {
    const uint32_t crc = crc32c(c.data + s.offset, s.size);
    LCG_CHECK(crc == s.crc32c, LCG_ERR_CHECKSUM, "%s section at offset %llu: checksum 0x%08x, stored 0x%08x",
              section_type_name(s.type), (unsigned long long) s.offset, crc, s.crc32c);
}

} // namespace lcg
