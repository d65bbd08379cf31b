"""A loopback port for a process a test starts to listen on.

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from the ephemeral range, the same range every
outgoing connection takes its local port from. Between the probe closing it and the child binding it, a connection
made elsewhere (CI runs the floor suite beside this one) can take it, and the child fails with EADDRINUSE. A port
below that range is never given to a connection, so only another listener could take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # above the ports services usually take


def _ephemeral_start() -> int:
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default start; elsewhere (macOS: 49152) the range starts later still


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and that no outgoing connection will be given; where the ephemeral
    range leaves too few ports below it (a host tuned to start it low), one the kernel picks."""
    top = _ephemeral_start()
    candidates = range(LOWEST, top)
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
