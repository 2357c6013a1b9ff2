"""The binary envelopes of llama-cachegen's own metadata (a saved state's llama-cpp-python fields,
chunk headers, manifests): magic, u32 version, u32 header size, a JSON header, then arrays.

Readers bound every size before use, parse JSON only (never pickle), and turn anything malformed
into a CorruptDataError naming the field. Envelopes inside a container are covered by its
checksums; one stored alone (a manifest) ends in its own SHA-256 (`with_digest`, `check_digest`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np

from .errors import CacheGenError, ChecksumError, CorruptDataError, TruncatedDataError

PREFIX = struct.Struct("<4sII")
DIGEST_BYTES = 32  # SHA-256, after an envelope stored alone
MANIFEST_MAGIC = b"LCGM"  # a chunked context's manifest (chunks.Manifest)


def is_manifest(data: bytes | bytearray | memoryview) -> bool:
    """True when `data` starts like a manifest (a whole container starts with b"LCGC")."""
    return bytes(data[:4]) == MANIFEST_MAGIC


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(ok: bool, what: str, field_name: str) -> None:
    if not ok:
        raise CorruptDataError(f"invalid {what}: {field_name}")


def pack(magic: bytes, version: int, header: dict[str, Any], *arrays: np.ndarray) -> bytes:
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return PREFIX.pack(magic, version, len(text)) + text + b"".join(a.tobytes() for a in arrays)


def check_version(
    data: bytes, magic: bytes, version: int, what: str, version_error: type[CacheGenError] = CorruptDataError
) -> None:
    """The magic and the version, before anything else is read. Another version raises
    `version_error`."""
    if data[:4] != magic:
        raise CorruptDataError(f"not a llama-cachegen {what} (magic {bytes(data[:4])!r})")
    if len(data) < PREFIX.size:
        raise TruncatedDataError(
            f"a llama-cachegen {what} cut short: {len(data)} bytes, its prefix alone is {PREFIX.size}"
        )
    _, found, _ = PREFIX.unpack_from(data)
    if found != version:
        raise version_error(f"{what} version {found}; this release reads {version}")


def with_digest(data: bytes) -> bytes:
    """`data` and its SHA-256."""
    return data + hashlib.sha256(data).digest()


def check_digest(data: bytes, what: str) -> bytes:
    """What `with_digest` was given; ChecksumError when the bytes changed since."""
    if len(data) < PREFIX.size + DIGEST_BYTES:
        raise TruncatedDataError(f"a llama-cachegen {what} cut short: {len(data)} bytes")
    body = bytes(data[:-DIGEST_BYTES])
    if hashlib.sha256(body).digest() != bytes(data[-DIGEST_BYTES:]):
        raise ChecksumError(f"{what} checksum (SHA-256) mismatch: damaged in the store or on the way")
    return body


def unpack(
    data: bytes,
    magic: bytes,
    version: int,
    max_header: int,
    what: str,
    version_error: type[CacheGenError] = CorruptDataError,
) -> tuple[dict[str, Any], int]:
    """The JSON header and the offset of the arrays after it. Another version raises
    `version_error`; anything else malformed, CorruptDataError."""
    check_version(data, magic, version, what, version_error)
    _, _, size = PREFIX.unpack_from(data)
    if size > min(max_header, len(data) - PREFIX.size):
        raise CorruptDataError(f"{what} header of {size} bytes overruns the object")
    try:
        header = json.loads(bytes(data[PREFIX.size : PREFIX.size + size]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too deep, too many digits
        raise CorruptDataError(f"unreadable {what} header: {type(exc).__name__}") from None
    require(isinstance(header, dict), what, "the header is not an object")
    return header, PREFIX.size + size
