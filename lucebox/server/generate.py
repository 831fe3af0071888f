"""The API-independent core: render a chat into a prompt, submit it, and turn the engine's
cumulative outputs into per-choice events (parsed reasoning / content / tool calls, logprobs,
finish), with keep-alive ticks while nothing arrives, a request deadline, and an abort whenever
the consumer goes away (client disconnect) so the request's KV is freed at once.

The event loop serves every client: a request's CPU work (template rendering, tokenising) runs in
a small worker pool (`off_loop`), and its size (n, stop list, top logprobs, total tokens of work)
is checked against the server's limits before it reaches the engine (request_limits.py)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..errors import LuceboxError
from ..sampling import SamplingParams
from .constrain import BanTokens
from .errors import APIError, from_lucebox
from .parsing import (
    CALL_OPENS,
    PARSED_TAGS,
    REASONING_CLOSES,
    Event,
    OutputParser,
    closes_reasoning,
    opens_reasoning,
)
from .request_limits import check_n
from .tools import ToolSpec, param_schemas, template_tools, tool_format

log = logging.getLogger("lucebox.server")
KEEPALIVE = object()  # yielded when nothing arrived for config.keepalive seconds
_ids = itertools.count()
# Few threads: rendering and tokenising are CPU work; more threads than cores only share them out thinner.
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lucebox-prep")


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread: the event loop keeps serving every other request
    (and /health) while one request's template renders or its 10 MB prompt is tokenised."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args, **kwargs))


@dataclass
class ChatJob:
    """A chat request in API-neutral form."""
    messages: list[dict]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | <tool name>
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class Prepared:
    prompt_text: str
    prompt_ids: list[int]
    parser: Callable[[], OutputParser] | None  # None: raw text (legacy completions)
    processors: list = field(default_factory=list)


@dataclass
class ChoiceUpdate:
    index: int
    events: list[Event]
    logprobs: list | None = None  # per new token: (token_id, logprob, [(top_id, top_logprob)...])
    finish_reason: str | None = None
    stop_reason: Any = None
    num_tokens: int = 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kept_tokens: int | None = None  # PFlash: prompt tokens prefilled (None: exact prefill)

    def openai(self, reasoning_tokens: int | None = None) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.kept_tokens is not None:
            out["prompt_tokens_details"]["kept_tokens"] = self.kept_tokens
        if reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return out


def request_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def merge_late_system(messages: list[dict]) -> list[dict]:
    """Messages with each system message after the first position merged into the user turn that
    follows it (or the one before, at the end): for chat templates that reject system turns
    mid-conversation. The conversation's prefix stays as it was, so prefix caching still serves it."""
    out: list[dict] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m.get("role") == "system" and i > 0:
            pending.append(m.get("content") or "")
            continue
        if pending and m.get("role") == "user":
            m = {**m, "content": "\n\n".join(pending + [m.get("content") or ""])}
            pending = []
        out.append(m)
    if pending:
        last = next((j for j in range(len(out) - 1, -1, -1) if out[j].get("role") == "user"), None)
        if last is None:
            out.append({"role": "user", "content": "\n\n".join(pending)})
        else:
            out[last] = {**out[last], "content": "\n\n".join([out[last].get("content") or ""] + pending)}
    return out


async def prepare_chat(state, job: ChatJob) -> Prepared:
    """render_chat off the event loop."""
    return await off_loop(render_chat, state, job)


def render_chat(state, job: ChatJob) -> Prepared:
    tok = state.tokenizer
    tools_on = bool(job.tools) and job.tool_choice != "none"
    try:
        text = tok.apply_chat_template(job.messages, tools=template_tools(job.tools), add_generation_prompt=True,
                                       **job.template_kwargs)
    except LuceboxError as e:
        merged = merge_late_system(job.messages)
        if merged == job.messages:
            raise APIError(400, str(e), param="messages") from e
        try:  # templates that take a system message only first: late ones join the next user turn
            text = tok.apply_chat_template(merged, tools=template_tools(job.tools), add_generation_prompt=True,
                                           **job.template_kwargs)
        except LuceboxError as again:
            raise APIError(400, str(again), param="messages") from again
    ids = tok.encode_prompt(text)
    # A template that opens <think> itself (thinking models) starts the output inside reasoning.
    in_reasoning, after_reasoning = opens_reasoning(text), closes_reasoning(text)
    schemas = param_schemas(job.tools)
    call_format = getattr(state, "tool_format", None) or tool_format(tok.chat_templates)

    def parser() -> OutputParser:
        return OutputParser(tools=tools_on, in_reasoning=in_reasoning, param_schemas=schemas,
                            call_format=call_format, after_reasoning=after_reasoning)
    choice = _ToolChoice(job, in_reasoning, text.endswith(REASONING_CLOSES))
    return Prepared(text, ids, parser, [choice] if job.tools or job.response_format else [])


@dataclass
class _ToolChoice:
    """Placeholder resolved by `build_processors` (needs n and, maybe, a thread for compiling)."""
    job: ChatJob
    in_reasoning: bool
    reasoning_closed: bool  # the prompt ends in the reasoning end tag itself


async def build_processors(state, prepared: Prepared, n: int) -> list:
    check_n(state, n)  # before a grammar processor sized for n is made
    procs = []
    for p in prepared.processors:
        if not isinstance(p, _ToolChoice):
            procs.append(p)
            continue
        job = p.job
        compiled = None
        if job.tools and job.tool_choice == "none":
            banned = [i for t in CALL_OPENS if (i := state.tokenizer.token_to_id(t)) is not None]
            if banned:
                procs.append(BanTokens(banned))
        elif job.tools and (job.tool_choice != "auto" or state.config.constrain_auto_tools):
            compiled = await asyncio.to_thread(state.grammars.tool_calls, job.tools, job.tool_choice,
                                               state.tool_format, job.parallel_tool_calls, p.in_reasoning,
                                               p.reasoning_closed)
        if compiled is None and job.response_format and job.tool_choice in ("auto", "none"):
            compiled = await asyncio.to_thread(state.grammars.response_format, job.response_format)
        if compiled is not None:
            procs.append(state.grammars.processor(compiled, n))
    return procs


def skip_special_tokens(state) -> bool:
    """Keep special tokens in the text when the tags the parser needs are special tokens."""
    special = set(state.tokenizer.all_special_ids)
    for tag in PARSED_TAGS:
        if state.tokenizer.token_to_id(tag) in special:
            return False
    return True


async def generate(state, prepared: Prepared, params: SamplingParams, rid: str,
                   prefill_keep_ratio: float | None = None, kv_pool: bool | None = None) -> AsyncIterator:
    """Yields ChoiceUpdate, KEEPALIVE, and finally the Usage. Raises APIError. prefill_keep_ratio (PFlash)
    and kv_pool (KVFlash), both lossy: the request's own setting, None for the server's default."""
    cfg = state.config
    prompt = {"prompt": prepared.prompt_text, "prompt_token_ids": prepared.prompt_ids}
    if prefill_keep_ratio is not None:
        prompt["prefill_keep_ratio"] = prefill_keep_ratio
    if kv_pool is not None:
        prompt["kv_pool"] = kv_pool
    prompt_len = len(prepared.prompt_ids)
    max_tokens = params.max_tokens if params.max_tokens is not None else state.engine.max_model_len - prompt_len
    # A request that cannot fit the context is the engine's to refuse, in the context error's wording.
    fits = prompt_len + max_tokens <= state.engine.max_model_len
    work = state.work.admit(params.n, prompt_len, max_tokens) if fits else 0
    # A chat ends at the template's turn end (Laguna's </assistant>), reported as the model's own end.
    ours = state.turn_end.add_to(params) if state.turn_end and prepared.parser is not None else set()
    try:
        stream = await state.engine.add_request(rid, prompt, params)
    except BaseException as e:
        state.work.release(work)
        if isinstance(e, LuceboxError):
            raise from_lucebox(e) from e
        raise
    state.dashboard.arrived(rid, len(prepared.prompt_ids))
    parsers = {}
    seen_text, seen_lp, done = {}, {}, set()
    last = None
    deadline = time.monotonic() + cfg.request_timeout if cfg.request_timeout else None
    agen = stream.__aiter__()
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(agen.__anext__())
            wait = cfg.keepalive if deadline is None else max(0.0, min(cfg.keepalive, deadline - time.monotonic()))
            finished, _ = await asyncio.wait({pending}, timeout=wait)
            if not finished:
                if deadline is not None and time.monotonic() >= deadline:
                    raise APIError(504, f"the request took longer than --request-timeout {cfg.request_timeout:g} s",
                                   code="timeout")
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                break
            except LuceboxError as e:
                raise from_lucebox(e) from e
            last = out
            state.dashboard.progress(out)
            for o in out.outputs:
                i = o.index
                if i in done:
                    continue
                piece = o.text[seen_text.get(i, 0):]
                seen_text[i] = len(o.text)
                if prepared.parser is None:
                    events = [Event("content", piece)] if piece else []
                else:
                    parser = parsers.get(i) or parsers.setdefault(i, prepared.parser())
                    events = parser.feed(piece)
                lps = None
                if o.logprobs is not None:
                    new = o.logprobs[seen_lp.get(i, 0):]
                    seen_lp[i] = len(o.logprobs)
                    lps = [_logprob_entry(tid, d, params.logprobs) for tid, d in zip(o.token_ids[len(o.token_ids) - len(new):], new)]
                if o.finish_reason is not None:
                    done.add(i)
                    if prepared.parser is not None:
                        events += parsers.get(i, prepared.parser()).finish()
                if events or lps or o.finish_reason:
                    stop_reason = None if o.stop_reason in ours else o.stop_reason
                    yield ChoiceUpdate(i, events, lps, o.finish_reason, stop_reason, len(o.token_ids))
            if out.finished:
                break
        state.metrics.observe_request(last, _reason(last))
        kept = last.metrics.prompt_tokens_kept if last.metrics is not None else None
        yield Usage(len(last.prompt_token_ids), sum(len(o.token_ids) for o in last.outputs), last.num_cached_tokens,
                    kept)
        last = None
    finally:
        state.work.release(work)
        if pending is not None:
            pending.cancel()
        state.engine.abort(rid)  # no-op when finished; frees KV at once when the client went away
        state.dashboard.ended(rid)
        if last is not None and not last.finished:
            state.metrics.observe_request(last, "abort")


def _reason(out) -> str:
    reasons = {o.finish_reason for o in out.outputs}
    return "length" if "length" in reasons else next(iter(reasons), "stop") or "stop"


def _logprob_entry(token_id: int, d: dict, k: int) -> tuple:
    # The engine adds the sampled token to the top k whatever its rank; the APIs list exactly k.
    chosen = d.get(token_id)
    tops = sorted(((t, lp.logprob, lp.rank) for t, lp in d.items() if lp.rank is not None), key=lambda x: x[2])
    return token_id, chosen.logprob if chosen else float("-inf"), [(t, lp) for t, lp, _ in tops[:k]]


async def drain(agen, request, on_update: Callable | None = None) -> Usage:
    """Run a generation to the end for a non-streamed response; abort if the client disconnects."""
    async def run():
        usage = None
        async for item in agen:
            if isinstance(item, Usage):
                usage = item
            elif item is not KEEPALIVE and on_update is not None:
                on_update(item)
        return usage

    task = asyncio.ensure_future(run())
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=0.25)
            if finished:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        await agen.aclose()


def token_text(state, token_id: int) -> str:
    return state.tokenizer.decode([token_id], skip_special_tokens=False)
