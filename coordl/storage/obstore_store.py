"""Reads objects through obstore (the Rust ``object_store`` binding) instead
of fsspec: the fetch stage's hot path for ``http(s)://``, ``s3://``,
``gs://``/``gcs://`` and Azure URLs.

:class:`coordl.storage.FsspecStore` delegates single reads here when
:func:`plan` says it can; fsspec keeps listing (``scan``) and every scheme,
option or environment obstore cannot take.  Why not fsspec for reads: a GET
through fsspec/aiohttp costs ~200-300 us of client CPU even batched (Python
coroutines, an event loop thread, per-request objects); obstore's blocking
``get`` runs the request in Rust with the GIL released (~30% less CPU per
~110 KB object against nginx), and the fetch threads already give the
concurrency (benchmarks/remote_cpu.py; docs/_notes_obs.md).

Fork: obstore runs every request on one process-wide Tokio runtime that it
starts on first use and that does not survive ``fork()`` (the child gets the
runtime without its threads: a ``get`` there blocks forever or crashes the
process).  So a
process forked from one that had started it (:data:`_inherited`, set by an
``os.register_at_fork`` hook) never calls obstore: :meth:`Native.usable` is
false there and its reads go through fsspec.  Workers forked from a parent
that only listed the dataset (the usual case: the parent scans through
fsspec) start their own runtime and read natively.  Each process builds its
own obstore store on first use; only the recipe (:class:`Native`) is
pickled.  Errors are mapped to the exceptions fsspec raises for the same
failure (:func:`map_error`), so users see the same types and messages.
"""
from __future__ import annotations

import os
import re
import threading
import urllib.parse
from datetime import timedelta

from . import remote as _remote

__all__ = ["plan", "Native", "NativeUnusable", "NativeRefused", "map_error"]

ENV = "COORDL_NATIVE_STORE"

# fsspec protocol -> obstore store kind
_KINDS = {"http": "http", "https": "http", "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs",
          "az": "azure", "abfs": "azure", "abfss": "azure", "adl": "azure", "azure": "azure"}

# fsspec options that only shape listing or fsspec's own file objects/caches:
# they do not change which bytes a GET returns, so the native reader may ignore them
_IGNORABLE = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
              "block_size", "default_block_size", "default_fill_cache", "default_cache_type",
              "cache_type", "cache_options", "simple_links", "same_scheme", "size_policy",
              "asynchronous", "loop", "project", "version_aware"}

# No retries inside obstore: coordl retries (coordl.storage.remote), so that every
# refusal and timeout also reaches the per-host concurrency limiter, and
# both read paths retry alike.
_RETRY = {"max_retries": 0, "retry_timeout": timedelta(seconds=1),
          "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                      "base": 2}}


_started = False     # this process has started obstore's runtime (built a store)
_inherited = False   # forked from a process that had: obstore must not be called here


def _after_fork_in_child() -> None:
    global _started, _inherited
    if _started:
        _inherited = True
    _started = False


os.register_at_fork(after_in_child=_after_fork_in_child)


class NativeUnusable(Exception):
    """The native reader cannot serve this store in this process (obstore
    missing, the store does not build, or it refuses our credentials):
    the caller switches to fsspec."""


class NativeRefused(NativeUnusable):
    """The server refused obstore's request (401/403).  fsspec's credential
    chain (e.g. botocore's profiles) may differ from obstore's: the caller
    reads the object through fsspec, which raises its own error if it is
    refused too, and stays on fsspec if it is not."""


def _enabled() -> bool:
    v = os.environ.get(ENV, "1").strip().lower()
    return v not in ("0", "false", "no", "off")


def _options(kind: str, url: str, so: dict):
    """``(config, client_options)`` for obstore from fsspec storage_options,
    or None when an option has no obstore equivalent (fsspec then reads)."""
    config: dict = {}
    client: dict = {}
    for k, v in so.items():
        if k in _IGNORABLE:
            continue
        if kind == "http":
            if k == "headers" and isinstance(v, dict) and all(isinstance(x, str) for x in v.values()):
                client["default_headers"] = dict(v)
            elif k == "client_kwargs" and not v:
                pass
            else:
                return None
        elif kind == "s3":
            simple = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
                      "endpoint_url": "endpoint", "requester_pays": "request_payer"}
            if k in simple:
                if v is not None:
                    config[simple[k]] = v
            elif k == "anon":
                config["skip_signature"] = bool(v)
            elif k == "client_kwargs" and isinstance(v, dict) and set(v) <= {"region_name", "endpoint_url"}:
                if v.get("region_name"):
                    config["region"] = v["region_name"]
                if v.get("endpoint_url"):
                    config["endpoint"] = v["endpoint_url"]
            else:
                return None
        elif kind == "gcs":
            if k == "token" and v == "anon":
                config["skip_signature"] = True
            elif k == "token" and isinstance(v, str) and os.path.isfile(v):
                config["service_account_path"] = v
            elif k == "token" and v is None:
                pass
            else:
                return None
        elif kind == "azure":
            simple = {"account_name": "account_name", "account_key": "account_key", "sas_token": "sas_key"}
            if k in simple:
                if v is not None:
                    config[simple[k]] = v
            elif k == "anon":
                config["skip_signature"] = bool(v)
            else:
                return None
    if kind == "s3" and "endpoint" not in config:
        # a custom endpoint from the environment, with botocore's precedence
        # (the service-specific variable first), so both read paths use the same server
        env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if env:
            config["endpoint"] = env
    if kind == "http":
        client["allow_http"] = True   # the URL's own scheme decides, as with fsspec
    elif str(config.get("endpoint", os.environ.get("AWS_ENDPOINT", ""))).startswith("http://"):
        client["allow_http"] = True   # an http:// endpoint is the user's choice, as with botocore
    return config, client


def plan(url: str, storage_options: dict | None = None) -> "Native | None":
    """A :class:`Native` reader for ``url`` (a folder URL without trailing
    slash), or None when fsspec must read it: ``COORDL_NATIVE_STORE=0``,
    obstore not installed, a scheme obstore lacks, or storage_options it
    cannot take."""
    if not _enabled():
        return None
    scheme = url.split("://", 1)[0].lower()
    kind = _KINDS.get(scheme)
    if kind is None:
        return None
    try:
        import obstore  # noqa: F401
        import obstore.store  # noqa: F401
    except ImportError:
        return None
    opts = _options(kind, url, dict(storage_options or {}))
    if opts is None:
        return None
    return Native(url, kind, *opts)


class Native:
    """Reads ``<url>/<rel>`` with obstore's blocking ``get`` (GIL released).

    Thread-safe: the fetch threads share one store per process."""

    def __init__(self, url: str, kind: str, config: dict, client: dict) -> None:
        self.url = url
        self.kind = kind
        self.config = config
        self.client = client
        self._store = None
        self._pid = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"url": self.url, "kind": self.kind, "config": self.config, "client": self.client}

    def __setstate__(self, state):
        self.__init__(state["url"], state["kind"], state["config"], state["client"])

    @staticmethod
    def usable() -> bool:
        """False in a process forked from one that had started obstore."""
        return not _inherited

    def store(self):
        """This process's obstore store, built on first use."""
        if _inherited:
            raise NativeUnusable("this process was forked from one that had started obstore's runtime, "
                                 "which does not survive fork()")
        st = self._store
        if st is not None and self._pid == os.getpid():
            return st
        with self._lock:
            if self._store is None or self._pid != os.getpid():
                self._store, self._pid = self._build(), os.getpid()
            return self._store

    def _build(self):
        global _started
        try:
            from obstore import store as S
        except ImportError as e:
            raise NativeUnusable(f"obstore is not importable: {e}") from e
        _started = True   # before any call that could start the runtime
        url = self.url
        client = dict(self.client)
        if "timeout" not in client:   # coordl's request timeout (COORDL_REMOTE_TIMEOUT)
            t = _remote.timeout_s()
            client["timeout"] = f"{t:.3f}s"
            client.setdefault("connect_timeout", f"{min(t, 5.0):.3f}s")
        try:
            if self.kind == "http":
                return S.HTTPStore.from_url(url, client_options=client, retry_config=_RETRY)
            if self.kind == "gcs" and url.startswith("gcs://"):
                url = "gs://" + url[len("gcs://"):]
            cls = {"s3": S.S3Store, "gcs": S.GCSStore, "azure": S.AzureStore}[self.kind]
            return cls.from_url(url, config=self.config or None, client_options=client or None,
                                retry_config=_RETRY)
        except Exception as e:  # bad config, missing credentials/region...: fsspec may still manage
            raise NativeUnusable(f"obstore could not open {self.url}: {_first_line(e)}") from e

    def key(self, rel: str) -> str:
        # fsspec's HTTP listing yields percent-encoded hrefs; obstore encodes the key itself
        return urllib.parse.unquote(rel) if self.kind == "http" else rel

    def read(self, rel: str, full_url: str, span: tuple | None = None) -> bytes:
        """The object's bytes, or bytes ``[start, end)`` for ``span``;
        errors mapped by :func:`map_error`."""
        import obstore

        st = self.store()
        try:
            if span is not None:
                return bytes(obstore.get_range(st, self.key(rel), start=span[0], end=span[1]))
            return bytes(obstore.get(st, self.key(rel)).bytes())
        except Exception as e:
            raise map_error(e, full_url) from e


def _first_line(e: BaseException) -> str:
    """obstore's message without its multi-line debug dump."""
    text = str(e).split("\n\nDebug source:", 1)[0].strip()
    return text.splitlines()[0] if text else type(e).__name__


def map_error(e: BaseException, url: str) -> BaseException:
    """The exception fsspec raises for the same failure reading ``url``.

    * missing object: ``FileNotFoundError(url)`` (what fsspec's ``cat_file``
      raises: the message is the URL);
    * credentials refused: :class:`NativeRefused` (the caller retries
      through fsspec, whose credential chain may differ from obstore's, and
      so raises fsspec's own error when fsspec is refused too);
    * cannot connect: ``ConnectionError`` (an ``OSError``, as aiohttp's
      ``ClientConnectorError`` is) naming the host; a request the
      connection failed under (reset, closed): ``ConnectionError`` too;
    * timeout: ``TimeoutError`` (what aiohttp raises);
    * a transient status (5xx, 429, 408): :class:`coordl.storage.RemoteStatusError`
      with ``.status``;
    * anything else: ``OSError`` naming the URL and obstore's reason.

    The transient ones are retried by :func:`coordl.storage.remote.call`.
    """
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(url)
    try:
        from obstore import exceptions as X
    except ImportError:  # pragma: no cover - we only get here through obstore
        X = None
    if X is not None and isinstance(e, (X.PermissionDeniedError, X.UnauthenticatedError)):
        return NativeRefused(f"obstore was refused reading {url}: {_first_line(e)}")
    text = str(e)
    reason = _first_line(e)
    m = re.search(r"non-2xx status code: (\d{3})", text)
    status = int(m.group(1)) if m else None
    if status in _remote.TRANSIENT_STATUS:
        return _remote.RemoteStatusError(f"HTTP {status} reading {url}: {reason}", status)
    if "kind: Builder" in text:   # the request could not be built (configuration): fsspec may manage
        return NativeUnusable(f"obstore cannot build a request for {url}: {reason}")
    if "kind: Timeout" in text:
        return TimeoutError(f"Timed out reading {url}: {reason}")
    if "kind: Connect" in text:
        host = urllib.parse.urlsplit(url).netloc
        return ConnectionRefusedError(f"Cannot connect to host {host} reading {url}: {reason}")
    if status is None and ("HTTP error:" in text or "kind: Request" in text or "kind: Body" in text):
        return ConnectionResetError(f"Connection failed reading {url}: {reason}")
    if isinstance(e, OSError):
        return e
    return OSError(f"Error reading {url}: {type(e).__name__}: {reason}")
