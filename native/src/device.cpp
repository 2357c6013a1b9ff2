#include "device.h"

#include "cuda/plan.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace lcg {

namespace {

constexpr const char * BACKEND_FILE = "libllama_cachegen_cuda.so";
constexpr size_t MSG = 512;

thread_local DeviceTiming last_timing;

struct Loaded {
    const cuda::Backend * backend = nullptr;
    std::string why;  // when backend is NULL
};

// Our own directory: the backend is installed beside this library.
std::string library_dir() {
    Dl_info info;
    if (dladdr(reinterpret_cast<void *>(&library_dir), &info) == 0 || info.dli_fname == nullptr) {
        return ".";
    }
    const std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

Loaded load_backend() {
    Loaded l;
    if (std::getenv("LCG_NO_CUDA") != nullptr) {
        l.why = "LCG_NO_CUDA is set";
        return l;
    }
    const char * override_path = std::getenv("LCG_CUDA_LIBRARY");
    const std::string path = override_path ? override_path : library_dir() + "/" + BACKEND_FILE;
    void * handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed: kernels stay loaded
    if (handle == nullptr) {
        const char * err = dlerror();
        l.why = "no CUDA backend (" + path + ": " + (err ? err : "not found") +
                "); this build may have been made without CUDA (LCG_CUDA=OFF)";
        return l;
    }
    using Entry = const cuda::Backend * (*)();
    const auto entry = reinterpret_cast<Entry>(dlsym(handle, "lcg_cuda_backend"));
    const cuda::Backend * b = entry ? entry() : nullptr;
    if (b == nullptr || b->abi != cuda::BACKEND_ABI) {
        l.why = path + " is not a CUDA backend of this library version";
        return l;
    }
    l.backend = b;
    return l;
}

const Loaded & loaded() {
    static const Loaded l = load_backend();
    return l;
}

// The backend, with at least one device; else LCG_ERR_NO_DEVICE saying why.
const cuda::Backend & require_device() {
    std::string why;
    LCG_CHECK(cuda_device_count(&why) > 0, LCG_ERR_NO_DEVICE, "no CUDA device: %s", why.c_str());
    return *loaded().backend;
}

void check_backend(int status, const char * msg) {
    LCG_CHECK(status == LCG_OK, status, "CUDA: %s", msg);
}

// An aligned byte arena of plain structs, uploaded in one copy.
struct Arena {
    std::vector<uint8_t> buf;
    uint64_t put(const void * p, size_t n) {
        buf.resize((buf.size() + 7) & ~size_t(7));
        const uint64_t at = buf.size();
        buf.insert(buf.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
        return at;
    }
    template <typename T> uint64_t put(const std::vector<T> & v) { return put(v.data(), v.size() * sizeof(T)); }
};

cuda::Table device_table(const rans::Table & t) {
    cuda::Table d;
    for (uint32_t s = 0; s <= 256; s++) {
        d.cum[s] = t.cum[s];
    }
    d.cum[257] = static_cast<uint16_t>(rans::PROB_SCALE);
    uint32_t s = 0;
    for (uint32_t b = 0; b < (rans::PROB_SCALE >> cuda::BUCKET_SHIFT); b++) {
        const uint32_t slot = b << cuda::BUCKET_SHIFT;
        while (t.cum[s + 1] <= slot) {
            s++;
        }
        d.bucket[b] = static_cast<uint8_t>(s);
    }
    return d;
}

// Appends a tensor's tables (each table's cum must end at PROB_SCALE: read_table checked it) and,
// lossy, its quantizers to the stats space.
DeviceStats::Tensor put_stats(Arena & a, const TensorDecoder & dec) {
    std::vector<cuda::Table> tables;
    tables.reserve(dec.stats.tables.size());
    for (const rans::Table & t : dec.stats.tables) {
        tables.push_back(device_table(t));
    }
    DeviceStats::Tensor at;
    at.tables = a.put(tables);
    at.mean = a.put(dec.mean);
    at.step = a.put(dec.step);
    at.shrink = a.put(dec.shrink);
    return at;
}

// Collects the jobs of one object, parsing each tensor section as decode_rows does.
struct DeviceSink : DecodeSink {
    const uint8_t * container;
    uint8_t * dst;
    uint64_t dst_capacity;
    const DeviceStats::Copy * cached;  // chunk: stats already on the device
    Arena arena;                       // whole: the stats space; then rows, then the jobs
    std::vector<cuda::TensorJob> tensors;
    std::vector<cuda::SliceJob> slices;
    std::vector<cuda::BlockJob> blocks;
    std::vector<cuda::PlaneJob> planes;
    std::vector<cuda::CopyJob> copies;
    std::vector<cuda::ZeroJob> zeros;
    std::vector<float> escape_q;
    std::map<const uint32_t *, uint64_t> rows_at;  // row maps are shared per cell group

    DeviceSink(const uint8_t * container, uint8_t * dst, uint64_t dst_capacity, const DeviceStats::Copy * cached)
        : container(container), dst(dst), dst_capacity(dst_capacity), cached(cached) {}

    void copy(uint64_t dst_offset, const uint8_t * src, uint64_t size) override {
        if (size > 0) {
            copies.push_back({static_cast<uint64_t>(src - container), dst_offset, size});
        }
    }
    void zero(uint64_t dst_offset, uint64_t size) override {
        if (size > 0) {
            zeros.push_back({dst_offset, size});
        }
    }

    uint64_t rows(const std::vector<uint32_t> & row_cell) {
        bool identity = true;
        for (size_t r = 0; r < row_cell.size() && identity; r++) {
            identity = row_cell[r] == r;
        }
        if (identity) {
            return ~uint64_t(0);
        }
        auto it = rows_at.find(row_cell.data());
        if (it == rows_at.end()) {
            it = rows_at.emplace(row_cell.data(), arena.put(row_cell)).first;
        }
        return it->second;
    }

    void tensor(size_t i, ByteReader & r, const TensorDesc & obj, const TensorDecoder & dec, const TensorDesc & dst_t,
                const std::vector<uint32_t> & row_cell, const std::vector<int32_t> *) override {
        LCG_CHECK(dst_t.offset + dst_t.bytes() <= dst_capacity && row_cell.size() == obj.n_cells, LCG_ERR_INTERNAL,
                  "tensor %zu does not fit its destination", i);
        const TensorStats & s = dec.stats;
        LCG_CHECK(s.anchor_tokens == 0, LCG_ERR_UNSUPPORTED_FORMAT,
                  "tensor %zu is coded with the anchor/delta transform, which decodes on the CPU only", i);
        LCG_CHECK(!s.rope.pairing, LCG_ERR_UNSUPPORTED_FORMAT,
                  "tensor %zu is coded with the RoPE transform, which decodes on the CPU only", i);
        LCG_CHECK(!s.requantized, LCG_ERR_UNSUPPORTED_FORMAT,
                  "tensor %zu holds a q8_0 cache's values coded lossily, which decode on the CPU only", i);
        const DeviceStats::Tensor at = cached ? cached->tensors[i] : put_stats(arena, dec);
        cuda::TensorJob t{};
        t.dst = dst_t.offset;
        t.cell_stride = dst_t.transposed ? dst_t.unit_bytes : static_cast<uint64_t>(dst_t.n_units) * dst_t.unit_bytes;
        t.unit_stride = dst_t.transposed ? static_cast<uint64_t>(dst_t.n_cells) * dst_t.unit_bytes : dst_t.unit_bytes;
        t.rows = rows(row_cell);
        const Lines lines(obj, s);  // the object's coding order (docs/format.md)
        // The kernels index lines and slices with 32 bits (cuda/kernels.h; a lane's index in its
        // line passes the line's end by up to 32 before it wraps).
        LCG_CHECK(lines.n_lines <= (1u << 31) && lines.line_len <= (1u << 31), LCG_ERR_LIMIT,
                  "tensor %zu: %zu lines of %zu elements, past the device decoder's 32-bit indexes", i, lines.n_lines,
                  lines.line_len);
        t.group_shift = lines.shift;
        t.grouped = lines.kind == Lines::GROUPS;
        t.n_outer = lines.n_lines;
        t.n_inner = lines.line_len;
        t.mean = at.mean;
        t.step = at.step;
        t.shrink = at.shrink;
        t.transposed = obj.transposed;
        t.ggml_type = static_cast<uint32_t>(obj.ggml_type);
        t.unit_bytes = obj.unit_bytes;
        t.lossy = s.lossy;
        t.raw_bits = s.raw_bits;
        t.aligned = (reinterpret_cast<uintptr_t>(dst) + dst_t.offset) % obj.unit_bytes == 0;
        const uint32_t ti = static_cast<uint32_t>(tensors.size());
        tensors.push_back(t);

        // As decode_rows: exact rows, then the coded rows.
        const uint32_t n_sink = r.u32();
        LCG_CHECK(n_sink <= obj.n_cells && n_sink <= r.remaining() / 4, LCG_ERR_CORRUPT, "%u exact rows of %u",
                  n_sink, obj.n_cells);
        std::vector<uint32_t> sinks(n_sink);
        for (uint32_t & row : sinks) {
            row = r.u32();
            LCG_CHECK(row < obj.n_cells, LCG_ERR_CORRUPT, "exact row %u of %u", row, obj.n_cells);
        }
        const size_t row_bytes = static_cast<size_t>(obj.n_units) * obj.unit_bytes;
        const uint8_t * raw = r.take(n_sink * row_bytes);
        const size_t n = static_cast<size_t>(obj.n_cells) * obj.n_units;
        // A stream's slices, a warp each, in blocks of up to BLOCK_WARPS consecutive slices; returns
        // the escapes its directory declares.
        auto stream = [&](uint32_t plane, uint64_t tables) {
            const uint32_t bytes = r.u32();
            const std::vector<rans::Slice> list = rans::read_slices(r.take(bytes), bytes, n, s.lossy);
            uint64_t escapes = escape_q.size();
            for (size_t first = 0; first < list.size(); first += cuda::BLOCK_WARPS) {
                const size_t last = std::min(list.size(), first + cuda::BLOCK_WARPS) - 1;
                blocks.push_back({tables, static_cast<uint32_t>(slices.size()), static_cast<uint32_t>(last - first + 1)});
                for (size_t k = first; k <= last; k++) {
                    const rans::Slice & sl = list[k];
                    LCG_CHECK(sl.k1 - sl.k0 <= (1u << 31), LCG_ERR_LIMIT,
                              "a slice of %zu symbols, past the device decoder's 32-bit indexes", sl.k1 - sl.k0);
                    const size_t raw_bytes = rans::slice_raw_bytes(sl, s.raw_bits);
                    // initial lane states, with the CPU's messages
                    rans::open_stream(sl.data + raw_bytes, sl.bytes - raw_bytes);
                    cuda::SliceJob j{};
                    j.raw = static_cast<uint64_t>(sl.data - container);
                    j.src = j.raw + raw_bytes;
                    j.bytes = sl.bytes - raw_bytes;
                    j.k0 = sl.k0;
                    j.k1 = sl.k1;
                    j.escapes = escapes;
                    j.n_escapes = sl.count;
                    j.tensor = ti;
                    j.plane = plane;
                    slices.push_back(j);
                    escapes += sl.count;
                }
            }
            return escapes - escape_q.size();
        };
        if (s.lossy) {
            const uint64_t declared = stream(0, at.tables);
            const uint64_t n_escapes = r.varint();
            LCG_CHECK(n_escapes <= r.remaining(), LCG_ERR_CORRUPT, "tensor declares %llu escapes in %zu bytes",
                      (unsigned long long) n_escapes, r.remaining());
            LCG_CHECK(n_escapes == declared, LCG_ERR_CORRUPT, "tensor declares %llu escapes, its slices %llu",
                      (unsigned long long) n_escapes, (unsigned long long) declared);
            for (uint64_t e = 0; e < n_escapes; e++) {
                escape_q.push_back(static_cast<float>(read_escape(r)));  // as the CPU decoder
            }
        } else {
            uint64_t tables = at.tables;
            for (uint32_t b = 0; b < obj.unit_bytes; b++) {
                if (s.plane_stored[b]) {
                    planes.push_back({static_cast<uint64_t>(r.take(n) - container), ti, b});
                } else {
                    stream(b, tables);
                    tables += static_cast<uint64_t>(s.n_groups) * sizeof(cuda::Table);
                }
            }
        }
        for (uint32_t k = 0; k < n_sink; k++) {
            const uint64_t cell = row_cell[sinks[k]];
            const uint64_t src = static_cast<uint64_t>(raw + k * row_bytes - container);
            if (dst_t.transposed) {
                for (uint32_t u = 0; u < obj.n_units; u++) {
                    copy(t.dst + cell * t.cell_stride + u * t.unit_stride, container + src + u * obj.unit_bytes,
                         obj.unit_bytes);
                }
            } else {
                copy(t.dst + cell * t.cell_stride, container + src, row_bytes);
            }
        }
    }

    // Uploads and runs the plan; turns a stream's failure into the CPU decoder's error.
    void run(const cuda::Backend & b, uint64_t container_size, const uint8_t * device_stats, void * stream) {
        cuda::Plan p{};
        p.container = container;
        p.container_size = container_size;
        p.device_stats = device_stats;
        p.stats = 0;
        p.tensors = arena.put(tensors);
        p.slices = arena.put(slices);
        p.blocks = arena.put(blocks);
        p.planes = arena.put(planes);
        p.copies = arena.put(copies);
        p.zeros = arena.put(zeros);
        p.escape_values = arena.put(escape_q);
        p.n_tensors = static_cast<uint32_t>(tensors.size());
        p.n_slices = static_cast<uint32_t>(slices.size());
        p.n_blocks = static_cast<uint32_t>(blocks.size());
        p.n_planes = static_cast<uint32_t>(planes.size());
        p.n_copies = static_cast<uint32_t>(copies.size());
        p.n_zeros = static_cast<uint32_t>(zeros.size());
        p.n_escapes = escape_q.size();
        p.arena = arena.buf.data();
        p.arena_size = arena.buf.size();
        p.dst = dst;
        p.dst_capacity = dst_capacity;
        std::vector<uint32_t> status(slices.size(), 0);
        char msg[MSG] = "";
        check_backend(b.decode(&p, stream, status.data(), msg, sizeof(msg)), msg);
        last_timing = {p.seconds[0], p.seconds[1]};
        for (size_t j = 0; j < status.size(); j++) {
            const uint32_t tensor = slices[j].tensor;
            switch (status[j]) {
                case cuda::STREAM_OK: break;
                case cuda::STREAM_OVERRUN: fail(LCG_ERR_CORRUPT, "rANS stream runs past its bytes (corrupt stream)");
                case cuda::STREAM_LEFTOVER:
                    fail(LCG_ERR_CORRUPT, "rANS stream of tensor %u has words left over (corrupt stream)", tensor);
                case cuda::STREAM_END_STATE:
                    fail(LCG_ERR_CORRUPT, "a lane of tensor %u does not end in the initial state (corrupt stream)",
                         tensor);
                case cuda::STREAM_ESCAPES:
                    fail(LCG_ERR_CORRUPT, "rANS slice of tensor %u declares %llu escapes, its symbols another number",
                         tensor, (unsigned long long) slices[j].n_escapes);
                default: fail(LCG_ERR_INTERNAL, "slice %zu: status %u", j, status[j]);
            }
        }
    }
};

} // namespace

int cuda_device_count(std::string * why) {
    const Loaded & l = loaded();
    if (l.backend == nullptr) {
        if (why) {
            *why = l.why;
        }
        return 0;
    }
    int count = 0;
    char msg[MSG] = "";
    if (l.backend->device_count(&count, msg, sizeof(msg)) != LCG_OK || count <= 0) {
        if (why) {
            *why = msg[0] ? msg : "the CUDA driver reports no device";
        }
        return 0;
    }
    return count;
}

DeviceStats::~DeviceStats() {
    const cuda::Backend * b = loaded().backend;
    for (auto & [device, copy] : copies_) {
        if (b && copy.base) {
            b->free(const_cast<uint8_t *>(copy.base));
        }
    }
}

const DeviceStats::Copy & DeviceStats::on_current_device(const Stats & stats) {
    const cuda::Backend & b = require_device();
    char msg[MSG] = "";
    int device = 0;
    check_backend(b.current_device(&device, msg, sizeof(msg)), msg);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = copies_.find(device);
    if (it != copies_.end()) {
        return it->second;
    }
    Copy c;
    Arena a;
    for (const TensorDecoder & dec : stats.tensors) {
        c.tensors.push_back(put_stats(a, dec));
    }
    void * ptr = nullptr;
    check_backend(b.alloc(&ptr, a.buf.size(), msg, sizeof(msg)), msg);
    const int status = b.copy(ptr, a.buf.data(), a.buf.size(), nullptr, msg, sizeof(msg));
    if (status != LCG_OK) {
        b.free(ptr);
        check_backend(status, msg);
    }
    c.base = static_cast<const uint8_t *>(ptr);
    return copies_.emplace(device, std::move(c)).first->second;
}

size_t decode_whole_device(const uint8_t * data, size_t size, uint8_t * device_dst, size_t dst_capacity,
                           void * stream) {
    const cuda::Backend & b = require_device();
    DeviceSink sink(data, device_dst, dst_capacity, nullptr);
    const size_t n = decode_whole_to(data, size, LCG_PART_WHOLE, 1, dst_capacity, sink);
    sink.run(b, size, nullptr, stream);
    return n;
}

void decode_chunks_device(const uint8_t * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                          const Stats & stats, DeviceStats & cache, const uint8_t * state, size_t state_size,
                          uint8_t * device_state, void * stream) {
    const cuda::Backend & b = require_device();
    if (n_chunks == 0) {
        return;  // as lcg_decode_chunks
    }
    // The plan addresses one uploaded object: several chunks go side by side in one buffer, each
    // at a multiple of 256 bytes, as cudaMalloc places a chunk uploaded alone. One launch for all:
    // a 256-token chunk of a 7B-class state alone fills 32 blocks of an H100's 132 multiprocessors.
    struct Span {
        uint32_t begin, end;
        size_t chunk;
    };
    std::vector<Span> spans;
    std::vector<size_t> at(n_chunks);
    size_t total = 0;
    for (size_t k = 0; k < n_chunks; k++) {
        LCG_CHECK(chunks[k] != nullptr, LCG_ERR_INVALID_ARGUMENT, "chunk %zu is NULL", k);
        const ContainerHeader h = read_part(chunks[k], chunk_sizes[k], LCG_PART_CHUNK, "a chunk").header;
        spans.push_back({h.pos_begin, h.pos_end, k});
        at[k] = total;
        total += (chunk_sizes[k] + 255) & ~size_t(255);  // no overflow: each chunk is in memory
    }
    std::sort(spans.begin(), spans.end(), [](const Span & a, const Span & b) {
        return a.begin != b.begin ? a.begin < b.begin : a.chunk < b.chunk;
    });
    for (size_t r = 1; r < spans.size(); r++) {  // sorted: a shared position shows between neighbours
        LCG_CHECK(spans[r].begin >= spans[r - 1].end, LCG_ERR_INVALID_ARGUMENT,
                  "chunks %zu and %zu share positions (from %u): decode them in separate calls",
                  spans[r - 1].chunk, spans[r].chunk, spans[r].begin);
    }
    std::vector<uint8_t> joined;
    std::vector<const uint8_t *> parts(chunks, chunks + n_chunks);
    if (n_chunks > 1) {
        joined.resize(total);
        for (size_t k = 0; k < n_chunks; k++) {
            std::memcpy(joined.data() + at[k], chunks[k], chunk_sizes[k]);
            parts[k] = joined.data() + at[k];
        }
    }
    const uint8_t * object = n_chunks > 1 ? joined.data() : chunks[0];
    const DeviceStats::Copy & copy = cache.on_current_device(stats);
    DeviceSink sink(object, device_state, state_size, &copy);
    decode_chunks_to(parts.data(), chunk_sizes, n_chunks, stats, 1, state, state_size, sink);
    sink.run(b, n_chunks > 1 ? joined.size() : chunk_sizes[0], copy.base, stream);
}

DeviceTiming device_last_timing() { return last_timing; }

void * device_alloc(size_t size) {
    const cuda::Backend & b = require_device();
    void * ptr = nullptr;
    char msg[MSG] = "";
    check_backend(b.alloc(&ptr, size, msg, sizeof(msg)), msg);
    return ptr;
}

void device_free(void * ptr) {
    const cuda::Backend * b = loaded().backend;
    if (ptr && b) {
        b->free(ptr);
    }
}

void device_copy(void * dst, const void * src, size_t size, void * stream) {
    const cuda::Backend & b = require_device();
    char msg[MSG] = "";
    check_backend(b.copy(dst, src, size, stream, msg, sizeof(msg)), msg);
}

} // namespace lcg
