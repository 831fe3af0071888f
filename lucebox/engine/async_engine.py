"""AsyncEngine: the engine's step loop on a background thread, with asyncio streams per request.

`stream = await engine.add_request(id, prompt, params)` validates and queues the request (raising
LuceboxError at once if it is bad), then `async for output in stream` yields cumulative
RequestOutputs until the last one has `finished`. Leaving the loop early (a client that went away)
aborts the request and frees its KV blocks.

The server sees the engine only through this class: requests and streams, and a few read-only
facts (max_model_len, tokenizer, vocab_size, eos_token_ids, model_name, stats()).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import LuceboxError
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from .engine import LLMEngine

log = logging.getLogger("lucebox")


class EngineDeadError(LuceboxError):
    """The engine's step loop failed; the request could not be completed."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load for /metrics (vLLM's gauges and counters)."""
    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for a slot
    kv_blocks: int  # KV blocks in the pool
    kv_blocks_free: int
    kv_capacity_tokens: int  # tokens the KV pool holds
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens served from it
    preemptions: int  # sequences preempted to free KV blocks
    state_slots: int = 0  # recurrent-state slots in the pool (0: the model keeps no recurrent state)
    state_slots_free: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (1 = all)."""
        return (self.kv_blocks - self.kv_blocks_free) / self.kv_blocks if self.kv_blocks else 0.0

    @property
    def state_usage(self) -> float | None:
        """Fraction of the recurrent-state slots in use; None without recurrent state."""
        return (self.state_slots - self.state_slots_free) / self.state_slots if self.state_slots else None


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: steps on the thread, add/abort from asyncio
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="lucebox-engine", daemon=True)
        self._thread.start()

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._stopped:
            raise EngineDeadError("the engine has shut down")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        return self._stream(request_id, queue)

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
        with self._lock:
            self.engine.abort(request_id)
            self._streams.pop(request_id, None)

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
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting), kv_blocks=blocks.num_blocks,
                           kv_blocks_free=blocks.num_free_blocks, kv_capacity_tokens=self.engine.kv_capacity_tokens,
                           prefix_cache_queries=blocks.queries, prefix_cache_hits=blocks.hits,
                           preemptions=sched.num_preemptions,
                           state_slots=len(cache.slots) + len(cache.free_slots), state_slots_free=len(cache.free_slots))

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens the prefix cache holds now (read without the lock: a lookup, no change);
        what the request will be served from cache unless blocks are evicted before it starts."""
        blocks = self.engine.scheduler.blocks
        return len(blocks.match_prefix(token_ids)) * blocks.block_size

    @property
    def is_running(self) -> bool:
        """The step loop is alive and accepting work (the server's /health)."""
        return not self._stopped and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            deliveries = []
            with self._lock:
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step must not hang its requests: fail them all
                    log.exception("engine step failed")
                    error = EngineDeadError(f"the engine failed while running this request: {e}")
                    for request_id in list(self._streams):
                        self.engine.abort(request_id)
                        deliveries.append((self._streams.pop(request_id), error))
                    outputs = []
                for output in outputs:
                    target = self._streams.get(output.request_id)
                    if target is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    deliveries.append((target, output))
            for (loop, queue), item in deliveries:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the caller's event loop has closed
                    pass
