"""An API request's fields against the server's limits: SamplingParams built from them with n, the
stop list and logprobs bounded by the flags; max_tokens defaulted from the room left in the context
and the KV; and admission by tokens of work (`WorkLedger`), so that one huge request is refused
rather than filling the queue others then find full."""
from __future__ import annotations

from ..errors import LuceboxError
from ..sampling import SamplingParams
from .errors import APIError, context_error


def sampling_params(state, *, max_tokens, n=1, temperature=None, top_p=None, top_k=None, min_p=None,
                    presence_penalty=None, frequency_penalty=None, repetition_penalty=None, seed=None, stop=None,
                    stop_token_ids=None, ignore_eos=False, min_tokens=0, logit_bias=None, logprobs=None,
                    processors=(), skip_special=True, logprobs_param="top_logprobs") -> SamplingParams:
    """SamplingParams from API fields; unset ones are left to the model's generation_config.
    n, the stop list and logprobs are bounded by the server's flags."""
    check_n(state, n)
    cfg = state.config
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > cfg.max_stop_sequences:
        raise APIError(400, f"{len(stops)} stop sequences were given; this server takes at most "
                            f"{cfg.max_stop_sequences} (--max-stop-sequences)", param="stop")
    if isinstance(logprobs, int) and logprobs > cfg.max_top_logprobs:
        raise APIError(400, f"{logprobs_param}={logprobs} exceeds this server's limit of {cfg.max_top_logprobs} "
                            "(--max-top-logprobs)", param=logprobs_param)
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                 frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, seed=seed)
    kwargs = {k: v for k, v in given.items() if v is not None}
    if logit_bias:
        try:
            kwargs["logit_bias"] = {int(k): v for k, v in logit_bias.items()}
        except ValueError as e:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from e
    try:
        return SamplingParams(n=n, max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids,
                              ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs,
                              skip_special_tokens=skip_special, logits_processors=list(processors) or None, **kwargs)
    except LuceboxError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from e


def check_n(state, n) -> None:
    if isinstance(n, int) and n > state.config.max_n:
        raise APIError(400, f"n={n} exceeds this server's limit of {state.config.max_n} completions per request "
                            "(--max-n)", param="n")


class WorkLedger:
    """Admission by work: a request's tokens of work are n x (prompt + max_tokens), the KV its
    sequences can hold at once. One request may take at most --max-request-tokens (default: the KV
    cache's capacity, or with KVFlash a pooled context's), all admitted requests together
    --max-pending-tokens (default: 8 times that); so one client's huge request is refused (400) rather
    than filling the queue that others then find full (503).
    Used on the event loop only: no lock."""

    def __init__(self, config, kv_capacity_tokens: int):
        self.per_request = config.max_request_tokens or kv_capacity_tokens
        self.total = config.max_pending_tokens or 8 * self.per_request
        self.pending = 0  # tokens of work of the requests admitted and not yet finished

    def admit(self, n: int, prompt_tokens: int, max_tokens: int) -> int:
        work = n * (prompt_tokens + max_tokens)
        if work > self.per_request:
            raise APIError(400, f"this request asks for {work} tokens of work (n={n} x (prompt {prompt_tokens} + "
                                f"max_tokens {max_tokens})); this server takes at most {self.per_request} per request "
                                "(--max-request-tokens): lower n or max_tokens", param="n" if n > 1 else "max_tokens")
        if self.pending + work > self.total:
            raise APIError(503, f"the server is busy: {self.pending} tokens of work are pending and this request "
                                f"adds {work} (--max-pending-tokens {self.total}); retry later", code="overloaded")
        self.pending += work
        return work

    def release(self, work: int) -> None:
        self.pending -= work


def _param_of(message: str) -> str | None:
    # "sampling parameter top_p=... is invalid" -> top_p
    if message.startswith("sampling parameter "):
        return message[len("sampling parameter "):].split("=")[0].split("[")[0]
    return None


def max_tokens_for(state, prompt_len: int, requested: int | None, kv_pool: bool | None = None) -> int:
    """No max_tokens: --default-max-tokens, or up to the context window (never truncating the prompt) or,
    with KVFlash, up to what the request's KV may hold (the engine refuses a prompt past that, in its words)."""
    context = state.engine.max_model_len
    room = state.engine.kv_room(kv_pool) - prompt_len
    if requested is None:
        cap = state.config.default_max_tokens
        if prompt_len >= context:
            raise context_error(f"the prompt has {prompt_len} tokens; the model's maximum context length is "
                                f"{context} tokens", prompt_len, None, context)
        room = max(room, 1)
        return min(room, cap) if cap else room
    return requested
