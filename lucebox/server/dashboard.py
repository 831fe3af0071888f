"""The status page: the server's load sampled every second over the last ten minutes, the recent
requests' timelines, and the routes that serve them.

  GET /dashboard              the page: plain HTML + JS + the vendored uPlot (works offline)
  GET /dashboard/static/...   its assets
  GET /dashboard/data         the JSON the page polls

The page and its assets hold no data and are served without --api-key (a browser cannot send a header
on a plain page load); /dashboard/data requires the key like every API route: the page asks for it
once, keeps it in the browser's localStorage and sends it as `Authorization: Bearer`.

Fed by server/generate.py (arrived / progress / ended per request) and by AsyncEngine.stats(). Every
call runs on the server's event loop, the sampler too, so nothing here needs a lock.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

STATIC = Path(__file__).parent / "static"
PUBLIC_PATHS = ("/", "/dashboard", "/dashboard/")  # the root serves the page too
# Request ids carry their API's prefix (server/*.py: request_id("chatcmpl-") ...).
API_OF_PREFIX = (("chatcmpl-", "chat"), ("cmpl-", "completions"), ("resp_", "responses"), ("msg_", "messages"))
SERIES = ("running", "waiting", "generated_tps", "prompt_tps", "ttft", "acceptance_length", "kv_usage",
          "state_usage", "prefix_hit_rate")


def is_public(path: str) -> bool:
    """The page and its static assets: served without the API key (they carry no data)."""
    return path in PUBLIC_PATHS or path.startswith("/dashboard/static/")


def api_of(request_id: str) -> str:
    return next((api for prefix, api in API_OF_PREFIX if request_id.startswith(prefix)), "other")


def add_counts(into: list[int], counts: list[int]) -> None:
    for i, n in enumerate(counts):
        if i == len(into):
            into.append(0)
        into[i] += n


@dataclass
class Timeline:
    """One request as the server saw it; times on the engine's monotonic clock."""
    request_id: str
    api: str
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    generated: int = 0
    drafts: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def row(self, to_wall: Callable[[float | None], float | None]) -> dict:
        return {"id": self.request_id, "api": self.api, "arrival": to_wall(self.arrival),
                "first_token": to_wall(self.first_token), "finished": to_wall(self.finished),
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "generated_tokens": self.generated,
                "ttft": None if self.first_token is None else self.first_token - self.arrival,
                "acceptance_length": (self.accepted + self.drafts) / self.drafts if self.drafts else None}


@dataclass
class Interval:
    """What happened since the last sample (and, in `totals`, since the server started)."""
    requests: int = 0
    generated: int = 0
    prompt: int = 0  # prompt tokens prefilled (the cached ones not counted)
    ttfts: list[float] = field(default_factory=list)
    drafts: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    t: float  # monotonic
    values: dict  # SERIES -> float | None
    drafts: int
    accepted_per_position: list[int]


class Dashboard:
    def __init__(self, stats: Callable, period: float = 1.0, history: int = 600, recent: int = 100,
                 clock: Callable[[], float] = time.monotonic):
        """stats: AsyncEngine.stats; period: seconds between samples; history: samples kept;
        recent: finished requests kept for the timelines."""
        if period <= 0 or history < 1 or recent < 1:
            raise ValueError(f"dashboard: period > 0, history >= 1, recent >= 1 (got {period}, {history}, {recent})")
        self.stats, self.period, self.clock = stats, period, clock
        self.samples: deque[Sample] = deque(maxlen=history)
        self.live: dict[str, Timeline] = {}
        self.recent: deque[Timeline] = deque(maxlen=recent)
        self.interval, self.totals = Interval(), Interval()
        self.finish_reasons: dict[str, int] = {}
        self.started = self._last_t = clock()
        self._last_stats = None

    # ------------------------------------------------------------------ feed (server/generate.py)
    def arrived(self, request_id: str, prompt_tokens: int) -> None:
        self.live[request_id] = Timeline(request_id, api_of(request_id), self.clock(), prompt_tokens)
        for iv in (self.interval, self.totals):
            iv.requests += 1

    def progress(self, out) -> None:
        """A cumulative RequestOutput of a live request: the new tokens, its first token, drafts accepted."""
        tl = self.live.get(out.request_id)
        if tl is None:
            return
        m, now = out.metrics, self.clock()
        generated = sum(len(o.token_ids) for o in out.outputs)
        new, tl.generated = generated - tl.generated, generated
        prompt, ttfts = 0, []
        if tl.first_token is None and generated:
            if m is not None and m.arrival_time:
                tl.arrival = m.arrival_time
            tl.first_token = m.first_token_time if m is not None and m.first_token_time else now
            tl.cached_tokens = out.num_cached_tokens
            prompt, ttfts = tl.prompt_tokens - tl.cached_tokens, [tl.first_token - tl.arrival]
        drafts = accepted = 0
        per_position: list[int] = []
        if m is not None:
            drafts, accepted = m.num_drafts - tl.drafts, m.num_accepted_tokens - tl.accepted
            seen = tl.accepted_per_position + [0] * (len(m.accepted_per_position) - len(tl.accepted_per_position))
            per_position = [n - s for n, s in zip(m.accepted_per_position, seen)]
            tl.drafts, tl.accepted = m.num_drafts, m.num_accepted_tokens
            tl.accepted_per_position = list(m.accepted_per_position)
        for iv in (self.interval, self.totals):
            iv.generated += new
            iv.prompt += prompt
            iv.ttfts += ttfts
            iv.drafts += drafts
            iv.accepted += accepted
            add_counts(iv.accepted_per_position, per_position)
        if out.finished:
            tl.finished = m.finished_time if m is not None and m.finished_time else now
            reasons = {o.finish_reason for o in out.outputs} - {None}
            tl.finish_reason = "length" if "length" in reasons else next(iter(sorted(reasons)), "stop")

    def ended(self, request_id: str) -> None:
        """The request's handler is done with it: finished, or aborted (client gone, timeout, error)."""
        tl = self.live.pop(request_id, None)
        if tl is None:
            return
        if tl.finished is None:
            tl.finished, tl.finish_reason = self.clock(), "abort"
        self.finish_reasons[tl.finish_reason] = self.finish_reasons.get(tl.finish_reason, 0) + 1
        self.recent.append(tl)

    # ------------------------------------------------------------------ sampling
    def sample(self) -> Sample:
        """Close the current interval: one point of every series."""
        now, stats = self.clock(), self.stats()
        iv, self.interval = self.interval, Interval()
        dt = max(now - self._last_t, 1e-9)
        last = self._last_stats
        queries = stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)
        hits = stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        values = {"running": stats.running, "waiting": stats.waiting,
                  "generated_tps": iv.generated / dt, "prompt_tps": iv.prompt / dt,
                  "ttft": sum(iv.ttfts) / len(iv.ttfts) if iv.ttfts else None,
                  "acceptance_length": (iv.accepted + iv.drafts) / iv.drafts if iv.drafts else None,
                  "kv_usage": stats.kv_usage, "state_usage": stats.state_usage,
                  "prefix_hit_rate": hits / queries if queries > 0 else None}
        sample = Sample(now, values, iv.drafts, iv.accepted_per_position)
        self.samples.append(sample)
        self._last_t, self._last_stats = now, stats
        return sample

    async def run(self) -> None:
        """Sample every `period` seconds until cancelled (the app's lifespan)."""
        while True:
            await asyncio.sleep(self.period)
            self.sample()

    # ------------------------------------------------------------------ the page's data
    def snapshot(self, model: str) -> dict:
        offset = time.time() - self.clock()  # monotonic -> Unix seconds, for the page's clock axis

        def to_wall(t):
            return None if t is None else t + offset

        stats, samples, totals = self.stats(), list(self.samples), self.totals
        window_drafts = sum(s.drafts for s in samples)
        window_accepted: list[int] = []
        for s in samples:
            add_counts(window_accepted, s.accepted_per_position)
        series = {"t": [to_wall(s.t) for s in samples]} | {k: [s.values[k] for s in samples] for k in SERIES}
        requests = sorted(self.live.values(), key=lambda tl: -tl.arrival) + list(reversed(self.recent))
        return {
            "model": model, "now": time.time(), "started": to_wall(self.started), "period": self.period,
            "engine": {"running": stats.running, "waiting": stats.waiting, "kv_usage": stats.kv_usage,
                       "kv_blocks": stats.kv_blocks, "kv_blocks_free": stats.kv_blocks_free,
                       "kv_capacity_tokens": stats.kv_capacity_tokens, "state_usage": stats.state_usage,
                       "state_slots": stats.state_slots, "state_slots_free": stats.state_slots_free,
                       "prefix_cache_queries": stats.prefix_cache_queries,
                       "prefix_cache_hits": stats.prefix_cache_hits,
                       "prefix_hit_rate": (stats.prefix_cache_hits / stats.prefix_cache_queries
                                           if stats.prefix_cache_queries else None),
                       "preemptions": stats.preemptions,
                       # kv_usage above is the primary (full-attention) group's; each group's pool here
                       "kv_pools": [{"group": p.group, "blocks": p.blocks, "blocks_free": p.blocks_free,
                                     "usage": p.usage} for p in stats.kv_pools],
                       "recurrent_prefix_snapshots": stats.snapshots,
                       "recurrent_prefix_snapshots_in_use": stats.snapshots_in_use,
                       "recurrent_prefix_snapshot_hits": stats.snapshot_hits,
                       "recurrent_prefix_snapshot_hit_tokens": stats.snapshot_hit_tokens},
            "totals": {"requests": totals.requests, "finished": dict(sorted(self.finish_reasons.items())),
                       "prompt_tokens": totals.prompt, "generated_tokens": totals.generated,
                       "mean_ttft": sum(totals.ttfts) / len(totals.ttfts) if totals.ttfts else None,
                       "drafts": totals.drafts, "accepted_tokens": totals.accepted,
                       "acceptance_length": ((totals.accepted + totals.drafts) / totals.drafts
                                             if totals.drafts else None),
                       "acceptance_per_position": [n / totals.drafts for n in totals.accepted_per_position]
                       if totals.drafts else []},
            "series": series,
            # per-position acceptance over the samples shown: the rate a draft at position i is accepted
            "acceptance_per_position": [n / window_drafts for n in window_accepted] if window_drafts else [],
            "requests": [tl.row(to_wall) for tl in requests],
        }


def install(app, state) -> None:
    """The page, its assets and its data on `app`; `state` is the app's ServerState."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    async def page():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html; charset=utf-8")

    async def data():
        return state.dashboard.snapshot(state.model_id)

    for path in PUBLIC_PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/data", data, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
