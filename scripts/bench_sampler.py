"""Time the in-graph sampler (sampling/acceptance.py: accept_in_graph) by vocabulary size: the Triton kernel
(kernels/triton_sampling.py) against the torch reference, in the same run, on random logits.

    python scripts/bench_sampler.py            # on a CUDA device

Rows: a decode (1 sequence x 1 row) and a 16-row verify of one sequence, at temperature 1 alone and
with Qwen3's defaults (temperature 0.6, top-k 20, top-p 0.95, which the Triton kernel finds by
bisection), for each way the kernel searches (triton_sampling.SEARCHES: `chunks`, the default, many
programs a row; `list`, one program a row over a list of top-k candidates; `row`, 64 passes over
the vocabulary). Each is timed replayed from one CUDA graph, as the engine runs it
(bench_kernels.bench_in_graph): device time, without Python's launch overhead.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel_timing import bench_in_graph  # noqa: E402
from lucebox.kernels.triton_sampling import SEARCHES, accept_rows_triton  # noqa: E402
from lucebox.sampling import SamplingParams  # noqa: E402
from lucebox.sampling import acceptance  # noqa: E402
from lucebox.sampling.graph_rows import graph_row  # noqa: E402

PARAMS = {"T=1": SamplingParams(temperature=1.0),
          "top-k 20, top-p 0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95)}


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    acceptance.use_triton = lambda *tensors: False  # accept_in_graph below is the torch reference
    print("| vocab | rows | sampling | " + " | ".join(f"Triton, {s} us" for s in SEARCHES)
          + " | torch us | Triton / torch |\n|---:|---:|---|" + "---:|" * (len(SEARCHES) + 2))
    for vocab in (8192, 32768, 151936):
        for rows in (1, 16):
            logits = torch.randn(rows, vocab, device="cuda") * 3
            draft = torch.randint(0, vocab, (rows,), device="cuda")
            draft[-1] = -1  # the bonus row
            argmax, seed = logits.argmax(-1), torch.tensor([1], device="cuda")
            for name, params in PARAMS.items():
                t, k, p, min_p, greedy = (torch.tensor([c], device="cuda") for c in graph_row(params, vocab))
                args = (logits, draft, argmax, t.float(), k, p.float(), min_p.float(), greedy, seed)
                calls = [args] * 16  # one graph of 16 calls; the time is per call
                searches = [1e3 * bench_in_graph(lambda a, s=search: accept_rows_triton(*a, search=s), calls,
                                                 torch.device("cuda")) for search in SEARCHES]
                reference = 1e3 * bench_in_graph(lambda a: acceptance.accept_in_graph(*a), calls, torch.device("cuda"))
                print(f"| {vocab} | {rows} | {name} | " + " | ".join(f"{t:.0f}" for t in searches)
                      + f" | {reference:.0f} | {searches[0] / reference:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
