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
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
