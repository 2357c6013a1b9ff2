"""llama-server built from the llama.cpp that llama-cpp-python vendors, so that the server and the
Python bindings read and write one state format.

The build itself is `build-llama-server.sh` in this package (scripts/setup.sh runs the same file):
the llama-cpp-python sdist's vendor/llama.cpp, CPU only, static, cached in
`<cache_dir>/llama-server-<version>/llama-server`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import subprocess
import sys
from pathlib import Path

from .errors import CacheGenError
from .model import cache_dir

PINNED_LLAMA_CPP_PYTHON = "0.3.36"
SERVER_ENV = "LLAMA_CACHEGEN_LLAMA_SERVER"  # a llama-server binary to use instead of the cached one


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version (the one whose llama.cpp the server must match),
    else the pinned one."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return PINNED_LLAMA_CPP_PYTHON


def cached_server_path(version: str | None = None) -> Path:
    """Where the build keeps the binary (whether or not it is there)."""
    return cache_dir() / f"llama-server-{version or llama_cpp_python_version()}" / "llama-server"


def llama_server_path(build: bool = True) -> Path:
    """The llama-server binary: $LLAMA_CACHEGEN_LLAMA_SERVER, else the cached build, built now
    (~4-5 minutes on 2 cores, once; needs cmake, a C++ compiler and the sdist from PyPI) when
    missing and `build` is true. Raises CacheGenError when there is none."""
    if env := os.environ.get(SERVER_ENV):
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise CacheGenError(f"${SERVER_ENV} names {path}, which is not an executable file")
        return path
    version = llama_cpp_python_version()
    path = cached_server_path(version)
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if not build:
        raise CacheGenError(f"llama-server is not built yet ({path}); run scripts/setup.sh")
    script = importlib.resources.files(__package__).joinpath("build-llama-server.sh")
    env = dict(
        os.environ, LLAMA_CACHEGEN_CACHE=str(cache_dir()), LLAMA_CPP_PYTHON=version, PYTHON=sys.executable
    )
    print(f"llama-cachegen: building llama-server for llama-cpp-python {version} (once)", file=sys.stderr)
    proc = subprocess.run(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode or not path.is_file():
        raise CacheGenError(f"building llama-server failed (exit {proc.returncode}; see the log above)")
    return path


__all__ = ["SERVER_ENV", "cached_server_path", "llama_cpp_python_version", "llama_server_path"]
