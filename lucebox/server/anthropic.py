"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages, as Claude Code uses it)."""
from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .errors import APIError
from .generate import (
    KEEPALIVE,
    ChatJob,
    Usage,
    build_processors,
    drain,
    generate,
    prepare_chat,
    request_id,
    skip_special_tokens,
)
from .openai_chat import first_item
from .protocol import CountTokensRequest, MessagesRequest
from .request_limits import sampling_params
from .sse import SSE_HEADERS, anthropic_error_event, sse
from .tools import ToolSpec, assistant_tool_call, call_id, check_tools, parse_arguments

# Claude Code's first system line carries a per-request nonce; left in, every prefix-cache lookup
# would miss from about token 40 on.
_BILLING = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.MULTILINE)


def _blocks_text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of content blocks", param=param)
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"{param}[{j}]: expected a text block, got {kind!r}", param=f"{param}[{j}]")
        parts.append(b["text"])
    return "\n".join(parts)


def system_prompt(system) -> str | None:
    if system is None:
        return None
    text = _BILLING.sub("", _blocks_text(system, "system")).strip()
    return text or None


def anthropic_messages(req) -> list[dict]:
    out: list[dict] = []
    system = system_prompt(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        if m.role == "system":  # a system turn mid-conversation (generate.render_chat merges it if need be)
            text = _BILLING.sub("", _blocks_text(m.content, param)).strip()
            if text:
                out.append({"role": "system", "content": text})
            continue
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, reasoning = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type")
            where = f"{param}[{j}]"
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise APIError(400, f"{where}.text must be a string", param=where)
                texts.append(b["text"])
            elif kind == "tool_result" and m.role == "user":
                if texts:  # keep the order: text written before a tool result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                content = b.get("content")
                result = "" if content is None else _tool_result_text(content, where + ".content")
                if b.get("is_error"):
                    result = "Error: " + result
                out.append({"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id")})
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise APIError(400, f"{where}.name must be a string", param=where)
                calls.append(assistant_tool_call(b["name"], b.get("input") or {}, b.get("id")))
            elif kind == "thinking" and m.role == "assistant":
                reasoning.append(b.get("thinking") or "")
            elif kind == "redacted_thinking":
                continue
            elif kind in ("image", "document"):
                raise APIError(400, f"{where}: {kind} blocks are not supported by this model (text only)", param=where)
            else:
                raise APIError(400, f"{where}: unexpected block type {kind!r} in a {m.role} message", param=where)
        if texts or calls or (not out or out[-1]["role"] != "tool"):
            msg = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            out.append(msg)
    return out


def _tool_result_text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "text":
                parts.append(b.get("text") or "")
            else:
                raise APIError(400, f"{param}[{j}]: only text is supported inside tool_result", param=param)
        return "\n".join(parts)
    raise APIError(400, f"{param} must be a string or text blocks", param=param)


def messages_job(req) -> ChatJob:
    tools = check_tools([ToolSpec(t.name, t.description, t.input_schema or {"type": "object", "properties": {}})
                         for t in req.tools or []], "tools")
    choice, parallel = ("auto" if tools else "none"), True
    tc = getattr(req, "tool_choice", None)
    if tc is not None:
        kind = tc.get("type")
        parallel = not tc.get("disable_parallel_tool_use", False)
        if kind == "auto":
            choice = "auto"
        elif kind == "any":
            choice = "required"
        elif kind == "none":
            choice = "none"
        elif kind == "tool":
            choice = tc.get("name")
            if choice not in {t.name for t in tools}:
                raise APIError(400, f"tool_choice names the tool {choice!r}, which is not in tools", param="tool_choice")
        else:
            raise APIError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'any' needs at least one tool", param="tool_choice")
    kwargs = {}
    if req.thinking and isinstance(req.thinking, dict) and req.thinking.get("type") in ("enabled", "disabled"):
        kwargs["enable_thinking"] = req.thinking["type"] == "enabled"
    return ChatJob(anthropic_messages(req), tools, choice, parallel, None, kwargs)


async def count_tokens(state, req: CountTokensRequest):
    prepared = await prepare_chat(state, messages_job(req))
    return JSONResponse({"input_tokens": len(prepared.prompt_ids)})


async def messages(state, request: Request, req: MessagesRequest):
    if req.max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    job = messages_job(req)
    prepared = await prepare_chat(state, job)
    processors = await build_processors(state, prepared, 1)
    processors += state.extra_processors("messages", req.model_dump())
    params = sampling_params(state, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                             top_k=req.top_k, stop=req.stop_sequences, processors=processors,
                             skip_special=skip_special_tokens(state))
    rid = request_id("msg_")
    agen = generate(state, prepared, params, rid, prefill_keep_ratio=req.prefill_keep_ratio,
                    kv_pool=req.kv_pool)
    if req.stream:
        # before this request fills the cache
        cached = state.engine.cached_prefix_tokens(prepared.prompt_ids, req.prefill_keep_ratio)
        first = await first_item(agen)
        return StreamingResponse(_stream(agen, first, rid, req.model, len(prepared.prompt_ids), cached),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    blocks: list[dict] = []
    final = {}

    def add(u):
        for e in u.events:
            if e.kind in ("content", "reasoning"):
                kind, key = ("text", "text") if e.kind == "content" else ("thinking", "thinking")
                if not blocks or blocks[-1]["type"] != kind:
                    blocks.append({"type": kind, key: ""} | ({"signature": ""} if kind == "thinking" else {}))
                blocks[-1][key] += e.text
            elif e.kind == "tool_start":
                blocks.append({"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "_args": ""})
            elif e.kind == "tool_args":
                blocks[-1]["_args"] += e.text
        if u.finish_reason:
            final["reason"], final["stop"] = u.finish_reason, u.stop_reason

    usage = await drain(agen, request, add)
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = parse_arguments(b.pop("_args"))
    reason, seq = stop_reason(final.get("reason"), final.get("stop"), any(b["type"] == "tool_use" for b in blocks))
    return JSONResponse({"id": rid, "type": "message", "role": "assistant", "model": req.model, "content": blocks,
                         "stop_reason": reason, "stop_sequence": seq, "usage": _usage(usage)})


def stop_reason(reason, stop, has_calls) -> tuple[str, str | None]:
    if reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(u: Usage) -> dict:
    # Anthropic counts cache reads apart from input_tokens: their sum is the prompt.
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


async def _stream(agen, first, rid, model, prompt_len, cached):
    # message_start goes out before prefill (pings keep the stream alive through a long one), so its
    # cache split is the prefix cache's at admission; message_delta repeats it, so clients that add
    # or overwrite the two usages agree.
    split = _usage(Usage(prompt_len, 0, cached))

    def ev(kind, **data):
        return sse({"type": kind, **data}, event=kind)

    index, open_kind = -1, None
    has_calls, final = False, {}
    try:
        yield ev("message_start", message={
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": split})
        yield ev("ping")
        item = first
        while item is not None:
            if item is KEEPALIVE:
                yield ev("ping")
            elif isinstance(item, Usage):
                if open_kind is not None:
                    yield ev("content_block_stop", index=index)
                reason, seq = stop_reason(final.get("reason"), final.get("stop"), has_calls)
                yield ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                         usage=split | {"output_tokens": item.completion_tokens})
                yield ev("message_stop")
            else:
                for e in item.events:
                    if e.kind in ("content", "reasoning"):
                        kind = "text" if e.kind == "content" else "thinking"
                        if open_kind != kind:
                            if open_kind is not None:
                                yield ev("content_block_stop", index=index)
                            index, open_kind = index + 1, kind
                            block = {"type": "text", "text": ""} if kind == "text" else \
                                {"type": "thinking", "thinking": "", "signature": ""}
                            yield ev("content_block_start", index=index, content_block=block)
                        delta = {"type": "text_delta", "text": e.text} if kind == "text" else \
                            {"type": "thinking_delta", "thinking": e.text}
                        yield ev("content_block_delta", index=index, delta=delta)
                    elif e.kind == "tool_start":
                        if open_kind is not None:
                            yield ev("content_block_stop", index=index)
                        index, open_kind, has_calls = index + 1, "tool_use", True
                        yield ev("content_block_start", index=index, content_block={
                            "type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": {}})
                    elif e.kind == "tool_args" and e.text:
                        yield ev("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": e.text})
                    elif e.kind == "tool_end" and open_kind == "tool_use":
                        yield ev("content_block_stop", index=index)
                        open_kind = None
                if item.finish_reason:
                    final["reason"], final["stop"] = item.finish_reason, item.stop_reason
            item = await agen.__anext__()
    except StopAsyncIteration:
        pass
    except APIError as e:
        yield anthropic_error_event(e)
    finally:
        await agen.aclose()
