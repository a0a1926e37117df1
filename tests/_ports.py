"""A free TCP port on the loopback interface, for tests that start servers
or process groups (the port is free when asked; a test that loses it to
another process fails at bind, with that error)."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
