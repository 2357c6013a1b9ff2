"""Stores by URL against real backends: a directory, a redis-server and a `llama-cachegen serve`
subprocess, all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DEAD_WRITER, free_port, wait_port
from llama_cachegen.errors import (
    AuthenticationError,
    EntryNotFoundError,
    InvalidArgumentError,
    LimitExceededError,
    StoreError,
)
from llama_cachegen.stores import KEY_ENV, TAG_MAGIC, Store, open_store, read_url, write_url
from llama_cachegen.stores.file import FileStore
from llama_cachegen.stores.http import MAX_POST_BODY, TOKEN_ENV, HttpStore


def _store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store of the kind `request.param` names, for this test alone."""
    if request.param == "file":
        return tmp_path.as_uri()
    if request.param == "redis":
        return request.getfixturevalue("redis_url") + f"?prefix=t{os.getpid()}-{request.node.name}:"
    base, _root = request.getfixturevalue("http_server")
    return f"{base}/{tmp_path.name}"  # a fresh folder on the server per test


@pytest.fixture(params=["file", "redis", "http"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with open_store(_store_url(request, tmp_path)) as s:
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
    before = max(e.mtime for e in listed.values())
    time.sleep(0.02)
    store.mark_used(["a/one.bin", "a/missing.bin", "a/two.bin"])  # a missing key is passed over
    marked = {e.key: e.mtime for e in store.list("a/")}
    assert before < marked["a/one.bin"] < marked["a/two.bin"]  # in that order, a microsecond apart
    store.mark_used([])
    asked = ["a/one.bin", "a/none.bin", "b.bin", "a/two.bin", "a", "c/one.bin"]
    assert store.exists_many(asked) == [True, False, True, True, False, False] and store.exists_many([]) == []
    assert store.has_many(asked) == store.exists_many(asked)
    assert store.delete("a/one.bin") and not store.delete("a/one.bin")
    with pytest.raises(EntryNotFoundError):
        store.get("a/one.bin")
    with pytest.raises(KeyError):  # EntryNotFoundError is a KeyError too
        store.get("nothing")


def test_a_delete_after_a_listing_keeps_an_entry_used_since(store: Store) -> None:
    """An evicting process deletes what its listing had as the oldest; another process may have
    used the entry since (a hit reading it, a save keeping it), and it went. With the listing's
    mtime, a delete keeps an entry written or used after it."""
    store.put("a/one.bin", b"first")
    store.put("a/two.bin", b"second")
    listed = {e.key: e.mtime for e in store.list("a/")}
    time.sleep(0.02)
    store.mark_used(["a/one.bin"])  # another process's use
    assert not store.delete("a/one.bin", unused_since=listed["a/one.bin"])
    assert store.get("a/one.bin") == b"first"
    assert store.delete("a/two.bin", unused_since=listed["a/two.bin"])
    assert not store.exists("a/two.bin") and not store.delete("a/two.bin", unused_since=listed["a/two.bin"])
    now = {e.key: e.mtime for e in store.list("a/")}
    assert now.keys() == {"a/one.bin"} and store.delete("a/one.bin", unused_since=now["a/one.bin"])
    assert store.list("a/") == []


def test_a_delete_condition_the_server_cannot_read_deletes_nothing(http_server: tuple[str, Path]) -> None:
    base, _root = http_server
    with open_store(f"{base}/cond") as store:
        store.put("k.bin", b"kept")
        port = int(base.rsplit(":", 1)[1])
        for since in (b"soon", b"nan", b"inf", b""):
            head = b"DELETE /cond/k.bin HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            head += b"X-Unused-Since: %s\r\n\r\n" % since
            assert _exchange(port, head).startswith(b"HTTP/1.1 400 ")
        assert store.get("k.bin") == b"kept"


def test_a_value_over_max_size_is_not_read(store: Store) -> None:
    """A reader that knows the most an object can hold reads no further (a planted object of 2 GiB
    where a chunk goes was read whole before its tag refused it)."""
    store.put("big.bin", b"v" * 10000)
    assert store.get("big.bin", max_size=10000) == b"v" * 10000
    with pytest.raises(LimitExceededError, match="more than"):
        store.get("big.bin", max_size=9999)
    with pytest.raises(EntryNotFoundError):
        store.get("absent.bin", max_size=10)


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
    for empty in ("", "file://"):  # names no file (the current folder was read as one)
        with pytest.raises(InvalidArgumentError, match="names nothing"):
            read_url(empty)
        with pytest.raises(InvalidArgumentError, match="names nothing"):
            write_url(empty, b"x")


_HALTED_WRITER = """
import sys
from llama_cachegen.stores import open_store
from llama_cachegen.stores.file import PendingWrite
store = open_store(sys.argv[1])
store.put("entry.bin", b"old" * 1000)
write = PendingWrite.write
def halting_write(self, data):  # the put below stops halfway through its data
    write(self, data[: len(data) // 2])
    print("halfway", flush=True)
    sys.stdin.readline()  # killed here
    write(self, data[len(data) // 2 :])
PendingWrite.write = halting_write
store.put("entry.bin", bytes(range(256)) * 8192)
print("done", flush=True)
"""


def test_a_server_that_stops_answering_is_asked_once() -> None:
    """A read timeout is not retried (the server took the request and stayed silent for the whole
    timeout); a frozen store held a load three timeouts long."""

    with socket.create_server(("127.0.0.1", 0)) as wedged:  # accepts, reads, never answers
        wedged.settimeout(5.0)
        held = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    held.append(wedged.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        store = HttpStore(f"http://127.0.0.1:{wedged.getsockname()[1]}", auth_key="", timeout=0.5)
        with pytest.raises(StoreError, match="timed out"):
            store.get("x")
        store.close()
        deadline = time.monotonic() + 10.0
        while not held:  # the accept thread's turn
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # a retry would connect again
        assert len(held) == 1  # one connection, one request: no retry
        for conn in held:
            conn.close()


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_a_read_waiting_for_the_reply_ends_when_cancelled(end: str) -> None:
    """cancel() and close() ended a read's body only: a request still waiting for the reply's
    headers held its thread and socket for the whole read timeout (a streaming load against a
    server that stopped answering left 130 fetch threads after 12 loads)."""
    with socket.create_server(("127.0.0.1", 0)) as wedged:  # accepts, reads, never answers
        held: list[socket.socket] = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    held.append(wedged.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        store = HttpStore(f"http://127.0.0.1:{wedged.getsockname()[1]}", auth_key="", timeout=60.0)
        errors: list[BaseException] = []

        def read() -> None:
            try:
                store.get("x")
            except StoreError as exc:
                errors.append(exc)

        reading = threading.Thread(target=read, daemon=True)
        reading.start()
        deadline = time.monotonic() + 10.0
        while not held:  # the request is sent: the read waits for headers that never come
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        start = time.monotonic()
        if end == "cancel":
            assert reading.ident is not None and store.cancel(reading.ident)
        else:
            store.close()
        reading.join(10.0)
        assert not reading.is_alive() and time.monotonic() - start < 5.0
        assert len(errors) == 1
        time.sleep(0.2)
        assert len(held) == 1  # not asked again on a fresh connection
        for conn in held:
            conn.close()


def test_an_error_reply_whose_body_stalls_is_a_store_error() -> None:
    """A 404 whose body stops coming: reading it timed out with urllib3's own ReadTimeoutError,
    past every caller's `except StoreError` (a review)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []

        def answer() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn = server.accept()[0]
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
                    held.append(conn)  # the other 990 bytes never come

        threading.Thread(target=answer, daemon=True).start()
        store = HttpStore(f"http://127.0.0.1:{server.getsockname()[1]}", auth_key="", timeout=0.5)
        with pytest.raises(StoreError, match="404"):
            store.get("x")
        store.close()
        for conn in held:
            conn.close()


def test_a_file_store_removed_under_its_writer_is_made_again(tmp_path: Path) -> None:
    """A tmp cleaner removed a running process's store folder: every later write failed until the
    process restarted (the folder was made only when the store was opened)."""
    import shutil

    store = open_store(str(tmp_path / "store"))
    store.put("a/one.bin", b"1")
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(EntryNotFoundError):
        store.get("a/one.bin")
    assert store.list() == []
    store.put("a/two.bin", b"2")
    assert store.get("a/two.bin") == b"2"


def test_killed_file_writer_leaves_no_torn_entry(tmp_path: Path) -> None:
    """SIGKILL a writer halfway through a put over an entry: readers see the old value, never a
    torn one, and the leftover temporary is not an entry."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HALTED_WRITER, tmp_path.as_uri()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "halfway"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = open_store(tmp_path.as_uri())
    assert store.get("entry.bin") == b"old" * 1000
    assert [e.key for e in store.list()] == ["entry.bin"]
    assert len(list(tmp_path.glob(".tmp-*"))) == 1  # the half-written one
    assert store.sweep(max_age_s=0) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_http_upload_cut_short_stores_nothing(http_server: tuple[str, Path]) -> None:
    base, root = http_server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        head = b"PUT /cut/entry.bin HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
        s.sendall(head + b"x" * 5000)
    time.sleep(0.3)
    with open_store(base) as store:
        assert not store.exists("cut/entry.bin")
    assert not (root / "cut" / "entry.bin").exists()


# ---- authenticated objects ---------------------------------------------------------------------


def test_tagged_objects_verify_and_refuse_forgeries(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a key every object carries an HMAC tag over its name and bytes: a reader with the key
    refuses untagged objects, other keys' tags, and tagged objects replayed under another name."""
    url = store.url if not isinstance(store, FileStore) else store.root
    keyed = open_store(str(url), auth_key="k1")
    keyed.put("a/entry.lcg", b"honest bytes")
    assert keyed.get("a/entry.lcg") == b"honest bytes"
    assert store.get("a/entry.lcg") == b"honest bytes"  # no key: the tag is dropped, nothing verified
    store.put("a/forged.lcg", b"written without the key")
    with pytest.raises(AuthenticationError, match="no authentication tag"):
        keyed.get("a/forged.lcg")
    with pytest.raises(AuthenticationError, match="does not match"):
        open_store(str(url), auth_key="k2").get("a/entry.lcg")
    raw = open_store(str(url), auth_key="")
    tagged = raw._get("a/entry.lcg", None)
    assert tagged.startswith(TAG_MAGIC) and tagged.endswith(b"honest bytes")
    raw._put("a/replayed.lcg", tagged)  # a valid object under another key name
    with pytest.raises(AuthenticationError):
        keyed.get("a/replayed.lcg")
    flipped = bytearray(tagged)
    flipped[-1] ^= 1
    raw._put("a/flipped.lcg", bytes(flipped))
    with pytest.raises(AuthenticationError):
        keyed.get("a/flipped.lcg")
    names = ["a/entry.lcg", "a/forged.lcg", "a/replayed.lcg", "a/flipped.lcg", "a/none.lcg"]
    assert keyed.has_many(names) == [True, False, False, False, False]  # what get() would return
    assert raw.has_many(names) == [True, True, True, True, False]
    monkeypatch.setenv(KEY_ENV, "k1")  # the environment variable is the default key
    assert open_store(str(url)).get("a/entry.lcg") == b"honest bytes"
    with pytest.raises(InvalidArgumentError, match="needs a key"):
        raw.put("a/ambiguous.bin", TAG_MAGIC + b"x")
    keyed.close()
    raw.close()


def test_read_write_url_tag_with_the_file_name(tmp_path: Path, http_server: tuple[str, Path]) -> None:
    path = tmp_path / "state.lcg"
    write_url(path, b"container", auth_key="key")
    assert read_url(path, auth_key="key") == b"container"
    path.rename(tmp_path / "other.lcg")
    with pytest.raises(AuthenticationError):
        read_url(tmp_path / "other.lcg", auth_key="key")
    base, _ = http_server
    write_url(f"{base}/urls/x.lcg", b"remote", auth_key="key")
    # the same object through a store rooted deeper on the server: the tag binds the server path
    with open_store(f"{base}/urls", auth_key="key") as store:
        assert store.get("x.lcg") == b"remote"
    assert read_url(f"{base}/urls/x.lcg", auth_key="key") == b"remote"


# ---- the HTTP server: tokens, limits, smuggling, links ------------------------------------------


def _serve(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cachegen", "serve", "--dir", str(root), "--port", str(port), *args],
        env={**os.environ, **(env or {})},
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_port(port, proc)
    return proc, port


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("token-store")
    proc, port = _serve(root, "--max-body", "100000", "--body-timeout", "1", env={TOKEN_ENV: "s3cret"})
    try:
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()
        proc.wait(10)


def test_token_guards_writes_deletes_and_listings(token_server: tuple[str, Path]) -> None:
    base, root = token_server
    with open_store(base, token="s3cret") as owner, open_store(base, token="") as anon:
        owner.put("t/one.bin", b"1")
        assert anon.get("t/one.bin") == b"1" and anon.exists("t/one.bin")  # single reads stay open
        # a POST needs the token: asked key by key instead, as reads are
        assert anon.bulk_exists and owner.bulk_exists
        assert anon.exists_many(["t/one.bin", "t/two.bin"]) == owner.exists_many(["t/one.bin", "t/two.bin"])
        assert not anon.bulk_exists and owner.bulk_exists and anon.exists_many(["t/one.bin"]) == [True]
        for call in (
            lambda: anon.put("t/two.bin", b"2"),
            lambda: anon.delete("t/one.bin"),
            lambda: anon.list(),
            lambda: anon.mark_used(["t/one.bin"]),
        ):
            with pytest.raises(StoreError, match="401.*needs a token"):
                call()
        with open_store(base, token="wrong") as wrong, pytest.raises(StoreError, match="refused this token"):
            wrong.put("t/two.bin", b"2")
        assert not (root / "t" / "two.bin").exists() and (root / "t" / "one.bin").exists()
        assert [e.key for e in owner.list("t/")] == ["t/one.bin"]


def test_private_server_and_non_loopback_refusal(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    proc, port = _serve(tmp_path, "--token-file", str(tmp_path / "token"), "--private")
    try:
        with open_store(f"http://127.0.0.1:{port}", token="tok") as owner:
            owner.put("p.bin", b"private")
        with open_store(f"http://127.0.0.1:{port}", token="") as anon, pytest.raises(StoreError, match="401"):
            anon.get("p.bin")
    finally:
        proc.terminate()
        proc.wait(10)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    refused = subprocess.run(
        [sys.executable, "-m", "llama_cachegen", "serve", "--dir", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (
        refused.returncode == 1 and "without a token" in refused.stderr and "Traceback" not in refused.stderr
    )


def _exchange(port: int, data: bytes) -> bytes:
    """Sends raw bytes, returns everything the server answers until it closes (or goes quiet)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(3)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


_AUTH = b"Host: x\r\nAuthorization: Bearer s3cret\r\n"
_SMUGGLED = b"DELETE /victim.lcg HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n"


@pytest.mark.parametrize(
    "head",
    [
        b"PUT /a.bin HTTP/1.1\r\n" + _AUTH + b"Content-Length: 8589934592\r\n\r\n",
        b"PUT /a.bin HTTP/1.1\r\n" + _AUTH + b"Content-Length: 100001\r\n\r\n",
        b"PUT /a.bin HTTP/1.1\r\n" + _AUTH + b"\r\n",
        b"PUT /a.bin HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(_SMUGGLED),
        b"PUT /a.bin HTTP/1.1\r\n" + _AUTH + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\nabcd\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\n" + _AUTH + b"Content-Length: %d\r\n\r\n" % (MAX_POST_BODY + 1),
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(_SMUGGLED),
        b"POST /a.bin HTTP/1.1\r\n" + _AUTH + b"Content-Length: %d\r\n\r\n" % len(_SMUGGLED),
    ],
    ids=[
        "8GiB-declared",
        "over-max-body",
        "no-length",
        "no-token",
        "chunked-and-length",
        "mark-over-max",
        "mark-no-token",
        "mark-not-a-folder",
    ],
)
def test_refused_bodies_are_never_executed(token_server: tuple[str, Path], head: bytes) -> None:
    """A refused upload's body (here: a DELETE of another file) is not parsed as a request."""
    base, root = token_server
    (root / "victim.lcg").write_bytes(b"victim")
    answer = _exchange(int(base.rsplit(":", 1)[1]), head + _SMUGGLED)
    status = answer.split(b"\r\n", 1)[0]
    assert status.split()[1] in (b"400", b"401", b"405", b"411", b"413"), answer[:200]
    assert answer.count(b"HTTP/1.") == 1  # one reply: the body never became a second request
    assert (root / "victim.lcg").read_bytes() == b"victim" and not (root / "a.bin").exists()


def test_expect_continue_is_answered_only_after_the_token_check(token_server: tuple[str, Path]) -> None:
    """aiohttp's own Expect handler answered `100 Continue` before the route ran: a client
    without the token was asked for its body. Refused heads get their refusal instead; a
    client with the token gets 100 Continue and its upload is stored."""
    base, root = token_server
    port = int(base.rsplit(":", 1)[1])
    expect = b"Expect: 100-continue\r\nContent-Length: 6\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(3)
        s.sendall(b"PUT /e.bin HTTP/1.1\r\nHost: x\r\n" + expect + b"\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 401 "), "asked for the body without the token"
    for head, status in (
        (b"PUT /e.bin HTTP/1.1\r\n" + _AUTH + b"Content-Encoding: gzip\r\n" + expect, b"415"),
        (b"PUT /e.bin HTTP/1.1\r\n" + _AUTH + b"Expect: 200-ok\r\nContent-Length: 6\r\n", b"417"),
        # a body over the limit is refused before it is asked for, not after
        (b"PUT /e.bin HTTP/1.1\r\n" + _AUTH + b"Expect: 100-continue\r\nContent-Length: 100001\r\n", b"413"),
        (b"POST / HTTP/1.1\r\n" + _AUTH + b"Expect: 100-continue\r\n", b"411"),
    ):
        assert _exchange(port, head + b"\r\n").startswith(b"HTTP/1.1 " + status + b" ")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(3)
        s.sendall(b"PUT /e.bin HTTP/1.1\r\n" + _AUTH + expect + b"\r\n")
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"stored")
        assert s.recv(65536).startswith(b"HTTP/1.1 201 ")
    assert (root / "e.bin").read_bytes() == b"stored"


def test_chunked_uploads_are_bounded_and_stalls_dropped(token_server: tuple[str, Path]) -> None:
    base, root = token_server
    port = int(base.rsplit(":", 1)[1])
    head = (
        b"PUT /c/%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (60000, b"z" * 60000)
    assert b" 201 " in _exchange(port, head % b"ok.bin" + chunk + b"0\r\n\r\n").split(b"\r\n", 1)[0]
    assert (root / "c" / "ok.bin").stat().st_size == 60000
    assert b" 413 " in _exchange(port, head % b"big.bin" + chunk * 2 + b"0\r\n\r\n")
    assert b" 408 " in _exchange(port, head % b"stall.bin" + chunk)  # --body-timeout 1, then silence
    mark = b"POST /c/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Length: 100\r\n\r\n{"
    assert b" 408 " in _exchange(port, mark)  # a mark_used body that stalls, likewise
    assert sorted(p.name for p in (root / "c").iterdir()) == ["ok.bin"]  # no entry, no temporary


def test_a_body_that_trickles_past_the_timeout_is_dropped(token_server: tuple[str, Path]) -> None:
    """A byte now and then, each within --body-timeout, held a connection and a temporary file
    for as long as the sender liked. Past the timeout (1 s here) a body must come at the rate a
    client's reads ask of the server."""
    base, root = token_server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"PUT /c/trickle.bin HTTP/1.1\r\n" + _AUTH + b"Content-Length: 50000\r\n\r\n")
        s.settimeout(0.6)
        answer, began = b"", time.monotonic()
        while not answer and time.monotonic() - began < 20:
            with contextlib.suppress(OSError):
                s.sendall(b"z")
            with contextlib.suppress(TimeoutError):
                answer = s.recv(65536)
    assert b" 408 " in answer.split(b"\r\n", 1)[0], answer
    assert not (root / "c" / "trickle.bin").exists()


def test_a_compressed_upload_is_refused_not_inflated(token_server: tuple[str, Path]) -> None:
    """aiohttp inflates a body sent with Content-Encoding: 51 KB of gzip stored 50 MB (bounded
    only by --max-body). The server takes bytes as they are sent."""
    base, root = token_server
    bomb = gzip.compress(b"\0" * 90000)  # under --max-body once inflated too: only the encoding counts
    for encoding in (b"gzip", b"deflate, identity"):
        answer = _exchange(
            int(base.rsplit(":", 1)[1]),
            b"PUT /z.bin HTTP/1.1\r\n" + _AUTH + b"Content-Encoding: " + encoding + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(bomb) + bomb,
        )
        assert answer.startswith(b"HTTP/1.1 415 "), answer[:200]
    assert not (root / "z.bin").exists()


def test_idle_connections_do_not_block_requests(token_server: tuple[str, Path]) -> None:
    base, _ = token_server
    port = int(base.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        with open_store(base, token="s3cret") as store:
            store.put("idle/x.bin", b"served")
            assert store.get("idle/x.bin") == b"served"
    finally:
        for s in idle:
            s.close()


def test_a_server_without_a_token_serves_loopback_names_to_no_web_page(http_server: tuple[str, Path]) -> None:
    """A web page can reach a loopback port through a name it rebinds to 127.0.0.1 (its own Host
    header) or with a cross-site form POST (no preflight): both wrote, read and deleted entries."""
    base, root = http_server
    port = int(base.rsplit(":", 1)[1])
    FileStore(root).put("web/a.bin", b"kept")
    for head in (
        b"GET /web/a.bin HTTP/1.1\r\nHost: rebound.example:%d\r\n" % port,
        b"DELETE /web/a.bin HTTP/1.1\r\nHost: rebound.example\r\n",
        b"PUT /web/a.bin HTTP/1.1\r\nHost: 127.0.0.1.evil.example\r\nContent-Length: 1\r\n\r\nx",
        b"GET /web/a.bin HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nOrigin: http://rebound.example\r\n" % port,
        b"POST /web/ HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\nContent-Length: 2\r\n\r\n{}",
    ):
        assert _exchange(port, head + b"\r\n").startswith(b"HTTP/1.1 421 "), head
    assert FileStore(root).get("web/a.bin") == b"kept"
    for host in (b"localhost:%d" % port, b"127.0.0.1", b"[::1]:%d" % port, b"LOCALHOST."):
        answer = _exchange(port, b"GET /web/a.bin HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"kept"), host


def test_a_client_that_stops_reading_is_dropped(token_server: tuple[str, Path]) -> None:
    """A GET whose client never reads held the handler, its socket and the open file for good."""
    base, root = token_server  # --body-timeout 1
    size = 64 << 20
    FileStore(root).put("slow/big.bin", bytes(size))
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(b"GET /slow/big.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        time.sleep(4)  # the server's writes block for longer than its body timeout
        s.settimeout(30)
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 20):
                received += len(chunk)
    assert received < size  # the connection ended before the body


def test_keep_alive_reuses_one_connection(http_server: tuple[str, Path]) -> None:
    base, _ = http_server
    with open_store(base) as store:
        for i in range(20):
            store.put(f"ka/{i}.bin", b"x" * i)
            assert store.get(f"ka/{i}.bin") == b"x" * i
        assert store._pool.connection_from_url(base).num_connections == 1  # opened once, reused


def test_folders_files_and_links_are_4xx_not_tracebacks(
    http_server: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    base, root = http_server
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_bytes(b"secret")
    (root / "links").mkdir()
    (root / "links" / "out").symlink_to(outside)
    (root / "links" / "file").symlink_to(outside / "secret.txt")
    with open_store(base) as store:
        store.put("dir/file.bin", b"f")
        assert not store.delete("dir")  # a folder is no entry
        with pytest.raises(StoreError, match="409"):
            store.put("dir/file.bin/under", b"x")
        with pytest.raises(StoreError, match="409"):
            store.put("dir", b"x")
        with pytest.raises(EntryNotFoundError):
            store.get("dir")
        with pytest.raises(EntryNotFoundError):
            store.get("links/out/secret.txt")
        with pytest.raises(EntryNotFoundError):
            store.get("links/file")
        with pytest.raises(StoreError):
            store.put("links/out/planted.txt", b"x")
        with pytest.raises(StoreError):
            store.put("links/file", b"x")
        assert not store.delete("links/file") and not store.exists("links/file")
        assert "links/file" not in {e.key for e in store.list()}
        before = (outside / "secret.txt").stat().st_mtime_ns
        store.mark_used(["links/file", "links/out/secret.txt", "dir", "dir/file.bin"])  # passed over
        assert (outside / "secret.txt").stat().st_mtime_ns == before
        port = int(base.rsplit(":", 1)[1])
        head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
        for body in (
            b"[",
            b'{"mark_used": "dir/file.bin"}',
            b'{"mark_used": ["../x"]}',
            b"{}",
            b'{"exists": ["../x"]}',
            b'{"exists": [1]}',
            b'{"exists": [], "mark_used": []}',
            b'{"delete": ["dir/file.bin"]}',
        ):
            answer = _exchange(port, head % len(body) + body)
            assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert store.get("dir/file.bin") == b"f"  # the server still answers
        assert store.exists_many(["links/file", "links/out/secret.txt", "dir", "dir/file.bin"]) == [
            False,
            False,
            False,
            True,
        ]
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == b"secret"


def test_dead_writers_temporaries_are_counted_and_swept_at_once(tmp_path: Path) -> None:
    writer = [sys.executable, "-c", DEAD_WRITER, str(tmp_path), "ns/entry.lcg", "5000"]
    subprocess.run(writer, check=True, timeout=60)
    store = FileStore(tmp_path)
    pending = store.temporaries("ns/")
    assert len(pending) == 1 and pending[0].size == 5000 and store.list() == []
    live = store.begin_write("ns/live.lcg")  # this process is alive: its temporary stays
    try:
        assert store.sweep() == 1  # the dead writer's, without waiting an hour
        assert len(store.temporaries("ns/")) == 1
    finally:
        live.abort()
    assert store.temporaries() == []


def test_a_server_sweeps_what_its_killed_predecessor_left(tmp_path: Path) -> None:
    """A server killed mid-upload leaves a temporary no client sees (HttpStore counts and sweeps
    none): the next server removes it at start-up."""
    writer = [
        sys.executable,
        "-c",
        DEAD_WRITER,
        str(tmp_path),
        "lcg4/chunks/" + "ab" * 32 + "/balanced",
        "5000",
    ]
    subprocess.run(writer, check=True, timeout=60)
    assert len(FileStore(tmp_path).temporaries()) == 1
    proc, _ = _serve(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while FileStore(tmp_path).temporaries() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert FileStore(tmp_path).temporaries() == []
    finally:
        proc.terminate()
        proc.wait(10)


_NAMESPACED_WRITER = """
import os, sys
from llama_cachegen.stores.file import FileStore
free = {int(p) for p in sys.argv[2].split(",")}
while True:  # the writer is the first child whose pid is no process in the sweeper's namespace
    pid = os.fork()
    if pid == 0:
        if os.getpid() not in free:
            os._exit(0)
        break
    os.waitpid(pid, 0)
    if pid in free:
        sys.exit(0)
pending = FileStore(sys.argv[1]).begin_write("ns/entry")
pending.write(b"x" * 1000)
print("writing", flush=True)
sys.stdin.readline()
pending.commit()
print("committed", flush=True)
"""


def test_a_writer_in_another_pid_namespace_is_never_taken_for_dead(tmp_path: Path) -> None:
    """Containers sharing a volume and the host's name: a writer's pid in its own PID namespace is
    no process (or another one) in the sweeper's, which removed the live writer's temporary and
    failed its put. Temporaries name the PID namespace; another's is judged by age only."""
    unshare = ["unshare", "--pid", "--fork"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not permitted here")
    free = [str(p) for p in range(2, 500) if not os.path.exists(f"/proc/{p}")]
    writer = subprocess.Popen(
        [*unshare, sys.executable, "-c", _NAMESPACED_WRITER, str(tmp_path), ",".join(free)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "writing"
        store = FileStore(tmp_path)
        assert len(store.temporaries()) == 1 and store.sweep() == 0
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "committed"
        assert store.get("ns/entry") == b"x" * 1000
    finally:
        writer.kill()
        writer.wait(10)


def test_deleting_removes_the_folders_it_empties(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk has a folder of its own: left behind empty, they piled up (124 after 60 prompts
    of a small prompt cache) and every listing and eviction walked them. A writer whose folder a
    delete removes meanwhile creates it again."""
    store = FileStore(tmp_path)
    keys = [f"lcg4/chunks/{i:064x}/balanced" for i in range(20)]
    for key in keys:
        store.put(key, b"v")
    store.put("lcg4/stats/" + "0" * 64, b"s")
    for key in keys:
        assert store.delete(key)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "lcg4",
        "lcg4/stats",
        "lcg4/stats/" + "0" * 64,
    ]
    opened = FileStore._open_folder

    def open_then_removed(self: FileStore, key: str, *, create: bool = False) -> int:
        fd = opened(self, key, create=create)
        if create and not removed:  # another process deleted the folder's last entry meanwhile
            removed.append(key)
            os.rmdir(tmp_path / key.rsplit("/", 1)[0])
        return fd

    removed: list[str] = []
    monkeypatch.setattr(FileStore, "_open_folder", open_then_removed)
    store.put(keys[0], b"again")
    assert removed == [keys[0]] and store.get(keys[0]) == b"again"
    monkeypatch.undo()
    assert store.delete(keys[0])
    store.begin_write(keys[1]).abort()  # an upload refused or cut short: no folder left either
    subprocess.run([sys.executable, "-c", DEAD_WRITER, str(tmp_path), keys[2], "10"], check=True, timeout=60)
    assert store.sweep() == 1  # a writer that died: its temporary goes, and its folder
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "lcg4",
        "lcg4/stats",
        "lcg4/stats/" + "0" * 64,
    ]


def _within(seconds: float, call: Any) -> BaseException | None:
    """What `call` raised, on a thread given `seconds`: a call that blocks fails the test instead of
    hanging the suite."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


def test_a_fifo_planted_in_a_store_is_no_entry_and_blocks_no_reader(tmp_path: Path) -> None:
    """Anyone who can write to a shared folder can put a FIFO where an object goes: opening it
    blocked every reader until a writer came, before any tag or type was checked."""
    store = FileStore(tmp_path)
    (tmp_path / "lcg4").mkdir()
    os.mkfifo(tmp_path / "lcg4" / "ctx")
    assert isinstance(_within(10, lambda: store.get("lcg4/ctx")), EntryNotFoundError)
    assert isinstance(_within(10, lambda: read_url((tmp_path / "lcg4" / "ctx").as_uri())), StoreError)


def test_listings_hold_only_keys_a_store_can_delete(tmp_path: Path, redis_url: str) -> None:
    """A name planted beside the entries (a file store's folder, a Redis store's LRU set) that is no
    valid key was listed, and an eviction that met it first (oldest) stopped there for good; a
    member that is not UTF-8 failed every listing."""
    import redis

    store = FileStore(tmp_path)
    store.put("lcg4/chunks/a", b"x")
    (tmp_path / "lcg4" / "chunks" / "junk name").write_bytes(b"y")
    os.utime(tmp_path / "lcg4" / "chunks" / "junk name", (0, 0))
    assert [e.key for e in store.list("lcg4/")] == ["lcg4/chunks/a"]
    prefix = f"t{os.getpid()}-listing:"
    with open_store(f"{redis_url}?prefix={prefix}") as rstore:
        rstore.put("lcg4/chunks/a", b"x")
        client = redis.Redis.from_url(redis_url)
        client.zadd(f"{prefix}__lru__", {b"\xff\xfe": 0, b"junk name": 0})
        assert [e.key for e in rstore.list("")] == ["lcg4/chunks/a"]
        client.close()


def test_a_redis_value_of_another_type_is_no_entry_and_is_written_over(redis_url: str) -> None:
    """A list at a key (another client's) failed every read of it with WRONGTYPE, a StoreError: a
    prompt cache or proxy set the whole store aside each time, and a save skipped it as present.
    It is a miss now, absent from exists and listings, and a put replaces it."""
    import redis

    prefix = f"t{os.getpid()}-wrongtype:"
    client = redis.Redis.from_url(redis_url)
    with open_store(f"{redis_url}?prefix={prefix}") as store:
        store.put("lcg4/chunks/b", b"y")
        client.rpush(f"{prefix}lcg4/chunks/a", b"x")
        store.mark_used(["lcg4/chunks/a"])  # in the LRU set too, as an entry written and later replaced
        for max_size in (None, 10):
            with pytest.raises(EntryNotFoundError, match="a list there"):
                store.get("lcg4/chunks/a", max_size)
        assert store.exists_many(["lcg4/chunks/a", "lcg4/chunks/b"]) == [False, True]
        assert not store.exists("lcg4/chunks/a") and not store.has("lcg4/chunks/a")
        assert [e.key for e in store.list("lcg4/")] == ["lcg4/chunks/b"]
        store.put("lcg4/chunks/a", b"z")
        assert store.get("lcg4/chunks/a") == b"z"
    client.close()


def test_a_redis_store_keeps_its_lru_set_in_step_on_the_servers_clock(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LRU clock is the server's (a client an hour behind stored entries an hour old, and its
    own eviction took them first); a use registers a value the set lost (it stayed invisible to
    listings and eviction for good), a listing drops members whose value is gone (the set grew);
    the set's own name is no key (writing it broke every later put and listing); a misspelt option
    fails at open (it escaped at the first command as redis-py's TypeError)."""
    import redis

    prefix = f"t{os.getpid()}-lru:"
    client = redis.Redis.from_url(redis_url)
    with open_store(f"{redis_url}?prefix={prefix}") as store:
        real = time.time()
        monkeypatch.setattr(time, "time", lambda: real - 3600)  # this client's clock, an hour behind
        store.put("a/one.bin", b"1")
        store.put("a/two.bin", b"2")
        monkeypatch.undo()
        assert all(abs(e.mtime - time.time()) < 60 for e in store.list())
        client.delete(f"{prefix}__lru__")  # the set lost (an operator, a partial restore)
        assert store.list() == []
        store.mark_used(["a/one.bin", "a/gone.bin"])
        assert [e.key for e in store.list()] == ["a/one.bin"]
        client.delete(f"{prefix}a/one.bin")  # a value gone behind the store's back
        assert store.list() == [] and client.zcard(f"{prefix}__lru__") == 0
        for call in (lambda: store.put("__lru__", b"x"), lambda: store.get("__lru__")):
            with pytest.raises(InvalidArgumentError, match="LRU set"):
                call()
        assert client.type(f"{prefix}__lru__") in (b"zset", b"none")
    client.close()
    for option in ("prefx=app:", "protocol=4"):  # a misspelt option, a value redis-py refuses
        with pytest.raises(InvalidArgumentError, match="option"):
            open_store(f"{redis_url}?{option}")
    with pytest.raises(InvalidArgumentError, match="socket_timeout"):  # refused by from_url itself
        open_store(f"{redis_url}?socket_timeout=abc")


def test_messages_never_show_a_urls_password(redis_url: str) -> None:
    from llama_cachegen.stores import redact

    assert redact("redis://:pw-1@h:6379/0/ctx") == "redis://:***@h:6379/0/ctx"
    assert redact("https://me:p@ss@h/a?b=c@d") == "https://me:***@h/a?b=c@d"
    for plain in ("redis://h:6379/0", "http://me@h/", "/tmp/a:b@c", "file:///x@y", "http://[::1"):
        assert redact(plain) == plain
    url = redis_url.replace("redis://", "redis://:not-the-password@", 1)
    with pytest.raises(StoreError) as failed, open_store(url) as store:
        store.get("a")  # the server has no password: redis-py sends AUTH and is refused
    assert "not-the-password" not in str(failed.value) and ":***@" in str(failed.value)
    with pytest.raises(InvalidArgumentError) as refused:
        open_store(url + "?socket_timeout=abc")
    assert "not-the-password" not in str(refused.value)
    assert redact("redis://h/0?db=1&password=pw-2&x=1") == "redis://h/0?db=1&password=***&x=1"
    assert redact("rediss://h/0?SSL_PASSWORD=pw-3") == "rediss://h/0?SSL_PASSWORD=***"
    # urllib3 sends no user:password of a URL: an HTTP store refuses them rather than ignore them
    with pytest.raises(InvalidArgumentError, match="token=") as refused:
        open_store("http://me:pw-4@127.0.0.1:9/store")
    assert "pw-4" not in str(refused.value)


class _Hostile(http.server.BaseHTTPRequestHandler):
    """A server that answers what a store's client must not take: redirects and bad listings."""

    BOMB = gzip.compress(bytes(1 << 20))  # 1 MiB of zeros in about 1 KB
    LISTINGS = {
        "/listing/": b'[{"key": "listing/ok.bin", "size": 1, "mtime": 0},'
        b' {"key": "../../etc/passwd", "size": 1, "mtime": 0},'
        b' {"key": "listing/bad key", "size": 1, "mtime": 0}]',
        "/infinite/": b'[{"key": "infinite/a", "size": 1e400, "mtime": 0}]',
    }
    EXISTS = {"/short/": b"[true]", "/text/": b"yes", "/ints/": b"[1, 0]"}  # answers to two keys
    asked: list[str] = []  # the paths requested, in order
    sent: dict[str, int] = {}  # body bytes written per path

    def _answer(self) -> None:
        self.asked.append(self.path)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/busy/a.bin":  # urllib3 waited this long before each of two retries
            self.send_response(503)
            self.send_header("Retry-After", "5")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/drip/a.bin":  # 100 bytes, one every 0.2 s: each read is within the timeout
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            with contextlib.suppress(OSError):  # the client gave up
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            return
        if self.path == "/big/declared.bin":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            self.wfile.write(bytes(1 << 20))
            return
        if self.path == "/big/undeclared.bin":  # 256 MiB until close (HTTP/1.0), unless the client leaves
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(4096):
                    self.wfile.write(bytes(1 << 16))
                    self.sent[self.path] = self.sent.get(self.path, 0) + (1 << 16)
            self.sent[self.path + " done"] = 1
            return
        if self.path == "/bomb/a.bin":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(self.BOMB)))
            self.end_headers()
            self.wfile.write(self.BOMB)
            return
        answers = self.EXISTS if self.command == "POST" else self.LISTINGS
        body = answers.get(self.path, b"redirect!")
        self.send_response(200 if self.path in answers else 302)
        self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_DELETE = do_HEAD = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def test_a_client_takes_no_redirect_or_foreign_listing_for_an_answer() -> None:
    """A redirect (say http -> https in front of the server) was success: a put stored nothing and
    returned, a get returned the redirect's page as the value, exists and delete said yes. Listing
    entries outside the store's folder or with invalid keys were kept (cut to garbage keys that
    eviction would delete), and a size of 1e400 raised OverflowError."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with open_store(f"{base}/redirect") as store:
            for call in (
                lambda: store.put("a.bin", b"x"),
                lambda: store.get("a.bin"),
                lambda: store.exists("a.bin"),
                lambda: store.delete("a.bin"),
                lambda: store.exists_many(["a.bin"]),  # a redirect is no refusal: not asked key by key
            ):
                with pytest.raises(StoreError, match="302"):
                    call()
        for name in _Hostile.EXISTS:  # an exists answer that is not one boolean per key
            with open_store(f"{base}{name}") as store, pytest.raises(StoreError, match="exists answer"):
                store.exists_many(["a.bin", "b.bin"])
        with open_store(f"{base}/listing") as store:
            assert [e.key for e in store.list()] == ["ok.bin"]
        with open_store(f"{base}/infinite") as store, pytest.raises(StoreError, match="unreadable listing"):
            store.list()
        with pytest.raises(InvalidArgumentError, match="visible ASCII"):
            open_store(base, token="a\nb")
        with open_store(f"{base}/bomb") as store:  # the bytes sent, not inflated
            assert store.get("a.bin") == _Hostile.BOMB
        with open_store(f"{base}/busy") as store, pytest.raises(StoreError, match="503"):
            _Hostile.asked.clear()
            store.get("a.bin")  # at once: a reply's Retry-After is not obeyed (no retry on it)
        assert _Hostile.asked == ["/busy/a.bin"]
        store = HttpStore(f"{base}/drip", auth_key="", timeout=1.0)
        with pytest.raises(StoreError, match="bytes/s past the 1 s timeout"):
            store.get("a.bin")  # not after the 20 s the body lasts
        store.close()
        with open_store(f"{base}/big") as store:
            for name in ("declared.bin", "undeclared.bin"):
                with pytest.raises(LimitExceededError):
                    store.get(name, max_size=1000)
        deadline = time.monotonic() + 60
        while "/big/undeclared.bin done" not in _Hostile.sent:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _Hostile.sent["/big/undeclared.bin"] < 64 << 20  # the reader stopped, not read it all
    finally:
        server.shutdown()
        server.server_close()


def test_an_authorization_header_that_is_not_utf8_is_refused(token_server: tuple[str, Path]) -> None:
    """aiohttp keeps its bytes as surrogates: the comparison raised, a 500 with a traceback."""
    base, root = token_server
    head = b"PUT /u.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3\xffcret\r\nContent-Length: 1\r\n\r\nx"
    answer = _exchange(int(base.rsplit(":", 1)[1]), head)
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"401" and not (root / "u.bin").exists()


def test_a_token_under_another_scheme_than_bearer_is_refused(token_server: tuple[str, Path]) -> None:
    """Only `Authorization: Bearer <token>` lets a write in: the token sent as Basic (or any other
    scheme's) credentials is refused, and nothing is stored."""
    base, root = token_server
    port = int(base.rsplit(":", 1)[1])
    for scheme in (b"Basic", b"Token", b"Bearerx"):
        head = (
            b"PUT /scheme.bin HTTP/1.1\r\nHost: x\r\nAuthorization: " + scheme + b" s3cret\r\n"
            b"Content-Length: 1\r\n\r\nx"
        )
        answer = _exchange(port, head)
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"401", (scheme, answer[:80])
    assert not (root / "scheme.bin").exists()
    ok = b"PUT /scheme.bin HTTP/1.1\r\nHost: x\r\nAuthorization: bearer s3cret\r\nContent-Length: 1\r\n\r\nx"
    assert _exchange(port, ok).split(b"\r\n", 1)[0].split()[1] == b"201"  # the scheme is case-blind


@pytest.fixture(params=["file", "redis", "http"])
def keyed_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with open_store(_store_url(request, tmp_path), auth_key="a key") as s:
        yield s


def test_a_tagged_value_over_max_size_is_over_the_limit_not_forged(keyed_store: Store) -> None:
    """With a key, a value past max_size is a LimitExceededError, as without one: the raw read
    stops at the limit itself (a value cut there fails its tag, an AuthenticationError, which
    `_get_within` does not remove and `has` takes for a forgery)."""
    keyed_store.put("big.bin", b"v" * 10000)
    assert keyed_store.get("big.bin", max_size=10000) == b"v" * 10000
    for max_size in (9999, 5000):  # one byte short; far short (the read stops inside the value)
        with pytest.raises(LimitExceededError, match="more than"):
            keyed_store.get("big.bin", max_size=max_size)


def test_a_redis_lru_member_that_is_no_key_is_not_listed_even_with_a_value(redis_url: str) -> None:
    """A member of the LRU set that is no valid key is skipped though a string value is stored
    under its name (the TYPE check alone let it through: an eviction could never delete it)."""
    import redis

    prefix = f"t{os.getpid()}-listing-valued:"
    with open_store(f"{redis_url}?prefix={prefix}") as rstore:
        rstore.put("lcg4/chunks/a", b"x")
        client = redis.Redis.from_url(redis_url)
        client.set(f"{prefix}junk name", b"y")
        client.set(f"{prefix}../up", b"y")
        client.zadd(f"{prefix}__lru__", {b"junk name": 0, b"../up": 0})
        assert [e.key for e in rstore.list("")] == ["lcg4/chunks/a"]
        client.close()
