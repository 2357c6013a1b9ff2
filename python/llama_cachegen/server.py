"""llama-server built from the llama.cpp that llama-cpp-python vendors, so that the server and the
Python bindings read and write one state format.

The build itself is `build-llama-server.sh` in this package (scripts/setup.sh runs the same file):
the llama-cpp-python sdist's vendor/llama.cpp, CPU only, static, cached in
`<cache_dir>/llama-server-<version>/llama-server`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.resources
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .errors import CacheGenError
from .model import cache_dir, default_model_path

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET url: (status, body), an HTTP error status included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[Any, dict[str, str]]:
    """POST body as JSON: (the JSON answer, the response headers); HTTPError on an error status."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


class Processes:
    """llama-servers and sharing proxies on 127.0.0.1, for tests and benchmarks: each logs to
    `<root>/<name>.log`, is ready once its /health answers 200, and `close` stops them all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
              timeout: float = 180.0) -> str:  # fmt: skip
        """Starts argv (listening on port) and returns its URL once it is ready."""
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - kept for the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CacheGenError(f"{name} exited with {proc.returncode}; see {self.root / name}.log")
            with contextlib.suppress(OSError):
                if http_status(url + "/health", 2.0)[0] == 200:
                    return url
            time.sleep(0.1)
        raise CacheGenError(f"{name} not ready after {timeout:.0f} s; see {self.root / name}.log")

    def llama_server(
        self,
        name: str,
        binary: Path,
        n_ctx: int,
        model: Path | None = None,
        *extra: str,
        port: int | None = None,
    ) -> tuple[str, Path]:
        """A llama-server of `model` (default: the bundled one) with one slot, one thread and a slot
        directory, and `extra` arguments: (URL, slot directory). `port`: the port of one stopped
        (a restart: its name's slot directory again)."""
        slot_dir = self.root / f"slots-{name}"
        slot_dir.mkdir(exist_ok=port is not None)
        port = port or free_port()
        model = model or default_model_path()
        argv = [str(binary), "-m", str(model), "-c", str(n_ctx), "-np", "1", "-t", "1", "-b", "512",
                "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", str(slot_dir),
                "--cache-ram", "0", "--no-warmup", *extra]  # fmt: skip
        return self.start(f"server-{name}", argv, port), slot_dir

    def proxy(self, name: str, server: str, slot_dir: Path, store: str, *args: str,
              env: dict[str, str] | None = None) -> str:  # fmt: skip
        """`llama-cachegen proxy` before `server` (its slot directory, `store`, more args)."""
        port = free_port()
        argv = [sys.executable, "-m", "llama_cachegen", "proxy", "--server", server,
                "--slot-dir", str(slot_dir), "--store", store,
                "--listen", f"127.0.0.1:{port}", *args]  # fmt: skip
        return self.start(f"proxy-{name}", argv, port, env)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


__all__ = [
    "SERVER_ENV",
    "Processes",
    "cached_server_path",
    "free_port",
    "http_status",
    "llama_cpp_python_version",
    "llama_server_path",
    "post_json",
]
