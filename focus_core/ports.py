"""Free ports on loopback, for the processes FOCUS starts: the data-parallel update's rendezvous
(``tasks/update_dp.py``) and the local services (``infra/services.py``)."""

from __future__ import annotations

import socket
from collections.abc import Collection


def free_ports(count: int, exclude: Collection[int] = frozenset()) -> list[int]:
    """``count`` distinct ports, none in ``exclude``, that the kernel considers free now on 127.0.0.1 (another
    process could still take one before the caller binds it)."""
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            if sock.getsockname()[1] in exclude:
                sock.close()
                continue
            sockets.append(sock)  # held open until all are chosen, so the kernel hands out distinct ports
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` of 127.0.0.1. SO_REUSEADDR as servers set it: connections of a server that just
    stopped linger in TIME_WAIT, and they must not keep it from starting again on its own port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
