"""Async front door for the HTTP server: the engine steps on a worker thread; callers await streams.

All engine state is touched only by the worker thread. Callers hand it commands (add, abort) through
a queue; outputs travel back to each request's asyncio.Queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from adapters.types import AdapterRef
from base_engine.engine import LLMEngine
from base_engine.outputs import EngineStats, RequestOutput
from base_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    tenant_id: str | None = None
    cache_salt: bytes = b""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        self._stats = engine.stats()
        self.on_finished: list[Callable[[RequestOutput], None]] = []  # called on the worker thread

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self._stats

    def validate(self, request: EngineRequest) -> None:
        self.engine.validate(request.prompt_token_ids, request.params)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Streams outputs until the request finishes; cancelling the iterator aborts the request."""
        self.validate(request)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request.request_id] = (loop, outputs)
        arrival = time.monotonic()
        self._submit(lambda: self._add(request, arrival))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._deliver_all([self.engine.abort(request_id)]))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, request: EngineRequest, arrival: float) -> None:
        try:
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                adapter=request.adapter,
                tenant_id=request.tenant_id,
                cache_salt=request.cache_salt,
                arrival=arrival,
            )
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
            self._deliver(_failed(request, str(exc)))

    def _run(self) -> None:
        while not self._stop:
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished:
                self._stats = self.engine.stats()
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the in-flight requests, keep serving
                logger.exception("engine step failed; failing its requests")
                outputs = [
                    self.engine.fail(rid, f"engine error: {exc}") for rid in list(self.engine.requests)
                ]
            self._deliver_all(outputs)
            self._stats = self.engine.stats()

    def _deliver_all(self, outputs: list[RequestOutput | None]) -> None:
        for out in outputs:
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            for callback in self.on_finished:
                callback(out)
            target = self._streams.pop(out.request_id, None)
        else:
            target = self._streams.get(out.request_id)
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, out)


def _failed(request: EngineRequest, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=[],
        text="",
        finish_reason="error",
        error=error,
    )
