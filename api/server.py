"""Running the app under uvicorn with a graceful drain on SIGTERM / SIGINT.

uvicorn on its own closes the listening socket at the first signal and re-raises the signal after
shutdown (the process then dies by SIGTERM, not exit 0). Here the first signal only starts the drain
(the `drain` it is handed, api.app.drain): new requests get 503 while the socket stays open,
in-flight requests get `drain_timeout_s` to finish and are aborted after it; then uvicorn shuts down,
the lifespan stops each service (api.app.shut_down: usage written) and stops the engine, and `serve`
returns normally: exit status 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from api.http.header_timeout import protocol_class
from api.settings import Settings
from api.tenancy.admission import Admission

Drain = Callable[[float], Awaitable[None]]  # stop admitting, wait up to the timeout, abort the rest

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, *, drain_timeout_s: float, admission: Admission, drain: Drain
    ) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.admission = admission
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._is_draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown.
        if self._is_draining or self._loop is None:
            logger.warning("second signal %d: shutting down now", sig)
            self.should_exit = True
            return
        logger.info("signal %d: draining (grace %.1f s)", sig, self.drain_timeout_s)
        self._is_draining = True
        self.admission.is_draining = True
        # A signal handler may run in the middle of the event loop: hand the task over through it.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.drain(self.drain_timeout_s)
        finally:
            self.should_exit = True


def raise_open_file_limit(ceiling: int = 65536) -> int:
    """Raises the soft open-files limit to the hard one (at most `ceiling`), as vLLM does at start:
    every connection holds a descriptor, and many systems default the soft limit to 1024, which a
    thousand idle connections would use up for everyone. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, wanted, exc)
    return soft


def run(app: FastAPI, *, settings: Settings, admission: Admission, drain: Drain) -> None:
    """Serve until a signal drains the server; returns normally (exit status 0)."""
    logger.info("open files limit: %d", raise_open_file_limit())
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        http=protocol_class(settings.request_header_timeout_s),  # slow headers: api/http/header_timeout.py
        # Our own logging configuration (api/cli/options.py) stays in place.
        log_config=None,
    )
    DrainingServer(config, drain_timeout_s=settings.drain_timeout_s, admission=admission, drain=drain).run()
