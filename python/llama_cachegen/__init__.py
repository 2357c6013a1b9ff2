"""llama-cachegen: CacheGen-style compression and streaming of llama.cpp context state."""

from .codec import (
    DeviceBuffer,
    Rope,
    cuda_available,
    decode,
    decode_into,
    decoded_size,
    encode,
    inspect,
    inspect_state,
    user_meta,
    version,
)
from .errors import (
    AuthenticationError,
    CacheGenError,
    ChecksumError,
    CorruptDataError,
    EntryNotFoundError,
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ModelMismatchError,
    NoDeviceError,
    NotAContainerError,
    StoreError,
    TruncatedDataError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)

__version__ = "0.5.0"

__all__ = [
    "AuthenticationError",
    "CacheGenError",
    "ChecksumError",
    "CorruptDataError",
    "EntryNotFoundError",
    "InternalError",
    "InvalidArgumentError",
    "LimitExceededError",
    "ModelMismatchError",
    "NoDeviceError",
    "NotAContainerError",
    "StoreError",
    "TruncatedDataError",
    "UnsupportedFormatError",
    "UnsupportedVersionError",
    "DeviceBuffer",
    "Rope",
    "cuda_available",
    "decode",
    "decode_into",
    "decoded_size",
    "encode",
    "inspect",
    "inspect_state",
    "user_meta",
    "version",
]

# The llama-cpp-python integration and the stores load on first use, so that the codec works
# without llama-cpp-python installed.
_LAZY = {
    "Llama": "llama",
    "LoadReport": "llama",
    "load_compressed_state": "llama",
    "save_compressed_state": "llama",
    "model_rope": "llama",
    "load_chunked": "chunks",
    "load_prefix": "chunks",
    "longest_prefix": "chunks",
    "read_manifest": "chunks",
    "save_chunked": "chunks",
    "load_streaming": "stream",
    "StreamReport": "stream",
    "CompressedStateCache": "cache",
    "open_store": "stores",
}
__all__ += list(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
