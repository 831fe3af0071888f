"""POST /v1/chat/completions."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import RequestError
from ..text.chat_template import check_request_template
from .errors import APIError
from .generate import (
    KEEPALIVE,
    ChatJob,
    ChoiceUpdate,
    Usage,
    build_processors,
    drain,
    generate,
    prepare_chat,
    request_id,
    skip_special_tokens,
    token_text,
)
from .protocol import ChatCompletionRequest
from .request_limits import max_tokens_for, sampling_params
from .sse import SSE_HEADERS, openai_error_event, sse
from .tools import ToolSpec, assistant_tool_call, call_id, check_tools


def text_of(content, param: str) -> str:
    """OpenAI message content: a string or parts; text parts are joined, other kinds are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(part.get("refusal") or "")
        else:
            raise APIError(400, f"{param}[{j}]: content parts of type {kind!r} are not supported by this model "
                                "(text only)", param=f"{param}[{j}].type")
    return "\n".join(texts)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        role = "system" if m.role == "developer" else "tool" if m.role == "function" else m.role
        msg = {"role": role, "content": text_of(m.content, param)}
        if role == "system" and out and out[-1]["role"] == "system" and len(out) == 1:
            out[-1]["content"] += "\n\n" + msg["content"]  # templates take one leading system message
            continue
        if role == "assistant":
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                calls = []
                for j, c in enumerate(m.tool_calls):
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise APIError(400, f"messages[{i}].tool_calls[{j}] needs function.name",
                                       param=f"messages[{i}].tool_calls[{j}]")
                    calls.append(assistant_tool_call(fn["name"], fn.get("arguments"), c.get("id")))
                msg["tool_calls"] = calls
        if role == "tool":
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


def chat_job(req: ChatCompletionRequest) -> ChatJob:
    tools = check_tools([ToolSpec(t.function.name, t.function.description, t.function.parameters
                                  or {"type": "object", "properties": {}}) for t in req.tools or []], "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must be auto, none, required or "
                                '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        choice = name
    if choice not in ("auto", "none", "required") and choice not in {t.name for t in tools}:
        raise APIError(400, f"tool_choice names the tool {choice!r}, which is not in tools "
                            f"({', '.join(t.name for t in tools) or 'none declared'})", param="tool_choice")
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool in tools", param="tool_choice")
    kwargs = {}
    if req.reasoning_effort is not None:
        kwargs["enable_thinking"] = req.reasoning_effort != "none"
    kwargs.update(req.chat_template_kwargs or {})
    return ChatJob(chat_messages(req), tools, choice, req.parallel_tool_calls, req.response_format, kwargs)


async def chat_completions(state, request: Request, req: ChatCompletionRequest):
    job = chat_job(req)
    try:  # a template's text in the request is code from the network: off unless the server allows it
        check_request_template(job.template_kwargs, state.tokenizer.chat_templates,
                               state.config.allow_request_chat_template)
    except RequestError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from e
    prepared = await prepare_chat(state, job)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    processors = await build_processors(state, prepared, req.n)
    processors += state.extra_processors("chat", req.model_dump())
    params = sampling_params(
        state, max_tokens=max_tokens_for(state, len(prepared.prompt_ids), req.max_completion_tokens or req.max_tokens,
                                         req.kv_pool),
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logit_bias=req.logit_bias,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None, processors=processors,
        skip_special=skip_special_tokens(state))
    rid = request_id("chatcmpl-")
    model = state.model_name(req.model)
    created = int(time.time())
    agen = generate(state, prepared, params, rid, prefill_keep_ratio=req.prefill_keep_ratio,
                    kv_pool=req.kv_pool)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first = await first_item(agen)  # errors before the first byte still get a proper status code
        return StreamingResponse(_stream(state, agen, first, rid, model, created, req.n, include_usage, req.logprobs),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    choices = {i: _Choice() for i in range(req.n)}
    usage = await drain(agen, request, lambda u: choices[u.index].add(state, u))
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [c.message(state, i, req.logprobs) for i, c in choices.items()],
            "usage": usage.openai(sum(c.reasoning_tokens for c in choices.values()))}
    return JSONResponse(body)


async def first_item(agen):
    """The first item, so that a bad request fails with its status before the stream's headers go out."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await agen.aclose()
        raise


class _Choice:
    def __init__(self):
        self.content, self.reasoning, self.calls = "", "", []
        self.logprobs: list = []
        self.finish_reason = None
        self.reasoning_tokens = 0

    def add(self, state, u: ChoiceUpdate) -> None:
        for e in u.events:
            if e.kind == "content":
                self.content += e.text
            elif e.kind == "reasoning":
                self.reasoning += e.text
            elif e.kind == "tool_start":
                self.calls.append({"id": call_id(), "type": "function", "function": {"name": e.name, "arguments": ""}})
            elif e.kind == "tool_args":
                self.calls[e.call]["function"]["arguments"] += e.text
        self.logprobs += u.logprobs or []
        if u.finish_reason:
            self.finish_reason = finish_reason(u.finish_reason, bool(self.calls))

    def message(self, state, index: int, want_logprobs: bool) -> dict:
        msg = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return {"index": index, "message": msg, "finish_reason": self.finish_reason,
                "logprobs": logprobs_block(state, self.logprobs) if want_logprobs else None}


def finish_reason(reason: str, has_calls: bool) -> str:
    if reason == "stop" and has_calls:
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


def logprobs_block(state, entries) -> dict:
    def item(tid, lp):
        text = token_text(state, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [dict(item(tid, lp), top_logprobs=[item(t, l) for t, l in tops]) for tid, lp, tops in entries]}


async def _stream(state, agen, first, rid, model, created, n, include_usage, want_logprobs):
    def chunk(choices, usage=None):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    ids: dict[tuple[int, int], str] = {}
    has_calls: set[int] = set()
    try:
        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        item = first
        while item is not None:
            if item is KEEPALIVE:
                yield ": keep-alive\n\n"
            elif isinstance(item, Usage):
                if include_usage:
                    yield chunk([], item.openai())
            else:
                for delta in _deltas(item, ids, has_calls):
                    yield chunk([{"index": item.index, "delta": delta, "logprobs": None, "finish_reason": None}])
                if want_logprobs and item.logprobs:
                    yield chunk([{"index": item.index, "delta": {}, "finish_reason": None,
                                  "logprobs": logprobs_block(state, item.logprobs)}])
                if item.finish_reason:
                    yield chunk([{"index": item.index, "delta": {}, "logprobs": None,
                                  "finish_reason": finish_reason(item.finish_reason, item.index in has_calls)}])
            item = await agen.__anext__()
    except StopAsyncIteration:
        pass
    except APIError as e:  # after the headers: the error travels as an event
        yield openai_error_event(e)
        return
    finally:
        await agen.aclose()
    yield "data: [DONE]\n\n"


def _deltas(u: ChoiceUpdate, ids, has_calls):
    """OpenAI streaming rules: a tool call's first delta has index, id, type and name; argument
    fragments follow with the index only."""
    for e in u.events:
        if e.kind == "content":
            yield {"content": e.text}
        elif e.kind == "reasoning":
            yield {"reasoning_content": e.text}
        elif e.kind == "tool_start":
            has_calls.add(u.index)
            ids[(u.index, e.call)] = cid = call_id()
            yield {"tool_calls": [{"index": e.call, "id": cid, "type": "function",
                                   "function": {"name": e.name, "arguments": ""}}]}
        elif e.kind == "tool_args" and e.text:
            yield {"tool_calls": [{"index": e.call, "function": {"arguments": e.text}}]}
