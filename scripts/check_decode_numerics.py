#!/usr/bin/env python
"""Do decode (one token: the Triton GEMVs with their prologues) and verify (16 rows: cuBLAS and the
unfused kernels) compute the same logits? Forced-acceptance speculation (`bench speed`) and
greedy equality with plain decoding rest on their argmaxes agreeing.

    python scripts/check_decode_numerics.py --shape qwen3-0.6b [--quant bf16] [--tokens 64]
    python scripts/check_decode_numerics.py --model models/default --device cpu   # the script's logic

A random model of the shape (as `lucebox bench speed` builds it) or a model path; a prompt is
prefilled, then `tokens` greedy decode steps run one token at a time (each step's logits kept);
then the same positions run again as verify chunks of 16 rows that read the K/V the decode wrote
and write none (StepPlan.write_kv=False). Per variant of the decode GEMVs: the
largest logit difference relative to the logits' range, and the share of positions whose argmax
agrees. Variants: the launch rule in use; one program per row block for RMSNorm prologues too (no
resident input); no decode GEMVs at all (the unfused kernels, as verify runs them).

Then the same through the engine, as `bench speed`'s forced-acceptance row runs it: plain greedy
decoding, then speculation whose drafts are that recorded continuation (15 a step), with CUDA graphs
and eagerly; greedy speculation is lossless only if its output equals the recording. Reported: the
tokens equal before the first difference, and tau.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lucebox.bench import shapes  # noqa: E402
from lucebox.bench.forced import RecordedContinuationProposer  # noqa: E402
from lucebox.bench.speed import engine_args as bench_engine_args  # noqa: E402
from lucebox.config import EngineArgs  # noqa: E402
from lucebox.engine.block_manager import BlockManager  # noqa: E402
from lucebox.engine.engine import LLMEngine  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.engine.step_plan import StepPlan  # noqa: E402
from lucebox.kernels import routing, triton_gemv  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from lucebox.sampling import SamplingParams  # noqa: E402

CHUNK = 16
BLOCK = 16


def row_blocks_only(n, k, prologue, device):
    """The launch rule without the resident input: one program per block of rows."""
    block_n, block_k, warps, programs = RULE(n, k, prologue, device)
    if not programs:
        return block_n, block_k, warps, programs
    block_k = min(block_k, triton_gemv.RESIDENT_MAX_K // 2)
    return max(1, triton_gemv.TILE // 2 // block_k), block_k, 4, 0


RULE = triton_gemv.launch_config
GEMV_APPLIES = routing.float_gemv_applies
VARIANTS = {"launch rule": lambda: None,
            "row blocks only": lambda: setattr(triton_gemv, "launch_config", row_blocks_only),
            "no decode GEMVs": lambda: setattr(routing, "float_gemv_applies", lambda *a: False)}


@torch.inference_mode()
def compare(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    blocks = -(-(len(prompt) + tokens + CHUNK) // BLOCK)
    runner = ModelRunner(model, blocks, BLOCK)
    table: list[int] = []
    BlockManager(blocks, BLOCK).allocate(table, len(prompt) + tokens + 1)
    logits = runner.run_eager(StepPlan.forward([prompt], [0], [table])).logits
    fed, decoded = [], []
    for i in range(tokens):
        token = int(logits[-1].argmax())
        fed.append(token)
        logits = runner.run_eager(StepPlan.forward([[token]], [len(prompt) + i], [table])).logits
        decoded.append(logits[-1].float())
    decoded = torch.stack(decoded)
    verified = torch.cat([runner.run_eager(StepPlan.forward([fed[i:i + CHUNK]], [len(prompt) + i], [table],
                                                            all_logits=True, write_kv=False)).logits.float() for i in range(0, tokens, CHUNK)])
    spread = (decoded.max() - decoded.min()).item()
    diff = (decoded - verified).abs().max().item() / spread
    agree = (decoded.argmax(-1) == verified.argmax(-1)).float().mean().item()
    return diff, agree


def greedy(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Output tokens and tau (committed tokens per verify step; 1.0 without speculation)."""
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    m = out.metrics
    return out.outputs[0].token_ids, (m.num_accepted_tokens + m.num_drafts) / max(1, m.num_drafts)


def compare_engines(loaded, prompt: list[int], tokens: int, cuda_graphs: bool,
                    bench_sizing: bool = False) -> tuple[int, float, list[int]]:
    """Plain greedy decoding, then forced-acceptance speculation of its own output: tokens equal
    before the first difference, tau and the drafts accepted per verify step. bench_sizing: the
    engines sized as `bench speed`'s forced phase sizes them (a KV pool of one context, twice that
    for the speculating engine), else a roomy pool."""
    max_len = len(prompt) + tokens + 2 * CHUNK

    def engine_args(kv_factor: int, **extra) -> EngineArgs:
        if bench_sizing:
            flags = argparse.Namespace(cache_type_k="auto", cache_type_v="auto", cuda_graphs=cuda_graphs)
            return bench_engine_args(flags, max_len, loaded, kv_factor=kv_factor, **extra)
        return EngineArgs(model=loaded.source, max_model_len=max_len, max_num_seqs=1, enable_prefix_caching=False,
                          cuda_graphs=cuda_graphs, kv_cache_memory=1 << 30, **extra)
    recorded, _ = greedy(LLMEngine.from_args(engine_args(1), loaded), prompt, tokens)
    spec = {"method": "ngram", "num_speculative_tokens": CHUNK - 1, "adaptive": False}
    engine = LLMEngine.from_args(engine_args(2, speculative_config=spec), loaded)
    engine.speculator.proposer = RecordedContinuationProposer({tuple(prompt): list(recorded)})
    accepted, record = [], engine.speculator.record
    engine.speculator.record = lambda seq, drafts, n: accepted.append(n) or record(seq, drafts, n)
    got, tau = greedy(engine, prompt, tokens)
    same = next((i for i, (a, b) in enumerate(zip(got, recorded)) if a != b), min(len(got), len(recorded)))
    return same, tau, accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--quant", default="bf16", help="weights of --shape: bf16, q8_0, q4_k_m, ... (Q4_K and split "
                   "Q8_0 / Q6_K on int8 activations unless LUCEBOX_INT8_ACTIVATIONS=0)")
    p.add_argument("--model", help="a model path instead of random weights of --shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    device = torch.device(args.device)
    loaded = (load_model(args.model, dtype="auto", device=args.device) if args.model
              else shapes.build_random_model(args.shape, args.quant, device))
    loaded.model.fuse_projections()
    loaded.model.split_quant_rows()  # as the engine lays quantised rows out
    vocab = loaded.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{args.model or f'{args.shape} ({args.quant})'} on {device}: {args.tokens} greedy decode steps after a "
          f"{args.prompt_len}-token prompt, verified in chunks of {CHUNK}\n")
    print("| decode GEMVs | max logit difference / logit range | argmax agreement |\n|---|---:|---:|")
    for name, install in VARIANTS.items():
        install()
        try:
            diff, agree = compare(loaded.model, prompt, args.tokens)
        finally:
            triton_gemv.launch_config, routing.float_gemv_applies = RULE, GEMV_APPLIES
        print(f"| {name} | {diff:.2e} | {100 * agree:.1f}% |", flush=True)
    print(f"\n| engine, {args.tokens} greedy tokens | equal to plain decoding before the first difference "
          f"| forced tau |\n|---|---:|---:|")
    for graphs, sizing in ((True, False), (True, True), (False, False), (False, True)):
        if graphs and device.type != "cuda":
            continue
        same, tau, accepted = compare_engines(loaded, prompt, args.tokens, graphs, sizing)
        name = ("CUDA graphs" if graphs else "eager") + (", bench speed's KV sizing" if sizing else "")
        print(f"| {name} | {same} | {tau:.2f} (accepted per step: {accepted}) |", flush=True)


if __name__ == "__main__":
    main()
