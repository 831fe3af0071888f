"""The table `lucebox bench speed` prints: each figure beside its limit or peer, and the goal it is held to."""
from __future__ import annotations

from .prefix import report_rows as prefix_rows

# Issue 7's targets (H200, batch 1): % of the measured limit, or a ratio, or tok/s.
GOALS = {"decode_512": 90.0, "decode_32768": 80.0, "q8_0": 80.0, "q4_k_m": 75.0, "prefill_4096": 60.0,
         "verify_ratio": 1.3, "peer_ratio": 2.5, "qwen3-0.6b_tok_s": 2000.0, "forced_of_bound": 85.0,
         # issue 26 (hybrid / MoE shapes, H200, batch 1): against llama.cpp, and verify(16) / decode
         "llama_decode_ratio": 1.3, "llama_prefill_ratio": 1.0, "verify_ratio_hybrid": 1.5,
         "tree_verify_ratio": 1.6}  # issue 28: a 32-node tree verify against a decode step


def _goal(value: float | None, bound: float, unit: str = "%", higher: bool = True) -> str:
    met = "" if value is None else " met" if (value >= bound if higher else value <= bound) else " MISSED"
    return f"{'>=' if higher else '<='} {bound:,g}{unit}{met}"


def _pct(row: dict, key: str) -> str:
    return f"{row[key]:.1f}%" if key in row else "-"


def _n(x: float) -> str:
    """At least 3 significant digits, thousands separated: 4,012 / 81.5 / 0.0123."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def report_rows(r: dict) -> list[tuple[str, str, str, str, str]]:
    """measure | value | limit / reference | % of limit (or ratio) | goal (issue 7's, for an H200)."""
    m, ref, rows = r["model"], r["reference"] or {}, []
    bf16 = m["quant"] == "bf16"
    hybrid = bool(m["config"].get("layer_types") or m["config"].get("num_experts"))  # issue 26's shapes
    if ref:
        g, n = ref["gemv_shape"], ref["matmul_shape"][0]
        rows.append(("GEMV bandwidth (reference)", f"{_n(ref['gemv_gb_s'])} GB/s",
                     f"{ref['dtype']} [{g[0]} x {g[1]}] @ vector", "", ""))
        rows.append(("matmul rate (reference)", f"{_n(ref['matmul_tflops'])} TFLOP/s", f"{ref['dtype']} {n}^3", "", ""))
    bw = f"{_n(ref['gemv_gb_s'])} GB/s" if ref else "unmeasured"
    mm = f"{_n(ref['matmul_tflops'])} TFLOP/s" if ref else "unmeasured TFLOP/s"
    for p in r["prefill"]:
        goal = _goal(p.get("pct_matmul"), GOALS["prefill_4096"]) if p["prompt_len"] == 4096 and bf16 else ""
        rows.append((f"prefill {p['prompt_len']:,} tokens", f"{_n(p['tok_s'])} tok/s, TTFT {_n(1e3 * p['ttft_s'])} ms",
                     f"{_n(p['tflops'])} of {mm}", _pct(p, "pct_matmul"), goal))
    rows += prefix_rows(r, _n)
    for d in r["decode"]:
        bound = GOALS.get(f"decode_{d['context']}" if bf16 else m["quant"])
        goals = [_goal(d.get("pct_bandwidth"), bound)] if bound and (bf16 or d["context"] == 512) else []
        if m["shape"] == "qwen3-0.6b" and bf16 and d["context"] == 512:
            goals.append(_goal(d["tok_s"], GOALS["qwen3-0.6b_tok_s"], " tok/s"))
        held = f"; KV held {_n(d['kv_held_bytes'] / 2**20)} MiB" if d.get("kv_held_bytes") is not None else ""
        counter = f" (counter {d['counter_joules_per_token']:.3g})" if d.get("counter_joules_per_token") else ""
        joules = (f"{d['joules_per_token']:.3g} J/token{counter}" if "joules_per_token" in d
                  else (r.get("energy") or {}).get("skipped", "n/a (no NVML)").split(":")[0])
        rows.append((f"decode at context {d['context']:,}",
                     f"{_n(d['tok_s'])} tok/s, {_n(d['ms_per_token'])} ms, {joules}{held}",
                     f"{_n(d['gb_s'])} of {bw}; {_n(d['bytes_per_token'] / 1e9)} GB/token", _pct(d, "pct_bandwidth"),
                     "; ".join(goals)))
    if r["verify"]:
        v, f = r["verify"], r["verify"]["decode_forward"]
        graphs = " with CUDA graphs" if v.get("cuda_graph_replays") else ""
        rows.append((f"decode forward alone (runner{graphs}) at {f['context']:,}", f"{_n(f['tok_s'])} tok/s",
                     f"{_n(f['gb_s'])} of {bw}", _pct(f, "pct_bandwidth"), ""))
        rows.append((f"verify forward of {v['q_len']} tokens / decode forward",
                     f"{_n(1e3 * v['verify_step_s'])} / {_n(1e3 * v['decode_step_s'])} ms", "", f"{v['ratio']:.2f}x",
                     _goal(v["ratio"], GOALS["verify_ratio_hybrid" if hybrid else "verify_ratio"], "x", higher=False)))
        for t in v.get("trees", []):
            how = "CUDA graph" if t["cuda_graph"] else "eager"
            rows.append((f"DDTree verify of {t['nodes']} nodes (depth {t['depth']}, {how}) / decode forward",
                         f"{_n(1e3 * t['verify_step_s'])} / {_n(1e3 * v['decode_step_s'])} ms", "", f"{t['ratio']:.2f}x",
                         _goal(t["ratio"], GOALS["tree_verify_ratio"], "x", higher=False) if t["nodes"] == 32 else ""))
    if r.get("forced"):
        f = r["forced"]
        unsettled = "" if f.get("converged", True) else " NOT CONVERGED"
        redone = (f", drafts re-recorded {f['rerecorded']}x{unsettled} (near-ties: equal to plain greedy for "
                  f"{f['equal_to_plain_before']} tokens)") if f.get("rerecorded") else ""
        rows.append((f"speculative, forced acceptance ({f['draft_tokens']} drafts), tau {f['tau']:.2f}{redone}",
                     f"{_n(f['tok_s'])} tok/s, {f['speedup']:.2f}x plain",
                     f"bound tau x decode / verify = {f['bound']:.2f}x", f"{100 * f['of_bound']:.0f}%",
                     _goal(100 * f["of_bound"], GOALS["forced_of_bound"])))
    s, p = r["spec"] or {}, r["peer"] or {}
    if "tau" in s:
        rows.append((f"speculative ({s['method']}), tau {s['tau']:.2f}", f"{_n(s['tok_s'])} tok/s",
                     f"plain {_n(s['plain_tok_s'])} tok/s", f"{s['speedup']:.2f}x", ""))
    if "ratios" in p:
        rows += llama_cpp_rows(r)
    if "tok_s" in p:
        rows.append((f"transformers generate (static cache) at {p['context']:,}", f"{_n(p['tok_s'])} tok/s",
                     f"lucebox {_n(p['lucebox_tok_s'])} tok/s", f"{p['ratio']:.2f}x",
                     _goal(p["ratio"], GOALS["peer_ratio"], "x")))
    if r["peak_memory_bytes"]:
        rows.append(("peak GPU memory", f"{r['peak_memory_bytes'] / 2**30:.2f} GiB",
                     f"weights {m['weight_bytes'] / 2**30:.2f} GiB", "", ""))
    return rows


def llama_cpp_rows(r: dict) -> list[tuple[str, str, str, str, str]]:
    """llama-bench's figures beside lucebox's: the ratio lucebox / llama.cpp, issue 26's goals."""
    p, rows = r["peer"], []
    ours_p = {x["prompt_len"]: x["tok_s"] for x in r["prefill"]}
    ours_d = {x["context"]: x["tok_s"] for x in r["decode"]}
    for x in p["prefill"]:
        if x["depth"] == 0 and x["prompt_len"] in ours_p:
            ratio = p["ratios"]["prefill"][x["prompt_len"]]
            rows.append((f"llama.cpp prefill {x['prompt_len']:,} tokens", f"{_n(x['tok_s'])} tok/s",
                         f"lucebox {_n(ours_p[x['prompt_len']])} tok/s", f"{ratio:.2f}x",
                         _goal(ratio, GOALS["llama_prefill_ratio"], "x") if x["prompt_len"] == 4096 else ""))
    for x in p["decode"]:
        if x["context"] in ours_d:
            ratio = p["ratios"]["decode"][x["context"]]
            rows.append((f"llama.cpp decode at context {x['context']:,}", f"{_n(x['tok_s'])} tok/s",
                         f"lucebox {_n(ours_d[x['context']])} tok/s", f"{ratio:.2f}x",
                         _goal(ratio, GOALS["llama_decode_ratio"], "x")))
    return rows


def print_report(r: dict) -> None:
    m = r["model"]
    print(f"{m['source']}: {m['quant']} weights, {m['dtype']} activations, {r['meta']['device']}, batch 1; a step "
          f"reads {_n(m['weight_bytes_per_token'] / 1e9)} GB of weights"
          + (f" (routed experts only) + {_n(m['state_bytes_per_token'] / 1e6)} MB of recurrent state (read and "
             f"written)" if m.get("state_bytes_per_token") or m["config"].get("num_experts") else "")
          + f" + {m['kv_bytes_per_token']:,} B of KV per context token" + _window_note(m) + "\n")
    print("| measure | value | limit / reference | % of limit (ratio) | goal |\n|---|---:|---|---:|---|")
    for row in report_rows(r):
        print("| " + " | ".join(row) + " |")
    for note in r["notes"]:
        print(f"\nnote: {note}")


def _window_note(m: dict) -> str:
    """Models with sliding-window layers: how much of the KV a token costs is read at any context."""
    full = m.get("kv_unbounded_bytes_per_token")
    if full is None or full >= m["kv_bytes_per_token"]:
        return ""
    return (f" ({full:,} B of it in full-attention layers; the sliding-window layers' "
            f"{m['kv_bytes_per_token'] - full:,} B only up to their window)")
