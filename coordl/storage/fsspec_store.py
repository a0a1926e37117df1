"""Where sample bytes live: local files (default) or any fsspec URL.

``coordl.ImageFolder("s3://bucket/train")``, ``"http://host/data/"``,
``"gcs://..."``: any protocol fsspec knows works, with no coordl code per
protocol (install ``coordl[remote]`` for fsspec and its HTTP client; other
protocols need their fsspec package, e.g. s3fs).  The fetch stage's threads
call :meth:`FsspecStore.read`, so storage latency is hidden by read-ahead.

A filesystem object is created lazily in each process: async fsspec
filesystems hold an event loop and sessions that must not cross a fork.

Reads of ``http(s)``, ``s3``, ``gs``/``gcs`` and Azure URLs go through obstore
(:mod:`coordl.storage.obstore_store`) when it is installed: less client CPU per
sample than fsspec's aiohttp path.  fsspec still lists the tree and reads
everything else; ``COORDL_NATIVE_STORE=0`` turns the native reader off.
"""
from __future__ import annotations

import os
import posixpath
from typing import Callable

from . import obstore_store as _native_store, remote as _remote

__all__ = ["is_url", "FsspecStore"]


def is_url(root) -> bool:
    """True for ``proto://...`` roots other than ``file://``."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def _mtime_ns(info: dict) -> int:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(key)
        if v is None:
            continue
        try:
            if hasattr(v, "timestamp"):
                return int(v.timestamp() * 1e9)
            return int(float(v) * 1e9)
        except (TypeError, ValueError):
            continue
    return 0


def _version(info: dict) -> str:
    """The object version a store reports (S3 ETag/VersionId, GCS generation,
    Azure etag, HTTP ETag, ...), or "" if none."""
    for key in ("VersionId", "version_id", "generation", "ETag", "etag", "md5Hash", "md5",
                "content_md5", "checksum"):
        v = info.get(key)
        if v not in (None, ""):
            return f"{key}={v}"
    return ""


class FsspecStore:
    """Lists a folder tree through fsspec and reads it through obstore when
    :attr:`native` (see :mod:`coordl.storage.obstore_store`), else through fsspec."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        try:
            import fsspec  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"reading {url!r} needs fsspec: pip install 'coordl[remote]' "
                "(plus the fsspec package for the protocol, e.g. s3fs for s3://)"
            ) from e
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs = None
        self._pid = None
        self._native = _native_store.plan(self.url, self.storage_options)

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options, "_fs": None, "_pid": None,
                "_native": self._native}

    @property
    def native(self) -> bool:
        """True when reads go through obstore (decided when the store is
        made, from the URL's scheme, storage_options, whether obstore is
        installed and ``COORDL_NATIVE_STORE``; a process whose obstore store
        cannot be built or is refused credentials reads through fsspec)."""
        return self._native is not None and self._native.usable()

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url, **_with_timeouts(self.url, self.storage_options))
            self._pid = os.getpid()
        return self._fs

    def _rel(self, path: str) -> str:
        self.fs
        root = self._root.rstrip("/")
        if path.startswith(root):
            return path[len(root):].lstrip("/")
        stripped = self._fs._strip_protocol(path)
        return stripped[len(self._fs._strip_protocol(root)):].lstrip("/")

    def scan(self, valid: Callable[[str], bool]):
        """``(classes, [(rel_path, class_name, size, mtime_ns, version)])`` in
        sorted order: class folders are the first path components under the
        root; ``version`` is what the store reports (see :func:`_version`)."""
        fs = self.fs
        try:
            found = fs.find(self._root, detail=True, withdirs=True)
        except FileNotFoundError as e:   # e.g. s3fs: "The specified bucket does not exist"
            raise FileNotFoundError(f"Cannot list {self.url}: {e}") from e
        except PermissionError as e:
            raise refused(self.url, e, "listing") from e
        classes: set[str] = set()
        files = []
        for path, info in found.items():
            rel = self._rel(path)
            if not rel:
                continue
            parts = rel.split("/")
            if info.get("type") == "directory":
                if len(parts) == 1:
                    classes.add(parts[0])
                continue
            if len(parts) < 2:
                continue  # files directly under the root are not samples
            classes.add(parts[0])
            if valid(posixpath.join(self.url, rel)):
                size = info.get("size")
                files.append((rel, parts[0], int(size) if size is not None else -1, _mtime_ns(info),
                              _version(info)))
        files.sort(key=lambda f: f[0].split("/"))
        return sorted(classes), files

    def location(self) -> str:
        """The URL, plus the endpoint when the store has a custom one (an
        S3-compatible server: ``storage_options`` or ``AWS_ENDPOINT_URL``),
        which decides what the URL names: part of the dataset's fingerprint."""
        so = self.storage_options
        ep = so.get("endpoint_url") or (so.get("client_kwargs") or {}).get("endpoint_url")
        if not ep and self.url.split("://", 1)[0].lower() in ("s3", "s3a"):
            ep = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return f"{self.url} @ {ep}" if ep else self.url

    def _path(self, url: str) -> str:
        self.fs
        return posixpath.join(self._root, url[len(self.url):].lstrip("/"))

    def read(self, url: str) -> bytes:
        """The bytes at ``url``: under the host's concurrency limit, with
        transient failures retried (:func:`coordl.storage.remote.call`)."""
        try:
            return _remote.call(url, lambda: self._read_once(url))
        except PermissionError as e:
            raise refused(url, e, "reading") from e

    def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``url`` (one ranged GET),
        with :meth:`read`'s limits, retries, fallbacks and errors."""
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise ValueError(f"start and end should be ints with 0 <= start <= end, but got start={start!r}, "
                             f"end={end!r}")
        if start == end:
            return b""
        try:
            return _remote.call(url, lambda: self._read_once(url, (start, end)))
        except PermissionError as e:
            raise refused(url, e, "reading") from e

    def _read_once(self, url: str, span: tuple | None = None) -> bytes:
        start, end = span if span is not None else (None, None)
        native = self._native
        if native is not None and native.usable():
            try:
                return native.read(url[len(self.url):].lstrip("/"), url, span)
            except _native_store.NativeRefused:
                data = self.fs.cat_file(self._path(url), start=start, end=end)   # fsspec's own error if refused too
                self._native = None   # fsspec's credentials work here: read through fsspec from now on
                return data
            except _native_store.NativeUnusable:
                self._native = None   # obstore cannot serve this store here: fsspec from now on
        return self.fs.cat_file(self._path(url), start=start, end=end)

    def read_many(self, urls: list[str]) -> list:
        """Bytes of each URL (or the exception reading it raised): fetched
        concurrently in one call (fsspec's ``cat``), or one after the other
        through obstore when :attr:`native` (the fetch stage then reads from
        its own threads instead, see ``ImageFolder.raw_many``).  Either way
        under the host's concurrency limit, with transient failures retried
        (:mod:`coordl.storage.remote`)."""
        if self.native:
            out = []
            for u in urls:
                try:
                    out.append(self.read(u))
                except Exception as e:
                    out.append(e)
            return out
        return _remote.call_many(urls, self._cat)

    def _cat(self, urls: list[str]) -> list:
        paths = [self._path(u) for u in urls]
        got = self.fs.cat(paths, on_error="return")
        out = []
        for p in paths:
            v = got.get(p) if isinstance(got, dict) else got
            if v is None:
                v = FileNotFoundError(2, "No such file", p)
            out.append(v)
        return out


def refused(url: str, e: BaseException, doing: str) -> PermissionError:
    """A refusal (401/403: credentials or permissions) naming the URL and
    where credentials come from; not retried."""
    if url in str(e):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}"
    hint = ""
    if url.split("://", 1)[0].lower() in ("s3", "s3a"):
        hint = (" For S3 the credentials come from storage_options (key=, secret=, token=) or the "
                "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE) "
                "and the endpoint from endpoint_url= or AWS_ENDPOINT_URL.")
    return PermissionError(f"Access refused {doing} {url} ({text}): check the credentials and the "
                           f"permissions they carry; not retried.{hint}")


def _with_timeouts(url: str, so: dict) -> dict:
    """fsspec storage options for a store's own filesystem, with coordl's request timeout
    (``COORDL_REMOTE_TIMEOUT``) where the user set none: aiohttp's default
    is 5 minutes, botocore's 60 s per connect and per read."""
    so = dict(so)
    # each store its own filesystem: fsspec's instance cache is keyed by the options alone, so a
    # filesystem made earlier would keep the credentials the environment had then
    so.setdefault("skip_instance_cache", True)
    scheme = url.split("://", 1)[0].lower()
    t = _remote.timeout_s()
    if scheme in ("http", "https"):
        ck = dict(so.get("client_kwargs") or {})
        if "timeout" not in ck:
            try:
                import aiohttp
            except ImportError:
                return so
            ck["timeout"] = aiohttp.ClientTimeout(total=t)
            so["client_kwargs"] = ck
    elif scheme in ("s3", "s3a"):
        cfg = dict(so.get("config_kwargs") or {})
        cfg.setdefault("connect_timeout", t)
        cfg.setdefault("read_timeout", t)
        so["config_kwargs"] = cfg
    return so
