"""Stores by URL against real backends: a directory, a redis-server and a `llama-cachegen serve`
subprocess, all on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_cachegen.errors import EntryNotFoundError, InvalidArgumentError
from llama_cachegen.stores import Store, open_store, read_url, write_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis Python package is not installed")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait_port(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("http-store")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cachegen", "serve", "--dir", str(root), "--port", str(port)]
    )
    try:
        _wait_port(port, proc)
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(params=["file", "redis", "http"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "file":
        url = tmp_path.as_uri()
    elif request.param == "redis":
        url = request.getfixturevalue("redis_url") + f"?prefix=t{os.getpid()}-{request.node.name}:"
    else:
        base, root = request.getfixturevalue("http_server")
        url = f"{base}/{tmp_path.name}"  # a fresh folder on the server per test
    with open_store(url) as s:
        yield s


def test_put_get_list_touch_delete(store: Store) -> None:
    store.put("a/one.bin", b"\x00first")
    store.put("a/two.bin", b"second" * 1000)
    store.put("b.bin", b"")
    assert store.get("a/one.bin") == b"\x00first"
    store.put("a/one.bin", b"replaced")
    assert store.get("a/one.bin") == b"replaced"
    assert store.get("b.bin") == b""
    assert store.exists("a/two.bin") and not store.exists("a/none.bin")
    listed = {e.key: e for e in store.list("a/")}
    assert set(listed) == {"a/one.bin", "a/two.bin"}
    assert listed["a/two.bin"].size == 6000
    assert {e.key for e in store.list()} == {"a/one.bin", "a/two.bin", "b.bin"}
    before = listed["a/one.bin"].mtime
    time.sleep(0.02)
    store.get("a/one.bin")  # the HTTP server marks an entry used on GET, the others on touch
    store.touch("a/one.bin")
    store.touch("a/missing.bin")
    assert {e.key: e for e in store.list("a/")}["a/one.bin"].mtime > before
    assert store.delete("a/one.bin") and not store.delete("a/one.bin")
    with pytest.raises(EntryNotFoundError):
        store.get("a/one.bin")
    with pytest.raises(KeyError):  # EntryNotFoundError is a KeyError too
        store.get("nothing")


@pytest.mark.parametrize("key", ["", "../escape", "a/../b", "/abs", "a//b", ".hidden", "sp ace"])
def test_invalid_keys_are_refused(store: Store, key: str) -> None:
    with pytest.raises(InvalidArgumentError):
        store.put(key, b"x")


def test_read_write_url(tmp_path: Path, redis_url: str, http_server: tuple[str, Path]) -> None:
    path = tmp_path / "dir with space" / "state file.lcg"
    assert write_url(path, b"plain path") == str(path)
    assert read_url(path) == b"plain path" and read_url(path.as_uri()) == b"plain path"
    base, root = http_server
    write_url(f"{base}/x/obj.lcg", b"over http")
    assert (root / "x" / "obj.lcg").read_bytes() == b"over http"
    assert read_url(f"{base}/x/obj.lcg") == b"over http"
    write_url(f"{redis_url}/urltest/obj.lcg", b"in redis")
    assert read_url(f"{redis_url}/urltest/obj.lcg") == b"in redis"
    with pytest.raises(EntryNotFoundError):
        read_url(tmp_path / "missing")
    with pytest.raises(EntryNotFoundError):
        read_url(f"{base}/x/missing")


_SLOW_WRITER = """
import sys
from llama_cachegen.stores import open_store
store = open_store(sys.argv[1])
store.put("entry.bin", b"old" * 1000)
print("ready", flush=True)
sys.stdin.readline()
store.put("entry.bin", bytes(range(256)) * (int(sys.argv[2]) // 256))
print("done", flush=True)
"""


def test_killed_file_writer_leaves_no_torn_entry(tmp_path: Path) -> None:
    """SIGKILL a writer in the middle of a large put: readers see the old value, never a torn one."""
    size = 256 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, tmp_path.as_uri(), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = open_store(tmp_path.as_uri())
    assert store.get("entry.bin") in (b"old" * 1000, bytes(range(256)) * (size // 256))
    assert [e.key for e in store.list()] == ["entry.bin"]  # the leftover temporary is not an entry
    assert list(tmp_path.glob(".tmp-*")), "the writer was not caught mid-write"
    assert store.sweep(max_age_s=0) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_http_upload_cut_short_stores_nothing(http_server: tuple[str, Path]) -> None:
    base, root = http_server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"PUT /cut/entry.bin HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000)
    time.sleep(0.3)
    with open_store(base) as store:
        assert not store.exists("cut/entry.bin")
    assert not (root / "cut" / "entry.bin").exists()
