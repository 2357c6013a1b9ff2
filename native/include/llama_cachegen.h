/*
 * llama_cachegen.h -- CacheGen-style compression of llama.cpp context state.
 *
 * The only public header of libllama_cachegen. Plain C, no C++ types and no exceptions cross it.
 *
 * What it does: llama.cpp's state (a sequence state buffer, a full state buffer, a sequence state
 * file such as a llama-server slot file, or a session file) goes in as bytes; a compact, versioned,
 * checksummed container comes out. Decoding the container gives back a state that llama.cpp loads:
 * byte-identical to the input everywhere except inside lossily coded K/V tensor payloads (and
 * byte-identical everywhere at LCG_LEVEL_LOSSLESS).
 *
 * Conventions
 *  - Every function returning int returns LCG_OK (0) or a negative lcg_status (except
 *    lcg_cuda_available, a device count).
 *  - On error, lcg_last_error() gives a message for the calling thread that says what was found.
 *  - n_threads arguments: <= 0 uses every core; no more threads start than there are pieces of
 *    work (tensors, slices). state_kind arguments: an lcg_state_kind, LCG_KIND_AUTO (0) detects it.
 *  - size_t * written arguments may be NULL, except where the call answers a size query.
 *  - Input buffers are never written to. Untrusted containers are safe to decode: every length is
 *    checked against the buffer and against LCG_MAX_* bounds before anything is allocated.
 *  - Buffers returned by the library are freed with lcg_free() (NULL is accepted).
 *  - Structs grow at their end only, and each call is told the size of the caller's (sizeof as
 *    the caller's header gives it: lcg_encode_params.struct_size, set by lcg_encode_params_init;
 *    the info_size argument of the lcg_inspect calls), so that either side can add fields without
 *    breaking the other's binaries (the rule of Linux's openat2/clone3 structs): a library reads
 *    or writes only the caller's bytes; fields it knows and the caller's struct lacks take their
 *    defaults (parameters) or are not reported (info); a caller's fields it does not know must be 0
 *    (parameters: else LCG_ERR_INVALID_ARGUMENT) or are written 0 (info). Sizes below 0.5's (the
 *    first version with this rule), and above 4096, are refused. Fields named reserved are 0 (a
 *    caller sets them so, as lcg_encode_params_init does; the library writes them so).
 *  - Container byte layout: docs/format.md. llama.cpp layouts read: docs/llama-state.md.
 *
 * The declarations between the cffi markers below are read verbatim by the Python binding
 * (python/llama_cachegen/_native.py): keep them free of preprocessor lines and macros.
 */
#ifndef LLAMA_CACHEGEN_H
#define LLAMA_CACHEGEN_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  define LCG_API __declspec(dllexport)
#elif defined(__GNUC__)
#  define LCG_API __attribute__((visibility("default")))
#else
#  define LCG_API
#endif

/* Library version (the container format has its own version: LCG_FORMAT_VERSION). */
#define LCG_VERSION_MAJOR 0
#define LCG_VERSION_MINOR 5
#define LCG_VERSION_PATCH 0
#define LCG_VERSION_NUMBER (LCG_VERSION_MAJOR * 10000 + LCG_VERSION_MINOR * 100 + LCG_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* cffi-begin */

/* Status codes. Pinned: values never change, new ones are appended. */
typedef enum {
    LCG_OK                      =   0,
    LCG_ERR_INVALID_ARGUMENT    =  -1, /* a NULL pointer, an unknown level, a bad knob            */
    LCG_ERR_UNSUPPORTED_FORMAT  =  -2, /* input is not a llama.cpp state layout this library reads */
    LCG_ERR_NOT_A_CONTAINER     =  -3, /* decode input does not start with the container magic    */
    LCG_ERR_UNSUPPORTED_VERSION =  -4, /* container written by a newer format version             */
    LCG_ERR_TRUNCATED           =  -5, /* container ends before the sizes it declares             */
    LCG_ERR_CHECKSUM            =  -6, /* a CRC32C does not match: data corrupted in transit       */
    LCG_ERR_CORRUPT             =  -7, /* checksums match but the content is inconsistent          */
    LCG_ERR_LIMIT               =  -8, /* a declared size exceeds LCG_MAX_* bounds                 */
    LCG_ERR_DST_TOO_SMALL       =  -9, /* caller's buffer is smaller than lcg_decoded_size()        */
    LCG_ERR_OUT_OF_MEMORY       = -10,
    LCG_ERR_INTERNAL            = -11, /* a bug: please report with the message                    */
    LCG_ERR_NO_DEVICE           = -12  /* a device call without a CUDA device, driver or CUDA build */
} lcg_status;

/* Quality levels. A lossy level promises at most the KL divergence of one of llama.cpp's quantized
 * KV cache types and sets each tensor's step from the error that cache type makes on that tensor
 * (README, "Levels", has the measured sizes: ~2.1x, ~4.0x, ~4.6x smaller than f16 on SmolLM2). */
typedef enum {
    LCG_LEVEL_LOSSLESS = 0, /* bit-exact                                                       */
    LCG_LEVEL_HIGH     = 1, /* KL at most the q8_0 cache's                                       */
    LCG_LEVEL_BALANCED = 2, /* KL at most the q5_1 cache's (the default)                         */
    LCG_LEVEL_COMPACT  = 3  /* KL at most the q4_0 cache's                                       */
} lcg_level;

/* How a lossy level transforms values before quantizing them. Anchor/delta (CacheGen's token
 * grouping) codes token t of each group of anchor_tokens as its difference from the group's first
 * token; it measured larger than none on SmolLM2 at equal error (docs/format.md, "Stats section"),
 * decodes on the CPU only, and chunks of it must start at multiples of anchor_tokens. */
typedef enum {
    LCG_TRANSFORM_NONE         = 0,
    LCG_TRANSFORM_ANCHOR_DELTA = 1
} lcg_transform;

/* How a model's RoPE pairs channels within a head (llama.cpp's rope types). */
typedef enum {
    LCG_ROPE_NONE     = 0,
    LCG_ROPE_ADJACENT = 1, /* (2i, 2i + 1): LLAMA_ROPE_TYPE_NORM                                */
    LCG_ROPE_HALVES   = 2  /* (i, i + n_dims / 2): LLAMA_ROPE_TYPE_NEOX                          */
} lcg_rope_pairing;

/* Which llama.cpp state a buffer holds. */
typedef enum {
    LCG_KIND_AUTO        = 0, /* detect: only valid as an encode parameter                       */
    LCG_KIND_SEQ_BUFFER  = 1, /* llama_state_seq_get_data: io magic, seq id, memory              */
    LCG_KIND_FULL_BUFFER = 2, /* llama_state_get_data: arch string, memory                       */
    LCG_KIND_SEQ_FILE    = 3, /* llama_state_seq_save_file / llama-server slot: 'ggsq' v3        */
    LCG_KIND_SESSION     = 4  /* llama_state_save_file: 'ggsn' v10                               */
} lcg_state_kind;

/* What a container object holds (format v4). A context can be stored whole (one object), or as a
 * skeleton (the state's bytes other than K/V, tiny), one statistics object per level (quantizer
 * and frequency tables, computed over the whole state) and chunks: the K/V of positions
 * [pos_begin, pos_end) at one level, each decodable on its own into its place in a state. */
typedef enum {
    LCG_PART_WHOLE    = 0, /* a whole state: lcg_encode / lcg_decode                                  */
    LCG_PART_SKELETON = 1, /* a state without its K/V payloads: lcg_encode_skeleton / lcg_skeleton_state */
    LCG_PART_STATS    = 2, /* statistics of one level: lcg_chunker_stats                              */
    LCG_PART_CHUNK    = 3  /* K/V of a position range at one level: lcg_chunker_encode / lcg_decode_chunk */
} lcg_part;

typedef struct {
    uint32_t struct_size;   /* sizeof(lcg_encode_params), set by lcg_encode_params_init      */
    int32_t level;          /* lcg_level                                                        */
    int32_t state_kind;     /* lcg_state_kind; LCG_KIND_AUTO detects it                          */
    int32_t n_threads;      /* <= 0: all cores                                                  */
    /* Expert knobs; a negative value takes the level's preset. Ignored at LCG_LEVEL_LOSSLESS.
     * A lossy level sets each tensor's step so that its squared error is error_scale x the error
     * llama.cpp's reference cache type (high: q8_0, balanced: q5_1, compact: q4_0) makes on that
     * same tensor. Setting k_step or v_step switches to fixed steps instead.                   */
    float   error_scale;    /* our squared error / the reference cache type's, per tensor       */
    float   k_step;         /* K step in the tensor's RMS channel deviation (last layer)         */
    float   v_step;         /* V step in the tensor's RMS channel deviation (last layer)         */
    float   first_layer_scale; /* step of layer 0 = this x the last layer's; linear in between  */
    int32_t n_sink_tokens;  /* cells with position < this are stored exactly                     */
    uint32_t reserved0;
    /* Opaque bytes stored (checksummed) in the container, e.g. the caller's model fingerprint.  */
    const void * user_meta;
    size_t       user_meta_size; /* at most LCG_MAX_USER_META                                    */
    /* Symbols per stream slice (docs/format.md, "Streams"): a positive multiple of 32 up to 2^24, or
     * 0 for 65536. Slices decode independently (CPU threads, one GPU warp each); each costs ~136
     * bytes. */
    uint32_t slice_elements;
    int32_t  transform;     /* lcg_transform (lossy levels)                                      */
    uint32_t anchor_tokens; /* LCG_TRANSFORM_ANCHOR_DELTA: tokens per group, 2..255 (0: 10)       */
    /* The model's RoPE (lossy levels, keys, not with anchor/delta): keys are stored rotated by their
     * position, which spreads each channel pair's steady mean over the pair; a K tensor whose spread
     * shrinks by rotating it back with one of rope_bases is coded so (fewer bits at the same
     * squared error) and rotated forward on decode, on the CPU only. rope_pairing 0: off.      */
    int32_t  rope_pairing;  /* lcg_rope_pairing                                                   */
    uint16_t rope_head_dim; /* channels per KV head                                              */
    uint16_t rope_n_dims;   /* rotated channels at the start of each head (even, <= head_dim)   */
    float    rope_bases[2]; /* candidate bases (e.g. global and sliding-window layers); 0: unused */
    float    rope_freq_scale; /* theta_i = rope_freq_scale x base^(-2i / n_dims); 0: 1          */
    /* Where lcg_encode writes the container. NULL: memory of its own (*out, free it with
     * lcg_free). Else out_alloc(out_alloc_ctx, size) is called once, on the calling thread, with
     * the container's size; the container is written into the memory it returns and *out is that
     * pointer (the caller's; NULL from out_alloc: LCG_ERR_OUT_OF_MEMORY). It encodes straight into
     * memory the caller manages (a language's byte string, a shared or registered buffer) without
     * a copy: a 40 MB container's copy cost a lossless encode a tenth of its time. If the encode
     * fails after out_alloc, that memory stays the caller's and *out is not set. Only lcg_encode
     * calls it: the chunker's objects are the library's (lcg_free). */
    void * (*out_alloc)(void * ctx, size_t size);
    void *   out_alloc_ctx;
    /* Error weights, to split a level's error by each tensor's sensitivity (measured by
     * bench/layer_sensitivity.py): at a lossy level with a reference cache type, K/V tensor i's
     * squared error is error_weights[i] x the level's, i in the order the state stores its
     * tensors (per cache: K of each layer, then V of each layer); n_error_weights must be the
     * state's number of K/V tensors, each weight in 1/256..256. NULL: 1 for every tensor. Not
     * stored: decoding needs only the steps it finds. */
    const float * error_weights;
    uint32_t      n_error_weights;
    uint32_t      reserved1;
} lcg_encode_params;

/* What lcg_inspect reports about a container, from its header and layout only. */
typedef struct {
    uint32_t format_version;
    int32_t  level;             /* lcg_level it was encoded at (skeleton: LCG_LEVEL_LOSSLESS)    */
    int32_t  state_kind;        /* lcg_state_kind of the original state                         */
    uint32_t n_sections;
    uint32_t n_tensors;         /* K/V tensors (all layers, streams and caches)                  */
    uint32_t n_cells;           /* KV cells over all streams and caches (chunk: in the chunk)    */
    uint32_t n_layers;          /* layers of the first KV cache                                  */
    uint32_t n_tokens;          /* prompt tokens stored in file kinds, else 0                    */
    uint64_t state_size;        /* bytes of the decoded state (whole, skeleton), else 0          */
    uint64_t container_size;    /* bytes of the container                                        */
    uint64_t kv_bytes;          /* bytes of K/V payload the object restores                      */
    float    k_step, v_step, first_layer_scale;
    int32_t  n_sink_tokens;
    int32_t  ref_type;          /* ggml type of the reference cache type the steps follow, or -1 */
    float    error_scale;       /* squared error / the reference's (when ref_type >= 0)          */
    int32_t  part;              /* lcg_part                                                      */
    uint32_t n_caches;          /* KV caches (2 for interleaved sliding-window models)           */
    uint32_t pos_begin, pos_end;/* chunk: its positions; whole/skeleton of a chunkable state: 0, n */
    uint8_t  stats_id[32];      /* chunk: the id of the statistics it was coded with             */
    uint32_t chunkable;         /* state / whole / skeleton: 1 if it can be cut into chunks       */
    uint32_t has_tail;          /* lcg_inspect_state: 1 if bytes follow its KV caches (a hybrid
                                   model's recurrent state, of the last position): the state's
                                   chunks then load at its full length only                   */
    int32_t  k_type, v_type;    /* lcg_inspect_state: ggml type of the first K and V tensors (-1:
                                   none, e.g. no cells); 0 elsewhere                            */
    uint32_t reserved[2];
} lcg_info;

/* One entry of the container's section table. */
typedef struct {
    uint32_t type;              /* lcg_section_type                                             */
    uint32_t tensor;            /* tensor index for tensor and stats sections, else 0            */
    uint64_t offset;            /* from the start of the container                               */
    uint64_t size;
    uint32_t crc32c;
    uint32_t reserved;
} lcg_section;

typedef enum {
    LCG_SECTION_LAYOUT    = 1, /* tensors (and for whole/skeleton: segments rebuilding the state) */
    LCG_SECTION_VERBATIM  = 2, /* the state's bytes that are not K/V payloads                  */
    LCG_SECTION_TENSOR    = 3, /* one tensor's coded rows                                        */
    LCG_SECTION_USER_META = 4, /* caller's opaque bytes                                         */
    LCG_SECTION_STATS     = 5, /* one tensor's quantizer and frequency tables                    */
    LCG_SECTION_STATS_REF = 6  /* 32-byte id of the statistics object a chunk was coded with     */
} lcg_section_type;

/* An encoder of chunks at one level, and statistics opened for decoding (opaque). */
typedef struct lcg_chunker lcg_chunker;
typedef struct lcg_stats lcg_stats;

/* Runtime twin of LCG_VERSION_NUMBER, and the container format version this library writes. */
LCG_API uint32_t lcg_version_number(void);
LCG_API uint32_t lcg_format_version(void);

/* Name of a status code ("LCG_ERR_CHECKSUM"); never NULL. */
LCG_API const char * lcg_status_name(int status);
/* Message of this thread's last call, if it failed; "" after one that succeeded. Valid until the
 * next call. */
LCG_API const char * lcg_last_error(void);

/* Fills the caller's params (struct_size = sizeof(lcg_encode_params) as the caller's header has
 * it) with the defaults: LCG_LEVEL_BALANCED, auto kind, all cores, level presets. Start every
 * lcg_encode_params from it. */
LCG_API int lcg_encode_params_init(lcg_encode_params * params, size_t struct_size);

/* Encodes a llama.cpp state. On success *out holds a library-allocated container of *out_size
 * bytes, to be released with lcg_free(). params may be NULL for the defaults. */
LCG_API int lcg_encode(const void * state, size_t state_size, const lcg_encode_params * params,
                       void ** out, size_t * out_size);

/* Size of the state a container decodes to, read from its header (checked, not trusted). */
LCG_API int lcg_decoded_size(const void * container, size_t container_size, size_t * state_size);

/* Decodes a container into dst (dst_capacity >= lcg_decoded_size). Verifies every checksum
 * first; on any error dst's content is unspecified and nothing else is touched. */
LCG_API int lcg_decode(const void * container, size_t container_size, int32_t n_threads,
                       void * dst, size_t dst_capacity, size_t * written);

/* Reads a container's header, section table and layout; verifies those checksums only.
 * info_size: sizeof(lcg_info) (the conventions above). */
LCG_API int lcg_inspect(const void * container, size_t container_size, lcg_info * info, size_t info_size);
/* The section table: up to `capacity` entries into `sections`; *n_sections gets the count (call
 * with capacity 0 to ask). One pass over the header. */
LCG_API int lcg_inspect_sections(const void * container, size_t container_size, lcg_section * sections,
                                 uint32_t capacity, uint32_t * n_sections);

/* Points *meta into the container at the caller's opaque bytes (NULL and 0 when absent),
 * after verifying that section's checksum. */
LCG_API int lcg_user_meta(const void * container, size_t container_size,
                          const void ** meta, size_t * meta_size);

/* Parses a llama.cpp state without encoding it: kind, cells, layers, tensors, K/V bytes, caches,
 * whether it can be chunked (pos_end = its positions). container_size and format_version are 0. */
LCG_API int lcg_inspect_state(const void * state, size_t state_size, int32_t state_kind,
                              lcg_info * info, size_t info_size);

/* ---- chunks ---------------------------------------------------------------------------------
 * A chunkable state (every stream with cells holds positions 0..n-1 once, each cell of one and the
 * same sequence) is stored as a skeleton, one statistics object per level and chunks of positions.
 * To load positions [0, m): lcg_skeleton_state(skeleton, m) builds the state with zero K/V, then
 * lcg_decode_chunk fills each chunk's rows in place (chunks are independent: decode them in any
 * order, on any threads, into the same buffer), and lcg_splice copies rows that llama.cpp computed
 * itself. */

/* The skeleton of a state: its bytes other than K/V payloads, and its layout. */
LCG_API int lcg_encode_skeleton(const void * state, size_t state_size, int32_t state_kind,
                                void ** out, size_t * out_size);
/* Writes the state of the skeleton's first n_pos positions, K/V zero, into dst. With dst NULL
 * only *written gets the size needed. n_pos below the skeleton's positions needs a chunkable state. */
LCG_API int lcg_skeleton_state(const void * skeleton, size_t skeleton_size, uint32_t n_pos,
                               void * dst, size_t dst_capacity, size_t * written);

/* Prepares chunk encoding at params->level: parses the state (borrowed: it must outlive the
 * chunker), computes the level's statistics over all of it and quantizes it once. Refuses states
 * that cannot be chunked with LCG_ERR_UNSUPPORTED_FORMAT saying why. */
LCG_API int lcg_chunker_init(const void * state, size_t state_size, const lcg_encode_params * params,
                             lcg_chunker ** out);
/* The statistics object. Its id (stats_id below) is the caller's hash of these bytes (SHA-256). */
LCG_API int lcg_chunker_stats(lcg_chunker * chunker, void ** out, size_t * out_size);
/* The chunk of positions [pos_begin, pos_end), naming the statistics by stats_id (32 bytes).
 * params->user_meta of lcg_chunker_init is not used; user_meta here is stored in the chunk. */
LCG_API int lcg_chunker_encode(lcg_chunker * chunker, uint32_t pos_begin, uint32_t pos_end,
                               const uint8_t * stats_id, const void * user_meta, size_t user_meta_size,
                               void ** out, size_t * out_size);
LCG_API void lcg_chunker_free(lcg_chunker * chunker);

/* Opens a statistics object for decoding chunks: verifies its checksums and expands its tables
 * once (tens of MB for a 7B model: keep one handle per statistics object, not per chunk); the
 * handle keeps what it needs, so the bytes may be freed once it is open. stats_id (32 bytes) is
 * the caller's hash of the bytes; chunks naming another id are refused. */
LCG_API int lcg_stats_open(const void * stats, size_t stats_size, const uint8_t * stats_id, int32_t n_threads,
                           lcg_stats ** out);
LCG_API void lcg_stats_free(lcg_stats * stats);

/* Decodes a chunk into its place in `state` (a state from lcg_skeleton_state, or any state of the
 * same layout holding the chunk's positions). Verifies every checksum, that the chunk names these
 * statistics and that its layout matches the state's before writing; on error only the chunk's
 * rows may have been written. Safe to call from several threads at once with one handle. */
LCG_API int lcg_decode_chunk(const void * chunk, size_t chunk_size, const lcg_stats * stats, int32_t n_threads,
                             void * state, size_t state_size);

/* Decodes n_chunks chunks, all naming `stats`, as lcg_decode_chunk does each, tensor by tensor
 * across them: a tensor's decode tables are read into cache once for all of them instead of once
 * per chunk (the tables of a layer can outweigh a short chunk's rows). Every chunk is checked before
 * any is written; chunks covering the same positions are written in list order. */
LCG_API int lcg_decode_chunks(const void * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                              const lcg_stats * stats, int32_t n_threads, void * state, size_t state_size);

/* Copies the K/V rows of positions [pos_begin, pos_end) from `src` (a llama.cpp state of the same
 * layout holding those positions of one sequence, e.g. what llama.cpp computed for a chunk sent as
 * text; positions outside the range may be missing, as a sliding-window cache reuses their cells)
 * into `state` (positions 0..n-1 of one sequence). */
LCG_API int lcg_splice(void * state, size_t state_size, const void * src, size_t src_size,
                       uint32_t pos_begin, uint32_t pos_end);

LCG_API void lcg_free(void * ptr);

/* ---- CUDA -----------------------------------------------------------------------------------
 * Decoding straight into device memory, same bitstream and the same bytes as lcg_decode (docs/cuda.md).
 * The kernels live in libllama_cachegen_cuda.so, built when CMake finds a CUDA toolkit (LCG_CUDA)
 * and loaded from this library's directory on the first call below (LCG_CUDA_LIBRARY names another
 * file; LCG_NO_CUDA set keeps it unloaded). Without it, a driver or a device, the library works as
 * before and these calls return LCG_ERR_NO_DEVICE. Device pointers are of the current CUDA device
 * (cudaSetDevice); cuda_stream is a cudaStream_t (NULL: the default stream). The decode calls check
 * and parse the object on the CPU, run the kernels on cuda_stream and return once they finished. */

/* Number of usable CUDA devices: 0 without a device, a driver or a CUDA build. */
LCG_API int lcg_cuda_available(void);

/* lcg_decode into device memory: container in host memory, dst_capacity >= lcg_decoded_size.
 * Verifies every checksum first; on error the device buffer's content is unspecified. */
LCG_API int lcg_decode_device(const void * container, size_t container_size, void * device_dst,
                              size_t dst_capacity, void * cuda_stream);

/* lcg_decode_chunk into device_state, a device copy of `state` (host memory, state_size bytes, e.g.
 * from lcg_skeleton_state: only its parts other than K/V payloads are read, for the layout and the
 * cells of each position). The statistics' tables are copied to each device once and kept with
 * the handle. Safe to call from several threads at once with one handle. */
LCG_API int lcg_decode_chunk_device(const void * chunk, size_t chunk_size, const lcg_stats * stats,
                                    const void * state, size_t state_size, void * device_state,
                                    void * cuda_stream);

/* lcg_decode_chunk_device of n_chunks chunks, all naming `stats`, in one upload and one kernel
 * launch (a short chunk alone leaves most of a GPU idle). Every chunk is checked before any runs;
 * chunks sharing a position are refused (LCG_ERR_INVALID_ARGUMENT: they would race). */
LCG_API int lcg_decode_chunks_device(const void * const * chunks, const size_t * chunk_sizes, size_t n_chunks,
                                     const lcg_stats * stats, const void * state, size_t state_size,
                                     void * device_state, void * cuda_stream);

/* Device memory for callers without a CUDA allocator of their own (the Python binding): cudaMalloc,
 * cudaFree (NULL accepted), and a copy in any direction (cudaMemcpyDefault) that waits for itself. */
LCG_API int lcg_device_alloc(size_t size, void ** device_ptr);
LCG_API void lcg_device_free(void * device_ptr);
LCG_API int lcg_device_copy(void * dst, const void * src, size_t size, void * cuda_stream);

/* Where the last device decode call of this thread spent its device time,
 * in seconds (CUDA events): uploading the object and its plan, and the kernels. For benchmarks. */
LCG_API void lcg_device_last_timing(double * upload_s, double * kernels_s);

/* cffi-end */

/* Bounds on what a header may ask for (checked before allocating). */
#define LCG_MAX_STATE_SIZE  ((uint64_t) 1 << 40) /* 1 TiB decoded state                         */
#define LCG_MAX_SECTIONS    (1u << 16)
#define LCG_MAX_USER_META   ((size_t) 64 << 20)
#define LCG_FORMAT_VERSION  4u

#ifdef __cplusplus
}
#endif

#endif /* LLAMA_CACHEGEN_H */
