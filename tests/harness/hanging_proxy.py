"""A TCP proxy on 127.0.0.1 that can be made to hang: what a stuck S3 endpoint looks like to a client.

While `hang()` is in force, new connections are accepted and never answered, and whatever arrives on
open ones is swallowed: a client sees its request go out and no byte come back (its read timeout is
the only way out). `resume()` forwards again (connections hung meanwhile stay dead, as they would).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class HangingProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._hung = threading.Event()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="hanging-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def hang(self) -> None:
        self._hung.set()

    def resume(self) -> None:
        self._hung.clear()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._keep(client)
            if self._hung.is_set():
                continue  # held open, never read, never answered
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            self._keep(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = src.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self._hung.is_set():
                continue  # swallowed: the other side waits for an answer that never comes
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> HangingProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
