"""A compressed prompt cache for llama-cpp-python (`llm.set_cache(CompressedStateCache(...))`).

Each entry is two store objects under `<namespace>/`: `<name>.lcg`, the compressed context state
(a llama-cachegen container whose envelope carries the token ids, see llama.py), and `<name>.tok`,
the entry's key (int32 token ids) for cheap longest-prefix lookups. `<name>` is a hash of the key.
The state is written first, so a visible key always has its state; eviction removes the key
first. Stores write atomically, so processes sharing one store never see half an entry. The
namespace is the model fingerprint once the cache is bound to a model (`model=` or
`llama_cachegen.Llama.set_cache`), so different models or KV types never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from . import codec
from .errors import (
    AuthenticationError,
    CacheGenError,
    CorruptDataError,
    EntryNotFoundError,
    ModelMismatchError,
)
from .llama import StateMeta, check_fingerprint, fingerprint_key, model_fingerprint
from .model import cache_dir
from .stores import EntryInfo, Store, open_store

_STATE, _KEY = ".lcg", ".tok"


class _CachedState(llama_cpp.llama.LlamaState):
    """A cache hit; `discard` drops its entry if llama.cpp refuses the state after all."""

    def __init__(self, discard: Callable[[], None], **fields: Any) -> None:
        super().__init__(**fields)
        self.discard = discard


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class CompressedStateCache(BaseLlamaCache):
    """llama-cpp-python's prompt cache with compressed states in a shared store.

    `store` is a store URL (`file://dir`, `redis://…`, `http://…`) or a Store; the default is a
    folder in the llama-cachegen cache directory. `capacity_bytes` bounds the bytes stored in this
    cache's namespace, partial writes included; the least recently used entries go first.

    A hit is reported only for an entry that passed every check that needs no context: its
    authentication tag (when the store has a key), its envelope, the fingerprint, its size, its
    decode. An entry that fails one, or that llama.cpp still refuses (llama_cachegen.Llama), is
    removed and counts as a miss. An unbound cache (a plain llama_cpp.Llama without `model=`)
    cannot check the fingerprint: bind it whenever processes with other settings share a store.
    """

    def __init__(
        self,
        store: str | Path | Store | None = None,
        *,
        level: str | int = "balanced",
        capacity_bytes: int = 2 << 30,
        model: llama_cpp.Llama | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes)
        if store is None:
            store = cache_dir() / "prompt-cache"
        self.store = store if isinstance(store, Store) else open_store(str(store))
        self.level = level
        self.threads = threads
        self.namespace = "default"
        self.hits = self.misses = 0
        self._fingerprint: dict[str, Any] | None = None
        self._n_ctx: int | None = None
        self._logits_all = False
        self._keys: dict[str, np.ndarray] = {}  # entry name -> its key; names are content hashes
        if model is not None:
            self.bind(model)

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Ties the cache to `llm`'s model fingerprint: entries of other models are never seen."""
        self._fingerprint = model_fingerprint(llm)
        self.namespace = fingerprint_key(self._fingerprint)
        self._n_ctx = len(llm.input_ids)
        self._logits_all = bool(llm._logits_all)

    def _entries(self) -> dict[str, list[EntryInfo]]:
        groups: dict[str, list[EntryInfo]] = {}
        for info in self.store.list(f"{self.namespace}/"):
            name, dot, ext = info.key.rpartition(".")
            if dot and f".{ext}" in (_STATE, _KEY):
                groups.setdefault(name, []).append(info)
        return groups

    @property
    def cache_size(self) -> int:
        """Bytes of this namespace's entries and of the partial writes in it."""
        pending = sum(info.size for info in self.store.temporaries(f"{self.namespace}/"))
        return pending + sum(info.size for infos in self._entries().values() for info in infos)

    def _key_of(self, name: str) -> np.ndarray | None:
        if name not in self._keys:
            try:
                data = self.store.get(name + _KEY)
            except (EntryNotFoundError, AuthenticationError):  # gone, or not by a holder of the key
                return None
            if len(data) % 4:
                return None  # not ours: the store never holds partial writes
            self._keys[name] = np.frombuffer(data, dtype="<i4")
        return self._keys[name]

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        found = self._find(np.asarray(key, dtype="<i4"))
        return None if found is None else tuple(int(t) for t in found[1])

    def _find(self, key: np.ndarray) -> tuple[str, np.ndarray] | None:
        best: tuple[str, np.ndarray] | None = None
        best_len = 0
        for name, infos in self._entries().items():
            if not any(i.key.endswith(_KEY) for i in infos):
                continue
            tokens = self._key_of(name)
            if tokens is None or (self._n_ctx is not None and tokens.size > self._n_ctx):
                continue
            n = _common_prefix(tokens, key)
            if n > best_len:
                best, best_len = (name, tokens), n
        return best

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find(np.asarray(key, dtype="<i4")) is not None

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        found = self._find(np.asarray(key, dtype="<i4"))
        if found is None:
            self.misses += 1
            raise KeyError("no cached prefix")
        name = found[0]
        # everything that can be checked without the context is checked here: llama-cpp-python
        # overwrites its token list before it hands the state to llama.cpp
        try:
            blob = self.store.get(name + _STATE)
            meta = StateMeta.unpack(codec.user_meta(blob))
            if meta.scope != "all":
                raise CorruptDataError("a prompt-cache entry holds a whole-context state")
            if self._fingerprint is not None:
                check_fingerprint(meta.fingerprint, self._fingerprint)
            cells = int(codec.inspect(blob)["cells"])
            if self._n_ctx is not None and max(cells, meta.tokens.size) > self._n_ctx:
                raise ModelMismatchError(f"{cells} KV cells do not fit n_ctx {self._n_ctx}")
            state = codec.decode(blob, threads=self.threads)
        except EntryNotFoundError:  # evicted by another process since the lookup
            self.misses += 1
            raise KeyError("cached prefix evicted meanwhile") from None
        except CacheGenError as exc:  # damaged, foreign or forged: drop it and miss rather than fail
            self._remove(name)
            self.misses += 1
            raise KeyError(f"unusable cache entry {name}: {exc}") from exc
        self.store.touch(name + _STATE)
        self.hits += 1
        n_ctx = self._n_ctx or meta.n_ctx
        input_ids = np.zeros(n_ctx, dtype=np.intc)
        n = meta.tokens.size
        input_ids[:n] = meta.tokens
        n_vocab = (self._fingerprint or meta.fingerprint).get("n_vocab")
        if not isinstance(n_vocab, int) or n_vocab <= 0:  # unbound, and an envelope without it
            n_vocab = meta.logits.size if meta.logits is not None else 1
        logits = meta.logits if meta.logits is not None and meta.logits.size == n_vocab else None
        # llama-cpp-python broadcasts this one row over the restored rows; only the last one is real
        scores = (logits if logits is not None else np.zeros(n_vocab, np.single))[None, :]
        return _CachedState(
            lambda: self._discard(name),
            input_ids=input_ids,
            scores=scores,
            n_tokens=n,
            llama_state=state,
            llama_state_size=len(state),
            seed=meta.seed if meta.seed is not None else 0,
        )

    def _discard(self, name: str) -> None:
        """An entry llama.cpp refused after all (see llama_cachegen.Llama.load_state): a miss."""
        self._remove(name)
        self.hits -= 1
        self.misses += 1

    def __setitem__(self, key: Sequence[int], value: llama_cpp.llama.LlamaState) -> None:
        key_arr = np.asarray(key, dtype="<i4")
        n = int(value.n_tokens)
        logits = None
        if self._logits_all and 0 < n <= value.scores.shape[0]:
            logits = value.scores[n - 1]
        meta = StateMeta(
            fingerprint=self._fingerprint or {},
            scope="all",
            seq_id=None,
            n_ctx=len(value.input_ids),
            tokens=value.input_ids[:n],
            logits=logits,
            seed=value.seed,
        )
        blob = codec.encode(
            value.llama_state, self.level, threads=self.threads, kind="full_buffer", user_meta=meta.pack()
        )
        name = f"{self.namespace}/{hashlib.sha256(key_arr.tobytes()).hexdigest()[:32]}"
        self.store.put(name + _STATE, blob)
        self.store.put(name + _KEY, key_arr.tobytes())
        self._keys[name] = key_arr
        self._evict()

    def _remove(self, name: str) -> None:
        self.store.delete(name + _KEY)  # the key first: lookups stop finding it before the state goes
        self.store.delete(name + _STATE)
        self._keys.pop(name, None)

    def _evict(self) -> None:
        self.store.sweep()  # leftovers of dead writers go first; the rest still take space
        groups = self._entries()
        size = sum(i.size for i in self.store.temporaries(f"{self.namespace}/"))
        size += sum(i.size for infos in groups.values() for i in infos)
        # a group's last use is its newest object: orphans of dead writers simply age out
        order = sorted(groups, key=lambda n: max(i.mtime for i in groups[n]))
        for name in order:
            if size <= self.capacity_bytes:
                break
            self._remove(name)
            size -= sum(i.size for i in groups[name])

    def clear(self) -> None:
        """Removes every entry of this cache's namespace."""
        for name in self._entries():
            self._remove(name)
