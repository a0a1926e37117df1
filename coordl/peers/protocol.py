"""The peer protocol: versioned, length-prefixed binary frames over TCP.

Nothing here is pickled, and nothing read from the network is trusted: every
frame's type, version and length are checked against fixed bounds before its
payload is read, every read has a deadline (a handshake one for all its
frames), and any violation ends the connection (:class:`ProtocolError`).
Sends are bounded too: by the socket's timeout, or by an explicit deadline
where another thread owns the socket's timeout (the client's receiver).

Frame::

    header  8 bytes  magic "CP" (2), version (1), type (1), payload length (4, big-endian)
    payload          at most MAX_PAYLOAD[type] bytes

Handshake (mutual, challenge-response; the job secret never crosses the
wire, and each side's nonce is fresh per connection, so a recorded
handshake cannot be replayed)::

    client -> HELLO      client nonce (32) + cache id (16)
    server -> CHALLENGE  server nonce (32) + HMAC(secret, "srv" | cn | sn | id)
                         (or closes the connection at once if it does not
                         serve cache ``id``: no challenge, no MAC computed)
    client -> AUTH       HMAC(secret, "cli" | sn | cn | id)
    server -> OK         (empty)                       or closes the connection

The two MACs are domain-separated ("srv"/"cli" and the order of the
nonces), so a client cannot use the server as an oracle for its own proof.
The cache id names the node cache being asked for (a server answers only
for the one it serves, and refuses any other before the challenge).

Requests, after the handshake::

    client -> GET   request id (4) + count (2) + count x sample index (8)
    server -> ITEM  request id (4) + sample index (8) + status (1) + CRC32 (4) + bytes
                    (one ITEM per index, in the order asked; status 0 = here,
                    1 = absent: the peer does not hold it; the CRC32 of the
                    bytes, checked by the receiver before it uses or caches them)
    client -> HAVE? request id (4) + number of samples n (8)
    server -> HAVE  request id (4) + n (8) + free bytes (8) + ceil(n/8) bytes:
                    bit i (numpy packbits order) set iff the server's cache
                    holds sample i; free bytes: its cache's room left
    client -> PUT   sample index (8) + CRC32 (4) + bytes: a sample no node
                    held, read from storage by a node whose cache is full,
                    handed to one with room (no answer; admitted if it fits
                    and the CRC32 matches)
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import select
import socket
import struct
import time
import zlib

__all__ = ["ProtocolError", "VERSION", "HELLO", "CHALLENGE", "AUTH", "OK", "GET", "ITEM",
           "MAX_GET", "MAX_SAMPLE", "HAVEQ", "HAVE", "CORRUPT", "send_frame", "recv_frame", "client_handshake",
           "server_handshake", "pack_get", "unpack_get", "pack_item_header", "unpack_item"]

MAGIC = b"CP"
VERSION = 2
HEADER = struct.Struct("!2sBBI")
HELLO, CHALLENGE, AUTH, OK, GET, ITEM, HAVEQ, HAVE, PUT = 1, 2, 3, 4, 5, 6, 7, 8, 9
NONCE = 32
CACHE_ID = 16
MAC = 32
MAX_GET = 1024                      # indices in one request
MAX_SAMPLE = 256 << 20              # bytes of one sample a server sends (and a client accepts)
_GET_HEAD = struct.Struct("!IH")
_ITEM_HEAD = struct.Struct("!IQBI")
_HAVE_HEAD = struct.Struct("!IQ")
_HAVE_FREE = struct.Struct("!Q")
_PUT_HEAD = struct.Struct("!QI")
MAX_SAMPLES = 1 << 32                # samples a membership bitmap may describe (512 MiB of bits)
MAX_PAYLOAD = {
    HELLO: NONCE + CACHE_ID,
    CHALLENGE: NONCE + MAC,
    AUTH: MAC,
    OK: 0,
    GET: _GET_HEAD.size + 8 * MAX_GET,
    ITEM: _ITEM_HEAD.size + MAX_SAMPLE,
    HAVEQ: _HAVE_HEAD.size,
    HAVE: _HAVE_HEAD.size + 8 + MAX_SAMPLES // 8,
    PUT: _PUT_HEAD.size + MAX_SAMPLE,
}
HERE, ABSENT = 0, 1
CORRUPT = 2                         # (never on the wire: a HERE item whose CRC32 failed)


class ProtocolError(ConnectionError):
    """The other side broke the protocol (or took too long): close the connection."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out with {got} of {n} bytes of a frame read")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise ProtocolError(f"timed out with {got} of {n} bytes of a frame read") from None
        if k == 0:
            raise ProtocolError("connection closed" if got == 0 else f"connection closed mid-frame ({got} of {n})")
        got += k
    return buf


def _send_by(sock: socket.socket, data, deadline: float) -> None:
    """``sock.sendall(data)``, but done by ``deadline`` whatever timeout the
    socket has (another thread may have made it blocking: a receiver)."""
    view = memoryview(data).cast("B")
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while view.nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out with {len(data) - view.nbytes} of {len(data)} bytes of a "
                                "frame sent (the peer stopped reading)")
        if not poller.poll(max(1, int(left * 1000))):
            continue
        try:
            k = sock.send(view, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            continue
        view = view[k:]


def send_frame(sock: socket.socket, ftype: int, *parts, deadline: float | None = None) -> None:
    """Send one frame whose payload is ``parts`` (bytes-like) joined.  With a
    ``deadline`` (``time.monotonic()`` time) the frame must be sent by then
    (:class:`ProtocolError` if not), else the socket's own timeout applies."""
    length = sum(len(p) for p in parts)
    if length > MAX_PAYLOAD[ftype]:
        raise ValueError(f"frame type {ftype} of {length} bytes exceeds its bound {MAX_PAYLOAD[ftype]}")
    head = HEADER.pack(MAGIC, VERSION, ftype, length)
    if deadline is not None:
        _send_by(sock, b"".join([head, *parts]), deadline)
    elif length <= 1 << 16:
        sock.sendall(b"".join([head, *parts]))
    else:   # large payloads (samples): no copy into one buffer
        sock.sendall(head)
        for p in parts:
            sock.sendall(p)


def _cap(t: float, deadline: float | None) -> float:
    return t if deadline is None else min(t, deadline)


def recv_frame(sock: socket.socket, expect: tuple, first_timeout: float | None,
               body_timeout: float, deadline: float | None = None) -> tuple[int, bytes]:
    """``(type, payload)`` of the next frame, which must be of a type in
    ``expect``.  ``first_timeout`` bounds the wait for its header (None:
    wait for its first byte as long as the socket is open), ``body_timeout``
    the rest; ``deadline`` (``time.monotonic()`` time), if given, caps both:
    the frame must be whole by then (a handshake's frames share one)."""
    if first_timeout is None:
        sock.settimeout(None)
        try:
            first = sock.recv(1)
        except socket.timeout:  # pragma: no cover - no timeout set
            raise ProtocolError("timed out") from None
        if not first:
            raise ProtocolError("connection closed")
        end = _cap(time.monotonic() + body_timeout, deadline)
        head = bytes(first + _recv_exact(sock, HEADER.size - 1, end))
    else:
        head = bytes(_recv_exact(sock, HEADER.size, _cap(time.monotonic() + first_timeout, deadline)))
        end = _cap(time.monotonic() + body_timeout, deadline)
    magic, version, ftype, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a coordl peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this coordl speaks {VERSION}: run one coordl "
                            "version on every node")
    if ftype not in expect:
        raise ProtocolError(f"unexpected frame type {ftype} (expected {expect})")
    if length > MAX_PAYLOAD[ftype]:
        raise ProtocolError(f"frame type {ftype} announces {length} bytes, over its bound {MAX_PAYLOAD[ftype]}")
    payload = _recv_exact(sock, length, end) if length else bytearray()
    return ftype, payload


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def cache_id(name: str) -> bytes:
    """The 16-byte id a client names the node cache by (from the cache's name,
    the same on every node: the dataset's fingerprint)."""
    return hashlib.blake2b(name.encode(), digest_size=CACHE_ID).digest()


def client_handshake(sock: socket.socket, secret: bytes, cid: bytes, timeout: float) -> None:
    """Authenticate the server and ourselves within ``timeout`` (the whole
    handshake, not each frame); raise :class:`ProtocolError` if not."""
    deadline = time.monotonic() + timeout
    cn = os.urandom(NONCE)
    send_frame(sock, HELLO, cn, cid)
    _, p = recv_frame(sock, (CHALLENGE,), timeout, timeout, deadline)
    if len(p) != NONCE + MAC:
        raise ProtocolError("malformed challenge")
    sn, proof = p[:NONCE], p[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"srv", cn, sn, cid)):
        raise ProtocolError("the peer failed to prove it knows the job secret (another job on that "
                            "address, or a different coordl rendezvous)")
    send_frame(sock, AUTH, _mac(secret, b"cli", sn, cn, cid))
    recv_frame(sock, (OK,), timeout, timeout, deadline)


def server_handshake(sock: socket.socket, secret: bytes, cid: bytes, timeout: float) -> None:
    """Authenticate a new client within ``timeout`` (the whole handshake, so a
    client trickling its frames cannot hold the connection longer); raise
    :class:`ProtocolError` if it fails."""
    deadline = time.monotonic() + timeout
    _, p = recv_frame(sock, (HELLO,), timeout, timeout, deadline)
    if len(p) != NONCE + CACHE_ID:
        raise ProtocolError("malformed hello")
    cn, want = p[:NONCE], p[NONCE:]
    check_hello_cache(want, cid)
    sn = os.urandom(NONCE)
    send_frame(sock, CHALLENGE, sn, _mac(secret, b"srv", cn, sn, want))
    _, proof = recv_frame(sock, (AUTH,), timeout, timeout, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"cli", sn, cn, want)):
        raise ProtocolError("authentication failed (wrong secret or a replayed handshake)")
    send_frame(sock, OK)


def check_hello_cache(want, cid: bytes) -> None:
    """A HELLO for a cache this server does not serve is refused before any
    challenge: the server computes no MAC over an id it was not started for
    (docs/architecture.md, "Handshake").  The cache id is a hash of the
    dataset's fingerprint, which the job's own nodes know anyway."""
    if not hmac.compare_digest(bytes(want), cid):
        raise ProtocolError("the client asks for a cache this server does not serve")


def pack_get(rid: int, indices) -> bytes:
    n = len(indices)
    if not 0 < n <= MAX_GET:
        raise ValueError(f"a request should ask for 1..{MAX_GET} samples, but got {n}")
    return _GET_HEAD.pack(rid, n) + struct.pack(f"!{n}Q", *indices)


def unpack_get(payload: bytes) -> tuple[int, tuple]:
    if len(payload) < _GET_HEAD.size:
        raise ProtocolError("malformed request")
    rid, n = _GET_HEAD.unpack_from(payload)
    if not 0 < n <= MAX_GET or len(payload) != _GET_HEAD.size + 8 * n:
        raise ProtocolError("malformed request (count and length disagree)")
    return rid, struct.unpack_from(f"!{n}Q", payload, _GET_HEAD.size)


def pack_item_header(rid: int, index: int, status: int, crc: int = 0) -> bytes:
    return _ITEM_HEAD.pack(rid, index, status, crc)


def unpack_item(payload: bytes) -> tuple[int, int, int, memoryview]:
    """``(rid, index, status, bytes)``; a HERE item whose bytes do not match
    the CRC32 it carries comes back ABSENT (the sample is read from storage,
    never used or cached from that peer)."""
    if len(payload) < _ITEM_HEAD.size:
        raise ProtocolError("malformed item")
    rid, index, status, crc = _ITEM_HEAD.unpack_from(payload)
    if status not in (HERE, ABSENT) or (status == ABSENT and len(payload) != _ITEM_HEAD.size):
        raise ProtocolError("malformed item status")
    data = memoryview(payload)[_ITEM_HEAD.size:]
    if status == HERE and zlib.crc32(data) != crc:
        return rid, index, CORRUPT, data[:0]
    return rid, index, status, data


def pack_haveq(rid: int, n: int) -> bytes:
    if not 0 <= n <= MAX_SAMPLES:
        raise ValueError(f"n should be in 0..{MAX_SAMPLES}, but got n={n}")
    return _HAVE_HEAD.pack(rid, n)


def unpack_haveq(payload) -> tuple[int, int]:
    if len(payload) != _HAVE_HEAD.size:
        raise ProtocolError("malformed membership request")
    rid, n = _HAVE_HEAD.unpack_from(payload)
    if n > MAX_SAMPLES:
        raise ProtocolError("membership request over its bound")
    return rid, n


def pack_have_header(rid: int, n: int, free: int = 0) -> bytes:
    return _HAVE_HEAD.pack(rid, n) + _HAVE_FREE.pack(max(0, int(free)))


def unpack_have(payload) -> tuple[int, int, memoryview]:
    """``(rid, n, bits)``; :func:`have_free` reads the room left."""
    rid, n, _free, bits = unpack_have_free(payload)
    return rid, n, bits


def unpack_have_free(payload) -> tuple[int, int, int, memoryview]:
    if len(payload) < _HAVE_HEAD.size + 8:
        raise ProtocolError("malformed membership")
    rid, n = _HAVE_HEAD.unpack_from(payload)
    (free,) = _HAVE_FREE.unpack_from(payload, _HAVE_HEAD.size)
    bits = memoryview(payload)[_HAVE_HEAD.size + 8:]
    if len(bits) != (n + 7) // 8:
        raise ProtocolError("malformed membership (count and length disagree)")
    return rid, n, free, bits


def pack_put_header(index: int, crc: int) -> bytes:
    return _PUT_HEAD.pack(index, crc)


def unpack_put(payload) -> tuple[int, int, memoryview]:
    if len(payload) < _PUT_HEAD.size:
        raise ProtocolError("malformed hand-off")
    index, crc = _PUT_HEAD.unpack_from(payload)
    return index, crc, memoryview(payload)[_PUT_HEAD.size:]


# ---------------------------------------------------------------- addresses
# (here, below both ends, so the server checks its bind address without
# importing the rendezvous that starts it)

def _unspecified(host: str) -> bool:
    """True if binding ``host`` would bind every interface: an unspecified
    address in any spelling ("0.0.0.0", "0", "::", "::0", "0:0:0:0:0:0:0:0",
    ...), or a name that resolves to one."""
    h = host.strip()
    if h in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(h.strip("[]").split("%")[0]).is_unspecified
    except ValueError:
        pass
    try:   # what bind() would do with it: inet_aton spellings ("0", "0.0") and names
        infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False     # not resolvable: bind() will fail with its own error
    for *_, sockaddr in infos:
        try:
            if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_unspecified:
                return True
        except ValueError:
            continue
    return False


def check_bind_host(host: str, what: str = "host") -> str:
    """``host``, or ValueError if it is every interface's address."""
    if not isinstance(host, str) or _unspecified(host):
        raise ValueError(f"{what} should be one interface's address (never every interface), but got "
                         f"{what}={host!r}")
    return host
