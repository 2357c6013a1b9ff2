"""A store in a local directory, safe to share between processes.

Each key is a file; `put` writes a uniquely named hidden temporary file in the same folder and
renames it over the key (atomic on POSIX), so readers never see a partial value and two writers
never interleave. A writer killed mid-write leaves only a hidden temporary, which `list` ignores
and `sweep` removes once stale.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from ..errors import EntryNotFoundError, InvalidArgumentError, StoreError
from . import EntryInfo, Store, check_key

_TMP_PREFIX = ".tmp-"


def path_of(url: str | Path) -> Path:
    """The local path of a `file://` URL or a plain path."""
    url = str(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "file":
        return Path(url).expanduser()
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgumentError(f"file URL {url!r} names a remote host")
    return Path(urllib.request.url2pathname(parts.path))


def atomic_write(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a unique hidden temporary and a rename."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not become visible before the data
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write {path}: {exc}") from exc


def read_path(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise EntryNotFoundError(f"no file {path}") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc


class FileStore(Store):
    def __init__(self, url: str | Path) -> None:
        self.root = path_of(url)
        self.url = self.root.resolve().as_uri() if self.root.is_absolute() else str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def get(self, key: str) -> bytes:
        return read_path(self._path(key))

    def put(self, key: str, data: bytes) -> None:
        atomic_write(self._path(key), data)

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[EntryInfo]:
        entries = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if name.startswith(".") or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted by another process meanwhile
                    continue
                entries.append(EntryInfo(key, st.st_size, st.st_mtime))
        return entries

    def touch(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._path(key))

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Removes temporaries left by writers that died more than `max_age_s` ago; returns how many."""
        removed = 0
        deadline = time.time() - max_age_s
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    if name.startswith(_TMP_PREFIX) and os.stat(path).st_mtime < deadline:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed
