"""POST /v1/responses: the Responses API as Codex uses it (stateless: the full input every time).

Custom (freeform) tools are offered to the model as functions of one string `input` and answered
with custom_tool_call items carrying that raw string, never as function_call items.
"""
from __future__ import annotations

import json
import time

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
from .protocol import ResponsesRequest
from .request_limits import max_tokens_for, sampling_params
from .sse import SSE_HEADERS, sse
from .tools import CUSTOM_SCHEMA, ToolSpec, assistant_tool_call, call_id, check_tools


def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of content parts", param=param)
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(p.get("text") or "")
        elif kind == "refusal":
            parts.append(p.get("refusal") or "")
        else:
            raise APIError(400, f"{param}[{j}]: content of type {kind!r} is not supported by this model (text only)",
                           param=f"{param}[{j}]")
    return "\n".join(parts)


def _output_text(output) -> str:
    return output if isinstance(output, str) else _text(output, "output")


def responses_messages(req: ResponsesRequest) -> list[dict]:
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    reasoning = None

    def assistant() -> dict:
        nonlocal reasoning
        if out and out[-1]["role"] == "assistant" and "_open" in out[-1]:
            return out[-1]
        msg = {"role": "assistant", "content": "", "_open": True}
        if reasoning:
            msg["reasoning_content"], reasoning = reasoning, None
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type") or ("message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
            text = _text(item.get("content"), where + ".content")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
                continue
            role = "system" if role == "developer" else role
            if role == "system" and len(out) == 1 and out[0]["role"] == "system":
                out[0]["content"] += "\n\n" + text  # instructions first, then the leading system/developer text
                continue
            out.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if not isinstance(name, str):
                raise APIError(400, f"{where}.name must be a string", param=where)
            args = item.get("arguments") if kind == "function_call" else {"input": item.get("input") or ""}
            assistant().setdefault("tool_calls", []).append(assistant_tool_call(name, args, item.get("call_id")))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "content": _output_text(item.get("output")),
                        "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            text = _text(item.get("content"), where + ".content") or _text(item.get("summary"), where + ".summary")
            reasoning = (reasoning + "\n" if reasoning else "") + text if text else reasoning
        # Other item kinds (web_search_call, local_shell_call, item_reference...) carry nothing to render.
    for m in out:
        m.pop("_open", None)
    return out


def responses_job(req: ResponsesRequest) -> tuple[ChatJob, set[str]]:
    specs, custom = [], set()
    for i, t in enumerate(req.tools or []):
        kind = t.get("type")
        if kind == "function":
            specs.append(ToolSpec(t.get("name"), t.get("description"), t.get("parameters") or
                                  {"type": "object", "properties": {}}))
        elif kind == "custom":
            specs.append(ToolSpec(t.get("name"), t.get("description"), CUSTOM_SCHEMA, custom=True))
            custom.add(t.get("name"))
        # Hosted tools (web_search, local_shell, namespace...) are the client's business: not offered.
    tools = check_tools(specs, "tools")
    tc = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(tc, dict):
        tc = tc.get("name")
    if not tools:
        tc = "none" if tc in ("auto", "none") else tc
    if tc not in ("auto", "none", "required") and tc not in {t.name for t in tools}:
        raise APIError(400, f"tool_choice names the tool {tc!r}, which is not in tools", param="tool_choice")
    if tc == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    kwargs = {}
    if req.reasoning is not None:
        kwargs["enable_thinking"] = req.reasoning.get("effort") != "none"
    fmt = (req.text or {}).get("format")
    return ChatJob(responses_messages(req), tools, tc, req.parallel_tool_calls, fmt, kwargs), custom


async def responses(state, request: Request, req: ResponsesRequest):
    if req.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation in input (store: false)", param="previous_response_id")
    job, custom = responses_job(req)
    prepared = await prepare_chat(state, job)
    processors = await build_processors(state, prepared, 1)
    processors += state.extra_processors("responses", req.model_dump())
    max_tokens = max_tokens_for(state, len(prepared.prompt_ids), req.max_output_tokens, req.kv_pool)
    params = sampling_params(state, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                             processors=processors,
                             skip_special=skip_special_tokens(state))
    rid = request_id("resp_")
    builder = _Builder(rid, state.model_name(req.model), req, custom)
    agen = generate(state, prepared, params, rid, prefill_keep_ratio=req.prefill_keep_ratio,
                    kv_pool=req.kv_pool)
    if req.stream:
        first = await first_item(agen)
        return StreamingResponse(builder.stream(agen, first), media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await drain(agen, request, lambda u: list(builder.update(u)))
    list(builder._close())
    return JSONResponse(builder.response("completed", usage))


class _Builder:
    """Builds output items from parser events; `update` yields the SSE events they imply."""

    def __init__(self, rid, model, req: ResponsesRequest, custom: set[str]):
        self.rid, self.model, self.req, self.custom = rid, model, req, custom
        self.created = int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}
        self.reason = None
        self.seq = 0

    def event(self, kind: str, **data) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **data}, event=kind)

    def response(self, status: str, usage: Usage | None = None) -> dict:
        if status == "completed" and self.reason == "length":
            status = "incomplete"
        req = self.req
        body = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
                "reasoning": req.reasoning, "store": False, "temperature": req.temperature, "top_p": req.top_p,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "metadata": {}, "usage": None}
        if usage is not None:
            body["usage"] = {"input_tokens": usage.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                             "output_tokens": usage.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return body

    def _close(self):
        item, self.open = self.open, None
        if item is None:
            return
        idx = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                             text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                             part=part)
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                             text=text)
        elif item["type"] == "function_call":
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             arguments=item["arguments"], name=item["name"])
        elif item["type"] == "custom_tool_call":
            raw = item.pop("_args")
            try:
                value = json.loads(raw)
                value = value.get("input", "") if isinstance(value, dict) else value
            except json.JSONDecodeError:
                value = raw
            item["input"] = value if isinstance(value, str) else json.dumps(value)
            if item["input"]:
                yield self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                 delta=item["input"])
            yield self.event("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                             input=item["input"])
        yield self.event("response.output_item.done", output_index=idx, item=item)

    def _add(self, item: dict):
        self.output.append(item)
        self.open = item
        idx = len(self.output) - 1
        shown = {k: v for k, v in item.items() if not k.startswith("_")}
        yield self.event("response.output_item.added", output_index=idx, item=dict(shown, status="in_progress"))
        if item["type"] == "message":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})

    def update(self, u):
        for e in u.events:
            kind = {"content": "message", "reasoning": "reasoning"}.get(e.kind)
            if kind:
                if self.open is None or self.open["type"] != kind:
                    yield from self._close()
                    if kind == "message":
                        item = {"type": "message", "id": request_id("msg_"), "status": "in_progress",
                                "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                  "annotations": []}]}
                    else:
                        item = {"type": "reasoning", "id": request_id("rs_"), "summary": [],
                                "content": [{"type": "reasoning_text", "text": ""}]}
                    yield from self._add(item)
                idx = len(self.output) - 1
                self.open["content"][0]["text"] += e.text
                name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
                extra = {"logprobs": []} if kind == "message" else {}
                yield self.event(name, item_id=self.open["id"], output_index=idx, content_index=0, delta=e.text,
                                 **extra)
            elif e.kind == "tool_start":
                yield from self._close()
                if e.name in self.custom:
                    item = {"type": "custom_tool_call", "id": request_id("ctc_"), "call_id": call_id(),
                            "name": e.name, "input": "", "_args": ""}
                else:
                    item = {"type": "function_call", "id": request_id("fc_"), "call_id": call_id(),
                            "name": e.name, "arguments": ""}
                self.calls[e.call] = item
                yield from self._add(item)
            elif e.kind == "tool_args":
                item = self.calls[e.call]
                if item["type"] == "custom_tool_call":
                    item["_args"] += e.text  # the raw input is known once the call's JSON is complete
                else:
                    item["arguments"] += e.text
                    yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=e.text)
            elif e.kind == "tool_end" and self.open is self.calls.get(e.call):
                yield from self._close()
        if u.finish_reason:
            self.reason = u.finish_reason

    async def stream(self, agen, first):
        try:
            yield self.event("response.created", response=self.response("in_progress"))
            yield self.event("response.in_progress", response=self.response("in_progress"))
            item = first
            while item is not None:
                if item is KEEPALIVE:
                    yield ": keep-alive\n\n"
                elif isinstance(item, Usage):
                    for chunk in self._close():
                        yield chunk
                    body = self.response("completed", item)
                    # Always response.completed (status inside says "incomplete" at the token cap): clients,
                    # the openai SDK's stream helper included, wait for that event to finish a turn.
                    yield self.event("response.completed", response=body)
                else:
                    for chunk in self.update(item):
                        yield chunk
                item = await agen.__anext__()
        except StopAsyncIteration:
            pass
        except APIError as e:
            body = self.response("failed")
            body["error"] = {"code": e.code or "server_error", "message": e.message}
            yield self.event("response.failed", response=body)
        finally:
            await agen.aclose()
