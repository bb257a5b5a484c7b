"""Async front door for the HTTP server: the engine steps on a worker thread; callers await streams.

All engine state is touched only by the worker thread. Callers hand it commands (add, abort) through
a queue; outputs travel back to each request's asyncio.Queue with `call_soon_threadsafe`.

This is the only door into the engine for code outside `base_engine`: what the API reads of it (the
tokenizer, limits, dtype, KV cache shape, stats) and what it asks of the adapter cache (pin, unpin,
prefetch, evict) are methods here, run on the engine thread where they touch engine state.

The engine thread never waits on I/O: finished requests go to `on_finished` observers (metering,
metrics) on a separate dispatcher thread, which then delivers the final output, so a request's usage
is recorded before its client sees the end. A failing command fails only its own request; a failing
step fails the requests of that step; after `MAX_CONSECUTIVE_FAILURES` failed steps in a row the
engine reports itself unhealthy (`/health`, `/ready`: 503) and fails what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from adapters.types import AdapterRef
from base_engine.engine import LLMEngine
from base_engine.outputs import EngineStats, RequestOutput
from base_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_CONSECUTIVE_FAILURES = 3


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    tenant_id: str | None = None
    cache_salt: bytes = b""
    priority: int = 0  # lower = more urgent (base_engine/priority.py)


@dataclass(frozen=True, slots=True)
class KvCacheInfo:
    """The KV cache's shape, as vLLM's `cache_config_info` metric reports it."""

    block_size: int  # tokens per block
    num_blocks: int
    enable_prefix_caching: bool


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        # Finished outputs on their way to observers, then to their stream; None stops the thread.
        self._finished: queue.SimpleQueue[RequestOutput | None] = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch, name="loraserve-finished", daemon=True)
        self._dispatcher_lock = threading.Lock()
        self._dispatcher_stopped = False
        self._stats = engine.stats()
        self.num_consecutive_failures = 0  # failed steps since the last good one
        self.fatal_error: str | None = None  # set when the engine thread itself died
        self._idle_error: str | None = None  # the last idle housekeeping failure, logged once
        self.on_finished: list[Callable[[RequestOutput], None]] = []  # called on the dispatcher thread
        self.flushes_denormals = False  # set by the engine thread as it starts (`_run`)

    def start(self) -> None:
        self._dispatcher.start()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then the dispatcher once every final is dispatched. The engine
        itself stays usable (see `close`)."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # still in a step: it stops the dispatcher itself when it ends
            logger.warning("engine thread still running %g s after shutdown; it stops on its own", timeout)
            return
        self._stop_dispatcher()
        if self._dispatcher.is_alive():
            self._dispatcher.join(timeout)

    def close(self) -> None:
        """After `shutdown`, by the engine's owner: release the engine's resources (the adapter
        loader's threads). Nothing may use the engine after."""
        self.engine.close()

    def _stop_dispatcher(self) -> None:
        """Once, after the engine thread's last final: the dispatcher ends after dispatching it."""
        with self._dispatcher_lock:
            if not self._dispatcher_stopped:
                self._dispatcher_stopped = True
                self._finished.put(None)

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and stepping (what readiness checks ask)."""
        return self._thread.is_alive() and not self._stop and self.is_healthy

    @property
    def is_healthy(self) -> bool:
        """False once the engine thread died or its steps keep failing (a liveness probe's answer)."""
        if self.fatal_error is not None:
            return False
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stop:
            return False
        return self.num_consecutive_failures < MAX_CONSECUTIVE_FAILURES

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- what the API reads of the engine: fixed once the engine is built, safe from any thread ----

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model_config.vocab_size)

    @property
    def has_unloaded_vision_tower(self) -> bool:
        """The checkpoint is multimodal (Gemma3ForConditionalGeneration) and only its text model is served."""
        return bool(self.engine.model_config.has_vision_tower)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def base_weight_norms(self) -> dict[tuple[int, str], float]:
        """||W||_F per (layer, checkpoint projection) of the served weights (the coverage report's base)."""
        return self.engine.base_weight_norms

    @property
    def kv_cache(self) -> KvCacheInfo:
        return KvCacheInfo(
            block_size=self.engine.config.block_size,
            num_blocks=self.engine.block_manager.num_blocks,
            enable_prefix_caching=self.engine.config.enable_prefix_caching,
        )

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    def determinism_refusal(self) -> str | None:
        """Why this engine cannot serve a deterministic request (None: it can)."""
        return self.engine.determinism.refusal()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode_prompt(prompt)

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

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(run)
        return await future

    # ---- the adapter cache, on the engine thread between steps ----

    async def pin_adapter(self, ref: AdapterRef) -> None:
        """Operator pin: load `ref` now and keep it resident until unpinned."""
        await self._call(lambda engine: engine.lora.pin(ref))

    async def unpin_adapter(self, ref: AdapterRef) -> None:
        await self._call(lambda engine: engine.lora.unpin(ref))

    async def set_adapter_pins(self, wanted: dict[str, AdapterRef]) -> None:
        """Pin exactly `wanted` (ref.id -> ref): unpin every other pinned adapter, pin what is missing."""

        await self._call(lambda engine: engine.lora.set_pins(wanted))

    async def prefetch_adapter(self, ref: AdapterRef) -> bool:
        """Start loading `ref` (a no-op while it loads or is resident); True once it is resident on
        either tier or its load failed for good (the request's own admission then reports why)."""

        return await self._call(lambda engine: engine.lora.prefetch(ref))

    async def evict_adapters(self, ref_ids: list[str]) -> list[str]:
        """Drop these adapters from both tiers; returns those still serving in-flight requests (their
        slots are freed when those finish)."""
        return await self._call(lambda engine: engine.lora.evict(ref_ids))

    def adapter_residency(self) -> dict[str, str]:
        """ref.id -> "gpu" | "cpu", as of the last step (absent: not loaded in this engine)."""
        return dict(self._stats.adapters.residency)

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
                priority=request.priority,
                cache_salt=request.cache_salt,
                arrival=arrival,
            )
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
            self._deliver(failed_output(request, str(exc)))

    def _run(self) -> None:
        # Denormals flushed to zero on this thread (and the intra-op threads it starts, which inherit
        # its floating-point state): on CPUs without fast denormal arithmetic one adapter whose values
        # run into the subnormal range slowed every co-batched request several-fold. False on CPUs
        # without the FTZ/DAZ flags (then adapters' subnormal factors are still flushed at load).
        self.flushes_denormals = torch.set_flush_denormal(True)
        try:
            while not self._stop:
                self._run_commands()
                if not self.engine.has_unfinished:
                    self._idle()
                    continue
                num_steps = self.engine.num_steps
                outputs = self._step()
                self._deliver_all(outputs)
                self._stats = self.engine.stats()
                if self.engine.num_steps == num_steps and not outputs:
                    # Nothing could run (e.g. adapters still loading): wait for a command or a moment.
                    self._wake.wait(0.005)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the thread is gone: say so and end every stream
            self.fatal_error = f"engine thread stopped: {type(exc).__name__}: {exc}"
            logger.exception("engine thread died")
            for rid in list(self._streams):
                self._deliver(RequestOutput(rid, [], [], "", finish_reason="error", error=self.fatal_error))
        finally:
            if self._stop:  # asked to stop: every final of this thread is queued, the dispatcher may end
                self._stop_dispatcher()

    def _run_commands(self) -> None:
        while not self._commands.empty():
            command = self._commands.get()
            try:
                command()
            except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                logger.exception("engine command failed; the engine goes on")

    def _idle(self) -> None:
        try:
            self.engine.lora.housekeeping()
        except Exception as exc:  # noqa: BLE001 - e.g. placing a pinned adapter failed: retried next idle
            error = f"{type(exc).__name__}: {exc}"
            if error != self._idle_error:  # once per distinct failure, not 20 times a second
                logger.exception("adapter housekeeping failed while idle; retrying")
            self._idle_error = error
        else:
            self._idle_error = None
        self._stats = self.engine.stats()
        self._wake.wait(self.idle_wait_s)
        self._wake.clear()

    def _step(self) -> list[RequestOutput | None]:
        """One engine step; a failure fails that step's requests (all of them once failures repeat)."""
        try:
            outputs: list[RequestOutput | None] = list(self.engine.step())
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
            self.num_consecutive_failures += 1
            logger.exception("engine step failed (%d in a row)", self.num_consecutive_failures)
            return self._fail_step(exc)
        self.num_consecutive_failures = 0
        return outputs

    def _fail_step(self, exc: Exception) -> list[RequestOutput | None]:
        """The finals the failed step already made, then a failed final for each other request of it.

        A request whose finish itself raised is no longer in the engine: it still gets a failed final,
        so its stream, its in-flight entry and its meter all end."""
        finished = [out for out in self.engine.step_outputs if out.finished]
        done = {out.request_id for out in finished}
        victims = list(self.engine.step_request_ids)
        if self.num_consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            victims += self.engine.requests  # it cannot go on: nothing may wait forever
        reason = f"engine error: {type(exc).__name__}: {exc}"
        outputs: list[RequestOutput | None] = list(finished)
        for rid in dict.fromkeys(victims):
            if rid not in done:
                outputs.append(self._fail_request(rid, reason))
        return outputs

    def _fail_request(self, request_id: str, reason: str) -> RequestOutput:
        try:
            out = self.engine.fail(request_id, reason)
        except Exception:  # noqa: BLE001 - its finish raised again: end its stream all the same
            logger.exception("failing request %s raised", request_id)
            out = None
        return out or RequestOutput(request_id, [], [], "", finish_reason="error", error=reason)

    def _deliver_all(self, outputs: list[RequestOutput | None]) -> None:
        for out in outputs:
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self._finished.put(out)  # observers may do I/O: never on this thread
            return
        target = self._streams.get(out.request_id)
        if target is None:
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read it, end it now
            logger.warning("stream of %s has no event loop any more: aborted", out.request_id)
            self._streams.pop(out.request_id, None)
            self._deliver_all([self.engine.abort(out.request_id)])

    def _dispatch(self) -> None:
        """Dispatcher thread: observers first (usage is recorded before the client sees the end)."""
        while (out := self._finished.get()) is not None:
            for callback in self.on_finished:
                try:
                    callback(out)
                except Exception:  # noqa: BLE001 - a broken observer must not lose the stream's end
                    logger.exception("on_finished callback failed for request %s", out.request_id)
            target = self._streams.pop(out.request_id, None)
            if target is not None:
                loop, outputs = target
                try:
                    loop.call_soon_threadsafe(outputs.put_nowait, out)
                except RuntimeError:  # the caller's event loop is closed: nobody is waiting
                    logger.debug("stream of %s has no running loop", out.request_id)


def failed_output(request: EngineRequest, error: str) -> RequestOutput:
    """The final output of a request that failed before producing anything."""
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=[],
        text="",
        finish_reason="error",
        error=error,
    )
