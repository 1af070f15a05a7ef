"""A TCP proxy in front of a real server that a test can make faulty: slow, silent, or cutting replies."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

PASS, SLOW, SILENT, CUT, BLACKHOLE = "pass", "slow", "silent", "cut", "blackhole"


class FaultProxy:
    """Listens on 127.0.0.1:`port` and forwards to 127.0.0.1:`upstream_port`. `mode` applies to every
    connection, open or new, from the next chunk on: PASS forwards; SLOW holds each request `delay_s`
    before forwarding it (a slow link or server); SILENT swallows requests (a server that accepts and never
    answers); CUT forwards a reply's first chunk, then closes both ends (a server stopped mid-reply);
    BLACKHOLE drops everything both ways and passes on no close (a network partition: no FIN, no RST reach
    either side).
    `reset()` ends every connection with a TCP RST (a peer's host gone, a firewall rejecting)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = PASS
        self.delay_s = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while chunk := client.recv(65536):
                if self.mode in (SILENT, BLACKHOLE):
                    continue
                if self.mode == SLOW:
                    time.sleep(self.delay_s)  # the fault itself: this request is late
                upstream.sendall(chunk)
        except OSError:
            pass
        self._closed(client, upstream)

    def _closed(self, ended: socket.socket, other: socket.socket) -> None:
        """One side ended: close both, unless partitioned (the other side must not see that FIN either:
        it is left open until `reset` or `close`)."""
        if self.mode == BLACKHOLE:
            _close(ended)
        else:
            _close(ended, other)

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := upstream.recv(65536):
                if self.mode == BLACKHOLE:
                    continue
                client.sendall(chunk)
                if self.mode == CUT:
                    break
        except OSError:
            pass
        if self.mode == CUT:
            _close(client, upstream)
        else:
            self._closed(upstream, client)

    def reset(self) -> None:
        """End every open connection with a RST (SO_LINGER 0), both ends; new ones are still accepted."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # wake the thread blocked reading it (SHUT_RD sends nothing), so the close below is the
                # last reference and sends the RST at once
                sock.shutdown(socket.SHUT_RD)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            _close(*self._sockets)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):  # already closed by the other side
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
