"""llama.cpp's own format constants, in one place for the Python side (layouts in
docs/llama-state.md; the native parser has its own, in native/src/state_format.cpp)."""

from __future__ import annotations

# a sequence state buffer (llama_state_seq_get_data) starts with this u32, then the i32 seq id
IO_MAGIC = 0xAF143CD8
# a sequence file (llama_state_seq_save_file, llama-server's slot save): 'ggsq', version 3
GGSQ_MAGIC, GGSQ_VERSION = 0x67677371, 3

# ggml type ids of the KV cache types llama.cpp accepts (type_k / type_v); llama_cpp has no
# constant for bf16, so they are listed here rather than taken from it
GGML_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
GGML_TYPE_NAMES: dict[int, str] = {type_id: name for name, type_id in GGML_TYPES.items()}
