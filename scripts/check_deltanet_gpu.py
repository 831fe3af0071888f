"""Gated DeltaNet on the GPU at the Qwen3.6-27B shape (Hk=16, Hv=48, dk=dv=128, conv 4, hidden 5120):
errors of fla's chunked prefill and of the Triton steps kernel against the torch references, then
per-layer timings (one GatedDeltaNet layer, random bfloat16 weights, projections included) of
prefill 512 / 4096 tokens, decode 1 token and verify 16 tokens + commit, eagerly and in a CUDA
graph (decode and verify). Prints a small table; a missing fla-core or a failing section is
reported and the rest still runs.

    python scripts/check_deltanet_gpu.py [--iters 50] [--batch 1]
"""
from __future__ import annotations

import argparse
import statistics
import traceback
from types import SimpleNamespace

import torch

from lucebox.kernels.forward_batch import ForwardBatch
from lucebox.kernels.gated_delta import (
    chunked_gated_delta_rule,
    fla_chunk,
    gated_delta_chunk,
    gated_delta_steps,
    gated_delta_steps_reference,
    l2_normalize,
)
from lucebox.model.deltanet import GatedDeltaNet

K_HEADS, V_HEADS, DK, DV, CONV, HIDDEN = 16, 48, 128, 128, 4, 5120
BLOCK = 16


def random_inputs(tokens: int, seed: int = 0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    q = l2_normalize(torch.randn(tokens, K_HEADS, DK, generator=g, device=device)) * DK ** -0.5
    k = l2_normalize(torch.randn(tokens, K_HEADS, DK, generator=g, device=device))
    v = torch.randn(tokens, V_HEADS, DV, generator=g, device=device)
    decay = -torch.rand(tokens, V_HEADS, generator=g, device=device) * 0.3
    beta = torch.rand(tokens, V_HEADS, generator=g, device=device)
    return q, k, v, decay, beta


def rel(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-9)).item()


def check_fla(rows: list) -> None:
    if fla_chunk() is None:
        rows.append(("fla chunk vs torch", "fla-core not installed (pip install 'lucebox[gpu]'): torch path"))
        return
    lens = [512, 100, 3]
    q, k, v, decay, beta = random_inputs(sum(lens))
    state0 = torch.randn(3, V_HEADS, DK, DV, device="cuda") * 0.1
    starts = [0, 512, 612, 615]
    for dtype in (torch.float32, torch.bfloat16):
        state = state0.clone()
        o = gated_delta_chunk(q.to(dtype), k.to(dtype), v.to(dtype), decay, beta, state, [0, 1, 2], starts)
        errs_o, errs_s = [], []
        for i in range(3):
            r = slice(starts[i], starts[i + 1])
            heads = lambda x: x[r].repeat_interleave(V_HEADS // K_HEADS, 1).transpose(0, 1)  # noqa: E731
            want, want_state = chunked_gated_delta_rule(heads(q), heads(k), v[r].transpose(0, 1), decay[r].t(),
                                                        beta[r].t(), state0[i].clone())
            errs_o.append(rel(o[r], want.transpose(0, 1)))
            errs_s.append(rel(state[i], want_state))
        rows.append((f"fla chunk vs torch ({str(dtype)[6:]} in)", f"out rel {max(errs_o):.2e}, state rel {max(errs_s):.2e}"))


def check_steps(rows: list) -> None:
    lens, slots, advance = [1, 16, 7, 1], [3, 0, 5, 1], [1, 0, 7, 1]
    q, k, v, decay, beta = random_inputs(sum(lens), seed=1)
    starts = torch.tensor([0, 1, 17, 24], device="cuda")
    ends = torch.tensor([1, 17, 24, 25], device="cuda")
    idx = lambda values: torch.tensor(values, device="cuda")  # noqa: E731
    state = torch.randn(6, V_HEADS, DK, DV, device="cuda") * 0.1
    want_state = state.clone()
    want = gated_delta_steps_reference(q, k, v, decay, beta, want_state, idx(slots), starts, ends, idx(advance), 16)
    got = gated_delta_steps(q, k, v, decay, beta, state, idx(slots), starts, ends, idx(advance), 16)
    rows.append(("triton steps vs torch (f32)", f"out rel {rel(got, want):.2e}, state rel {rel(state, want_state):.2e}"))


def layer_and_state(positions: int):
    cfg = SimpleNamespace(linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS, linear_key_head_dim=DK,
                          linear_value_head_dim=DV, linear_conv_kernel_dim=CONV, hidden_size=HIDDEN, rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.A_log.uniform_(-1, 1)
    layer = layer.to("cuda", torch.bfloat16)
    layer.state = layer.cache_spec().build(8, positions, "cuda")
    return layer


def eager_batch(lens: list[int], advance: list[int]) -> ForwardBatch:
    tables = [list(range(-(-max(n, 1) // BLOCK))) for n in lens]
    batch = ForwardBatch.build([[0] * n for n in lens], [0] * len(lens), tables, BLOCK, "cuda")
    batch.state_slots_host, batch.state_advance_host = list(range(len(lens))), advance
    batch.state_slots = torch.tensor(batch.state_slots_host, device="cuda")
    batch.state_advance = torch.tensor(advance, device="cuda")
    return batch


def device_batch(num_seqs: int, query_len: int, advance: int) -> ForwardBatch:
    tokens = num_seqs * query_len
    zeros = torch.zeros(tokens, dtype=torch.long, device="cuda")
    batch = ForwardBatch.from_device(zeros, zeros, torch.full((num_seqs,), query_len, device="cuda"),
                                     torch.zeros(num_seqs, 1, dtype=torch.int32, device="cuda"), zeros, BLOCK, query_len)
    batch.state_slots = torch.arange(num_seqs, device="cuda")
    batch.state_advance = torch.full((num_seqs,), advance, device="cuda")
    return batch


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over iters runs (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def in_graph(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.inference_mode()
def timings(rows: list, iters: int, batch_size: int) -> None:
    layer = layer_and_state(positions=16)
    commit_slots = torch.arange(batch_size, device="cuda")
    accepted = torch.full((batch_size,), 15, device="cuda")
    for tokens in (512, 4096):
        h = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        batch = eager_batch([tokens], [tokens])
        route = "fla" if fla_chunk() is not None else "torch"
        rows.append((f"prefill {tokens} ({route}), eager", f"{timed(lambda: layer(h, batch), iters):.3f} ms"))
    for name, q_len, advance in (("decode 1", 1, 1), ("verify 16", 16, 0)):
        h = torch.randn(batch_size * q_len, HIDDEN, device="cuda", dtype=torch.bfloat16)
        eager = eager_batch([q_len] * batch_size, [advance] * batch_size)
        rows.append((f"{name} x{batch_size}, eager", f"{timed(lambda: layer(h, eager), iters):.3f} ms"))
        static = device_batch(batch_size, q_len, advance)
        replay = in_graph(lambda: layer(h, static))
        rows.append((f"{name} x{batch_size}, CUDA graph", f"{timed(replay, iters):.3f} ms"))
    tree_timings(rows, iters, batch_size)
    commit = lambda: layer.state.commit(commit_slots, accepted)  # noqa: E731
    rows.append((f"commit 16 of verify x{batch_size}, eager", f"{timed(commit, iters):.3f} ms"))
    rows.append((f"commit 16 of verify x{batch_size}, CUDA graph", f"{timed(in_graph(commit), iters):.3f} ms"))
    # the engine's commit: all 48 DeltaNet layers of Qwen3.6-27B in one pool, one launch pair
    pool = layer.cache_spec().build(8, 16, "cuda", layers=48)
    pool_commit = lambda: pool.commit(commit_slots, accepted)  # noqa: E731
    rows.append((f"commit 16 of verify x{batch_size}, 48-layer pool (whole model)",
                 f"{timed(pool_commit, iters):.3f} ms"))


# A 32-node draft tree: a 15-node top-1 spine, then bushes under its first nodes (DFS order).
TREE_PARENTS = [-1] + list(range(15)) + [1, 16, 16, 18, 2, 20, 21, 3, 23, 4, 25, 0, 27, 28, 0, 30, 31][:17]


@torch.inference_mode()
def tree_timings(rows: list, iters: int, batch_size: int) -> None:
    """A 33-token tree verify row (kernels/gated_delta_tree.py) beside a 33-token chain verify."""
    layer, n = layer_and_state(positions=len(TREE_PARENTS)), len(TREE_PARENTS)
    h = torch.randn(batch_size * n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    tables = [list(range(-(-n // BLOCK)))] * batch_size
    eager = ForwardBatch.build([[0] * n] * batch_size, [0] * batch_size, tables, BLOCK, "cuda",
                               tree_parents=[TREE_PARENTS] * batch_size)
    eager.set_state_rows(list(range(batch_size)), [0] * batch_size)
    rows.append((f"tree verify {n} x{batch_size}, eager", f"{timed(lambda: layer(h, eager), iters):.3f} ms"))
    static = device_batch(batch_size, n, 0)
    static.tree_mask = eager.tree_mask
    rows.append((f"tree verify {n} x{batch_size}, CUDA graph",
                 f"{timed(in_graph(lambda: layer(h, static)), iters):.3f} ms"))
    chain = device_batch(batch_size, n, 0)
    rows.append((f"chain verify {n} x{batch_size}, CUDA graph",
                 f"{timed(in_graph(lambda: layer(h, chain)), iters):.3f} ms"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=1, help="sequences of the decode / verify steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    print(f"{torch.cuda.get_device_name()}; Gated DeltaNet layer Hk={K_HEADS} Hv={V_HEADS} dk={DK} dv={DV} "
          f"conv={CONV} hidden={HIDDEN}, bf16 weights, float32 state")
    rows: list[tuple[str, str]] = []
    try:
        from importlib.metadata import version
        rows.append(("fla-core", version("fla-core") if fla_chunk() is not None else "not installed"))
    except Exception as e:  # metadata missing for a source install
        rows.append(("fla-core", f"importable, version unknown ({type(e).__name__})"))
    for section in (check_fla, check_steps, lambda r: timings(r, args.iters, args.batch)):
        try:
            section(rows)
        except Exception as e:  # a section's failure is reported; the others still run
            traceback.print_exc()
            rows.append((getattr(section, "__name__", "timings"), f"FAILED: {type(e).__name__}: {e}"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
