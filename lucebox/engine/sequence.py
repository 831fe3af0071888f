"""Sequence: one generated continuation, its tokens, KV blocks, sampling state and stop rules."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..model.kv_pool.view import KVView
from ..outputs import RequestMetrics
from ..sampling import SamplingParams
from .pflash.positions import PromptCompression


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # position among the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # admission order, for FIFO fairness and newest-first preemption
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # the primary KV cache group's (engine/cache_manager.py)
    window_tables: list[list[int]] = field(default_factory=list)  # one per sliding-window group of a mixed model
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at admission
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str = ""  # emitted text (stop strings removed)
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    detokenizer: object = None
    stop_checker: object = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    draft: object = None  # spec.proposer.Draft for this step, or None
    # PFlash: prompt_token_ids are the kept tokens, rotated at their original positions (never prefix-cached)
    compression: PromptCompression | None = None
    # KVFlash (engine/kv_pool.py): whether its KV is pooled, and the resident part attention reads (None: all)
    kv_pool: bool = False
    kv_view: KVView | None = None

    @property
    def request_prompt_ids(self) -> list[int]:
        """The prompt as the request sent it (prompt_token_ids: what the KV cache holds)."""
        return self.compression.original_ids if self.compression is not None else self.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        """prompt + output, a new list (O(length)): per-step code reads token_slice / last_token."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] in O(end - start): at a 32K context, building token_ids takes ~0.3 ms
        of Python, as long as a small model's whole decode step."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
