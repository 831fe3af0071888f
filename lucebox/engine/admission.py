"""What a request must pass before any work: a prompt in a known form, inside the context window and the
vocabulary, and (KVFlash) inside the room its KV's home has -- the pool's host memory for a pooled
request, the device's KV for another."""
from __future__ import annotations

from dataclasses import replace

from ..errors import ContextLengthError, RequestError, UnsupportedError
from ..sampling import SamplingParams


def tokenize(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string, a list of ids, or a dict with either."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise RequestError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")


def check_prompt(ids: list[int], params: SamplingParams, max_model_len: int, vocab: int) -> None:
    """The prompt (and max_tokens) inside the context window, every id inside the vocabulary."""
    if not ids:
        raise RequestError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens; the context window (max_model_len) is {max_model_len}, "
            f"which leaves no room for output", len(ids), None, max_model_len)
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise ContextLengthError(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
            f"window (max_model_len {max_model_len}); lower max_tokens to at most "
            f"{max_model_len - len(ids)}", len(ids), params.max_tokens, max_model_len)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    params.verify_token_ids(vocab)


def pooled(engine, requested) -> bool:
    """Whether a request's target KV is pooled (KVFlash, lossy): its kv_pool field, else --kv-pool-target."""
    if requested is not None and not isinstance(requested, bool):
        raise RequestError(f"kv_pool must be true or false, got {requested!r}")
    if requested and engine.kv_pool is None:
        raise UnsupportedError("kv_pool (KVFlash) needs the engine started with --kv-pool-tokens N")
    return engine.args.kv_pool_target if requested is None else requested


def kv_room(engine, is_pooled: bool) -> int:
    """Tokens of context a request may reach: max_model_len, or with KVFlash what its KV's home holds."""
    if engine.kv_pool is None:
        return engine.max_model_len
    home = engine.kv_pool.host_capacity_tokens if is_pooled else engine.kv_capacity_tokens
    return min(engine.max_model_len, home)


def fit_kv_room(engine, prompt_len: int, params: SamplingParams, is_pooled: bool) -> SamplingParams:
    """A request inside its KV room (check_prompt did max_model_len); without max_tokens, its output stops
    where the room ends."""
    room = kv_room(engine, is_pooled)
    if room == engine.max_model_len:
        return params
    wanted = prompt_len + (params.max_tokens if params.max_tokens is not None else 0)
    if wanted > room or prompt_len >= room:
        where = ("the KV pool's host memory (--kv-pool-host-memory) holds" if is_pooled else
                 "the device holds, for a request without kv_pool (lossy),")
        raise ContextLengthError(f"the prompt ({prompt_len} tokens) plus max_tokens exceeds the {room} tokens of "
                                 f"KV {where}", prompt_len, params.max_tokens, room)
    return params if params.max_tokens is not None else replace(params, max_tokens=room - prompt_len)
