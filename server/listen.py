"""The listening socket, bound before the model loads (as vLLM does).

A second server started on a busy port used to load the whole model (tens of seconds, gigabytes)
before uvicorn found the port taken. :func:`bind_socket` binds ``host:port`` first and fails at
once with one clear line; the socket is handed to uvicorn, which starts listening on it only once
the model is loaded (until then a connection attempt is refused rather than left hanging).
"""

from __future__ import annotations

import errno
import socket


class PortUnavailableError(ValueError):
    """``host:port`` cannot be bound (taken, not this machine's address, or not permitted). A
    ValueError so that the command line reports it as a usage error, without a traceback."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound (not yet listening) to ``host:port``, with ``SO_REUSEADDR`` as uvicorn
    sets it; raises :class:`PortUnavailableError` naming the address and the flags to change."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailableError(f"cannot listen on {host}:{port}: the host does not "
                                   f"resolve ({exc.strerror}); check --host") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
            # "::" serves IPv4 too, as uvicorn's own binding does.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "the port is already in use (another server?); choose "
                                 "another --port or stop the other process",
               errno.EADDRNOTAVAIL: "this machine has no such address; check --host",
               errno.EACCES: "permission denied (ports below 1024 need privileges); "
                             "choose another --port"}.get(exc.errno, exc.strerror or str(exc))
        raise PortUnavailableError(f"cannot listen on {host}:{port}: {why}") from None
    return sock
