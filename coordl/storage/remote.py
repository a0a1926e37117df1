"""Requests to remote storage: how many go to a host at once, retries, and
the words of the errors that end them.

Every object read of a URL dataset, through obstore
(:mod:`coordl.storage.obstore_store`) or fsspec (:mod:`coordl.storage.fsspec_store`), goes
through :func:`call` (one object) or :func:`call_many` (a batch through
fsspec's concurrent ``cat``), so both read paths behave the same.

**How many at once.**  The fetch stage runs many threads (64 per worker for
URLs read through obstore) so that reads in flight hide the storage's
latency.  A large object store takes all of them; a small server does not
(``python -m http.server`` queues 5 connections: 64 at once overflow its
listen queue, the kernel drops the connection attempts and each waits for a
SYN retransmit, seconds, until requests time out).  So the threads share one
:class:`HostLimiter` per host and process: a cap on concurrent requests
that adapts to what the server sustains (AIMD, as TCP's congestion window):

* start at 4; double each round trip (slow start) until the first sign of
  congestion, then add one per round trip and at most one per second
  (at millisecond latencies, probing every round trip would refill a small
  server's queue within a second of each cut);
* grow only while latency holds (the median of the last 16 requests within
  2x a base: the lowest such median seen, drifting up slowly) and only
  while the limit is in use (requests wait for it), so an idle limit
  never runs away;
* halve on a refusal, reset, timeout, 5xx or 429, or a request that took
  over 0.9 s and 20x the base (a dropped connection attempt waiting for
  its retransmit: what a full listen queue does); cut to 0.8x when the
  median passes 4x the base (requests queue at the server); at most one
  cut per round trip (only requests started after the last cut can cut
  again).

Each process has its own limiters (fetch threads are per process; a fork
child starts afresh).

**Retries.**  Transient failures (connection refused/reset, timeouts, 408,
429, 5xx) are retried with exponential backoff and jitter, at most
``COORDL_REMOTE_RETRIES`` times (default 4) and not once past
``2 x COORDL_REMOTE_TIMEOUT`` since the first attempt.  Permanent ones
(404 and other 4xx, a missing key or bucket, refused credentials) are not
retried.  The clients' own retries are off (obstore's) or not there
(fsspec's HTTP) so that every failure reaches the limiter.

**Errors.**  A transient failure that outlasts its retries raises the same
kind of exception (``TimeoutError``, ``ConnectionError``, or
:class:`RemoteStatusError` for a 5xx/429) naming the URL, the attempts,
what was in flight to the host and what to change; it carries
``coordl_transient = True`` so the loader never calls it a bad file.  A
missing object raises ``FileNotFoundError`` saying it was not retried.

Settings (environment, read at each call): ``COORDL_REMOTE_TIMEOUT``
seconds per request (default 30), ``COORDL_REMOTE_RETRIES`` (default 4),
``COORDL_REMOTE_MAX_INFLIGHT`` a fixed cap per host (default: adaptive,
up to 1024).
"""
from __future__ import annotations

import collections
import errno
import os
import random
import threading
import time
import urllib.parse
from typing import Callable

from ..base.units import env_number
from ..base import forks as _forks

__all__ = ["HostLimiter", "limiter", "call", "call_many", "classify", "RemoteStatusError",
           "timeout_s", "retries"]

ENV_TIMEOUT = "COORDL_REMOTE_TIMEOUT"
ENV_RETRIES = "COORDL_REMOTE_RETRIES"
ENV_MAX_INFLIGHT = "COORDL_REMOTE_MAX_INFLIGHT"

INITIAL = 4
MAXIMUM = 1024
GROW_BELOW = 2.0     # grow while the recent latency <= 2x the base
CUT_ABOVE = 4.0      # cut to 0.8x when it passes 4x
SLACK_S = 0.001      # latency noise below which nothing counts as a rise
STALL_S = 0.9        # a request this slow, 20x the base: a dropped connection attempt
ROUND_MIN_S = 1.0    # after slow start, the limit grows by at most 1 per second
BACKOFF_S = 0.1
BACKOFF_MAX_S = 5.0

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_NET_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
                         errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                         errno.EAGAIN})


_env_float = env_number   # (name, default, minimum)


def timeout_s() -> float:
    """Seconds one request may take (``COORDL_REMOTE_TIMEOUT``, default 30)."""
    return _env_float(ENV_TIMEOUT, 30.0, 0.001)


def retries() -> int:
    """Retries of a transient failure (``COORDL_REMOTE_RETRIES``, default 4)."""
    return int(_env_float(ENV_RETRIES, 4, 0))


def _max_inflight() -> int | None:
    v = os.environ.get(ENV_MAX_INFLIGHT, "").strip()
    return int(_env_float(ENV_MAX_INFLIGHT, 0, 1)) if v else None


class RemoteStatusError(OSError):
    """The server answered a transient HTTP status (5xx, 429, 408)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# -- classification -----------------------------------------------------------------

def _names(e: BaseException) -> set:
    return {c.__name__ for c in type(e).__mro__}


def _status(e: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v <= 599:
            return v
    resp = getattr(e, "response", None)   # botocore's ClientError
    if isinstance(resp, dict):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def classify(e: BaseException) -> str | None:
    """``"timeout"``, ``"connect"``, ``"reset"`` or ``"status"`` for a
    transient failure worth retrying, else None (permanent: retrying
    cannot help)."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return None
    names = _names(e)
    if isinstance(e, TimeoutError) or names & {"ServerTimeoutError", "ConnectTimeoutError", "ReadTimeoutError"}:
        return "timeout"
    if isinstance(e, ConnectionRefusedError) or names & {"ClientConnectorError", "EndpointConnectionError"}:
        return "connect"
    if isinstance(e, ConnectionError) or names & {"ClientConnectionError", "ClientPayloadError"}:
        return "reset"
    status = _status(e)
    if status is not None:
        return "status" if status in TRANSIENT_STATUS else None
    if isinstance(e, OSError) and e.errno in _NET_ERRNOS:
        return "reset"
    return None


# -- the limiter ----------------------------------------------------------------------

class HostLimiter:
    """A cap on concurrent requests to one host, shared by the threads of a
    process; see the module docstring for how it adapts."""

    def __init__(self, host: str, initial: int = INITIAL, maximum: int = MAXIMUM,
                 fixed: int | None = None) -> None:
        self.host = host
        self.fixed = fixed
        self.maximum = fixed or maximum
        self.limit = float(fixed or min(initial, maximum))
        self.inflight = 0
        self.waiting = 0
        self.peak_inflight = 0
        self.peak_limit = self.limit
        self.slow_start = fixed is None
        self.cuts = 0         # times the limit was cut (congestion or latency)
        self.failures = 0     # transient failures seen
        self.successes = 0
        self._epoch = 0       # bumped at each cut: one cut per round trip
        self._base = None     # the latency that "holds" (see _observe)
        self._recent_median = None   # recent latency: the median of the last 16
        self._recent = collections.deque(maxlen=16)
        self._last_ok = time.monotonic()
        self._streak = 0      # transient failures since the last success
        self.last_failure = None   # (kind, exception) of the latest transient failure
        self._cond = threading.Condition()

    # callers
    def acquire(self, n: int = 1) -> tuple:
        """Wait for room and take up to ``n`` slots (at least one): ``(k, ticket)``."""
        with self._cond:
            self.waiting += 1
            try:
                while self.inflight >= int(self.limit):
                    self._cond.wait()
            finally:
                self.waiting -= 1
            k = max(1, min(n, int(self.limit) - self.inflight))
            self.inflight += k
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            return k, (time.monotonic(), self._epoch, self.inflight >= int(self.limit) or self.waiting > 0)

    def release(self, k: int, ticket: tuple, ok: int = 0, congested: int = 0) -> None:
        """Give back ``k`` slots taken with ``ticket``: ``ok`` of them
        succeeded, ``congested`` failed transiently (the rest failed for
        reasons that say nothing about the server's load)."""
        t0, epoch, busy = ticket
        now = time.monotonic()
        latency = now - t0
        with self._cond:
            busy = busy or self.waiting > 0
            self.inflight -= k
            if ok:
                self.successes += ok
                self._last_ok = now
                self._streak = 0
            if congested:   # a refusal, reset, timeout, 5xx or 429 answers for the whole batch
                self.failures += congested
                self._streak += congested
                self._cut(epoch, 0.5)
            elif ok:
                self._observe(latency)
                base, recent = self._base, self._recent_median
                if latency >= STALL_S and latency > 20 * base:
                    # a request stalled while the others run in milliseconds: a dropped
                    # connection attempt (a full listen queue) waiting for its retransmit
                    self._cut(epoch, 0.5)
                elif recent > CUT_ABOVE * base + SLACK_S:
                    self._cut(epoch, 0.8)
                elif busy and recent <= GROW_BELOW * base + SLACK_S and self.fixed is None:
                    if recent > 1.5 * base + SLACK_S:
                        self.slow_start = False   # latency starts to rise: grow slowly from here
                    # slow start: +1 per success (x2 per round trip); then +1 per round
                    # trip, and no faster than +1 per ROUND_MIN_S: at millisecond latencies
                    # probing per round trip would overflow a small server's queue in ms
                    step = ok if self.slow_start else ok / self.limit * min(1.0, recent / ROUND_MIN_S)
                    self.limit = min(float(self.maximum), self.limit + step)
                    self.peak_limit = max(self.peak_limit, self.limit)
            self._cond.notify(k + (1 if self.limit - self.inflight >= 2 else 0))

    def down_for(self, streak: int) -> float:
        """Seconds since the last success when at least ``streak`` requests
        in a row have failed transiently since, else 0."""
        with self._cond:
            return time.monotonic() - self._last_ok if self._streak >= streak else 0.0

    def _observe(self, latency: float) -> None:
        """Update the recent latency (the median of the last 16 requests:
        object stores' latencies spread widely even when idle, and one slow
        request says little) and the base it is judged against: the lowest
        recent median, drifting up slowly (time constant ~5000 requests) so
        that a server that became slower for good is not taken for an
        overloaded one forever."""
        recent = self._recent
        recent.append(latency)
        med = sorted(recent)[len(recent) // 2]
        self._recent_median = med
        if self._base is None or med < self._base or self.limit <= 2:
            self._base = med   # at 1-2 requests in flight, none of the wait is queueing behind ours
        else:
            self._base += 0.0002 * (med - self._base)

    def _cut(self, epoch: int, factor: float) -> None:
        if self.fixed is not None or epoch != self._epoch:
            return   # a request started before the last cut: that cut answered it already
        self._epoch += 1
        self.cuts += 1
        self.limit = max(1.0, self.limit * factor)
        self.slow_start = False
        self._recent.clear()   # judge the new limit afresh

    def describe(self) -> str:
        """What was in flight, for an error message."""
        with self._cond:
            lim = "fixed by COORDL_REMOTE_MAX_INFLIGHT" if self.fixed is not None else "adaptive"
            return (f"{self.inflight} request(s) to {self.host} were in flight and {self.waiting} more "
                    f"waiting (the {lim} limit on concurrent requests to this host is now {int(self.limit)}, "
                    f"at most {int(self.peak_limit)} so far; {self.failures} transient failure(s) in "
                    f"this process)")

    def statistics(self) -> dict:
        with self._cond:
            return {"host": self.host, "limit": int(self.limit), "inflight": self.inflight,
                    "waiting": self.waiting, "peak_inflight": self.peak_inflight,
                    "peak_limit": int(self.peak_limit), "cuts": self.cuts, "failures": self.failures,
                    "successes": self.successes}


_limiters: dict = {}
_limiters_lock = _forks.worker_safe(threading.Lock())


def _forget_after_fork() -> None:
    global _limiters_lock
    _limiters.clear()     # the child's threads are its own; a lock held in the parent must not be inherited
    _limiters_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def host_of(url: str) -> str:
    """``scheme://netloc`` of a URL: what one limiter covers (for S3-style
    URLs without an endpoint host, the bucket)."""
    p = urllib.parse.urlsplit(url)
    return f"{p.scheme}://{p.netloc}"


def limiter(url: str) -> HostLimiter:
    """This process's limiter for ``url``'s host."""
    host = host_of(url)
    lim = _limiters.get(host)
    if lim is None:
        with _limiters_lock:
            lim = _limiters.get(host)
            if lim is None:
                lim = _limiters[host] = HostLimiter(host, fixed=_max_inflight())
    return lim


# -- retries and errors -----------------------------------------------------------

# the jitter's own generator: Python's global one is the user's (their sampler; their transforms, which
# coordl seeds per sample in the thread that prepares it while fetch threads retry beside it)
_jitter = random.Random()
os.register_at_fork(after_in_child=_jitter.seed)   # each worker its own jitter, as Python reseeds its global one


def _backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_S * (2 ** attempt)) * _jitter.uniform(0.5, 1.0)


_WHAT = {"timeout": "timed out", "connect": "could not connect", "reset": "lost the connection",
         "status": "answered with an error status"}


def final_error(e: BaseException, kind: str, url: str, attempts: int, elapsed: float,
                lim: HostLimiter, down: float = 0.0) -> BaseException:
    """The exception for a transient failure that outlasted its retries
    (or, with ``down``, for a request not sent because every request to the
    host has failed for ``down`` seconds)."""
    text = str(e).splitlines()[0] if str(e) else ""
    reason = text if type(e).__module__ == __name__ or type(e).__module__ == "builtins" and text \
        else f"{type(e).__name__}: {text}".rstrip(": ")
    if down:
        what = (f"not sent: every request to {lim.host} has failed for {down:.1f} s and the server "
                f"{_WHAT[kind]} on the latest (the last: {reason}). ")
    else:
        what = (f"the server {_WHAT[kind]} on each of {attempts} attempt(s) over {elapsed:.1f} s "
                f"(the last: {reason}). ")
    msg = (f"reading {url}: {what}"
           f"{lim.describe()}. This is the network or the server, not the file. "
           f"To fix: let the server take more concurrent connections (more server threads or "
           f"processes, a larger listen queue), or send it fewer: pass fetch_threads= to the "
           f"DataLoader (e.g. fetch_threads=8; the default for URLs is 64 per worker), use fewer "
           f"num_workers=, or set {ENV_MAX_INFLIGHT}=8; a slow server may need a larger "
           f"{ENV_TIMEOUT}= (now {timeout_s():g} s) or {ENV_RETRIES}= (now {retries()}).")
    if kind == "timeout":
        out: BaseException = TimeoutError(f"Timed out {msg}")
    elif kind == "connect":
        out = ConnectionRefusedError(f"Cannot connect to host {urllib.parse.urlsplit(url).netloc} {msg}")
    elif kind == "reset":
        out = ConnectionResetError(f"Connection failed {msg}")
    else:
        out = RemoteStatusError(f"HTTP {_status(e)} {msg}", _status(e) or 0)
    out.coordl_transient = True
    return out


def not_found(url: str) -> FileNotFoundError:
    """A missing object: the same words on every read path."""
    e = FileNotFoundError(errno.ENOENT, "No such object (the server answered 'not found'; not retried: "
                                        "a missing object is not a transient error)", url)
    return e


def call(url: str, read_once: Callable[[], bytes]) -> bytes:
    """``read_once()`` under ``url``'s host limiter, retrying transient
    failures (see the module docstring)."""
    lim = limiter(url)
    budget, deadline_s = retries(), 2 * timeout_s()
    attempt = 0
    start = None
    streak = budget + 1
    while True:
        k, ticket = lim.acquire()
        if start is None:
            start = time.monotonic()   # waiting for a slot is not the server failing
        down = lim.down_for(streak)
        if down >= deadline_s and lim.last_failure is not None:
            kind, last = lim.last_failure
            final = final_error(last, kind, url, attempt, time.monotonic() - start, lim, down=down)
            lim.release(k, ticket)
            raise final
        try:
            data = read_once()
        except BaseException as e:
            kind = classify(e) if isinstance(e, Exception) else None
            if kind is not None:
                lim.last_failure = (kind, e)
            elapsed = time.monotonic() - start
            if kind is not None and (attempt >= budget or elapsed >= deadline_s):
                final = final_error(e, kind, url, attempt + 1, elapsed, lim)   # with this request in flight
                lim.release(k, ticket, congested=1)
                raise final from e
            lim.release(k, ticket, congested=1 if kind else 0)
            if kind is None:
                if isinstance(e, FileNotFoundError):
                    raise not_found(url) from e
                raise
            time.sleep(_backoff(attempt))
            attempt += 1
            continue
        lim.release(k, ticket, ok=1)
        return data


def call_many(urls: list, read_batch: Callable[[list], list]) -> list:
    """Bytes (or the exception) for each URL, read in batches through
    ``read_batch(urls) -> [bytes | exception]`` under the host limiter
    (a batch takes one slot per URL), with :func:`call`'s retries."""
    out: list = [None] * len(urls)
    if not urls:
        return out
    lim = limiter(urls[0])
    budget, deadline_s = retries(), 2 * timeout_s()
    start = time.monotonic()
    attempts = [0] * len(urls)
    todo = list(range(len(urls)))
    first = True
    while todo:
        k, ticket = lim.acquire(len(todo))
        if first:
            start, first = time.monotonic(), False   # waiting for a slot is not the server failing
        idx, todo = todo[:k], todo[k:]
        down = lim.down_for(budget + 1)
        if down >= deadline_s and lim.last_failure is not None:
            kind, last = lim.last_failure
            for i in idx:
                out[i] = final_error(last, kind, urls[i], attempts[i], time.monotonic() - start, lim, down=down)
            lim.release(k, ticket)
            continue
        try:
            got = read_batch([urls[i] for i in idx])
            if len(got) != len(idx):
                raise ValueError(f"read_batch returned {len(got)} results for {len(idx)} URLs")
        except Exception as e:
            got = [e] * len(idx)
        ok = congested = 0
        again = []
        elapsed = time.monotonic() - start
        for i, r in zip(idx, got):
            if not isinstance(r, BaseException):
                ok += 1
                out[i] = r
                continue
            kind = classify(r)
            if kind is None:
                out[i] = not_found(urls[i]) if isinstance(r, FileNotFoundError) else r
                continue
            lim.last_failure = (kind, r)
            congested += 1
            if attempts[i] >= budget or elapsed >= deadline_s:
                err = final_error(r, kind, urls[i], attempts[i] + 1, elapsed, lim)
                err.__cause__ = r
                out[i] = err
            else:
                attempts[i] += 1
                again.append(i)
        lim.release(k, ticket, ok=ok, congested=congested)
        if again:
            time.sleep(_backoff(max(attempts[i] for i in again) - 1))
            todo = again + todo
    return out
