"""A raw HTTP/1.1 client that sends one streaming request and then reads nothing: a client that stopped
reading, for backpressure tests.

Loopback absorbs a lot before a writer blocks: Linux autotunes the server's send buffer from the MSS
(64 KiB on loopback) up to tcp_wmem's maximum, some 2 to 4 MB, whatever the client's receive buffer.
So the client also caps its MSS before connecting: the server then sizes its send buffer for small
segments and the connection holds only tens of KiB, beside uvicorn's own 64 KiB transport buffer.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

RCVBUF_BYTES = 4096  # the kernel doubles it; set before connect, so the advertised window stays small
MSS_BYTES = 536  # the classic minimum; set before connect, so the server's send buffer stays small


def open_silent_stream(base_url: str, path: str, body: dict[str, object]) -> socket.socket:
    """Connect with small buffers and send `body` as a JSON POST to `path`; the response is left unread."""
    address = urlsplit(base_url)
    if address.hostname is None or address.port is None:
        raise ValueError(f"no host and port in {base_url!r}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    if hasattr(socket, "TCP_MAXSEG"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS_BYTES)
    sock.connect((address.hostname, address.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock
