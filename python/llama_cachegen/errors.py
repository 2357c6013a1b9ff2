"""Exceptions raised by llama_cachegen; one class per native status code."""

from __future__ import annotations


class CacheGenError(Exception):
    """Base class of every llama_cachegen error."""

    status: int = -11
    status_name: str = "LCG_ERR_INTERNAL"
    # the index of the chunk of a prefix that failed (damaged, forged, of another model), where
    # one did: the chunks before it may still serve
    chunk: int | None = None


class InvalidArgumentError(CacheGenError, ValueError):
    """A bad argument: unknown level, negative knob, wrong buffer type."""


class UnsupportedFormatError(CacheGenError):
    """The input is not a llama.cpp state layout this library reads."""


class NotAContainerError(CacheGenError):
    """The data does not start with the llama-cachegen container magic."""


class UnsupportedVersionError(CacheGenError):
    """The container was written by a newer format version."""


class CorruptDataError(CacheGenError):
    """The container is damaged: inconsistent content."""


class TruncatedDataError(CorruptDataError):
    """The container ends before the sizes it declares."""


class ChecksumError(CorruptDataError):
    """A checksum does not match (a container's CRC32C, a manifest's SHA-256): the bytes changed
    after they were written."""


class LimitExceededError(CorruptDataError):
    """A declared size is beyond the library's bounds."""


class NativeMemoryError(CacheGenError, MemoryError):
    """The native library could not allocate memory."""


class InternalError(CacheGenError):
    """A bug in the native library."""


class NoDeviceError(CacheGenError):
    """A device (CUDA) call on a machine without a CUDA device or driver, or with a library built
    without CUDA; the message says which. The CPU path (device=None) always works."""


class ModelMismatchError(CacheGenError):
    """A state was saved from another model, context shape or KV type than the target."""


class StoreError(CacheGenError):
    """A store could not read or write an entry."""


class EntryNotFoundError(StoreError, KeyError):
    """No entry under that key or URL."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # KeyError would quote the message


class AuthenticationError(CacheGenError):
    """A store object's HMAC tag is missing or wrong: not written by a holder of the key, or
    written under another key name."""


# Pinned native status codes (native/include/llama_cachegen.h) -> exception classes.
STATUS_EXCEPTIONS: dict[int, type[CacheGenError]] = {
    -1: InvalidArgumentError,
    -2: UnsupportedFormatError,
    -3: NotAContainerError,
    -4: UnsupportedVersionError,
    -5: TruncatedDataError,
    -6: ChecksumError,
    -7: CorruptDataError,
    -8: LimitExceededError,
    -9: InternalError,  # dst too small: the binding sizes buffers itself, so this is a bug
    -10: NativeMemoryError,
    -11: InternalError,
    -12: NoDeviceError,
}
