"""Loads libllama_cachegen with cffi (ABI mode).

The declarations are read from the installed public header, between its cffi markers, so the
binding cannot drift from the library it loads.
"""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path

import cffi

from .errors import STATUS_EXCEPTIONS, CacheGenError, InternalError

_LIB_NAMES = {
    "linux": "libllama_cachegen.so",
    "darwin": "libllama_cachegen.dylib",
    "win32": "llama_cachegen.dll",
}


def _package_file(name: str) -> str:
    path = importlib.resources.files(__package__).joinpath(name)
    if not path.is_file():
        raise ImportError(
            f"llama_cachegen: {name} is missing from the installed package ({path}); "
            "reinstall with `pip install .` so that the native library is built"
        )
    return str(path)


def _cdef_from_header(header: str) -> str:
    text = Path(header).read_text(encoding="utf-8")
    begin, end = text.index("/* cffi-begin */"), text.index("/* cffi-end */")
    return text[begin:end].replace("LCG_API ", "")


ffi = cffi.FFI()
ffi.cdef(_cdef_from_header(_package_file("llama_cachegen.h")))
lib = ffi.dlopen(_package_file(_LIB_NAMES.get(sys.platform, "libllama_cachegen.so")))


def check(status: int) -> None:
    """Raises the exception class mapped to a native status, with the native message."""
    if status == 0:
        return
    name = ffi.string(lib.lcg_status_name(status)).decode()
    message = ffi.string(lib.lcg_last_error()).decode(errors="replace")
    cls = STATUS_EXCEPTIONS.get(status, InternalError)
    err: CacheGenError = cls(f"{name}: {message}" if message else name)
    err.status, err.status_name = status, name
    raise err
