"""A store in a local directory, safe to share between processes.

Each key is a file; `put` writes a uniquely named hidden temporary file in the same folder and
renames it over the key (atomic on POSIX), so readers never see a partial value and two writers
never interleave. A writer killed mid-write leaves only a hidden temporary, which `list` ignores,
`temporaries` reports and `sweep` removes as soon as its writer is known to be dead.

Nothing below the root is reached through a symbolic link: every folder is opened relative to its
parent with O_NOFOLLOW, so a link planted inside the directory cannot make a read or a write land
outside it (the root itself may be a link; it is resolved once).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import stat
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from ..errors import CacheGenError, EntryNotFoundError, InvalidArgumentError, StoreError
from . import AuthKey, EntryInfo, Store, check_key, is_key

_TMP_PREFIX = ".tmp-"
_FOLDER_ATTEMPTS = 8  # begin_write's tries when a delete removes the folder it just created


def _pid_space() -> str:
    """Where a pid names one process: the host name and the PID namespace (containers that share
    a volume and the host's name see other pids: a live writer's pid there is no process here)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: the host name alone
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


# temporaries are named .tmp-<pid space>-<pid>-<random>-<name>: a sweeper in the same pid space can
# tell whether the writer still runs
_PID_SPACE = _pid_space()
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_regular(name: str | Path, flags: int, dir_fd: int | None = None) -> int | None:
    """A blocking read descriptor of the regular file `name`, or None for anything else. Opened
    without blocking: a FIFO planted in a shared folder would block the open until a writer
    came, before the file's type could be checked."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | flags, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def path_of(url: str | Path) -> Path:
    """The local path of a `file://` URL or a plain path."""
    url = str(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "file":
        if not url:
            raise InvalidArgumentError("an empty path names nothing")
        return Path(url).expanduser()
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgumentError(f"file URL {url!r} names a remote host")
    if not parts.path:
        raise InvalidArgumentError(f"file URL {url!r} names nothing")
    return Path(urllib.request.url2pathname(parts.path))


def _tmp_name(name: str) -> str:
    return f"{_TMP_PREFIX}{_PID_SPACE}-{os.getpid()}-{uuid.uuid4().hex}-{name}"


def writer_is_dead(tmp_name: str) -> bool:
    """True when the temporary `tmp_name` was written in this pid space (host and PID namespace) by
    a process that is gone."""
    parts = tmp_name.removeprefix(_TMP_PREFIX).split("-", 3)
    if len(parts) < 4 or parts[0] != _PID_SPACE or not parts[1].isdigit():
        return False  # another host's or PID namespace's, or an older naming: only its age tells
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive under another user
        return False
    return False


class PendingWrite:
    """A new value for one file, written into a hidden temporary beside it: `commit` renames it
    over the file (atomic), `abort` removes it (and does nothing once committed or aborted), then
    calls `aborted` (a store removes the folders left empty). Takes ownership of `dir_fd`."""

    def __init__(self, dir_fd: int, name: str, aborted: Callable[[], None] | None = None) -> None:
        self._dir_fd, self._name, self._tmp = dir_fd, name, _tmp_name(name)
        self._aborted = aborted
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(self._tmp, flags, 0o666, dir_fd=dir_fd)
        except OSError:
            os.close(dir_fd)
            raise
        self._file = open(fd, "wb")  # noqa: SIM115 - closed by commit or abort
        self._open = True
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._file.write(data)
        self.size += len(data)

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())  # the rename must not become visible before the data
        self._file.close()
        os.replace(self._tmp, self._name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._open = False
        os.close(self._dir_fd)

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp, dir_fd=self._dir_fd)
        os.close(self._dir_fd)
        if self._aborted is not None:
            self._aborted()


def atomic_write(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Writes `data` to `path` through a unique hidden temporary and a rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pending = PendingWrite(os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)), path.name)
    except OSError as exc:
        raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
    _finish(pending, data, f"cannot write {path}")


def _finish(pending: PendingWrite, data: bytes | bytearray | memoryview, failure: str) -> None:
    try:
        pending.write(data)
        pending.commit()
    except OSError as exc:
        pending.abort()
        raise StoreError(f"{failure}: {exc.strerror or exc}") from exc


def read_path(path: Path) -> bytes:
    try:
        fd = _open_regular(path, _CLOEXEC)
        if fd is None:
            raise StoreError(f"cannot read {path}: not a regular file")
        with open(fd, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise EntryNotFoundError(f"no file {path}") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc


class FileStore(Store):
    local = True

    def __init__(self, url: str | Path, *, auth_key: AuthKey = None) -> None:
        super().__init__(auth_key=auth_key)
        self.root = path_of(url)
        self.url = self.root.resolve().as_uri() if self.root.is_absolute() else str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc
        self._real_root = os.path.realpath(self.root)

    @contextlib.contextmanager
    def _folder(self, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """An fd of the folder holding `key` and the key's last segment, every folder opened
        without following links (ELOOP / ENOTDIR where one is a link or a file)."""
        fd = self._open_folder(key, create=create)
        try:
            yield fd, key.rsplit("/", 1)[-1]
        finally:
            os.close(fd)

    def _open_folder(self, key: str, *, create: bool = False) -> int:
        try:
            fd = os.open(self._real_root, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self._real_root, exist_ok=True)  # removed under a running writer (a tmp cleaner)
            fd = os.open(self._real_root, _DIR_FLAGS)
        try:
            for folder in check_key(key).split("/")[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder, dir_fd=fd)
                sub = os.open(folder, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _failure(self, what: str, key: str, exc: OSError) -> StoreError:
        return StoreError(f"cannot {what} {key!r} in {self.root}: {exc.strerror or exc}")

    def open(self, key: str) -> BinaryIO:
        """The stored file of `key`, open for reading; EntryNotFoundError when absent."""
        try:
            with self._folder(key) as (dir_fd, name):
                fd = _open_regular(name, _NOFOLLOW | _CLOEXEC, dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            raise EntryNotFoundError(f"{key!r} not in {self.url}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link is no entry: a store follows none
                raise EntryNotFoundError(f"{key!r} is a link in {self.url}, not an entry") from None
            raise self._failure("read", key, exc) from exc
        if fd is None:
            raise EntryNotFoundError(f"{key!r} in {self.url} is a folder or a special file, not an entry")
        return open(fd, "rb")

    def _get(self, key: str, limit: int | None) -> bytes:
        with self.open(key) as f:
            try:
                data = f.read() if limit is None else f.read(limit + 1)
            except OSError as exc:
                raise self._failure("read", key, exc) from exc
        if limit is not None and len(data) > limit:
            raise self._over(key, limit)
        return data

    def begin_write(self, key: str) -> PendingWrite:
        """A PendingWrite for `key` (folders created as needed); StoreError when a folder of the
        key is a file or a link, or the key names a folder or a link."""
        gone = FileNotFoundError()
        for _ in range(_FOLDER_ATTEMPTS):
            try:
                return self._begin_write(key)
            except FileNotFoundError as exc:  # a delete emptied a folder of the key and removed it
                gone = exc  # between its creation here and the temporary's: once more
            except OSError as exc:
                raise self._failure("write", key, exc) from exc
        raise self._failure("write", key, gone) from gone

    def _begin_write(self, key: str) -> PendingWrite:
        fd = self._open_folder(key, create=True)
        name = key.rsplit("/", 1)[-1]
        try:
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                raise StoreError(f"cannot write {key!r} in {self.root}: a folder or a link is there")
        except BaseException:
            os.close(fd)
            raise
        return PendingWrite(fd, name, lambda: self._remove_empty_folders(key))

    def _put(self, key: str, data: bytes) -> None:
        _finish(self.begin_write(key), data, f"cannot write {key!r} in {self.root}")

    def _stat(self, key: str) -> os.stat_result | None:
        """The entry's stat, None when there is no regular file under `key`."""
        try:
            with self._folder(key) as (fd, name):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._failure("read", key, exc) from exc
        return st if stat.S_ISREG(st.st_mode) else None

    def size(self, key: str) -> int:
        """The stored size of `key`; EntryNotFoundError when absent."""
        st = self._stat(check_key(key))
        if st is None:
            raise EntryNotFoundError(f"{key!r} not in {self.url}")
        return st.st_size

    def delete(self, key: str, *, unused_since: float | None = None) -> bool:
        try:
            with self._folder(key) as (fd, name):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return False  # a folder or a link: not an entry
                if unused_since is not None and st.st_mtime > unused_since:
                    return False  # (a use between the stat and the unlink still loses the entry)
                os.unlink(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._failure("delete", key, exc) from exc
        self._remove_empty_folders(key)
        return True

    def _remove_empty_folders(self, key: str) -> None:
        """Removes the folders of `key` that its deletion (or a temporary's) left empty, deepest
        first (each chunk has a folder of its own: left behind, they piled up and every listing
        walked them). A writer that finds its folder gone meanwhile creates it again (begin_write)."""
        folders = key.split("/")[:-1]
        while folders:
            name = folders.pop()
            try:
                with self._folder("/".join([*folders, name])) as (parent, _):
                    os.rmdir(name, dir_fd=parent)
            except (OSError, CacheGenError):  # not empty, gone, not ours to remove: done
                return

    def exists(self, key: str) -> bool:
        return self._stat(check_key(key)) is not None

    def _walk(self, prefix: str, temporaries: bool) -> list[EntryInfo]:
        entries = []
        # os.walk descends into no linked folder; linked files are skipped below
        for dirpath, dirnames, filenames in os.walk(self._real_root):
            rel = Path(dirpath).relative_to(self._real_root).as_posix()
            base = "" if rel == "." else f"{rel}/"
            # descend only into folders that can hold keys under the prefix
            folders = ((d, f"{base}{d}/") for d in dirnames if not d.startswith("."))
            dirnames[:] = [d for d, f in folders if f.startswith(prefix) or prefix.startswith(f)]
            for name in filenames:
                if (name.startswith(_TMP_PREFIX) if temporaries else name.startswith(".")) != temporaries:
                    continue  # entries are the visible files, temporaries the .tmp- ones
                key = base + (name.split("-", 4)[-1] if temporaries else name)
                if not key.startswith(prefix) or not is_key(key):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted by another process meanwhile
                    continue
                if stat.S_ISREG(st.st_mode):
                    entries.append(EntryInfo(base + name if temporaries else key, st.st_size, st.st_mtime))
        return entries

    def list(self, prefix: str = "") -> list[EntryInfo]:
        return self._walk(prefix, temporaries=False)

    def temporaries(self, prefix: str = "") -> list[EntryInfo]:
        """Temporaries of writes in progress or of dead writers whose key starts with `prefix`;
        each EntryInfo's key is the temporary's own path."""
        return self._walk(prefix, temporaries=True)

    def mark_used(self, keys: Sequence[str]) -> None:
        # times set exactly, a microsecond apart (the file system's own clock ticks every few ms);
        # best effort: a key missing, a link or a read-only store is left as it is
        now = time.time_ns()
        for i, key in enumerate(keys):
            ns = now + i * 1000
            with contextlib.suppress(OSError), self._folder(key) as (fd, name):
                os.utime(name, ns=(ns, ns), dir_fd=fd, follow_symlinks=False)

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Removes temporaries whose writer died (known at once on this host) or that are older
        than `max_age_s` (writers on other hosts); returns how many."""
        removed = 0
        deadline = time.time() - max_age_s
        for info in self.temporaries():
            name = info.key.rsplit("/", 1)[-1]
            if info.mtime < deadline or writer_is_dead(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._real_root, info.key))
                    removed += 1
                self._remove_empty_folders(info.key)
        return removed
