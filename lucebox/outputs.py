"""What generation returns, in vLLM's shapes (RequestOutput.outputs[i].text / token_ids / ...)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict] | None = None  # per generated token: {token_id: Logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request counters; the speculative ones stay zero when speculation is off."""
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    prompt_tokens_kept: int | None = None  # PFlash: prompt tokens the target prefilled (None: all, exact)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens committed per verify step (accepted drafts + the bonus token)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 1.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # why the request failed after it was accepted (PFlash scoring: a LuceboxError); its outputs then end
    # with finish_reason "error", and AsyncEngine's stream raises it
    error: Exception | None = None
