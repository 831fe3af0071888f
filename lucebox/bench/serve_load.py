"""`lucebox bench serve`'s client: streaming OpenAI requests timed chunk by chunk, the load generator
(Poisson arrivals and/or a concurrency cap, agents' turns in order), and the server's /metrics."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from .serve_data import BenchRequest

CHAT = "/v1/chat/completions"
TIMEOUT = httpx.Timeout(6 * 3600.0, connect=30.0)  # a long generation under heavy load must not time out
# Counters read from /metrics, by the names vLLM (and lucebox) serve; older vLLMs used gpu_prefix_cache_*.
COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts_total",),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}


@dataclass
class RequestResult:
    """What one request measured; times in seconds from the moment it was sent."""
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    usage_reported: bool = False  # token counts from the server's usage, not estimated
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where served
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    latency: float = 0.0
    start: float = 0.0
    generated_text: str = ""


class Client:
    """Streams requests to one OpenAI-compatible server at `base` (http://host:port)."""

    def __init__(self, base: str, endpoint: str, model: str | None, api_key: str | None = None,
                 ignore_eos: bool = False, temperature: float = 0.0):
        self.base, self.endpoint, self.model = base.rstrip("/"), endpoint, model
        self.ignore_eos, self.temperature = ignore_eos, temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=TIMEOUT, headers=headers,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        await self.http.aclose()

    def payload(self, request: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:  # vLLM's and lucebox's extension; plain OpenAI would refuse it
            body["ignore_eos"] = True
        if self.endpoint == CHAT:
            body["messages"] = request.messages
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        start = last = time.perf_counter()
        result.start = start
        chunks = 0
        try:
            async with self.http.stream("POST", self.base + self.endpoint, json=self.payload(request)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, `: keep-alive` comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = "stream error: " + _error_message(json.dumps(chunk))
                        return result
                    if chunk.get("usage"):
                        self._usage(result, chunk["usage"])
                    choices = chunk.get("choices") or []
                    text = "".join(self._text(choice) for choice in choices)
                    # Tokens that stream no text (tool-call deltas; or special tokens, where only the
                    # finishing chunk shows they came) still arrived.
                    calls = any((c.get("delta") or {}).get("tool_calls") for c in choices)
                    finish_only = chunks == 0 and any(c.get("finish_reason") for c in choices)
                    if text or calls or finish_only:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        result.generated_text += text
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return result
        if chunks == 0:
            result.error = "the stream ended before any token came"
            return result
        result.latency = last - start
        if not result.usage_reported:
            result.output_len = chunks  # no usage chunk: one token per chunk, as a server without spec decoding streams
        result.success = True
        return result

    def _text(self, choice: dict) -> str:
        if self.endpoint != CHAT:
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")

    @staticmethod
    def _usage(result: RequestResult, usage: dict) -> None:
        result.usage_reported = True
        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        result.output_len = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]

    async def served_model(self) -> str | None:
        """The first model the server lists (GET /v1/models), or None if it lists none."""
        response = await self.http.get(self.base + "/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
        return data[0].get("id") if data else None

    async def chars_per_token(self, sample: str) -> float | None:
        """Characters per token of `sample` by the server's POST /tokenize (vLLM's body and llama.cpp's
        in one), or None where the server has none."""
        try:
            response = await self.http.post(self.base + "/tokenize",
                                            json={"model": self.model, "prompt": sample, "content": sample})
            tokens = response.json().get("tokens") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return len(sample) / len(tokens) if tokens else None

    async def metrics(self) -> dict[str, float] | None:
        """The counters of COUNTERS from GET /metrics (Prometheus text), summed over labels; None without /metrics."""
        try:
            response = await self.http.get(self.base + "/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        samples = parse_prometheus(response.text)
        found = {}
        for key, names in COUNTERS.items():
            name = next((n for n in names if n in samples), None)
            if name is not None:
                found[key] = samples[name]
        return found


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue  # a timestamped or malformed sample: not one of ours
    return samples


def _error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


def arrival_times(count: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds: a Poisson process of `request_rate` per second (exponential gaps, seeded),
    or all at zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


async def run_load(send, requests: list[BenchRequest], request_rate: float, max_concurrency: int | None,
                   seed: int, on_done=None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time, after the request it waits for (`after`) has finished,
    at most `max_concurrency` in flight. Returns the results in request order and the wall time."""
    finished = [asyncio.Event() for _ in requests]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(i: int, request: BenchRequest, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if request.after is not None:  # waiting takes no slot: a slot never waits on a later request
            await finished[request.after].wait()
        try:
            if slots is None:
                return await send(request)
            async with slots:
                return await send(request)
        finally:
            finished[i].set()
            if on_done is not None:
                on_done()

    times = arrival_times(len(requests), request_rate, seed)
    results = await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(requests, times))))
    return list(results), time.perf_counter() - start
