"""A shaped link on 127.0.0.1: a TCP relay whose downstream rate follows a bandwidth trace.

    client ──▶ Relay (127.0.0.1:port) ──▶ store server (llama-cachegen serve, redis-server)
           ◀── token bucket at trace.rate_at(t) ◀──

Everything a store sends back (server to client) passes one token bucket shared by every
connection, as one link would; requests go up unshaped. The trace gives the rate in bytes per
second over time since `set_trace` (segments, the last held). Faults for tests: `cut()` resets
every connection and refuses new ones (a store that died), `corrupt(after, every)` flips
downstream bytes (a chunk damaged on the wire).

`tc` (tbf/netem on a veth pair in a network namespace) would shape in the kernel, but it needs
root, iproute2 and network namespaces, which containers and CI runners rarely grant: this relay
runs anywhere and its rate and faults can be changed while a load is in flight. It runs its own
asyncio loop on a daemon thread, so a test or a bench drives it from synchronous code.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidArgumentError

_READ = 1 << 16
_MSS = 1460  # below this a slow link sends whole segments, not a byte at a time
_BURST_S = 0.01  # the bucket holds 10 ms of the current rate
_MAX_SLEEP_S = 0.02  # a rate change takes effect within this


def mbit(rate_mbps: float) -> float:
    """Bytes per second of a rate in Mbit/s."""
    return rate_mbps * 1e6 / 8


@dataclass(frozen=True)
class Trace:
    """A link's rate over time: (duration in seconds, bytes per second) segments; the last rate
    holds for ever. A rate of math.inf is an unshaped link."""

    segments: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise InvalidArgumentError("a trace needs at least one segment")
        for duration, rate in self.segments:
            if not (duration > 0 and rate > 0):
                raise InvalidArgumentError(
                    f"trace segments need positive durations and rates: {duration, rate}"
                )

    @classmethod
    def constant(cls, rate: float) -> Trace:
        return cls(((math.inf, rate),))

    @classmethod
    def steps(cls, segments: Sequence[tuple[float, float]]) -> Trace:
        return cls(tuple((float(d), float(r)) for d, r in segments))

    @classmethod
    def drop(cls, high: float, low: float, at_s: float) -> Trace:
        """`high` until `at_s`, then `low` (a sudden drop)."""
        return cls(((at_s, high), (math.inf, low)))

    @classmethod
    def random(cls, low: float, high: float, period_s: float, seed: int, duration_s: float = 600.0) -> Trace:
        """A new rate every `period_s`, drawn log-uniformly from [low, high] (CacheGen's evaluation
        draws a bandwidth per chunk; with `period_s` about one chunk's transfer time, the same)."""
        rng = random.Random(seed)
        n = max(1, math.ceil(duration_s / period_s))
        lo, hi = math.log(low), math.log(high)
        return cls(tuple((period_s, math.exp(rng.uniform(lo, hi))) for _ in range(n)))

    def rate_at(self, t: float) -> float:
        for duration, rate in self.segments:
            if t < duration:
                return rate
            t -= duration
        return self.segments[-1][1]

    def transfer_s(self, t0: float, nbytes: float) -> float:
        """Seconds to send `nbytes` starting at `t0` (the oracle a simulated streamer reads)."""
        t, left = 0.0, float(nbytes)
        for duration, rate in (*self.segments[:-1], (math.inf, self.segments[-1][1])):
            if t0 >= t + duration:
                t += duration
                continue
            start = max(t0, t)
            if math.isinf(rate):
                return start - t0
            span = t + duration - start
            if left <= span * rate:
                return start - t0 + left / rate
            left -= span * rate
            t += duration
        raise AssertionError("the last segment is unbounded")


class Relay:
    """A token-bucket TCP relay to `target` (a store URL or host:port) on 127.0.0.1.

    `url` is the target's URL with the relay's port: hand it to a loader instead of the store's.
    Use as a context manager, or call `close()`.
    """

    def __init__(self, target: str, trace: Trace | None = None, *, host: str = "127.0.0.1") -> None:
        parts = urllib.parse.urlsplit(target if "://" in target else f"tcp://{target}")
        if parts.hostname is None or parts.port is None:
            raise InvalidArgumentError(f"the relay needs a target with a host and a port, got {target!r}")
        self._target = (parts.hostname, parts.port)
        self._parts = parts
        self._trace = trace or Trace.constant(math.inf)
        self._t0 = time.monotonic()
        self._tokens, self._last = 0.0, self._t0
        self._cut = False
        self._corrupt_at: int | None = None
        self._corrupt_every: int | None = None
        self._switch: tuple[int, Trace | None] | None = None  # (at bytes_down, trace; None: cut)
        self._writers: set[asyncio.StreamWriter] = set()
        self.bytes_down = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lcg-relay", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, host, 0), self._loop
        ).result(10)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]

    @property
    def url(self) -> str:
        """The target URL with the relay's address (path and query kept)."""
        return urllib.parse.urlunsplit(self._parts._replace(netloc=f"{self.host}:{self.port}"))

    # ---- control (any thread) ------------------------------------------------------------------

    def set_trace(self, trace: Trace) -> None:
        """Follows `trace` from now on (its time 0 is now)."""
        self._call(self._set_trace, trace)

    def clock(self) -> float:
        """Seconds since the trace started."""
        return time.monotonic() - self._t0

    def rate(self) -> float:
        """The rate now, bytes per second."""
        return self._trace.rate_at(self.clock())

    def transfer_s(self, nbytes: float) -> float:
        """Seconds the trace needs to send `nbytes` from now (an oracle: ignores what is in flight)."""
        return self._trace.transfer_s(self.clock(), nbytes)

    def cut(self) -> None:
        """Resets every connection and refuses new ones, until `heal()`."""
        self._call(self._do_cut)

    def heal(self) -> None:
        self._cut = False

    def switch_after(self, after: int, trace: Trace | None) -> None:
        """Follows `trace` (None: `cut()`) once `after` more bytes have gone down: a change at a
        point of a transfer, whatever the timing of the loader's threads."""
        self._call(self._set_switch, after, trace)

    def corrupt(self, after: int, every: int | None = None) -> None:
        """Flips one downstream byte `after` bytes from now (and then every `every` bytes)."""
        self._call(self._set_corrupt, after, every)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            self._server.close()
            self._do_cut()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: object, *args: object) -> None:
        async def run() -> None:
            fn(*args)  # type: ignore[operator]

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # ---- the loop's side -----------------------------------------------------------------------

    def _set_trace(self, trace: Trace) -> None:
        self._trace = trace
        self._t0 = self._last = time.monotonic()
        self._tokens = 0.0

    def _do_cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def _set_switch(self, after: int, trace: Trace | None) -> None:
        self._switch = (self.bytes_down + after, trace)

    def _check_switch(self) -> None:
        if self._switch is not None and self.bytes_down >= self._switch[0]:
            trace = self._switch[1]
            self._switch = None
            if trace is None:
                self._do_cut()
            else:
                self._set_trace(trace)

    def _set_corrupt(self, after: int, every: int | None) -> None:
        self._corrupt_at = self.bytes_down + after
        self._corrupt_every = every

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer, False), self._pump(up_reader, writer, True))
        except asyncio.CancelledError:
            # closing the relay: the handler ends quietly (asyncio's stream callback would log the
            # cancellation of a connection handler as an error)
            pass
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, down: bool) -> None:
        try:
            while data := await reader.read(_READ):
                view = memoryview(bytearray(data)) if down else memoryview(data)
                while view:
                    # A cut connection stops here: its buffered bytes would take the link's
                    # tokens from the connections after it.
                    if writer.transport.is_closing():
                        return
                    n = await self._take(len(view)) if down else len(view)
                    piece = view[:n]
                    if down:
                        self._tamper(piece)
                        self.bytes_down += n
                        self._check_switch()
                    writer.write(piece)
                    await writer.drain()
                    view = view[n:]
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            pass
        finally:
            writer.transport.abort()

    def _tamper(self, piece: memoryview) -> None:
        while self._corrupt_at is not None and self._corrupt_at < self.bytes_down + len(piece):
            offset = self._corrupt_at - self.bytes_down
            if offset >= 0:
                piece[offset] ^= 0x5A
            self._corrupt_at = None if self._corrupt_every is None else self._corrupt_at + self._corrupt_every

    async def _take(self, want: int) -> int:
        """Waits until the bucket holds enough tokens for a piece of `want` bytes; returns how many
        bytes may go now."""
        while True:
            now = time.monotonic()
            rate = self._trace.rate_at(now - self._t0)
            if math.isinf(rate):
                return want
            burst = max(_MSS, rate * _BURST_S)
            self._tokens = min(burst, self._tokens + rate * (now - self._last))
            self._last = now
            need = min(want, _MSS)
            if self._tokens >= need:
                grant = min(want, int(self._tokens))
                self._tokens -= grant
                return grant
            await asyncio.sleep(min(_MAX_SLEEP_S, max(1e-3, (need - self._tokens) / rate)))


__all__ = ["Relay", "Trace", "mbit"]
