"""POST /v1/completions: legacy text completions (echo, logprobs), no chat template, no parsing."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .errors import APIError
from .generate import KEEPALIVE, Prepared, Usage, drain, generate, off_loop, request_id, token_text
from .openai_chat import first_item
from .protocol import CompletionRequest
from .request_limits import max_tokens_for, sampling_params
from .sse import SSE_HEADERS, openai_error_event, sse


def _prompt(state, req: CompletionRequest) -> tuple[str, list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return p, state.tokenizer.encode(p)
    if p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return state.tokenizer.decode(p, skip_special_tokens=False), list(p)
    if len(p) == 1 and isinstance(p[0], str):
        return p[0], state.tokenizer.encode(p[0])
    raise APIError(400, "prompt must be a string, a list of token ids, or a list holding one string "
                        "(batched prompts: send one request each)", param="prompt")


async def completions(state, request: Request, req: CompletionRequest):
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    text, ids = await off_loop(_prompt, state, req)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    params = sampling_params(
        state, max_tokens=max_tokens_for(state, len(ids), req.max_tokens, req.kv_pool), n=req.n,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logit_bias=req.logit_bias, logprobs=req.logprobs,
        logprobs_param="logprobs", processors=state.extra_processors("completions", req.model_dump()))
    rid, model, created = request_id("cmpl-"), state.model_name(req.model), int(time.time())
    agen = generate(state, Prepared(text, ids, None), params, rid, prefill_keep_ratio=req.prefill_keep_ratio,
                    kv_pool=req.kv_pool)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first = await first_item(agen)
        return StreamingResponse(_stream(state, agen, first, rid, model, created, req, text, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    texts = {i: text if req.echo else "" for i in range(req.n)}
    lps = {i: [] for i in range(req.n)}
    reasons = {}

    def add(u):
        texts[u.index] += "".join(e.text for e in u.events)
        lps[u.index] += u.logprobs or []
        if u.finish_reason:
            reasons[u.index] = "length" if u.finish_reason == "length" else "stop"

    usage = await drain(agen, request, add)
    choices = [{"index": i, "text": texts[i], "finish_reason": reasons.get(i),
                "logprobs": _legacy_logprobs(state, lps[i], len(text) if req.echo else 0)
                if req.logprobs is not None else None} for i in range(req.n)]
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage.openai()})


def _legacy_logprobs(state, entries, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp, top in entries:
        t = token_text(state, tid)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        token_lps.append(lp)
        tops.append({token_text(state, i): v for i, v in top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _stream(state, agen, first, rid, model, created, req, prompt_text, include_usage):
    def chunk(choices, usage=None):
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    offsets = {i: len(prompt_text) if req.echo else 0 for i in range(req.n)}
    try:
        if req.echo:
            for i in range(req.n):
                yield chunk([{"index": i, "text": prompt_text, "logprobs": None, "finish_reason": None}])
        item = first
        while item is not None:
            if item is KEEPALIVE:
                yield ": keep-alive\n\n"
            elif isinstance(item, Usage):
                if include_usage:
                    yield chunk([], item.openai())
            else:
                text = "".join(e.text for e in item.events)
                lp = None
                if req.logprobs is not None and item.logprobs:
                    lp = _legacy_logprobs(state, item.logprobs, offsets[item.index])
                    offsets[item.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                reason = None
                if item.finish_reason:
                    reason = "length" if item.finish_reason == "length" else "stop"
                yield chunk([{"index": item.index, "text": text, "logprobs": lp, "finish_reason": reason}])
            item = await agen.__anext__()
    except StopAsyncIteration:
        pass
    except APIError as e:
        yield openai_error_event(e)
        return
    finally:
        await agen.aclose()
    yield "data: [DONE]\n\n"
