"""llama-cpp-python integration: save and load compressed context state.

A saved state is one llama-cachegen container: the llama.cpp state bytes (the whole context or
one sequence) plus, in its user_meta, an envelope with what llama-cpp-python needs to resume and
what must match before loading:

    b"LCGL", u32 envelope version, u32 header size, JSON header (utf-8),
    i32 tokens[n_tokens], f32 logits[n_logits]              (all little-endian)

The header holds the model fingerprint, the scope ("all" or "seq"), the token and logit counts,
the saving context's n_ctx and the seed. Nothing in it is executed or unpickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import struct
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import llama_cpp
import numpy as np
from llama_cpp import _internals

from . import codec, envelope
from .errors import (
    CacheGenError,
    CorruptDataError,
    InvalidArgumentError,
    ModelMismatchError,
    UnsupportedFormatError,
)
from .llama_format import GGML_TYPE_NAMES
from .stores import read_url, write_url

ENVELOPE_MAGIC = b"LCGL"
ENVELOPE_VERSION = 1
_MAX_HEADER = 1 << 20

_FLASH_ATTN_NAMES = {
    llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO: "auto",
    llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED: "disabled",
    llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED: "enabled",
}
# Fields that must be equal for a state to load (n_ctx is checked separately: smaller is fine):
# the model, the KV layout llama.cpp writes (flash attention stores V untransposed, K/V types, one
# KV stream per sequence unless unified, the SWA cache's size), the RoPE the keys were rotated by
# (a context's overrides), the model's metadata overrides, a LoRA adapter (it changes the K/V
# projections: its keys are other keys), non-causal attention (a token's K/V saw the tokens after
# it) and the state format itself.
FINGERPRINT_FIELDS = (
    "arch",
    "n_layer",
    "n_head",
    "n_head_kv",
    "n_embd",
    "n_vocab",
    "type_k",
    "type_v",
    "flash_attn",
    "n_stream",
    "swa_full",
    "rope",
    "overrides",
    "lora",
    "attention",
    "model_hash",
    "state_format",
)
# ... left out of the canonical form (keys, namespaces) when None, so that the keys of contexts
# without them are those stores held before the field existed
_OPTIONAL_FIELDS = frozenset({"rope", "overrides", "lora", "attention"})
# llama-cpp-python's Llama defaults for a context's RoPE (0 and -1: the model's own values)
_ROPE_DEFAULTS: dict[str, float] = {
    "rope_scaling_type": -1,
    "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0,
    "yarn_attn_factor": 1.0,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_orig_ctx": 0,
}
_MAX_ENVELOPE_TOKENS = 1 << 28  # far beyond any n_ctx; bounds what a forged count can ask for


@dataclass
class StateMeta:
    """The envelope stored in a saved state's user_meta."""

    fingerprint: dict[str, Any]
    scope: str  # "all": the whole context; "seq": one sequence
    seq_id: int | None  # the sequence it was saved from
    n_ctx: int
    tokens: np.ndarray  # int32 token ids, may be empty when unknown
    logits: np.ndarray | None = None  # float32 [n_vocab]: logits after the last token
    seed: int | None = None
    # (exact_until, level): the saver held K/V decoded from `level` from that position on
    # (lossy_record): a lossless container of it is no exact K/V of its tokens
    lossy: tuple[int, str] | None = None

    def pack(self) -> bytes:
        tokens = np.ascontiguousarray(self.tokens, dtype="<i4")
        logits = np.ascontiguousarray(self.logits if self.logits is not None else [], dtype="<f4")
        header = {
            "fingerprint": self.fingerprint,
            "scope": self.scope,
            "seq_id": self.seq_id,
            "n_ctx": self.n_ctx,
            "n_tokens": int(tokens.size),
            "n_logits": int(logits.size),
            "seed": self.seed,
        }
        if self.lossy is not None:  # absent otherwise: envelopes without it stay as they were
            header["lossy"] = list(self.lossy)
        return envelope.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, header, tokens, logits)

    @classmethod
    def unpack(cls, data: bytes) -> StateMeta:
        """Parses an envelope; anything malformed (or no envelope at all) is a CorruptDataError."""
        header, offset = envelope.unpack(data, ENVELOPE_MAGIC, ENVELOPE_VERSION, _MAX_HEADER, "envelope")
        n_tokens, n_logits = header.get("n_tokens"), header.get("n_logits")
        n_ctx, seq_id, seed = header.get("n_ctx"), header.get("seq_id"), header.get("seed")
        fingerprint, scope = header.get("fingerprint"), header.get("scope")
        lossy = header.get("lossy")
        _check(scope in ("all", "seq"), "scope")
        _check(
            lossy is None
            or (
                isinstance(lossy, list)
                and len(lossy) == 2
                and envelope.is_int(lossy[0])
                and lossy[0] >= 0
                and lossy[1] in codec.LEVEL_ORDER
                and lossy[1] != "lossless"
            ),
            "lossy",
        )
        _check(envelope.is_int(n_tokens) and 0 <= n_tokens <= _MAX_ENVELOPE_TOKENS, "n_tokens")
        _check(envelope.is_int(n_logits) and 0 <= n_logits <= _MAX_ENVELOPE_TOKENS, "n_logits")
        _check(envelope.is_int(n_ctx) and n_ctx >= 0, "n_ctx")
        _check(seq_id is None or (envelope.is_int(seq_id) and seq_id >= 0), "seq_id")
        _check(seed is None or envelope.is_int(seed), "seed")
        _check(
            isinstance(fingerprint, dict)
            and all(v is None or isinstance(v, (str, int, float)) for v in fingerprint.values()),
            "fingerprint",
        )
        if len(data) != offset + 4 * (n_tokens + n_logits):
            raise CorruptDataError("envelope arrays do not match their declared sizes")
        tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=offset).astype(np.intc)
        logits = np.frombuffer(data, dtype="<f4", count=n_logits, offset=offset + 4 * n_tokens)
        return cls(
            fingerprint=fingerprint,
            scope=scope,
            seq_id=seq_id,
            n_ctx=n_ctx,
            tokens=tokens,
            logits=logits.astype(np.single) if n_logits else None,
            seed=seed,
            lossy=None if lossy is None else (int(lossy[0]), str(lossy[1])),
        )


def _check(ok: bool, field_name: str) -> None:
    envelope.require(ok, "envelope header", field_name)


@dataclass
class LoadReport:
    """What `load_compressed_state` did."""

    tokens: int  # token ids restored into llama-cpp-python's bookkeeping
    cells: int  # KV cells restored (every cache's: Gemma 3, two per position); chunked loads: positions
    bytes_read: int
    state_bytes: int
    ratio: float
    read_ms: float
    decode_ms: float
    restore_ms: float
    seq_id: int | None
    extra: dict[str, Any] = field(default_factory=dict)


_hash_cache: dict[tuple[tuple[str, int, int], ...], str] = {}
_lora_hash_cache: dict[tuple[str, int, int], str] = {}


def _file_identity(path: str) -> tuple[str, int, int]:
    """What the hash caches key a file by: a file written again gets hashed again."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


# GGUF value types of a fixed size (gguf.h): u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_U32 = 8, 9, 4


class _PastEnd(Exception):
    """The GGUF head runs past the bytes read so far."""


def _parse_gguf_head(head: bytes, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """_gguf_tensors on the first bytes of a file of `size` bytes; _PastEnd when they end first."""
    off = 0

    def take(fmt: str) -> Any:
        nonlocal off
        if off + struct.calcsize(fmt) > len(head):
            raise _PastEnd
        values = struct.unpack_from(fmt, head, off)
        off += struct.calcsize(fmt)
        return values[0]

    def skip(kind: int, count: int = 1) -> None:
        nonlocal off
        if kind in _GGUF_SIZES:
            off += _GGUF_SIZES[kind] * count
        elif kind == _GGUF_STRING:
            for _ in range(count):
                off += 8 + take("<Q")
        elif kind == _GGUF_ARRAY:
            for _ in range(count):
                inner = take("<I")
                skip(inner, take("<Q"))
        else:
            raise ValueError(f"GGUF value type {kind}")
        if off > len(head):
            raise _PastEnd

    if head[:4] != b"GGUF" or take("<4xI") not in (2, 3):
        return None
    n_tensors, n_kv = take("<Q"), take("<Q")
    alignment = 32
    for _ in range(n_kv):
        key_size = take("<Q")
        key = head[off : off + key_size]
        off += key_size
        kind = take("<I")
        if key == b"general.alignment" and kind == _GGUF_U32:
            alignment = max(1, take("<I"))
        else:
            skip(kind)
    infos_start, offsets = off, []
    for _ in range(n_tensors):
        skip(_GGUF_STRING)
        skip(10, take("<I"))  # dims, u64 each
        offsets.append(take("<4xQ"))  # after the ggml type
    data = -(-off // alignment) * alignment
    starts = sorted(data + o for o in offsets)
    if any(not data <= a <= size for a in starts):
        return None
    return head[infos_start:off], list(zip(starts, starts[1:] + [size], strict=True))


def _gguf_tensors(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The tensor-info bytes of a GGUF (v2, v3) file and each tensor's data span (start, end), in
    file order; None for anything else. gguf-py's reader takes seconds on a large vocabulary (an
    object per token): this steps over the metadata values, reading the head in growing pieces
    (pread: a file cut short meanwhile gives fewer bytes, where a memory map would fault)."""
    n = 1 << 20
    while True:
        head = os.pread(fd, min(n, size), 0)
        try:
            return _parse_gguf_head(head, size)
        except _PastEnd:
            if len(head) >= size:
                return None
        except (struct.error, ValueError, OverflowError):
            return None
        n *= 4


def _model_files(path: str, count: int | None = None) -> list[str]:
    """The model's GGUF files: one split in n (`split.count`; None: as its name says) is named
    after its first file as llama.cpp's llama_split_path names them (`<prefix>-0000i-of-0000n.gguf`),
    and loads them all."""
    first = re.fullmatch(r"(.*)-\d{5}-of-(\d{5})\.gguf", path)
    if first is None:
        return [path]
    count = int(first[2]) if count is None else count
    return [f"{first[1]}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)] if count > 1 else [path]


def _model_hash(llm: llama_cpp.Llama) -> str:
    """sha256 of the model's metadata and sizes, and of each of its files the tensors' names,
    shapes and types and 4 KiB at the start, middle and end of every tensor's data.

    Reading ~12 KiB per tensor keeps this at milliseconds for multi-GB models and tells apart any
    two models whose tensors differ throughout: fine-tunes, requantizations, LoRA adapters merged
    into a few tensors (16 blocks sampled over the first file missed q/v-only merges about one time
    in eight, and every tensor of a split model's other files). A file that is not GGUF v2/v3
    falls back to 16 blocks of 64 KiB over it. A file written while it is read raises.
    """
    files = _model_files(os.fspath(llm.model_path), int(llm.metadata.get("split.count", 0) or 0))
    cache_key = tuple(_file_identity(f) for f in files)
    if cache_key in _hash_cache:
        return _hash_cache[cache_key]
    h = hashlib.sha256()
    h.update(json.dumps(llm.metadata, sort_keys=True, default=str).encode())
    h.update(
        struct.pack("<QQ", llama_cpp.llama_model_size(llm.model), llama_cpp.llama_model_n_params(llm.model))
    )
    for path, (_, size, _) in zip(files, cache_key, strict=True):
        h.update(struct.pack("<Q", size))
        with open(path, "rb") as f:
            found = _gguf_tensors(f.fileno(), size)
            if found is None:
                block = 64 << 10
                spans = [(at, at + block) for at in (max(0, size - block) * i // 15 for i in range(16))]
            else:
                infos, tensors = found
                h.update(infos)
                block, spans = 4 << 10, []
                for a, b in tensors:  # the start, middle and end of each, within it
                    for at in (a, (a + b) // 2, b - block):
                        lo = max(a, min(at, b - block))
                        spans.append((lo, min(b, lo + block)))
            for a, b in spans:
                h.update(os.pread(f.fileno(), b - a, a))
    if tuple(_file_identity(f) for f in files) != cache_key:
        raise CacheGenError(f"the model file {files[0]} was written while it was read: try again")
    _hash_cache[cache_key] = digest = h.hexdigest()
    return digest


def model_n_ctx_train(path: str | Path) -> int | None:
    """The training context of the GGUF model at `path` (its `<arch>.context_length`), read
    without loading its tensors or making a context; None when llama.cpp cannot read it."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    log = logging.getLogger("llama-cpp-python")  # llama-cpp-python prints llama.cpp's log by its level
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    finally:
        log.setLevel(level)
    if not model:
        return None
    try:
        value = ctypes.create_string_buffer(64)

        def meta(key: str) -> str | None:
            n = llama_cpp.llama_model_meta_val_str(model, key.encode(), value, len(value))
            return value.value.decode(errors="replace") if 0 <= n < len(value) else None

        n_ctx_train = meta(f"{meta('general.architecture')}.context_length")
        return int(n_ctx_train) if n_ctx_train and n_ctx_train.isdigit() else None
    finally:
        llama_cpp.llama_model_free(model)


# llama.cpp's rope types whose pairs lie within a head: NORM (adjacent channels), NEOX (halves)
_ROPE_PAIRINGS = {llama_cpp.LLAMA_ROPE_TYPE_NORM: "adjacent", llama_cpp.LLAMA_ROPE_TYPE_NEOX: "halves"}


def model_rope(llm: llama_cpp.Llama) -> codec.Rope | None:
    """The model's RoPE as `encode(rope=)` takes it, from its GGUF metadata; None when its keys are
    not rotated by one position per token (no RoPE, M-RoPE, vision), when the rotated channels do
    not start each head (latent attention) or a head's size is unknown.

    Candidate bases: the model's, and 10,000 (what llama.cpp uses for the sliding-window layers of
    Gemma 3 and the like); the encoder keeps, per K tensor, the one that fits or none.
    """
    pairing = _ROPE_PAIRINGS.get(llama_cpp.llama_model_rope_type(llm.model))
    md, model = llm.metadata, llm.model
    arch = md.get("general.architecture", "")
    n_head = llama_cpp.llama_model_n_head(model)
    head_dim = int(md.get(f"{arch}.attention.key_length", 0)) or (
        llama_cpp.llama_model_n_embd(model) // n_head if n_head else 0
    )
    n_dims = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if pairing is None or head_dim <= 0 or not 0 < n_dims <= head_dim or n_dims % 2:
        return None
    if md.get(f"{arch}.attention.kv_lora_rank"):  # latent attention: the rotated channels end each row
        return None
    base = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    bases = (base,) if base == 10000.0 else (base, 10000.0)
    scale = llama_cpp.llama_model_rope_freq_scale_train(model) or 1.0
    return codec.Rope(pairing, head_dim, n_dims, bases, float(scale))


def _rope_overrides(params: Any) -> str | None:
    """A context's RoPE parameters where any differs from llama-cpp-python's defaults (llama.cpp
    caches keys rotated by them: a key cached under another frequency base or scale is another
    key); None for the defaults."""
    values = {name: getattr(params, name) for name in _ROPE_DEFAULTS}
    if values == _ROPE_DEFAULTS:
        return None
    return ",".join(f"{name}={float(v)!r}" for name, v in values.items())


def _kv_overrides(llm: llama_cpp.Llama) -> str | None:
    """The model's metadata overrides (llama-cpp-python's kv_overrides, which llama.cpp applies to
    the hyperparameters but not to the metadata the model hash reads; any of them may change the
    K/V) as canonical JSON; None without any."""
    overrides = getattr(llm, "kv_overrides", None)
    if not overrides:
        return None
    return json.dumps({str(k): v for k, v in overrides.items()}, sort_keys=True)


def _lora(llm: llama_cpp.Llama) -> str | None:
    """The context's LoRA adapter as `sha256 of its file x its scale`; None without one."""
    path = getattr(llm, "lora_path", None)
    if not path:
        return None
    cache_key = _file_identity(path)
    if cache_key not in _lora_hash_cache:  # adapters are small: all of the file
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _lora_hash_cache[cache_key] = h.hexdigest()
    return f"{_lora_hash_cache[cache_key]} x {float(llm.lora_scale)!r}"


def canonical_fingerprint(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The FINGERPRINT_FIELDS of `fingerprint` that keys and namespaces are computed from."""
    return {
        k: fingerprint.get(k)
        for k in FINGERPRINT_FIELDS
        if k not in _OPTIONAL_FIELDS or fingerprint.get(k) is not None
    }


def model_fingerprint(llm: llama_cpp.Llama) -> dict[str, Any]:
    """What must match between the saving and the loading context (FINGERPRINT_FIELDS)."""
    model, params = llm.model, llm.context_params
    has_swa = llama_cpp.llama_model_n_swa(model) > 0
    return {
        "arch": str(llm.metadata.get("general.architecture", "")),
        "n_layer": llama_cpp.llama_model_n_layer(model),
        "n_head": llama_cpp.llama_model_n_head(model),
        "n_head_kv": llama_cpp.llama_model_n_head_kv(model),
        "n_embd": llama_cpp.llama_model_n_embd(model),
        "n_vocab": llm.n_vocab(),
        "type_k": GGML_TYPE_NAMES.get(params.type_k, str(params.type_k)),
        "type_v": GGML_TYPE_NAMES.get(params.type_v, str(params.type_v)),
        "flash_attn": _FLASH_ATTN_NAMES.get(params.flash_attn_type, str(params.flash_attn_type)),
        # llama.cpp refuses a state written with another stream count ("n_stream mismatch")
        "n_stream": 1 if params.kv_unified else llama_cpp.llama_n_seq_max(llm.ctx),
        "swa_full": bool(params.swa_full) if has_swa else None,  # the SWA cache's size; no SWA: moot
        "rope": _rope_overrides(params),
        "overrides": _kv_overrides(llm),
        "lora": _lora(llm),
        # a non-causal context's K/V of a token saw the tokens after it: not a causal one's
        "attention": (
            "non-causal" if params.attention_type == llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL else None
        ),
        "model_hash": _model_hash(llm),
        # the state layout changes with llama.cpp; llama-cpp-python pins one llama.cpp per release
        "state_format": (
            f"llama-cpp-python {llama_cpp.__version__}, session v{llama_cpp.LLAMA_SESSION_VERSION}, "
            f"seq v{llama_cpp.LLAMA_STATE_SEQ_VERSION}"
        ),
    }


def fingerprint_key(fingerprint: dict[str, Any]) -> str:
    """A short stable name for a fingerprint (used to keep caches of different models apart)."""
    canonical = json.dumps(canonical_fingerprint(fingerprint), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ModelMismatchError naming every field that differs."""
    diffs = [
        f"{k}: saved {saved.get(k)!r}, this context {current.get(k)!r}"
        for k in FINGERPRINT_FIELDS
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise ModelMismatchError("state does not fit this model/context: " + "; ".join(diffs))


def capture_state(llm: llama_cpp.Llama, seq_id: int | None) -> bytes:
    """The llama.cpp state of the whole context (seq_id None) or of one sequence."""
    return _state_array(llm, seq_id).tobytes()


def _state_array(llm: llama_cpp.Llama, seq_id: int | None) -> np.ndarray:
    """capture_state's bytes in a numpy array, copied once, by llama.cpp, into a codec.empty_buffer
    (a zeroed ctypes array took ~18 ms of page faults for a 47 MB state before the copy)."""
    ctx = llm.ctx
    if seq_id is None:
        size = llama_cpp.llama_state_get_size(ctx)
        buf = codec.empty_buffer(size)
        n = llama_cpp.llama_state_get_data(ctx, _uint8_pointer(buf), size)
    else:
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        buf = codec.empty_buffer(size)
        n = llama_cpp.llama_state_seq_get_data(ctx, _uint8_pointer(buf), size, seq_id)
    if not 0 < n <= size:
        raise CacheGenError(f"llama.cpp could not copy the context state (seq_id {seq_id})")
    return buf[:n]


def _uint8_pointer(array: np.ndarray) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def restore_state(llm: llama_cpp.Llama, state: bytes | bytearray | np.ndarray, seq_id: int | None) -> bool:
    """llama_state_set_data (seq_id None) or llama_state_seq_set_data; False if llama.cpp refuses."""
    # no copy either way: point at the bytes object's storage, or wrap the writable buffer
    if isinstance(state, bytes):
        src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
    elif isinstance(state, np.ndarray):
        src = _uint8_pointer(state)
    else:
        src = (ctypes.c_uint8 * len(state)).from_buffer(state)
    if seq_id is None:
        n = llama_cpp.llama_state_set_data(llm.ctx, src, len(state))
    else:
        n = llama_cpp.llama_state_seq_set_data(llm.ctx, src, len(state), seq_id)
    return n == len(state)


def _last_logits(llm: llama_cpp.Llama) -> np.ndarray | None:
    """The logits row after llama-cpp-python's last evaluated token; only kept with logits_all,
    the one mode in which llama-cpp-python reads its score matrix."""
    n = llm.n_tokens
    if llm._logits_all and 0 < n <= llm.scores.shape[0]:
        return llm.scores[n - 1].copy()
    return None


def _seq_id_ok(llm: llama_cpp.Llama, seq_id: int | None) -> None:
    # llama.cpp aborts the process (GGML_ASSERT) on a sequence id beyond n_seq_max
    n_seq_max = llama_cpp.llama_n_seq_max(llm.ctx)
    if seq_id is not None and not envelope.is_int(seq_id):
        raise InvalidArgumentError(f"seq_id must be an int or None, got {type(seq_id).__name__} {seq_id!r}")
    if seq_id is not None and not 0 <= seq_id < n_seq_max:
        raise InvalidArgumentError(f"seq_id {seq_id} out of range: this context has n_seq_max {n_seq_max}")


def seq_room(llm: llama_cpp.Llama) -> int:
    """Positions one sequence can hold: n_ctx, or its share of it where each sequence has a KV
    stream of its own (kv_unified off), and at most llama-cpp-python's token list."""
    return min(llama_cpp.llama_n_ctx_seq(llm.ctx), len(llm.input_ids))


def room_message(llm: llama_cpp.Llama) -> str:
    """What `seq_room` is made of, for an error."""
    n_ctx, n_stream = llm.n_ctx(), llama_cpp.llama_n_seq_max(llm.ctx)
    if llm.context_params.kv_unified or n_stream == 1:
        return f"this context has n_ctx {seq_room(llm)}"
    return f"this context holds {seq_room(llm)} per sequence (n_ctx {n_ctx} over {n_stream} KV streams)"


def _positions(llm: llama_cpp.Llama, seq_id: int | None) -> int:
    """How many positions the KV holds for `seq_id` (None: the whole context, whose token ids are
    llama-cpp-python's, of sequence 0): its highest + 1, 0 when empty."""
    memory = llama_cpp.llama_get_memory(llm.ctx)
    return llama_cpp.llama_memory_seq_pos_max(memory, 0 if seq_id is None else seq_id) + 1


def has_recurrent_state(llm: llama_cpp.Llama) -> bool:
    """True for a recurrent (Mamba, RWKV) or hybrid model (LFM2, Jamba, Granite 4 H, ...): its
    state carries, beside any KV cache, a recurrent state of the last position only, which no
    prefix of the context can be cut from."""
    return bool(llama_cpp.llama_model_is_recurrent(llm.model) or llama_cpp.llama_model_is_hybrid(llm.model))


def has_kv_cache(llm: llama_cpp.Llama) -> bool:
    """False for a purely recurrent model (Mamba, RWKV): its state holds no KV cache."""
    return not llama_cpp.llama_model_is_recurrent(llm.model)


def require_kv_cache(llm: llama_cpp.Llama) -> None:
    """Refuses a purely recurrent model (UnsupportedFormatError): its state holds no KV cache."""
    if not has_kv_cache(llm):
        arch = llm.metadata.get("general.architecture", "this model")
        raise UnsupportedFormatError(
            f"{arch} is a recurrent model: its state holds no KV cache, which is what llama-cachegen "
            "compresses (a fixed-size recurrent state instead); llama.cpp's own llm.save_state() keeps it"
        )


def token_ids(llm: llama_cpp.Llama, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """`tokens` as an array of the model's token ids, else InvalidArgumentError: a flat sequence of
    integers in [0, n_vocab) (numpy alone wrapped 2**31, cut 1.5 to 1, and raised its own errors)."""
    try:
        ids = np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # ragged nesting
        raise InvalidArgumentError(f"token ids must be a flat sequence of integers: {exc}") from None
    if ids.size == 0:
        return np.zeros(0, np.intc)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"token ids must be a flat sequence of integers, not {ids.dtype} values of shape {ids.shape}"
        )
    if _outside_vocabulary(llm, ids):
        raise InvalidArgumentError(f"token ids must lie in [0, {llm.n_vocab()}) for this model")
    return ids.astype(np.intc)


def _outside_vocabulary(llm: llama_cpp.Llama, ids: np.ndarray) -> bool:
    """Whether any of the integer `ids` is no token of the model."""
    return ids.size > 0 and (int(ids.min()) < 0 or int(ids.max()) >= llm.n_vocab())


def capture_meta(llm: llama_cpp.Llama, seq_id: int | None, tokens: Sequence[int] | None = None) -> StateMeta:
    """The envelope for a state of `llm` (tokens default to llama-cpp-python's own, for seq 0 / all).

    The token ids name positions 0.. of the sequence: more ids than it holds positions are refused
    (a load would claim KV that is not there); fewer are fine (llama-cpp-python's next eval drops
    the positions past its tokens), none means unknown, but not for a model with a recurrent
    state, whose positions cannot be dropped (its next eval failed in llama_decode). A purely
    recurrent model is refused (`require_kv_cache`)."""
    require_kv_cache(llm)
    own = seq_id in (None, 0)
    if tokens is None:
        tokens = llm.input_ids[: llm.n_tokens] if own else []
    tokens = token_ids(llm, tokens)
    n_pos = _positions(llm, seq_id)
    if len(tokens) > n_pos:
        raise InvalidArgumentError(
            f"the state holds {n_pos} positions (sequence {0 if seq_id is None else seq_id}) but "
            f"{len(tokens)} token ids were given (tokens=, else llama-cpp-python's own): at most one id "
            "per position"
        )
    if 0 < len(tokens) < n_pos and has_recurrent_state(llm):
        raise InvalidArgumentError(
            f"the state holds {n_pos} positions but {len(tokens)} token ids were given: a model with a "
            "recurrent state cannot drop the positions past them, give one id per position (or none)"
        )
    return StateMeta(
        fingerprint=model_fingerprint(llm),
        scope="all" if seq_id is None else "seq",
        seq_id=seq_id,
        n_ctx=llm.n_ctx(),
        tokens=tokens,
        logits=_last_logits(llm) if own and len(tokens) == llm.n_tokens else None,
        seed=getattr(llm, "_seed", None),
        lossy=lossy_record(llm, seq_id, tokens),
    )


def save_compressed_state(
    llm: llama_cpp.Llama,
    dest: str | Path | None = None,
    *,
    level: str | int = "balanced",
    seq_id: int | None = None,
    tokens: Sequence[int] | None = None,
    threads: int | None = None,
    transform: str = "none",
) -> str | bytes:
    """Captures, encodes and writes the state of `llm` (every sequence, or `seq_id`).

    `dest` is a path or a store object URL (`file://`, `redis://`, `http://`); None returns the
    container bytes. The token ids default to llama-cpp-python's own (for seq_id None or 0); pass
    `tokens` for a sequence filled by other means (more ids than it holds positions are refused
    with InvalidArgumentError, see `capture_meta`). `transform` as `llama_cachegen.encode`'s.
    Returns where the state went.
    """
    _seq_id_ok(llm, seq_id)
    meta = capture_meta(llm, seq_id, tokens)
    state = _state_array(llm, seq_id)  # no copy into bytes: the encoder reads any buffer
    kind = "full_buffer" if seq_id is None else "seq_buffer"
    blob = codec.encode(state, level, threads=threads, kind=kind, transform=transform, user_meta=meta.pack())
    return blob if dest is None else write_url(dest, blob)


def load_compressed_state(
    llm: llama_cpp.Llama,
    src: str | Path | bytes | bytearray | memoryview,
    *,
    seq_id: int | None = None,
    threads: int | None = None,
) -> LoadReport:
    """Reads, verifies, decodes and restores a state saved by `save_compressed_state`.

    A whole-context state replaces the context (seq_id must be None); a sequence state goes into
    `seq_id` (default 0) and leaves other sequences alone. When it lands in sequence 0 or the whole
    context, llama-cpp-python's tokens and last logits are restored too, so the next completion
    whose prompt starts with the saved tokens evaluates only the rest. Everything is checked
    before the context is touched; if llama.cpp still refuses the state, the context is put back
    as it was and ModelMismatchError is raised.
    """
    t0 = time.perf_counter()
    blob = bytes(src) if isinstance(src, (bytes, bytearray, memoryview)) else read_url(src)
    from .chunks import load_chunked  # here: chunks imports this module

    if envelope.is_manifest(blob):  # a chunked context: the manifest's objects sit beside it in its store
        if isinstance(src, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError("a chunked context loads from its URL, not from its manifest's bytes")
        return load_chunked(llm, src, seq_id=seq_id, threads=threads, manifest=blob)
    t1 = time.perf_counter()
    meta = StateMeta.unpack(codec.user_meta(blob))
    check_fingerprint(meta.fingerprint, model_fingerprint(llm))
    info = codec.inspect(blob)
    if meta.scope == "all":
        if seq_id is not None:
            raise InvalidArgumentError("this state holds the whole context: load it with seq_id=None")
        target = None
    else:
        target = 0 if seq_id is None else seq_id
    _seq_id_ok(llm, target)
    # cells are counted over every cache: an interleaved sliding-window model keeps two, each up to
    # n_ctx (llama.cpp refuses what does not fit all the same, and the context is put back); one
    # sequence's cells go into its own KV stream, a whole context's over all of them
    cells_per_cache = -(-info["cells"] // max(1, info["caches"]))
    room, n_ctx = seq_room(llm), min(llm.n_ctx(), len(llm.input_ids))
    seq_cells = 0 if target is None else cells_per_cache
    if max(meta.tokens.size, seq_cells) > room or cells_per_cache > n_ctx:
        raise ModelMismatchError(
            f"context too small: the state holds {info['cells']} KV cells and {meta.tokens.size} tokens "
            f"(saved with n_ctx {meta.n_ctx}), {room_message(llm)}"
        )
    # the container knows the positions of a chunkable state (0..n-1) and of an empty one (none);
    # others (several sequences, a sliding-window cache) are checked by restore_context
    if (info["chunkable"] or not info["cells"]) and meta.tokens.size > info["positions"][1]:
        raise CorruptDataError(
            f"the state holds {info['positions'][1]} positions but its token list has {meta.tokens.size} ids"
        )
    state = codec.empty_buffer(codec.decoded_size(blob))
    codec.decode_into(blob, state, threads=threads)
    t2 = time.perf_counter()
    lossy = meta.lossy  # a lossless container of K/V its saver had loaded lossy is that K/V
    if info["level"] != "lossless":
        lossy = worse_load(lossy, 0, info["level"])
    restore_context(llm, state, target, meta.tokens, meta.logits, lossy, meta.seed)
    own = target in (None, 0)
    t3 = time.perf_counter()
    return LoadReport(
        tokens=int(meta.tokens.size) if own else 0,
        cells=int(info["cells"]),
        bytes_read=len(blob),
        state_bytes=len(state),
        ratio=len(state) / len(blob),
        read_ms=(t1 - t0) * 1e3,
        decode_ms=(t2 - t1) * 1e3,
        restore_ms=(t3 - t2) * 1e3,
        seq_id=target,
    )


def better_level(level: str, than: str) -> bool:
    """Whether `level` keeps more than `than` (lossless > high > balanced > compact)."""
    return codec.LEVEL_ORDER.index(level) < codec.LEVEL_ORDER.index(than)


@dataclass(frozen=True)
class LossyLoad:
    tokens: np.ndarray  # what the load restored
    exact_until: int  # its K/V from this position on came from a lossy level
    level: str  # the worst level loaded

    def held_by(self, tokens: np.ndarray) -> bool:
        """Whether a context holding `tokens` still uses this load's lossy K/V (or K/V computed
        on top of it): they share more than the exact positions."""
        n = min(self.tokens.size, tokens.size)
        differ = np.flatnonzero(self.tokens[:n] != tokens[:n])
        return (int(differ[0]) if differ.size else n) > self.exact_until


# Per context and sequence (the whole context and sequence 0 share llama-cpp-python's token list):
# the last load that put lossy K/V in it. Content-addressed saves consult it (lossy_level). A
# whole-context load's other sequences are recorded with no tokens and exact_until -1: their
# tokens are not known, so any tokens of theirs count as holding it.
_lossy_loads: weakref.WeakKeyDictionary[llama_cpp.Llama, dict[int, LossyLoad]] = weakref.WeakKeyDictionary()


def lossy_level(llm: llama_cpp.Llama, target: int | None, tokens: np.ndarray) -> str | None:
    """The worst lossy level whose decoded K/V the first positions `tokens` of the context (or
    sequence `target`) hold from one of this library's loads, or computed on top of it; None when
    they hold none. A chunk of them stored under its tokens' keys at a better level would pass for
    the exact K/V of those tokens. (Tokens evaluated again from scratch after `reset()` still
    count: the record follows the tokens, not llama.cpp's cells.)"""
    record = lossy_record(llm, target, tokens)
    return None if record is None else record[1]


def lossy_record(llm: llama_cpp.Llama, target: int | None, tokens: np.ndarray) -> tuple[int, str] | None:
    """lossy_level with the first position of that K/V: (exact_until, level), or None. Another
    sequence's record counts where its tokens start these: llama_memory_seq_cp (or seq_keep after
    it), which this library does not see, puts that sequence's K/V in this one (a compact load into
    sequence 1, copied to 0, was stored as lossless chunks). No tokens (a state saved without them)
    tell nothing: any record of the target counts."""
    found = None
    for seq, record in list(_lossy_loads.get(llm, {}).items()):
        if record.held_by(tokens) if len(tokens) else seq == (target or 0):
            found = worse_load(found, max(0, record.exact_until), record.level)
    return found


def worse_load(lossy: tuple[int, str] | None, begin: int, level: str) -> tuple[int, str]:
    """`lossy` (first position of lossy K/V, worst level) after K/V of `level` from `begin` on."""
    if lossy is None:
        return begin, level
    return min(lossy[0], begin), level if better_level(lossy[1], level) else lossy[1]


def lossy_level_anywhere(tokens: np.ndarray) -> str | None:
    """lossy_level over every context's record, for callers handed a state without its context
    (a prompt cache): the worst level any of them holds for these tokens (another context that
    loaded the same tokens lossy counts too: a caution, never a wrong answer)."""
    records = [r for per_target in list(_lossy_loads.values()) for r in list(per_target.values())]
    # records of unknown tokens (a whole load's other sequences, a state saved without token ids)
    # would hold every token list: this caution serves callers that do not name their context
    records = [r for r in records if r.exact_until >= 0]
    return max((r.level for r in records if r.held_by(tokens)), key=codec.LEVEL_ORDER.index, default=None)


def restore_context(
    llm: llama_cpp.Llama,
    state: bytes | bytearray | np.ndarray,
    target: int | None,
    tokens: np.ndarray,
    logits: np.ndarray | None,
    lossy: tuple[int, str] | None = None,
    seed: int | None = None,
) -> None:
    """Loads `state` into the whole context (target None) or sequence `target`, emptied first, with
    one llama.cpp call; if llama.cpp refuses, ModelMismatchError, and if the state holds fewer positions than
    `tokens` names, CorruptDataError: either way the context is put back as it was (else cleared).
    For the whole context or sequence 0, llama-cpp-python's token list and last logits follow, so
    the next completion evaluates only what comes after `tokens`. `lossy` (exact_until, worst
    level): the state's K/V from that position on was decoded from a lossy level (lossy_level).
    `seed`: the saving context's sampling seed, taken as llama-cpp-python's load_state takes it."""
    if _outside_vocabulary(llm, tokens):
        # a forged token list (a store without a key): llama.cpp reads its ids unchecked later
        raise CorruptDataError(
            f"the state's token ids are not in this model's vocabulary [0, {llm.n_vocab()})"
        )
    backup = _state_array(llm, target)
    # llama.cpp clears the target itself only for a state with cells: an empty one would leave
    # what the target held under the loaded (empty) token list
    forget_kv(llm, target)
    if not restore_state(llm, state, target):
        _put_back(
            llm,
            backup,
            target,
            ModelMismatchError,
            "llama.cpp refused the state (its log, shown with verbose=True, says why: the KV layout, V "
            f"transposition/flash attention, a sequence id beyond this context's n_seq_max "
            f"{llama_cpp.llama_n_seq_max(llm.ctx)}, or no room for the cells: {room_message(llm)}, "
            "and a sliding-window cache holds its window and one n_ubatch)",
        )
    n_pos = _positions(llm, target)
    message = f"the state holds {n_pos} positions but its token list has {tokens.size} ids"
    if tokens.size > n_pos:
        _put_back(llm, backup, target, CorruptDataError, message)
    if target in (None, 0) and 0 < tokens.size < n_pos and has_recurrent_state(llm):
        # llama-cpp-python's next eval would drop the positions past the tokens: a recurrent
        # state cannot be cut back (llama_decode failed)
        _put_back(
            llm, backup, target, UnsupportedFormatError, message + ", which a recurrent state cannot drop"
        )
    set_tokens(llm, target, tokens, logits, seed)
    record_load(llm, target, tokens, lossy)


def record_load(
    llm: llama_cpp.Llama, target: int | None, tokens: np.ndarray, lossy: tuple[int, str] | None
) -> None:
    """Notes that the context (or sequence `target`) now holds the K/V of `tokens`, decoded from
    a lossy level from position lossy[0] on (lossy_level), or exact (lossy None)."""
    records = _lossy_loads.setdefault(llm, {})
    if lossy is not None and not len(tokens):  # tokens unknown: any tokens hold it
        lossy = (-1, lossy[1])
    if target is not None:
        records.pop(target, None)
        if lossy is not None:
            records[target] = LossyLoad(np.array(tokens, dtype=np.intc), *lossy)
        return
    # the whole context was replaced: every sequence, those beside 0 too (their K/V came from
    # the same level; before, a save of sequence 1 stored it as exact)
    records.clear()
    if lossy is None:
        return
    records[0] = LossyLoad(np.array(tokens, dtype=np.intc), *lossy)
    memory = llama_cpp.llama_get_memory(llm.ctx)
    for seq in range(1, llama_cpp.llama_n_seq_max(llm.ctx)):
        if llama_cpp.llama_memory_seq_pos_max(memory, seq) >= 0:
            records[seq] = LossyLoad(np.zeros(0, np.intc), -1, lossy[1])


def record_possible_load(llm: llama_cpp.Llama, tokens: np.ndarray, level: str) -> None:
    """A prompt-cache hit at `level` into a context that does not say whether it loaded it (a
    plain llama_cpp.Llama loads a hit only when it is longer than what the context holds): the
    record only gets worse, so it holds either way. The context then holds `tokens` (loaded) or
    tokens that start with them (not loaded: they were held already)."""
    if level == "lossless":
        return
    records = _lossy_loads.setdefault(llm, {})
    held = records.get(0)
    worst = level if held is None or better_level(held.level, level) else held.level
    records[0] = LossyLoad(np.array(tokens, dtype=np.intc), 0, worst)


def put_back(llm: llama_cpp.Llama, backup: np.ndarray | None, target: int | None) -> bool:
    """Restores `backup` (the target's capture; None: it held nothing) into the target, emptied
    first: llama.cpp clears a target only for a state with cells, and the capture of an empty
    sequence has none. If llama.cpp refuses even that, empties the target (False)."""
    forget_kv(llm, target)
    if backup is not None and restore_state(llm, backup, target):
        return True
    _forget(llm, target)
    return False


def _put_back(
    llm: llama_cpp.Llama, backup: np.ndarray, target: int | None, error: type[CacheGenError], message: str
) -> NoReturn:
    """put_back, then raises `error`."""
    if put_back(llm, backup, target):
        raise error(f"{message}; the context was put back as it was")
    raise error(f"{message}; the context could not be put back and was cleared")


def set_tokens(
    llm: llama_cpp.Llama,
    target: int | None,
    tokens: np.ndarray,
    logits: np.ndarray | None = None,
    seed: int | None = None,
) -> None:
    """llama-cpp-python's token list (and last logits, when kept) for KV that now holds `tokens`,
    and the saver's seed: only for the whole context or sequence 0, the ones llama-cpp-python
    tracks. With logits_all the rows before the last are NaN: only the last travels, and a prompt's
    logprobs (echo) over loaded tokens would otherwise be another context's numbers (n x n_vocab
    floats, mostly memory llama-cpp-python allocated and never touched: advised for huge pages,
    Qwen2.5's 1,000 x 151,936 took 1.2 s in 4 KiB pages; see scores_fill_bytes)."""
    if target in (None, 0):
        n = int(tokens.size)
        llm.input_ids[:n] = tokens
        llm.n_tokens = n
        if llm._logits_all and n:
            stale = llm.scores[: n - 1]
            codec.advise_huge_pages(stale.ctypes.data, stale.nbytes)
            stale[:] = np.nan
            if logits is not None and logits.size == llm.n_vocab():
                llm.scores[n - 1] = logits
        if seed is not None:
            llm.set_seed(seed)
        llm._requires_eval = True  # llama.cpp keeps no logits in a state: the next token is decoded again


def scores_fill_bytes(llm: llama_cpp.Llama, target: int | None, n_tokens: int) -> int:
    """The bytes set_tokens writes into llama-cpp-python's logits rows for n_tokens loaded."""
    if target not in (None, 0) or not llm._logits_all or n_tokens < 2:
        return 0
    return (n_tokens - 1) * llm.n_vocab() * 4


def forget_kv(llm: llama_cpp.Llama, seq_id: int | None) -> None:
    """Empties the KV of the whole context (seq_id None) or of one sequence."""
    memory = llama_cpp.llama_get_memory(llm.ctx)
    if seq_id is None:
        llama_cpp.llama_memory_clear(memory, True)
    else:
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)


def _forget(llm: llama_cpp.Llama, seq_id: int | None) -> None:
    """Empties what a failed restore left and, where that is llama-cpp-python's own, its token
    list: nothing claims KV that is not there."""
    forget_kv(llm, seq_id)
    if seq_id in (None, 0):
        llm.n_tokens = 0


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` with compressed state save/load.

    Takes the same arguments, plus `n_seq_max` (several sequences sharing one unified KV cache of
    n_ctx cells, for per-sequence save/load).
    """

    def __init__(self, *args: Any, n_seq_max: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if n_seq_max is not None and n_seq_max != self.context_params.n_seq_max:
            self._remake_context(n_seq_max)

    def _remake_context(self, n_seq_max: int) -> None:
        # llama-cpp-python exposes no n_seq_max: build the context again with it
        if self.lora_path:
            raise InvalidArgumentError("n_seq_max together with a LoRA adapter is not supported")
        self.context_params.n_seq_max = n_seq_max
        self.context_params.kv_unified = True  # one stream: states stay loadable into 1-sequence contexts
        self._ctx.close()
        self._ctx = self._stack.enter_context(
            contextlib.closing(
                _internals.LlamaContext(model=self._model, params=self.context_params, verbose=self.verbose)
            )
        )

    def save_compressed_state(
        self,
        dest: str | Path | None = None,
        *,
        levels: Sequence[str] | None = None,
        chunk_tokens: int | None = 256,
        level: str | int | None = None,
        seq_id: int | None = None,
        tokens: Sequence[int] | None = None,
        transform: str = "none",
    ) -> str | bytes:
        """Saves in chunks under the manifest URL `dest` (see `llama_cachegen.save_chunked`;
        `levels` default high, balanced, compact). With `level`, `chunk_tokens=None` or no `dest`:
        one whole container at `level` (default balanced; see `llama_cachegen.save_compressed_state`,
        no `dest` returns its bytes); only those take `transform="anchor-delta"`. Returns where the
        state went."""
        if dest is None or level is not None or chunk_tokens is None:
            if levels is not None:
                raise InvalidArgumentError("levels= saves in chunks: pass a dest, and no level=")
            whole = "balanced" if level is None else level
            return save_compressed_state(
                self, dest, level=whole, seq_id=seq_id, tokens=tokens, transform=transform
            )
        if transform != "none":
            raise InvalidArgumentError(
                f"transform={transform!r} saves one whole container: pass level= or chunk_tokens=None"
            )
        from .chunks import DEFAULT_LEVELS, save_chunked

        chosen = DEFAULT_LEVELS if levels is None else levels
        save_chunked(self, dest, levels=chosen, chunk_tokens=chunk_tokens, seq_id=seq_id, tokens=tokens)
        return str(dest)

    def load_compressed_state(
        self,
        src: str | Path | bytes | bytearray | memoryview,
        *,
        seq_id: int | None = None,
        level: str | None = None,
        slo_s: float | None = None,
        **streaming: Any,
    ) -> LoadReport:
        """A chunked context (manifest) or a whole container, told apart by their magic; see
        `llama_cachegen.load_chunked` and `llama_cachegen.load_compressed_state`. `level` picks
        one level of a chunked context (default: the best stored per chunk).

        `slo_s` (seconds to a loaded context) streams a chunked context adaptively instead: per
        chunk the best level the measured link allows, or text computed here; it returns a
        StreamReport (a LoadReport). `streaming` goes to `llama_cachegen.load_streaming`
        (prior_mbps, threads, progress, ...). Without `slo_s` nothing changes."""
        if slo_s is not None or streaming:
            from .stream import load_streaming

            if isinstance(src, (bytes, bytearray, memoryview)):
                raise InvalidArgumentError("slo_s= streams a chunked context, which loads from a URL")
            return load_streaming(self, src, slo_s=slo_s, level=level, seq_id=seq_id, **streaming)
        if level is not None:
            from .chunks import load_chunked

            if isinstance(src, (bytes, bytearray, memoryview)):
                raise InvalidArgumentError("level= applies to chunked contexts, which load from a URL")
            return load_chunked(self, src, level=level, seq_id=seq_id)
        return load_compressed_state(self, src, seq_id=seq_id)

    def eval(self, tokens: Sequence[int]) -> None:
        """llama-cpp-python's eval, on top of the first n_tokens positions; where a sliding window
        no longer holds the positions the new tokens attend to, from the first token again.
        llama.cpp restores a sliding-window cache's last window only: a completion after a load (or
        a prompt-cache hit) that kept a shorter prefix (generate's prefix reuse) attended to
        positions that were not there and answered garbage."""
        n_swa = llama_cpp.llama_model_n_swa(self.model)
        if self.n_tokens > 0 and n_swa > 0:
            memory = llama_cpp.llama_get_memory(self.ctx)
            if llama_cpp.llama_memory_seq_pos_min(memory, 0) > max(0, self.n_tokens - n_swa):
                tokens = [*self.input_ids[: self.n_tokens].tolist(), *tokens]
                llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
                self.n_tokens = 0
        super().eval(tokens)

    def load_state(self, state: llama_cpp.llama.LlamaState) -> None:
        """llama-cpp-python's load_state; when llama.cpp refuses the state, the context is cleared
        and n_tokens set to 0 (llama-cpp-python has already overwritten its token list), and a
        prompt-cache entry is dropped as a miss: the completion then evaluates its whole prompt."""
        try:
            super().load_state(state)
        except RuntimeError:
            _forget(self, None)
            discard = getattr(state, "discard", None)
            if discard is None:
                raise
            discard()
            return
        loaded = getattr(state, "loaded", None)
        if loaded is not None:
            loaded(self)

    def set_cache(self, cache: Any) -> None:
        """Sets the prompt cache; a CompressedStateCache is bound to this model's fingerprint."""
        bind = getattr(cache, "bind", None)
        if callable(bind):
            bind(self)
        super().set_cache(cache)
