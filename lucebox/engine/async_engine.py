"""AsyncEngine: the engine's step loop on a background thread, with asyncio streams per request.

`stream = await engine.add_request(id, prompt, params)` tokenises the prompt in a worker thread,
hands the request to the engine thread and waits for its admission (raising LuceboxError if it is
bad or the queue is full), then `async for output in stream` yields cumulative RequestOutputs until
the last one has `finished`. Leaving the loop early (a client that went away) aborts the request
and frees its KV blocks.

The event loop never waits on a step: adds and aborts go into an inbox that the engine thread
drains between steps, and outputs come back through call_soon_threadsafe. A step that raises
kills the loop: every request fails with EngineDeadError and `health_problem` says why.

The server sees the engine only through this class: requests and streams, and a few read-only
facts (max_model_len, tokenizer, vocab_size, eos_token_ids, model_name, stats()).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import LuceboxError
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from . import admission
from .engine import LLMEngine
from .kv_pool import KVFlashStats

log = logging.getLogger("lucebox")


class EngineDeadError(LuceboxError):
    """The engine's step loop failed; the request could not be completed."""


@dataclass(frozen=True)
class KVPoolStats:
    """One KV cache group's pool (engine/cache_manager.py): `group` names it, "full" or "window=W"."""
    group: str
    blocks: int
    blocks_free: int

    @property
    def usage(self) -> float:
        return (self.blocks - self.blocks_free) / self.blocks if self.blocks else 0.0


def group_label(window: int | None) -> str:
    return "full" if window is None else f"window={window}"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load for /metrics (vLLM's gauges and counters). The kv_* figures
    are the primary KV cache group's (full attention); kv_pools has every group's."""
    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for a slot
    kv_blocks: int  # KV blocks in the primary group's pool
    kv_blocks_free: int
    kv_capacity_tokens: int  # tokens the KV pool holds
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens served from it
    preemptions: int  # sequences preempted to free KV blocks
    state_slots: int = 0  # recurrent-state slots in the pool (0: the model keeps no recurrent state)
    state_slots_free: int = 0
    kv_pools: tuple[KVPoolStats, ...] = ()  # every KV cache group's pool, the primary first
    snapshots: int = 0  # entries of the recurrent-state snapshot pool (hybrids' prefix reuse; 0: none)
    snapshots_in_use: int = 0  # entries holding a prefix's state
    snapshot_hits: int = 0  # admissions whose recurrent state was loaded from a snapshot
    snapshot_hit_tokens: int = 0  # prefix tokens those admissions did not compute
    kv_flash: KVFlashStats | None = None  # KVFlash's pool (engine/kv_pool.py); None: started without one

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (1 = all)."""
        return (self.kv_blocks - self.kv_blocks_free) / self.kv_blocks if self.kv_blocks else 0.0

    @property
    def state_usage(self) -> float | None:
        """Fraction of the recurrent-state slots in use; None without recurrent state."""
        return (self.state_slots - self.state_slots_free) / self.state_slots if self.state_slots else None


@dataclass
class _Add:
    request_id: str
    prompt: dict
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # the request's outputs, read by its stream
    admitted: asyncio.Future  # None once admitted, or the admission error


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: collections.deque = collections.deque()  # _Add / _Abort, drained between steps
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._stopped = False
        self._failure: str | None = None  # why the step loop died
        self._drain_deadline: float | None = None  # set at shutdown: no new requests; fail the rest after it
        self._thread = threading.Thread(target=self._run, name="lucebox-engine", daemon=True)
        self._thread.start()

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self._check_accepting()
        prompt = await self._tokenized(prompt)
        self._check_accepting()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        self._post(_Add(request_id, prompt, params, loop, queue, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before admission: free it once admitted
            raise
        return self._stream(request_id, queue)

    async def _tokenized(self, prompt):
        """A text prompt as {prompt, prompt_token_ids}, encoded in a worker thread (a 10 MB prompt
        takes seconds); other shapes go to the engine as they are, which checks them."""
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if not isinstance(text, str):
            return prompt
        extra = prompt if isinstance(prompt, dict) else {}  # e.g. prefill_keep_ratio
        return {**extra, "prompt": text, "prompt_token_ids": await asyncio.to_thread(self.engine.tokenizer.encode, text)}

    def _check_accepting(self) -> None:
        problem = self.health_problem
        if problem is not None:
            raise EngineDeadError(f"{problem}; no new requests are accepted")

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Never blocks: the engine thread frees the request between steps (a no-op once finished)."""
        self._post(_Abort(request_id))

    def _post(self, command) -> None:
        self._inbox.append(command)
        self._wake.set()
        if self._failure is not None or not self._thread.is_alive():
            self._fail_inbox(EngineDeadError(self.health_problem or "the engine is not running"))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @property
    def model_name(self) -> str:
        """The served model's file or directory name."""
        return Path(str(self.engine.args.model)).name

    def stats(self) -> EngineStats:
        """Read without the engine lock: the figures may lag a step, never block one."""
        sched = self.engine.scheduler
        blocks, cache = sched.blocks, sched.cache
        snapshots = cache.snapshots
        # sequences being scored (PFlash) wait too
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting) + self.engine.scoring.num_sequences,
                           kv_blocks=blocks.num_blocks,
                           kv_blocks_free=blocks.num_free_blocks, kv_capacity_tokens=self.engine.kv_capacity_tokens,
                           prefix_cache_queries=blocks.queries, prefix_cache_hits=blocks.hits,
                           preemptions=sched.num_preemptions,
                           state_slots=len(cache.slots) + len(cache.free_slots), state_slots_free=len(cache.free_slots),
                           kv_pools=tuple(KVPoolStats(group_label(window), n, free)
                                          for window, n, free in cache.pool_usage()),
                           # `is not None`: an empty pool has len 0, so it is falsy but still there
                           snapshots=snapshots.capacity if snapshots is not None else 0,
                           snapshots_in_use=len(snapshots) if snapshots is not None else 0,
                           snapshot_hits=snapshots.loaded if snapshots is not None else 0,
                           snapshot_hit_tokens=snapshots.loaded_tokens if snapshots is not None else 0,
                           kv_flash=self.engine.kv_pool.stats() if self.engine.kv_pool is not None else None)

    def kv_room(self, kv_pool: bool | None = None) -> int:
        """Tokens of context a request may reach: max_model_len, or with KVFlash what its KV's home holds
        (the pool's host memory for a pooled request, the device's KV for another: engine/admission.py)."""
        engine = self.engine
        return admission.kv_room(engine, engine.args.kv_pool_target if kv_pool is None else kv_pool)

    def cached_prefix_tokens(self, token_ids: list[int], prefill_keep_ratio: float | None = None) -> int:
        """Prompt tokens the prefix cache holds now (read without the lock: a lookup, no change);
        what the request will be served from cache unless blocks are evicted before it starts; 0
        for a prompt speculative prefill compresses (it bypasses the cache)."""
        args = self.engine.args
        ratio = prefill_keep_ratio if prefill_keep_ratio is not None else args.prefill_keep_ratio
        if ratio is not None and len(token_ids) >= args.prefill_min_tokens:
            return 0
        cache = self.engine.scheduler.cache  # hybrids: only up to a recurrent-state snapshot
        return len(cache.match_prefix(token_ids)) * cache.block_size

    @property
    def is_running(self) -> bool:
        """The step loop is alive and accepting work (the server's /health)."""
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why the engine takes no requests (None: it does)."""
        if self._failure is not None:
            return self._failure
        if self._stopped or not self._thread.is_alive():
            return "the engine has shut down"
        if self._drain_deadline is not None:
            return "the server is shutting down"
        return None

    def begin_shutdown(self, grace: float) -> None:
        """Stop admitting; requests still running `grace` seconds from now fail with a clear error."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + max(0.0, grace)
            self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._wake.clear()  # before the inbox: a command posted after this sets it again
                self._apply_inbox()
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._fail_all(EngineDeadError("the server shut down before this request finished "
                                                   "(--graceful-timeout)"))
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=None if self._drain_deadline is None else 0.1)
                    continue
                self._deliver(self.engine.step())
        except BaseException as e:  # a failed step leaves the engine's state unknown: stop, fail everything
            log.exception("the engine loop failed")
            self._failure = f"the engine failed ({type(e).__name__}: {e}); restart the server"
            self._fail_all(EngineDeadError(self._failure))
            self._fail_inbox(EngineDeadError(self._failure))
            return
        self._fail_all(EngineDeadError("the server shut down before this request finished"))
        self._fail_inbox(EngineDeadError("the engine has shut down"))

    def _apply_inbox(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                self._streams.pop(command.request_id, None)
                continue
            error = None
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params)
                self._streams[command.request_id] = (command.loop, command.queue)
            except Exception as e:  # the request's own fault (LuceboxError) or a bug: its caller hears of it
                error = e
            _call_soon(command.loop, _settle, command.admitted, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            # a request that failed alone (RequestOutput.error): its stream raises the error
            _call_soon(target[0], target[1].put_nowait, output.error if output.error is not None else output)

    def _fail_all(self, error: EngineDeadError) -> None:
        """Every admitted request ends with `error` (its stream raises it)."""
        for request_id, (loop, queue) in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be broken: the callers must hear of it all the same
                log.exception("abort of %s failed", request_id)
            _call_soon(loop, queue.put_nowait, error)
        self._streams.clear()

    def _fail_inbox(self, error: EngineDeadError) -> None:
        while True:
            try:
                command = self._inbox.popleft()
            except IndexError:
                return
            if isinstance(command, _Add):
                _call_soon(command.loop, _settle, command.admitted, error)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # a caller that left has cancelled it
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop has closed
        pass
