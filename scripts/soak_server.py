"""Soak a running `lucebox serve`: N concurrent streaming clients over /v1/chat/completions,
/v1/responses and /v1/messages for M minutes, a share of them hanging up mid-stream; the server's
RSS is sampled, /health is probed throughout, and at the end the running / waiting sequences and KV
usage (from /metrics) must be back to their idle values. Prints a summary; exit 1 if not back.

    lucebox serve --port 8000 &
    python scripts/soak_server.py --url http://127.0.0.1:8000 --pid $! --clients 16 --minutes 2
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import threading
import time

import httpx

BODIES = {
    "/v1/chat/completions": lambda n: {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
                                       "max_tokens": n, "stream": True},
    "/v1/responses": lambda n: {"model": "m", "input": "Tell me a story.", "max_output_tokens": n, "stream": True},
    "/v1/messages": lambda n: {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
                               "max_tokens": n, "stream": True},
}


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        m = re.search(rf"^\S*{name}\S* ([0-9.e+-]+)$", text, re.M)
        found[name] = float(m.group(1)) if m else float("nan")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, default=None, help="the server's process id, to sample its RSS")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--leave-share", type=float, default=0.4, help="share of streams cut mid-stream")
    args = p.parse_args()
    end = time.monotonic() + args.minutes * 60
    stats = {"done": 0, "left": 0, "errors": 0, "events": 0}
    lock = threading.Lock()
    rss, health = [rss_mib(args.pid)], []

    def client(seed: int):
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < end:
                path = rng.choice(list(BODIES))
                leave_after = rng.uniform(0.05, 2.0) if rng.random() < args.leave_share else None
                started, outcome, events = time.monotonic(), "done", 0
                try:
                    with c.stream("POST", args.url + path, json=BODIES[path](rng.randint(8, 128))) as r:
                        if r.status_code != 200:
                            outcome = "errors"
                        else:
                            for line in r.iter_lines():
                                events += line.startswith("data:")
                                if leave_after is not None and time.monotonic() - started > leave_after:
                                    outcome = "left"
                                    break
                except httpx.HTTPError:
                    outcome = "errors"
                with lock:
                    stats[outcome] += 1
                    stats["events"] += events

    def sampler():
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < end:
                t = time.perf_counter()
                ok = c.get(args.url + "/health").status_code == 200
                health.append((time.perf_counter() - t) if ok else float("inf"))
                if args.pid is not None and len(health) % 10 == 0:
                    rss.append(rss_mib(args.pid))
                time.sleep(0.1)

    baseline = gauges(args.url)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)] + [threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)  # the last aborts are applied between steps
    final = gauges(args.url)
    rss.append(rss_mib(args.pid))
    lat = sorted(health)
    back = (final["num_requests_running"] == 0 and final["num_requests_waiting"] == 0
            and final["kv_cache_usage_perc"] <= baseline["kv_cache_usage_perc"])
    print(f"soak: {args.clients} clients x {args.minutes:g} min over {', '.join(BODIES)}")
    print(f"  streams finished {stats['done']}, left mid-stream {stats['left']}, errors {stats['errors']}, "
          f"events {stats['events']}")
    print(f"  /health: {len(lat)} probes, median {statistics.median(lat) * 1000:.1f} ms, "
          f"p99 {lat[int(0.99 * (len(lat) - 1))] * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    if args.pid is not None:
        print(f"  RSS MiB: start {rss[0]:.0f}, peak {max(rss):.0f}, end {rss[-1]:.0f}")
    print(f"  idle before {baseline} / after {final}: {'back to baseline' if back else 'NOT BACK'}")
    return 0 if back and stats["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
