"""Prometheus text exposition, named like vLLM's metrics (prefix `vllm:`) so existing dashboards work.

Figures vLLM has no name for are prefixed `lucebox:`: each KV cache group's pool (models mixing
sliding-window and full attention keep one per window; vLLM's kv_cache_usage_perc is the primary,
full-attention group's), hybrid models' recurrent-state pool and prefix snapshots, and KVFlash's bounded
KV pool (`lucebox:kvflash_*`, only on a server started with --kv-pool-tokens).
Counters carry prometheus_client's `_total` suffix, as vLLM's do on the wire
(e.g. `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_accepted_tokens_per_pos_total`).
"""
from __future__ import annotations

import threading
from collections import defaultdict

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.success = defaultdict(int)  # finished_reason -> count
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft, self.tpot, self.e2e = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS), Histogram(E2E_BUCKETS)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe_request(self, out, finish_reason: str) -> None:
        """One finished (or aborted) request: a cumulative RequestOutput."""
        m = out.metrics
        generated = sum(len(o.token_ids) for o in out.outputs)
        with self.lock:
            self.success[finish_reason] += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.generation_tokens += generated
            if m is None:
                return
            if m.first_token_time is not None:
                self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
                if m.finished_time is not None:
                    self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
                    if generated > 1:
                        self.tpot.observe(max(m.finished_time - m.first_token_time, 0.0) / (generated - 1))
            self.num_drafts += m.num_drafts
            self.num_draft_tokens += m.num_draft_tokens
            self.num_accepted_tokens += m.num_accepted_tokens
            for i, n in enumerate(m.accepted_per_position):
                if i == len(self.accepted_per_pos):
                    self.accepted_per_pos.append(0)
                self.accepted_per_pos[i] += n

    def _kv_flash(self, metric, pool) -> None:
        """KVFlash (--kv-pool-tokens): pooled sequences, the host backing store, and resident-set churn."""
        L = self.labels
        metric("lucebox:kvflash_pool_tokens", "gauge", "KV tokens a pooled sequence keeps on the device.",
               [f"lucebox:kvflash_pool_tokens{{{L}}} {pool.pool_tokens}"])
        metric("lucebox:kvflash_sequences", "gauge", "Sequences whose KV is pooled (admitted, not finished).",
               [f"lucebox:kvflash_sequences{{{L}}} {pool.sequences}"])
        metric("lucebox:kvflash_host_blocks", "gauge", "KV blocks of the host memory backing pooled sequences.",
               [f"lucebox:kvflash_host_blocks{{{L}}} {pool.host_blocks}"])
        metric("lucebox:kvflash_host_blocks_in_use", "gauge", "Host KV blocks reserved by pooled sequences (each "
               "for its whole possible length).",
               [f"lucebox:kvflash_host_blocks_in_use{{{L}}} {pool.host_blocks_used}"])
        metric("lucebox:kvflash_reselects", "counter", "Resident sets chosen for sequences outgrowing the pool.",
               [f"lucebox:kvflash_reselects_total{{{L}}} {pool.reselects}"])
        metric("lucebox:kvflash_blocks_evicted", "counter", "Device KV blocks given back (kept in host memory).",
               [f"lucebox:kvflash_blocks_evicted_total{{{L}}} {pool.evicted}"])
        metric("lucebox:kvflash_blocks_paged_in", "counter", "KV blocks copied back from host memory to the device.",
               [f"lucebox:kvflash_blocks_paged_in_total{{{L}}} {pool.paged_in}"])

    def render(self, stats) -> str:
        """`stats`: the engine's EngineStats (AsyncEngine.stats()) beside this server's request counts."""
        L = self.labels
        lines: list[str] = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        with self.lock:
            metric("vllm:num_requests_running", "gauge", "Sequences in the running batch.",
                   [f"vllm:num_requests_running{{{L}}} {stats.running}"])
            metric("vllm:num_requests_waiting", "gauge", "Sequences waiting for a slot.",
                   [f"vllm:num_requests_waiting{{{L}}} {stats.waiting}"])
            metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = 100%), in the "
                   "primary (full-attention) group's pool; lucebox:kv_cache_blocks has every group's.",
                   [f"vllm:kv_cache_usage_perc{{{L}}} {stats.kv_usage}"])
            metric("vllm:kv_cache_capacity_tokens", "gauge", "Tokens the primary (full-attention) group's KV pool "
                   "holds.", [f"vllm:kv_cache_capacity_tokens{{{L}}} {stats.kv_capacity_tokens}"])
            pools = [(f'{L},group="{p.group}"', p) for p in stats.kv_pools]
            if pools:  # one per KV cache group: "full", and "window=W" for each window of a mixed model
                metric("lucebox:kv_cache_blocks", "gauge", "KV blocks in each KV cache group's pool.",
                       [f"lucebox:kv_cache_blocks{{{g}}} {p.blocks}" for g, p in pools])
                metric("lucebox:kv_cache_blocks_free", "gauge", "Free KV blocks in each KV cache group's pool.",
                       [f"lucebox:kv_cache_blocks_free{{{g}}} {p.blocks_free}" for g, p in pools])
                metric("lucebox:kv_cache_usage_perc", "gauge", "Fraction of each KV cache group's blocks in use "
                       "(1 = 100%).", [f"lucebox:kv_cache_usage_perc{{{g}}} {p.usage}" for g, p in pools])
            if stats.state_slots:  # hybrids (Gated DeltaNet): the recurrent-state pool beside the KV pool
                used = stats.state_slots - stats.state_slots_free
                metric("lucebox:recurrent_state_slots", "gauge", "Recurrent-state slots in the pool (one a running "
                       "sequence).", [f"lucebox:recurrent_state_slots{{{L}}} {stats.state_slots}"])
                metric("lucebox:recurrent_state_slots_in_use", "gauge", "Recurrent-state slots held by sequences.",
                       [f"lucebox:recurrent_state_slots_in_use{{{L}}} {used}"])
                metric("lucebox:recurrent_state_usage_perc", "gauge", "Fraction of recurrent-state slots in use "
                       "(1 = 100%).", [f"lucebox:recurrent_state_usage_perc{{{L}}} {stats.state_usage}"])
                metric("lucebox:recurrent_prefix_snapshots", "gauge", "Entries of the recurrent-state snapshot "
                       "pool that prefix reuse needs (0: no prefix reuse).",
                       [f"lucebox:recurrent_prefix_snapshots{{{L}}} {stats.snapshots}"])
                metric("lucebox:recurrent_prefix_snapshots_in_use", "gauge", "Snapshot entries holding a prefix's "
                       "state.", [f"lucebox:recurrent_prefix_snapshots_in_use{{{L}}} {stats.snapshots_in_use}"])
                metric("lucebox:recurrent_prefix_snapshot_hits", "counter", "Admissions whose recurrent state was "
                       "loaded from a snapshot (recomputes after preemption too).",
                       [f"lucebox:recurrent_prefix_snapshot_hits_total{{{L}}} {stats.snapshot_hits}"])
                metric("lucebox:recurrent_prefix_snapshot_hit_tokens", "counter", "Prefix tokens those admissions "
                       "did not compute.",
                       [f"lucebox:recurrent_prefix_snapshot_hit_tokens_total{{{L}}} {stats.snapshot_hit_tokens}"])
            if stats.kv_flash is not None:
                self._kv_flash(metric, stats.kv_flash)
            metric("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
                   [f"vllm:prefix_cache_queries_total{{{L}}} {stats.prefix_cache_queries}"])
            metric("vllm:prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache.",
                   [f"vllm:prefix_cache_hits_total{{{L}}} {stats.prefix_cache_hits}"])
            metric("vllm:num_preemptions", "counter", "Sequences preempted to free KV blocks.",
                   [f"vllm:num_preemptions_total{{{L}}} {stats.preemptions}"])
            metric("vllm:request_success", "counter", "Finished requests by finish reason.",
                   [f'vllm:request_success_total{{{L},finished_reason="{r}"}} {n}'
                    for r, n in sorted(self.success.items())])
            metric("vllm:prompt_tokens", "counter", "Prompt tokens of finished requests.",
                   [f"vllm:prompt_tokens_total{{{L}}} {self.prompt_tokens}"])
            metric("vllm:generation_tokens", "counter", "Generated tokens of finished requests.",
                   [f"vllm:generation_tokens_total{{{L}}} {self.generation_tokens}"])
            metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token.",
                   self.ttft.lines("vllm:time_to_first_token_seconds", L))
            metric("vllm:time_per_output_token_seconds", "histogram", "Mean time per output token after the first.",
                   self.tpot.lines("vllm:time_per_output_token_seconds", L))
            metric("vllm:e2e_request_latency_seconds", "histogram", "Arrival to last token.",
                   self.e2e.lines("vllm:e2e_request_latency_seconds", L))
            metric("vllm:spec_decode_num_drafts", "counter", "Verify steps that carried draft tokens.",
                   [f"vllm:spec_decode_num_drafts_total{{{L}}} {self.num_drafts}"])
            metric("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.",
                   [f"vllm:spec_decode_num_draft_tokens_total{{{L}}} {self.num_draft_tokens}"])
            metric("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
                   [f"vllm:spec_decode_num_accepted_tokens_total{{{L}}} {self.num_accepted_tokens}"])
            metric("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted per position.",
                   [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{L},position="{i}"}} {n}'
                    for i, n in enumerate(self.accepted_per_pos)])
        return "\n".join(lines) + "\n"
