"""The peer protocol under attack and under failure.

Everything here drives the real :class:`coordl.peers.PeerServer` over a real
:class:`coordl.cache.NodeCache` on 127.0.0.1, and the real client
(:class:`coordl.peers.PeerClient` and its connection, ``_Link``).  The
"attacker" and the "broken server" are raw sockets these tests control,
speaking bytes built by hand or by the protocol module's own functions.

What must hold for every bad input: the server closes that connection (the
socket reads EOF or a reset) within its handshake/body timeouts, keeps
serving a valid client, and leaves no thread or connection behind; memory
does not grow across hundreds of such connections.  The client, facing a
broken server, returns within about one timeout, marks that peer down for
the epoch, and tries again after ``new_epoch()``.
"""
from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
import tracemalloc
import uuid
import zlib

import pytest

from coordl.cache import NodeCache
from coordl.peers import PeerClient, PeerServer
from coordl.peers import protocol as P
from coordl.peers.client import PeerDown, _Link
from coordl.testing import run_in_child

SECRET = bytes(range(32))
N = 24                      # samples in the test dataset
HERE_IDX = [i for i in range(N) if i % 3 != 2]   # what the cache holds; i % 3 == 2 is absent
HS = 0.4                    # server handshake timeout (s)
BODY = 0.4                  # server body timeout (s)
IDLE = 1.5                  # server idle timeout (s)
CLOSE_WITHIN = HS + BODY + 5.0   # generous bound for "the server closed it" (no timing claim)


def sample(i: int) -> bytes:
    return bytes([i % 251]) * (50 + 7 * i)


@pytest.fixture
def cache():
    c = NodeCache.attach(f"peers-proto-{uuid.uuid4().hex}", N, 1 << 16)
    for i in HERE_IDX:
        assert c.put(i, sample(i))
    yield c
    c.close()


def make_server(cache, secret=SECRET, **kw):
    kw.setdefault("handshake_timeout", HS)
    kw.setdefault("body_timeout", BODY)
    kw.setdefault("idle_timeout", IDLE)
    return PeerServer(cache, secret, "127.0.0.1", **kw)


@pytest.fixture
def server(cache):
    s = make_server(cache)
    yield s
    s.close()
    assert s.threads == 0 and s.connections == 0


def cid_of(cache) -> bytes:
    return P.cache_id(cache.name)


def connect(server) -> socket.socket:
    return socket.create_connection(tuple(server.address), timeout=5)


def header(ftype: int, length: int, magic: bytes = P.MAGIC, version: int = P.VERSION) -> bytes:
    return P.HEADER.pack(magic, version, ftype, length)


def frame(ftype: int, payload: bytes) -> bytes:
    return header(ftype, len(payload)) + payload


def closed_by_peer(sock: socket.socket, within: float = CLOSE_WITHIN) -> bool:
    """Read (and drop) whatever the server still sends until it closes the
    connection (EOF or reset): True; False if it is still open after ``within``."""
    end = time.monotonic() + within
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what} still not true after {timeout:g} s")
        time.sleep(0.01)


def wait_idle(server) -> None:
    # the server's threads are fixed (accept + event loops): idle means no connection left
    wait_for(lambda: server.connections == 0, f"server idle (connections={server.connections})")


def authed(server, cache, secret=SECRET) -> socket.socket:
    s = connect(server)
    P.client_handshake(s, secret, cid_of(cache), 5.0)
    return s


def check_serves(server, cache) -> None:
    """A valid client (the real connection class) still gets what it asks for."""
    link = _Link(tuple(server.address), SECRET, cid_of(cache), 5.0, "test")
    try:
        idx = [0, 1, 2, N - 1]
        got = link.wait(link.request(idx), time.monotonic() + 5.0)
    finally:
        link.close()
    assert got == {i: (sample(i) if i in HERE_IDX else None) for i in idx}


# ---------------------------------------------------------------- fuzz cases
# Each case gets a connected socket (authenticated when its name starts with
# "post_") and an rng, sends its bytes, and returns; the server must then
# close the connection.

def _rand(rng, n):
    return bytes(rng.getrandbits(8) for _ in range(n))


def pre_random(s, rng, cache):
    s.sendall(_rand(rng, rng.randrange(1, 200)))


def pre_random_then_close(s, rng, cache):
    s.sendall(_rand(rng, rng.randrange(1, 7)))       # less than a header, then EOF
    s.shutdown(socket.SHUT_WR)


def pre_header_only(s, rng, cache):
    s.sendall(header(P.HELLO, P.NONCE + P.CACHE_ID))  # then silence


def pre_half_then_close(s, rng, cache):
    s.sendall(header(P.HELLO, P.NONCE + P.CACHE_ID) + _rand(rng, 20))
    s.shutdown(socket.SHUT_WR)


def pre_half_then_silence(s, rng, cache):
    s.sendall(header(P.HELLO, P.NONCE + P.CACHE_ID) + _rand(rng, 20))


def pre_partial_header_silence(s, rng, cache):
    s.sendall(header(P.HELLO, P.NONCE + P.CACHE_ID)[:rng.randrange(1, 8)])


def pre_oversized(s, rng, cache):
    # announced, never sent: must be refused on the header alone
    s.sendall(header(P.HELLO, rng.choice([P.NONCE + P.CACHE_ID + 1, 1 << 20, 2**32 - 1])))


def pre_wrong_magic(s, rng, cache):
    s.sendall(header(P.HELLO, 48, magic=rng.choice([b"XX", b"PC", b"\0\0"])) + _rand(rng, 48))


def pre_wrong_version(s, rng, cache):
    v = rng.choice([0, P.VERSION + 1, 255])
    s.sendall(header(P.HELLO, 48, version=v) + os.urandom(P.NONCE) + cid_of(cache))


def pre_wrong_type(s, rng, cache):
    t = rng.choice([0, P.CHALLENGE, P.AUTH, P.OK, P.ITEM, 7, 255])
    s.sendall(header(t, 0))


def pre_get_before_handshake(s, rng, cache):
    s.sendall(frame(P.GET, P.pack_get(1, [0, 1])))


def pre_garbage_hello(s, rng, cache):
    s.sendall(frame(P.HELLO, _rand(rng, rng.choice([0, 1, 47, 48]))))   # short, or a wrong cache id


def pre_wrong_mac(s, rng, cache):
    s.sendall(frame(P.HELLO, os.urandom(P.NONCE) + cid_of(cache)))
    P.recv_frame(s, (P.CHALLENGE,), 5, 5)
    s.sendall(frame(P.AUTH, _rand(rng, rng.choice([0, 1, 31, 32]))))


def pre_mac_over_bound(s, rng, cache):
    s.sendall(frame(P.HELLO, os.urandom(P.NONCE) + cid_of(cache)))
    P.recv_frame(s, (P.CHALLENGE,), 5, 5)
    s.sendall(header(P.AUTH, P.MAC + rng.randrange(1, 1000)))


def pre_silent(s, rng, cache):
    pass                                               # connects, never speaks


def post_out_of_range(s, rng, cache):
    s.sendall(frame(P.GET, P.pack_get(7, [0, rng.choice([N, N + 1, 2**63, 2**64 - 1])])))


def post_bad_count(s, rng, cache):
    n = rng.choice([0, 1, 2, P.MAX_GET + 1, 65535])
    k = rng.choice([k for k in (0, 1, 3) if k != n])       # count and length disagree
    s.sendall(frame(P.GET, struct.pack("!IH", 1, n) + b"\0" * (8 * k)))


def post_get_oversized(s, rng, cache):
    s.sendall(header(P.GET, rng.choice([P.MAX_PAYLOAD[P.GET] + 1, 1 << 24, 2**32 - 1])))


def post_get_header_only(s, rng, cache):
    s.sendall(header(P.GET, 14))


def post_get_half_then_close(s, rng, cache):
    s.sendall(header(P.GET, 14) + b"\0" * 5)
    s.shutdown(socket.SHUT_WR)


def post_get_half_then_silence(s, rng, cache):
    s.sendall(header(P.GET, 14) + b"\0" * 5)


def post_wrong_type(s, rng, cache):
    t = rng.choice([P.HELLO, P.CHALLENGE, P.AUTH, P.OK, P.ITEM, 0, 9])
    s.sendall(header(t, rng.choice([0, 8, 40])) + b"\0" * 40)


def post_random(s, rng, cache):
    s.sendall(_rand(rng, rng.randrange(1, 300)))


def post_valid_then_garbage(s, rng, cache):
    s.sendall(frame(P.GET, P.pack_get(3, [0, 2])) + _rand(rng, rng.randrange(1, 50)))


def post_second_hello(s, rng, cache):
    s.sendall(frame(P.HELLO, os.urandom(P.NONCE) + cid_of(cache)))


CASES = [pre_random, pre_random_then_close, pre_header_only, pre_half_then_close,
         pre_half_then_silence, pre_partial_header_silence, pre_oversized, pre_wrong_magic,
         pre_wrong_version, pre_wrong_type, pre_get_before_handshake, pre_garbage_hello,
         pre_wrong_mac, pre_mac_over_bound, pre_silent, post_out_of_range, post_bad_count,
         post_get_oversized, post_get_header_only, post_get_half_then_close,
         post_get_half_then_silence, post_wrong_type, post_random, post_valid_then_garbage,
         post_second_hello]
SLOW = {pre_header_only, pre_half_then_silence, pre_partial_header_silence, pre_silent,
        post_get_header_only, post_get_half_then_silence}


def run_batch(server, cache, rng, cases) -> None:
    """Open one connection per case at once (so the ones the server must time
    out overlap), then require each to be closed by the server."""
    socks = []
    try:
        for case in cases:
            s = authed(server, cache) if case.__name__.startswith("post_") else connect(server)
            socks.append((case, s))
            try:
                case(s, rng, cache)
            except (ConnectionResetError, BrokenPipeError):
                pass            # the server was quicker than us: closed already
        for case, s in socks:
            assert closed_by_peer(s), f"{case.__name__}: the server kept the connection open"
    finally:
        for _, s in socks:
            s.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_each_bad_input_closes_the_connection_and_the_server_keeps_serving(server, cache, case):
    rng = random.Random(hash(case.__name__) & 0xFFFF)
    run_batch(server, cache, rng, [case] * 4)
    wait_idle(server)
    check_serves(server, cache)
    wait_idle(server)
    assert server.refused == 0


def test_fuzz_many_connections_no_growth(server, cache):
    """500 fuzzed connections (seeded; slow cases, which the server must time
    out, kept to a few per batch): every one closed, no thread, connection or
    memory left behind."""
    rng = random.Random(20261123)
    fast = [c for c in CASES if c not in SLOW]
    slow = sorted(SLOW, key=lambda c: c.__name__)

    def batch():
        cases = [rng.choice(fast) for _ in range(23)] + [rng.choice(slow) for _ in range(2)]
        rng.shuffle(cases)
        run_batch(server, cache, rng, cases)

    batch()                         # warm up: first-use allocations are not growth
    wait_idle(server)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            batch()
        wait_idle(server)
        check_serves(server, cache)
        wait_idle(server)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # a leak of even one small object per connection would be ~100 KB here
    assert grown < 512 << 10, f"{grown} bytes still allocated after 500 fuzzed connections"


def test_oversized_frames_are_refused_without_allocating(cache):
    """An announced length over the type's bound is refused on the header: the
    server neither waits for the payload (body timeout long here) nor allocates it."""
    srv = make_server(cache, body_timeout=60.0, handshake_timeout=60.0, idle_timeout=60.0)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for ftype, pre in ((P.HELLO, True), (P.AUTH, True), (P.GET, False), (P.ITEM, False)):
            for length in (P.MAX_PAYLOAD[ftype] + 1, 2**31, 2**32 - 1):
                s = connect(srv) if pre else authed(srv, cache)
                if ftype == P.AUTH:
                    s.sendall(frame(P.HELLO, os.urandom(P.NONCE) + cid_of(cache)))
                    P.recv_frame(s, (P.CHALLENGE,), 5, 5)
                s.sendall(header(ftype, length))
                # well before the 60 s the server would wait for a payload it had accepted
                assert closed_by_peer(s, within=20.0), f"type {ftype} announcing {length} bytes not refused"
        wait_idle(srv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        srv.close()
    assert peak < 16 << 20, f"the server allocated {peak} bytes for frames it should have refused"


def test_a_client_that_never_reads_is_dropped(server, cache):
    """Requests pile up while the client reads nothing: the server's sends are
    bounded too, so its thread ends and the connection goes, with the client's
    socket still open and unread."""
    s = authed(server, cache)
    try:
        get = frame(P.GET, P.pack_get(9, list(range(N)) * (P.MAX_GET // N)))
        s.settimeout(0.05)
        for _ in range(400):        # far more answers than the socket buffers hold
            try:
                s.sendall(get)
            except (socket.timeout, ConnectionResetError, BrokenPipeError):
                break               # the server stopped reading (or dropped us already)
        wait_idle(server)
    finally:
        s.close()
    check_serves(server, cache)


# ---------------------------------------------------------------- handshake
def trickle(s, data: bytes, pause: float) -> None:
    """Send ``data`` as header, then payload, ``pause`` seconds apart."""
    s.sendall(data[:P.HEADER.size])
    time.sleep(pause)
    s.sendall(data[P.HEADER.size:])


def frames_until_close(s, within: float = CLOSE_WITHIN) -> list[int]:
    """Types of the whole frames received until the peer closes."""
    buf = b""
    end = time.monotonic() + within
    try:
        while time.monotonic() < end:
            s.settimeout(max(0.01, end - time.monotonic()))
            k = s.recv(1 << 16)
            if not k:
                break
            buf += k
    except (socket.timeout, ConnectionResetError):
        pass
    finally:
        s.close()
    types = []
    while len(buf) >= P.HEADER.size:
        _, _, t, length = P.HEADER.unpack_from(buf)
        if len(buf) < P.HEADER.size + length:
            break
        types.append(t)
        buf = buf[P.HEADER.size + length:]
    return types


def test_server_handshake_has_one_deadline(cache):
    """A client that sends each handshake frame slowly (every frame within its
    own timeout, the whole well past the handshake timeout) is dropped before
    it is let in: the handshake timeout bounds the handshake, not each frame."""
    srv = make_server(cache, handshake_timeout=0.6)
    s = None
    try:
        s = connect(srv)
        cn, cid = os.urandom(P.NONCE), cid_of(cache)
        trickle(s, frame(P.HELLO, cn + cid), 0.4)
        try:
            _, p = P.recv_frame(s, (P.CHALLENGE,), 5, 5)
        except P.ProtocolError:   # a loaded machine stretched the trickle past the timeout: dropped already
            wait_idle(srv)
            return
        sn = bytes(p[:P.NONCE])
        try:
            time.sleep(0.2)
            trickle(s, frame(P.AUTH, P._mac(SECRET, b"cli", sn, cn, cid)), 0.4)
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert P.OK not in frames_until_close(s), "a handshake taking twice the timeout was accepted"
        wait_idle(srv)
    finally:
        if s is not None:
            s.close()
        srv.close()


def test_client_handshake_has_one_deadline(cache):
    """The same bound on the client: a server that knows the secret but answers
    the handshake slowly costs one timeout, not one per frame."""
    lst = socket.create_server(("127.0.0.1", 0))
    cid = cid_of(cache)

    def slow_server():
        conn, _ = lst.accept()
        with conn:
            try:
                _, p = P.recv_frame(conn, (P.HELLO,), 5, 5)
                cn, sn = bytes(p[:P.NONCE]), os.urandom(P.NONCE)
                trickle(conn, frame(P.CHALLENGE, sn + P._mac(SECRET, b"srv", cn, sn, cid)), 0.4)
                P.recv_frame(conn, (P.AUTH,), 5, 5)
                time.sleep(0.3)
                conn.sendall(frame(P.OK, b""))
                conn.recv(1)
            except (OSError, P.ProtocolError):
                pass

    t = threading.Thread(target=slow_server, daemon=True)
    t.start()
    try:
        with pytest.raises(PeerDown):
            link = _Link(lst.getsockname(), SECRET, cid, 0.6, "slow")
            link.close()        # (only reached if it let the slow server in)
    finally:
        lst.close()
        t.join(10)
    assert not t.is_alive()


def test_wrong_secret_client_is_refused(server, cache):
    """A client that does not know the secret gets no OK (it cannot forge the
    proof: this one answers the challenge with a MAC under another secret)."""
    for wrong in (b"", b"x" * 32, SECRET[:-1] + b"\0"):
        s = connect(server)
        cn, cid = os.urandom(P.NONCE), cid_of(cache)
        s.sendall(frame(P.HELLO, cn + cid))
        _, p = P.recv_frame(s, (P.CHALLENGE,), 5, 5)
        s.sendall(frame(P.AUTH, P._mac(wrong, b"cli", bytes(p[:P.NONCE]), cn, cid)))
        assert frames_until_close(s) == [], "a client with the wrong secret was let in"
    # the real client with the wrong secret refuses the server first (its proof fails)
    with pytest.raises(PeerDown, match="prove"):
        _Link(tuple(server.address), b"not the secret", cid_of(cache), 5.0, "wrong")
    wait_idle(server)
    check_serves(server, cache)


def test_server_with_another_secret_is_refused(cache):
    srv = make_server(cache, secret=b"another job's secret")
    try:
        with pytest.raises(PeerDown, match="prove"):
            _Link(tuple(srv.address), SECRET, cid_of(cache), 5.0, "other")
        client = two_node_client(srv, cache)
        try:
            assert client.fetch(owned_by_peer(client)) == {}
            assert 1 in client.down()
        finally:
            client.close()
        wait_idle(srv)
    finally:
        srv.close()


class Recorder:
    """A real socket that keeps a copy of everything sent on it."""

    def __init__(self, sock):
        self.sock, self.sent = sock, bytearray()

    def sendall(self, data):
        self.sent += data
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_replayed_handshake_is_refused(server, cache):
    """A recorded handshake (HELLO, AUTH and a GET of a real, successful
    session) replayed on a new connection gets no OK and no sample."""
    cid = cid_of(cache)
    rec = Recorder(connect(server))
    P.client_handshake(rec, SECRET, cid, 5.0)
    P.send_frame(rec, P.GET, P.pack_get(1, [0]))
    _, item = P.recv_frame(rec.sock, (P.ITEM,), 5, 5)
    assert P.unpack_item(item)[2] == P.HERE
    rec.sock.close()
    hello_len = P.HEADER.size + P.NONCE + P.CACHE_ID
    hello, auth = bytes(rec.sent[:hello_len]), bytes(rec.sent[hello_len:hello_len + P.HEADER.size + P.MAC])
    rest = bytes(rec.sent[hello_len:])
    assert P.HEADER.unpack_from(auth)[2] == P.AUTH
    # step by step: the same HELLO gets a fresh challenge, the old AUTH fails it
    s = connect(server)
    s.sendall(hello)
    _, p = P.recv_frame(s, (P.CHALLENGE,), 5, 5)
    try:
        s.sendall(auth)
    except (ConnectionResetError, BrokenPipeError):
        pass
    assert frames_until_close(s) == [], "a replayed AUTH was accepted"
    # all at once, as a blind replay would
    s = connect(server)
    s.sendall(hello + rest)
    assert frames_until_close(s) == [P.CHALLENGE], "a replayed session got more than a challenge"
    wait_idle(server)
    assert server.samples_served == 1
    check_serves(server, cache)


def test_wrong_cache_id_is_refused(server, cache):
    """A client asking for another dataset's cache is refused (PeerDown), even
    with the right secret, and before any challenge (as
    docs/architecture.md says): the server computes no MAC over an id it does
    not serve; the cache it serves gets a challenge."""
    for cid, want in ((P.cache_id("another dataset"), []), (P.cache_id(cache.name), [P.CHALLENGE])):
        s = connect(server)
        s.sendall(frame(P.HELLO, os.urandom(P.NONCE) + cid))
        assert frames_until_close(s) == want      # then closed: no AUTH came
    with pytest.raises(PeerDown):
        _Link(tuple(server.address), SECRET, P.cache_id(cache.name + "x"), 5.0, "other-cache")
    client = two_node_client(server, cache, cache_name="another dataset")
    try:
        assert client.fetch(owned_by_peer(client)) == {}
        assert 1 in client.down()
    finally:
        client.close()
    wait_idle(server)
    assert server.samples_served == 0
    check_serves(server, cache)


# ---------------------------------------------------------------- client
PLAN = {"num_samples": N, "seed": 5, "batch_size": 4, "shuffle": True}


def two_node_client(server_or_addr, cache, *, cache_name=None, timeout=5.0) -> PeerClient:
    """This process as node "a" (serving nothing), the server as node "b";
    ranks 0 and 1 on a and b."""
    host, port = server_or_addr.address if hasattr(server_or_addr, "address") else server_or_addr
    return PeerClient([("a", "127.0.0.1", 0), ("b", host, port)], 0, [0, 1], SECRET,
                      cache_name if cache_name is not None else cache.name, PLAN, timeout=timeout)


def owned_by_peer(client) -> list[int]:
    return [i for i in range(N) if client.owners()[i] == 1]


def rx_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("coordl-peer-rx")]


def test_absent_samples_are_never_asked_and_the_peer_stays_up(server, cache):
    """Ownership is what the peer's cache holds (its membership, asked once
    per epoch): a sample it does not hold is read from storage without
    asking; one it holds is served."""
    client = two_node_client(server, cache)
    try:
        assert owned_by_peer(client) == HERE_IDX
        absent = [i for i in range(N) if i not in HERE_IDX]
        assert client.fetch(absent) == {}
        assert server.absent == 0 and server.samples_served == 0, "a sample the peer does not hold was asked"
        assert client.down() == {}
        got = client.fetch(list(range(N)))
        assert got == {i: sample(i) for i in HERE_IDX}
        assert server.absent == 0 and client.down() == {}
        assert server.samples_served == len(got)
        assert client.map_requests == 1, "membership asked more than once in an epoch"
        # a sample the peer admits during the epoch is found at the next one
        late = absent[0]
        assert cache.put(late, sample(late))
        assert client.fetch([late]) == {}
        client.new_epoch()
        assert client.fetch([late]) == {late: sample(late)} and client.map_requests == 2
    finally:
        client.close()
    assert rx_threads() == []
    wait_idle(server)


class FakeServer:
    """A peer address whose every connection is handled by ``behave(conn)``
    (in the accept thread, one connection at a time); connections stay open
    until :meth:`close` unless ``behave`` closes them."""

    def __init__(self, behave, port: int = 0) -> None:
        self.behave = behave
        self.lst = socket.create_server(("127.0.0.1", port))
        self.lst.settimeout(0.05)
        self.address = self.lst.getsockname()[:2]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="fake-peer", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.lst.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.accepted += 1
            self.conns.append(conn)
            try:
                self.behave(conn)
            except (OSError, P.ProtocolError):
                pass

    def close(self) -> None:
        self._stop.set()
        self._t.join(10)
        assert not self._t.is_alive()
        self.lst.close()
        for c in self.conns:
            c.close()


def _fake_handshake(conn, cid):
    P.server_handshake(conn, SECRET, cid, 5.0)
    _, p = P.recv_frame(conn, (P.HAVEQ,), 5, 5)     # claims to hold everything
    rid, n = P.unpack_haveq(p)
    P.send_frame(conn, P.HAVE, P.pack_have_header(rid, n), b"\xff" * ((n + 7) // 8))


def fake_silent(conn, cid):
    pass                                          # accepts, never says a word


def fake_garbage(conn, cid):
    conn.sendall(os.urandom(64))


def fake_stalls_after_handshake(conn, cid):
    _fake_handshake(conn, cid)                    # then never answers the GET


def fake_unasked_item(conn, cid):
    _fake_handshake(conn, cid)
    _, p = P.recv_frame(conn, (P.GET,), 5, 5)
    rid, idx = P.unpack_get(p)
    P.send_frame(conn, P.ITEM, P.pack_item_header(rid + 1, idx[0], P.HERE), b"zz")


def fake_unasked_index(conn, cid):
    _fake_handshake(conn, cid)
    _, p = P.recv_frame(conn, (P.GET,), 5, 5)
    rid, idx = P.unpack_get(p)
    other = next((i for i in range(N) if i not in idx), N + 5)
    P.send_frame(conn, P.ITEM, P.pack_item_header(rid, other, P.HERE), b"zz")


def fake_garbage_answer(conn, cid):
    _fake_handshake(conn, cid)
    P.recv_frame(conn, (P.GET,), 5, 5)
    conn.sendall(os.urandom(100))


def fake_oversized_answer(conn, cid):
    _fake_handshake(conn, cid)
    P.recv_frame(conn, (P.GET,), 5, 5)
    conn.sendall(header(P.ITEM, P.MAX_PAYLOAD[P.ITEM] + 1))


def fake_closes_mid_frame(conn, cid):
    _fake_handshake(conn, cid)
    _, p = P.recv_frame(conn, (P.GET,), 5, 5)
    rid, idx = P.unpack_get(p)
    whole = frame(P.ITEM, P.pack_item_header(rid, idx[0], P.HERE) + b"x" * 100)
    conn.sendall(whole[:len(whole) // 2])
    conn.close()


def fake_stalls_mid_frame(conn, cid):
    _fake_handshake(conn, cid)
    _, p = P.recv_frame(conn, (P.GET,), 5, 5)
    rid, idx = P.unpack_get(p)
    whole = frame(P.ITEM, P.pack_item_header(rid, idx[0], P.HERE) + b"x" * 100)
    conn.sendall(whole[:len(whole) // 2])         # and the rest never comes


def fake_answers_some(conn, cid):
    _fake_handshake(conn, cid)
    _, p = P.recv_frame(conn, (P.GET,), 5, 5)
    rid, idx = P.unpack_get(p)
    P.send_frame(conn, P.ITEM, P.pack_item_header(rid, idx[0], P.ABSENT))   # then stalls


FAKES = [fake_silent, fake_garbage, fake_stalls_after_handshake, fake_unasked_item,
         fake_unasked_index, fake_garbage_answer, fake_oversized_answer, fake_closes_mid_frame,
         fake_stalls_mid_frame, fake_answers_some]
T = 0.5                     # the client's timeout in these tests


@pytest.mark.parametrize("behave", FAKES, ids=lambda f: f.__name__)
def test_client_facing_a_broken_peer_falls_back_within_a_timeout(cache, behave):
    cid = cid_of(cache)
    fake = FakeServer(lambda conn: behave(conn, cid))
    client = two_node_client(fake.address, cache, timeout=T)
    try:
        idx = list(range(N))
        t0 = time.monotonic()
        assert client.fetch(idx) == {}
        took = time.monotonic() - t0
        assert 1 in client.down(), "a broken peer was not marked down"
        # connecting + handshake + membership cost at most one timeout, the answer one more;
        # the bound is loose (a hang, or a timeout per sample, would break it)
        assert took < 3 * T + 3.0, f"fetch took {took:.2f} s against a {T} s timeout"
        n = fake.accepted
        t1 = time.monotonic()
        again = client.fetch(idx)
        if time.monotonic() - t1 < T / 2:    # (within its back-off: not asked again)
            assert again == {} and fake.accepted == n, "a peer just marked down was asked again at once"
        client.new_epoch()
        assert client.down() == {}
        assert client.fetch(idx) == {}
        wait_for(lambda: fake.accepted == n + 1, "new_epoch() let the client try the peer again")
        assert 1 in client.down()
        client.close()
        assert rx_threads() == [], "client.close() left a receiver thread behind"
    finally:
        client.close()
        fake.close()


def test_a_peer_that_stalled_rejoins_within_one_timeout(cache):
    """A stalled peer is marked down; its successor on the same address (a
    restarted node daemon) serves again one timeout later, within the same
    epoch (it was down for the whole epoch)."""
    cid = cid_of(cache)
    fake = FakeServer(lambda conn: fake_stalls_after_handshake(conn, cid))
    port = fake.address[1]
    client = two_node_client(fake.address, cache, timeout=T)
    srv = None
    try:
        idx = list(range(N))
        assert client.fetch(idx) == {} and 1 in client.down()
        fake.close()
        srv = make_server(cache, port=port)
        time.sleep(T * 1.2)
        assert client.fetch(idx) == {i: sample(i) for i in HERE_IDX}, "not back within one timeout"
        assert client.down() == {}
    finally:
        client.close()
        if srv is not None:
            srv.close()
    assert rx_threads() == []


def test_client_asking_a_peer_that_stopped_reading_does_not_hang():
    """A peer that completes the handshake and then reads nothing more: once
    the requests fill the socket buffers, the send is bounded by the timeout
    too (the receiver thread leaves the socket blocking, so a plain sendall
    waited forever, holding the lock every other asker and the timeout path
    need).  Run in a child: the old code hangs."""
    code = r"""
import socket, threading, time
from coordl.peers import PeerClient
from coordl.peers import protocol as P
SECRET = bytes(range(32))
lst = socket.create_server(("127.0.0.1", 0))
held = []
def deaf_peer():
    conn, _ = lst.accept()
    held.append(conn)
    P.server_handshake(conn, SECRET, P.cache_id("ds"), 5.0)
    _, p = P.recv_frame(conn, (P.HAVEQ,), 5, 5)      # claims every other sample, then never reads
    rid, n = P.unpack_haveq(p)
    P.send_frame(conn, P.HAVE, P.pack_have_header(rid, n), b"\xaa" * ((n + 7) // 8))
threading.Thread(target=deaf_peer, daemon=True).start()
n = 2_000_000          # half of it asked of the peer: 8 MB of requests, more than the buffers hold
client = PeerClient([("a", "127.0.0.1", 0), ("b", *lst.getsockname())], 0, [0, 1], SECRET, "ds",
                    {"num_samples": n, "seed": 1, "batch_size": 4}, timeout=1.0)
idx = [int(i) for i in (client.owners() == 1).nonzero()[0]]
assert len(idx) == n // 2
t0 = time.monotonic()
got = client.fetch(idx)
took = time.monotonic() - t0
assert got == {} and 1 in client.down(), (len(got), client.down())
client.close()
assert not [t for t in threading.enumerate() if t.name.startswith("coordl-peer-rx")]
print("took", round(took, 2))
"""
    r = run_in_child(code, timeout=40)
    assert r.returncode == 0, r.stderr
    took = float(r.stdout.split()[-1])
    assert took < 1.0 * 2 + 5.0, f"fetch took {took} s against a 1 s timeout"


def test_a_forked_process_does_not_keep_the_servers_sockets_alive():
    """Loader workers are forked from the process that runs the server, and
    inherit its descriptors: the listening socket and every open connection.
    What the server drops must still be dropped on the wire while such a
    child lives (the client sees EOF at once, not at its own timeout), and a
    closed server's port must refuse connections, not queue them."""
    code = r"""
import os, socket, time, uuid
from coordl.cache import NodeCache
from coordl.peers import PeerServer
from coordl.peers import protocol as P
SECRET = bytes(range(32))
cache = NodeCache.attach("peers-fork-" + uuid.uuid4().hex, 4, 4096)
srv = PeerServer(cache, SECRET, "127.0.0.1", handshake_timeout=30, body_timeout=30, idle_timeout=30)
c = socket.create_connection(tuple(srv.address), timeout=5)
P.client_handshake(c, SECRET, P.cache_id(cache.name), 5)
r, w = os.pipe()
pid = os.fork()
if pid == 0:                     # a "worker": holds copies of every descriptor until told to go
    os.close(w)
    os.read(r, 1)
    os._exit(0)
os.close(r)
try:
    # a protocol error: the server drops this client, and the client must see it
    c.sendall(P.HEADER.pack(b"XX", 1, P.GET, 0))
    c.settimeout(10)
    try:
        print("dropped", c.recv(1) == b"")
    except socket.timeout:
        print("dropped", False)
    except ConnectionResetError:
        print("dropped", True)
    c.close()
    addr = tuple(srv.address)
    srv.close()
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(addr)
        print("refused", False)
    except ConnectionRefusedError:
        print("refused", True)
    except socket.timeout:
        print("refused", False)
    s.close()
finally:
    os.close(w)
    os.waitpid(pid, 0)
    cache.close()
"""
    r = run_in_child(code, timeout=60)
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in r.stdout.split("\n") if line)
    assert out["dropped"] == "True", "a client the server dropped saw no EOF while a forked child lived"
    assert out["refused"] == "True", "a closed server's port still accepted connections while a forked child lived"


def test_server_accepts_in_a_process_with_many_descriptors():
    """A loader process can hold over a thousand descriptors (files, shared
    memory, sockets) before the server starts: its sockets then have numbers
    past select()'s limit, and the server must still accept."""
    code = r"""
import os, resource, socket, uuid
from coordl.cache import NodeCache
from coordl.peers import PeerServer
from coordl.peers import protocol as P
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
SECRET = bytes(range(32))
cache = NodeCache.attach("peers-fds-" + uuid.uuid4().hex, 4, 4096)
cache.put(1, b"one")
srv = PeerServer(cache, SECRET, "127.0.0.1", handshake_timeout=5)
try:
    c = socket.create_connection(tuple(srv.address), timeout=5)
    P.client_handshake(c, SECRET, P.cache_id(cache.name), 5)
    P.send_frame(c, P.GET, P.pack_get(1, [1]))
    _, p = P.recv_frame(c, (P.ITEM,), 5, 5)
    print("served", bytes(P.unpack_item(p)[3]) == b"one")
    c.close()
except (OSError, P.ProtocolError) as e:
    print("served", False, repr(e))
finally:
    srv.close()
    cache.close()
"""
    r = run_in_child(code, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["served", "True"], r.stdout + r.stderr


def test_server_out_of_descriptors_waits_instead_of_spinning():
    """accept() failing with EMFILE leaves the connection in the backlog and
    the listening socket readable: the accept thread must pause (not burn a
    core, on a machine whose cores train) and serve it once descriptors free up."""
    code = r"""
import os, resource, socket, threading, time, uuid
from coordl.cache import NodeCache
from coordl.peers import PeerServer
from coordl.peers import protocol as P
SECRET = bytes(range(32))
cache = NodeCache.attach("peers-emfile-" + uuid.uuid4().hex, 4, 4096)
srv = PeerServer(cache, SECRET, "127.0.0.1", handshake_timeout=5)
acc = next(t for t in threading.enumerate() if t.name == "coordl-peer-accept")
stat = os.open(f"/proc/self/task/{acc.native_id}/stat", os.O_RDONLY)   # opened while we can
def cpu():
    fields = os.pread(stat, 4096, 0).decode().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
c = socket.socket()
c.settimeout(5)
spare = os.open(os.devnull, os.O_RDONLY)
resource.setrlimit(resource.RLIMIT_NOFILE, (spare + 1, hard))   # no descriptor left after `spare`
c.connect(tuple(srv.address))          # the server's accept() now fails with EMFILE
t0 = cpu()
time.sleep(1.0)
spent = cpu() - t0
os.close(spare)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
P.client_handshake(c, SECRET, P.cache_id(cache.name), 5)   # served once there are descriptors again
c.close()
srv.close()
cache.close()
os.close(stat)
print("cpu", spent)
"""
    r = run_in_child(code, timeout=60)
    assert r.returncode == 0, r.stderr
    spent = float(r.stdout.split()[-1])
    # a spinning thread takes most of the second; a waiting one next to nothing
    assert spent < 0.1, f"the accept thread spent {spent:.2f} s of CPU in 1 s without descriptors"


def test_server_serves_many_connections_with_fixed_threads_and_idle_sockets_cannot_starve_it():
    """Every fetching process keeps a connection to every
    peer (64 nodes x 8 ranks x 8 workers: ~4,000 per server).  Here 1,200
    authenticated connections stay open while 400 idle unauthenticated
    sockets sit on the server: every connection is served, the server's
    threads stay fixed, and the idle ones are closed to make room (capped
    apart, timed out apart), never counted against authenticated clients."""
    code = r"""
import resource, socket, threading, uuid
from coordl.cache import NodeCache
from coordl.peers import PeerServer
from coordl.peers import protocol as P
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
SECRET = bytes(range(32))
cache = NodeCache.attach("peers-many-" + uuid.uuid4().hex, 4, 4096)
cache.put(1, b"one")
srv = PeerServer(cache, SECRET, "127.0.0.1", handshake_timeout=30, max_unauthenticated=100)
base = threading.active_count()
cid = P.cache_id(cache.name)
idle = [socket.create_connection(tuple(srv.address), timeout=10) for _ in range(400)]
conns = []
for k in range(1200):
    c = socket.create_connection(tuple(srv.address), timeout=10)
    P.client_handshake(c, SECRET, cid, 10)
    conns.append(c)
print("threads", srv.threads, threading.active_count() - base)
served = 0
for k, c in enumerate(conns):
    P.send_frame(c, P.GET, P.pack_get(k, [1]))
for k, c in enumerate(conns):
    _, p = P.recv_frame(c, (P.ITEM,), 10, 10)
    rid, i, st, data = P.unpack_item(p)
    served += rid == k and bytes(data) == b"one"
print("served", served)
print("unauth", srv.unauthenticated, srv.evicted >= 300, srv.refused)
for c in conns + idle:
    c.close()
srv.close()
print("left", srv.threads)
cache.close()
"""
    r = run_in_child(code, timeout=120)
    assert r.returncode == 0, r.stderr
    out = {line.split()[0]: line.split()[1:] for line in r.stdout.split("\n") if line}
    assert out["served"] == ["1200"], r.stdout + r.stderr
    assert out["threads"] == ["3", "0"], r.stdout     # accept + 2 loops, none added per connection
    assert int(out["unauth"][0]) <= 100 and out["unauth"][1:] == ["True", "0"], r.stdout
    assert out["left"] == ["0"]


def test_serving_peers_does_not_count_as_this_nodes_hits_or_misses(server, cache):
    """The node cache's hits and misses are this node's own lookups (what
    `coordl cache ls` and stats report); a peer's requests are counted as
    peer traffic instead."""
    before = cache.info()
    client = two_node_client(server, cache)
    try:
        mine = list(range(N))
        got = client.fetch(mine)
    finally:
        client.close()
    after = cache.info()
    assert got and len(got) < len(mine)          # some here, some absent
    assert (after.hits, after.misses) == (before.hits, before.misses)
    assert after.peer_out_bytes - before.peer_out_bytes == sum(len(v) for v in got.values())


def test_server_refuses_a_short_secret(cache):
    for bad in (b"", b"short"):
        with pytest.raises(ValueError, match="secret should be"):
            PeerServer(cache, bad, "127.0.0.1")


def test_client_reconnects_after_the_server_closed_an_idle_connection(cache):
    """The server ends connections idle past ``idle_timeout``; the client's
    next request opens a new one, and the peer is not marked down for it."""
    srv = make_server(cache, idle_timeout=0.3)
    client = two_node_client(srv, cache)
    try:
        mine = owned_by_peer(client)
        want = {i: sample(i) for i in mine if i in HERE_IDX}
        assert client.fetch(mine) == want
        wait_for(lambda: srv.connections == 0, "the server closed the idle connection")
        wait_for(lambda: rx_threads() == [], "the client saw it closed")
        assert client.fetch(mine) == want
        assert client.down() == {}
        client.close()
        assert rx_threads() == []
    finally:
        client.close()
        srv.close()


def test_a_sample_asked_twice_in_one_fetch_is_served(server, cache):
    """A batch may hold a sample twice (a sampler with replacement, a user's
    batch sampler): asking the peer for it twice is no protocol error."""
    client = two_node_client(server, cache)
    try:
        mine = [i for i in owned_by_peer(client) if i in HERE_IDX]
        got = client.fetch([mine[0], mine[1], mine[0], mine[0]])
        assert got == {mine[0]: sample(mine[0]), mine[1]: sample(mine[1])}
        assert client.down() == {}
    finally:
        client.close()


def test_bytes_failing_their_checksum_are_read_from_storage_not_spread(cache):
    """A peer's bytes carry the CRC32 of what its cache
    verified; bytes that do not match (corrupted on the wire or a bad
    entry) are dropped, so they are neither used nor admitted here, and the
    peer stays up for the samples it sends intact."""
    cid = cid_of(cache)

    def bad_crc(conn, _cid=cid):
        _fake_handshake(conn, _cid)
        _, p = P.recv_frame(conn, (P.GET,), 5, 5)
        rid, idx = P.unpack_get(p)
        for i in idx:
            data = sample(i)
            crc = zlib.crc32(data) ^ (1 if i == idx[0] else 0)     # the first one corrupt
            P.send_frame(conn, P.ITEM, P.pack_item_header(rid, i, P.HERE, crc), data)
        time.sleep(1.0)

    fake = FakeServer(bad_crc)
    client = two_node_client(fake.address, cache, timeout=2.0)
    try:
        got = client.fetch([3, 4, 5])
        assert got == {4: sample(4), 5: sample(5)}, "bytes failing their CRC32 were used"
        assert client.down() == {}
    finally:
        client.close()
        fake.close()
    # and a server never sends an entry its cache cannot verify
    srv = make_server(cache)
    try:
        i = HERE_IDX[0]
        off = int(cache._index[i, 0])
        cache._arena[off] ^= 0xFF          # the entry's bytes rot in shared memory
        c2 = two_node_client(srv, cache)
        try:
            got = c2.fetch(HERE_IDX)
        finally:
            c2.close()
        assert i not in got and len(got) == len(HERE_IDX) - 1
        assert srv.absent == 1
    finally:
        srv.close()


def test_a_refused_connection_is_tried_again_one_timeout_later_every_time(monkeypatch):
    """Nothing listening (a node daemon being restarted) refuses at once and
    costs nothing: such a peer is tried again one timeout later each time,
    so it serves within about one timeout of coming back, however long the
    restart took.  A failure that cost a timeout (a stalled peer) still
    backs off 1, 2, 4, ... timeouts."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = s.getsockname()
    s.close()                                   # a port nobody listens on: connect() is refused
    c = PeerClient([("a", "127.0.0.1", 0), ("b", *addr)], 0, [0, 1], SECRET, "ds", PLAN, timeout=2.0)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    for _ in range(4):
        assert c._link(1) is None
        _why, retry, _k = c._down[1]
        assert retry == now[0] + 2.0, (retry - now[0])
        now[0] = retry
    # a peer that stalled (the failure cost a timeout) backs off as before
    from coordl.peers.client import PeerDown

    c._down.clear()
    waits = []
    for _ in range(3):
        c._mark_down(1, PeerDown("peer b did not answer within 2 s"))
        waits.append(c._down[1][1] - now[0])
    assert waits == [2.0, 4.0, 8.0]
