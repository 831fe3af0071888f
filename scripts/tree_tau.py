"""Tree tau on the bundled pair (CPU, T = 0) for draft-tree constructions, offline and through the engine.

At T = 0 the committed tokens are plain greedy decoding's whatever the drafts, and the drafter's pass at an
anchor depends on the committed prefix only. So one recording run (every step's draft forced wrong, so the
drafter runs at every anchor) gives the drafter's per-slot logits at every anchor; a construction's tau is
then replayed offline: build the tree at the anchor, descend while greedy's next token is a child, advance
by the accepted nodes + 1 (room and depth capped like spec/speculator.py: max_tokens - output - 1).
`--engine` also runs the real engine for the chain and the default trees (the replay must agree).
The ceiling line: what an unbounded tree holding each slot's top-k could accept.
`--drafter` names another drafter; a DFlash2 one also records its selector's lattice, for the trees over
its conditional scores (spec/tree.py build_lattice_tree) and its own chain (the selector's walk).

    python scripts/tree_tau.py [--engine] [--tokens 64] [--calibration --tokens 96] [--drafter DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from lucebox import LLM, SamplingParams
from lucebox.default_model import BUNDLED, BUNDLED_DRAFTER
from lucebox.sampling.acceptance import Draft
from lucebox.spec import tree as tree_mod

# The prompts of tests/spec/test_ddtree_bundled.py (the figure), and others the choices were checked on.
HELD_OUT = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class Stack:\n    def __init__(self):",
            "def quicksort(arr):"]
CALIBRATION = ["def binary_search(items, target):", "import os\n\ndef list_files(path):",
               "class Node:\n    def __init__(self, value):", "def merge_sort(values):",
               "def is_prime(n):", "import json\n\ndef load_config(path):"]


@dataclass
class Pass:
    """One drafter pass at an anchor: per-slot log-probs [slots, vocab]; a DFlash2 drafter's lattice
    (CandidateSelector.lattice: candidates [slots, K], raw scores [slots, K, K]) too."""
    log_probs: torch.Tensor
    candidates: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    def first(self, k: int) -> Pass:
        cut = None if self.candidates is None else (self.candidates[:k], self.scores[:k])
        return Pass(self.log_probs[:k], *(cut or ()))


def record(prompts: list[str], tokens: int, drafter: str) -> list[tuple[list[int], list[Pass]]]:
    """Per prompt: greedy's output tokens and the drafter's pass at each output length 1..tokens - 1
    (anchor = the last committed token)."""
    llm = LLM(str(BUNDLED), speculative_config={"method": "dflash", "model": drafter, "adaptive": False})
    greedy = SamplingParams(temperature=0, max_tokens=tokens + 16, ignore_eos=True)
    outs = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)}
    seen: dict[tuple[tuple[int, ...], int], Pass] = {}
    proposer = type(llm.engine.speculator.proposer)  # DFlash2Proposer has its own _draft_one
    original = proposer._draft_one

    def recording(self, seq, k):
        key = (tuple(seq.prompt_token_ids), len(seq.output_token_ids))
        logits, hidden = self._draft_pass(seq, self.block_size - 1)
        selector = getattr(self.drafter, "candidate_selector", None)
        lattice = () if selector is None else selector.lattice(hidden.float(), seq.last_token, logits.float())
        seen[key] = Pass(logits.float().log_softmax(-1), *lattice)
        wrong = (outs[key[0]][key[1]] + 1) % logits.shape[-1]
        return Draft([wrong])  # rejected: the next pass runs at the next anchor

    proposer._draft_one = recording
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True), use_tqdm=False)
    finally:
        proposer._draft_one = original
    data = []
    for prompt, out in outs.items():
        missing = [n for n in range(1, tokens) if (prompt, n) not in seen]
        if missing:
            raise RuntimeError(f"no drafter pass recorded at output lengths {missing[:5]}")
        data.append((out, [seen[(prompt, n)] for n in range(1, tokens)]))
    return data


def accepted_nodes(tree: tree_mod.DraftTree, truth: list[int]) -> int:
    row, n = 0, 0
    while n < len(truth) and (child := tree.children[row].get(truth[n])) is not None:
        row, n = child, n + 1
    return n


def replay(data, build, tokens: int) -> float:
    """tau of the construction build(Pass of k slots) -> DraftTree over the recorded anchors."""
    verifies = accepted = 0
    for out, passes in data:
        n = 1  # the prefill committed the first token
        while n < tokens:
            room = tokens - n - 1
            if room <= 0:
                n += 1
                continue
            k = min(passes[n - 1].log_probs.shape[0], room)
            a = accepted_nodes(build(passes[n - 1].first(k)), out[n:n + k])
            verifies, accepted, n = verifies + 1, accepted + a, n + a + 1
    return 1 + accepted / verifies


def coverage_ceiling(data, k: int, tokens: int) -> float:
    """tau of an unbounded tree holding the drafter's top-k at every slot under every node: the most any
    tree over these per-slot distributions can accept before the truth leaves the top-k."""
    verifies = accepted = 0
    for out, passes in data:
        n = 1
        while n < tokens:
            room = tokens - n - 1
            if room <= 0:
                n += 1
                continue
            top = passes[n - 1].log_probs[:min(passes[n - 1].log_probs.shape[0], room)].topk(k, -1).indices
            a = 0
            while a < top.shape[0] and out[n + a] in top[a].tolist():
                a += 1
            verifies, accepted, n = verifies + 1, accepted + a, n + a + 1
    return 1 + accepted / verifies


def engine_tau(prompts: list[str], tokens: int, budget: int | None, drafter: str) -> float:
    config = {"method": "dflash", "model": drafter, "adaptive": False}
    if budget is not None:
        config["tree_budget"] = budget
    outs = LLM(str(BUNDLED), speculative_config=config).generate(
        prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return 1 + sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_drafts for o in outs)


def chain(tokens: list[int]) -> tree_mod.DraftTree:
    return tree_mod.DraftTree(tokens, list(range(len(tokens))), list(range(1, len(tokens) + 1)))


def argmax_chain(p: Pass) -> tree_mod.DraftTree:
    return chain(p.log_probs.argmax(-1).tolist())


def walk_chain(p: Pass) -> tree_mod.DraftTree:
    """The selector's greedy walk (a DFlash2 drafter's chain draft)."""
    tokens, c = [], 0
    for s in range(p.candidates.shape[0]):
        c = int(p.scores[s, c].argmax())
        tokens.append(int(p.candidates[s, c]))
    return chain(tokens)


def lattice(mass: bool, chain_seed: bool = tree_mod.CHAIN_SEED):
    """Trees over the selector's conditional log-probs: its scores softmaxed over the K candidates, plus
    (mass) the log of the drafter's probability of the slot's top-K (how often the token is among them)."""
    def construction(budget: int):
        def build(p: Pass) -> tree_mod.DraftTree:
            log_probs = p.scores.log_softmax(-1)
            if mass:
                log_probs = log_probs + p.log_probs.gather(1, p.candidates).logsumexp(-1)[:, None, None]
            return tree_mod.build_lattice_tree(p.candidates, log_probs, budget, chain_seed)
        return build
    return construction


def best_first(branches: int, chain_seed: bool, chain_below_depth: bool = False):
    """A construction: top-`branches` per depth, best-first, seeded or not; chain_below_depth: budgets up to
    the depth draft the plain chain (the construction before 2026-12-05)."""
    def construction(budget: int):
        def build(p: Pass) -> tree_mod.DraftTree:
            k = 1 if chain_below_depth and budget <= p.log_probs.shape[0] else branches
            values, ids = p.log_probs.topk(k, dim=-1)  # replay only: ties among the top-K never decided a figure
            return tree_mod.tree_of(sorted(tree_mod.best_first(values.tolist(), budget, chain_seed)), ids.tolist())
        return build
    return construction


METHODS = {
    "seeded top-8 (before)": best_first(8, True, chain_below_depth=True),
    "best-first top-8": best_first(8, False),
    f"default (top-{tree_mod.BRANCHES}, seed {tree_mod.CHAIN_SEED})":
        lambda budget: lambda p: tree_mod.build_tree(p.log_probs, budget),
}
LATTICE_METHODS = {
    "lattice, within top-K": lattice(mass=False),
    "lattice, x top-K mass": lattice(mass=True),
    "lattice, x mass, walk seeded": lattice(mass=True, chain_seed=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engine", action="store_true", help="also measure the chain and default trees through the engine")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 22, 32, 48, 63])
    ap.add_argument("--calibration", action="store_true", help="the other prompts (the constructions were tuned on "
                                                                 "these and the held-out ones together)")
    ap.add_argument("--drafter", default=str(BUNDLED_DRAFTER), help="the drafter (default: the bundled one)")
    args = ap.parse_args()
    prompts = CALIBRATION if args.calibration else HELD_OUT
    data = record(prompts, args.tokens, args.drafter)
    base = replay(data, argmax_chain, args.tokens)
    selector = data[0][1][0].candidates is not None
    print(f"bundled target, {args.drafter}, CPU, T = 0, {len(prompts)} prompts x {args.tokens} tokens (replayed): "
          f"tau (x the argmax chain)" + (f"; the selector's walk: {replay(data, walk_chain, args.tokens):.2f}"
                                        if selector else ""))
    print(f"| {'construction':30s} | chain | " + " | ".join(f"{b:>11d}" for b in args.budgets) + " |")
    for name, construction in (METHODS | LATTICE_METHODS if selector else METHODS).items():
        cells = []
        for b in args.budgets:
            tau = replay(data, construction(b), args.tokens)
            cells.append(f"{tau:.2f} ({tau / base:.2f}x)")
        print(f"| {name:30s} | {base:.2f}  | " + " | ".join(cells) + " |")
    ceilings = ", ".join(f"top-{k} {coverage_ceiling(data, k, args.tokens) / base:.2f}x" for k in (2, 4, 8, 16))
    print(f"ceiling of any tree over the per-slot distributions (top-k at every slot, unbounded nodes): {ceilings}")
    if args.engine:
        cells = [f"{engine_tau(prompts, args.tokens, b, args.drafter):.2f}" for b in [None] + args.budgets]
        print(f"| {'engine (default construction)':30s} | {cells[0]}  | " + " | ".join(f"{c:>11s}" for c in cells[1:]) + " |")


if __name__ == "__main__":
    main()
