"""Draft trees on models mixing sliding-window and full attention (Qwen2 `layer_types`, Gemma 4 with
KV-shared layers, Laguna): windows of at least a tree row (64) take trees.
Each KV cache group's K/V is compacted through its own tables, the window blocks behind the window
are released exactly as after chain steps, and greedy output equals plain decoding (and transformers)
through the window's edge, eagerly and through the tree buckets' padded static batches."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cache_manager import CacheManager
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.engine.runner import ModelRunner
from lucebox.engine.sequence import Sequence
from lucebox.engine.step_plan import RowKind, StepPlan
from lucebox.errors import UnsupportedError
from lucebox.model.cache_spec import kv_groups
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model
from tests.spec_fixtures import write_dflash_drafter

WINDOW, BLOCK, NEW = 64, 4, 40
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
KV_MEMORY = 8 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
TREE = [-1, 0, 1, 1, 0, 4, 0]  # the pending token's tree: 0 -> 1 -> {2, 3}, 0 -> 4 -> 5, 0 -> 6


def mixed_model(tokenizer_dir, path: Path, window: int) -> str:
    return str(build_hf_model("qwen2", path, tokenizer_dir, seed=5, num_hidden_layers=len(LAYER_TYPES),
                              layer_types=LAYER_TYPES, sliding_window=window))


@pytest.fixture(scope="module")
def mixed(tokenizer_dir, tmp_path_factory):
    target = mixed_model(tokenizer_dir, tmp_path_factory.mktemp("qwen2-mixed-64"), WINDOW)
    return target, write_dflash_drafter(Path(target), tmp_path_factory.mktemp("drafter"), block_size=4)


def prompts(n: int = 4, seed: int = 3) -> list[dict]:
    """Prompts of 30..60 tokens: with 40 new tokens each crosses the 64-token window."""
    g = random.Random(seed)
    return [{"prompt_token_ids": [g.randrange(380) for _ in range(g.randint(30, 60))]} for _ in range(n)]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ----------------------------------------------------------------------------- compaction per group

class MixedRunner:
    """A mixed model's runner and cache manager with one sequence prefilled with `prompt`."""

    def __init__(self, model, prompt: list[int]):
        specs = model.cache_specs()
        groups = kv_groups(specs)
        self.cache = CacheManager(specs, [64, 40], BLOCK)
        self.runner = ModelRunner(model, 64, BLOCK, groups=groups, group_blocks=[40])
        self.seq = Sequence("r", 0, [], SamplingParams())
        self.cache.admit(self.seq, [])
        self.run(prompt)
        self.seq.num_computed = len(prompt)

    def run(self, tokens: list[int], parents: list[int] | None = None):
        seq, start = self.seq, self.seq.num_computed
        self.cache.grow(seq, start + len(tokens))
        plan = StepPlan.forward([tokens], [start], [seq.block_table], [seq.window_tables], all_logits=True)
        if parents is not None:
            plan.rows[0].kind, plan.rows[0].parents = RowKind.VERIFY, parents
        return self.runner.run(plan).logits

    def kv(self, start: int, n: int) -> list[torch.Tensor]:
        """K and V of positions start..start+n-1 in every paged layer, read through its group's table."""
        out = []
        for layer, (k, v) in zip(self.runner.paged_layers, self.runner.caches):
            g = self.runner.layer_group[layer]
            table = self.seq.block_table if g == 0 else self.seq.window_tables[g - 1]
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)],
                                 device=k.values.device)
            out += [k.gather(slots, torch.float32), v.gather(slots, torch.float32)]
        return out


@pytest.mark.parametrize("path", ["eager", "static-batches"])
def test_compaction_moves_every_groups_kv_onto_the_accepted_chain(mixed, path):
    """The accepted path (rows 0, 4, 5) moved onto start + 0..2 in the full and the window group holds
    what verifying those tokens as a chain writes; so do the next step's logits."""
    model = load_model(mixed[0], dtype="float32").model
    prompt = [(7 * j) % 300 + 3 for j in range(70)]  # past the window: its early blocks are out of reach
    tree_tokens = [5, 11, 12, 13, 21, 22, 31]
    tree = MixedRunner(model, prompt)
    assert tree.runner.group_scratch  # two KV cache groups
    if path == "static-batches":
        settings = replace(tree_settings(), capture=False)
        runner = tree.runner
        runner.graphs = CudaGraphRunner(model, BLOCK, runner.scratch_block, settings, runner.group_scratch)
    tree.run(tree_tokens, TREE)
    if path == "static-batches":
        assert sum(tree.runner.graphs.tree_replays.values()) == 1
    start = len(prompt)
    tree.runner.compact_tree_rows([tree.seq.block_table], [start], [[0, 4, 5]], [tree.seq.window_tables])
    chain = MixedRunner(model, prompt)
    chain.run([5, 21, 22])
    for got, want in zip(tree.kv(start, 3), chain.kv(start, 3)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for runner in (tree, chain):
        runner.seq.num_computed = start + 3
    torch.testing.assert_close(tree.run([40, 41]), chain.run([40, 41]), atol=1e-5, rtol=1e-4)


def tree_settings():
    from lucebox.engine.graph_settings import GraphSettings
    return GraphSettings(max_model_len=160, max_batch=2, query_lens=(1, 4), tree_lens=(8,))


# ----------------------------------------------------------------------------- the engine

def tree_llm(target, drafter, budget: int, **kwargs) -> LLM:
    return LLM(target, block_size=BLOCK, kv_cache_memory=KV_MEMORY, speculative_config={
        "method": "dflash", "model": str(drafter), "tree_budget": budget, "adaptive": False}, **kwargs)


def watch_window_tables(llm) -> list[tuple[int, list[int]]]:
    """After every step: each running sequence's committed length and window-group table."""
    engine, seen = llm.engine, []
    step = engine.step

    def spy():
        out = step()
        seen.extend((s.num_computed, list(s.window_tables[0])) for s in engine.scheduler.running)
        return out
    engine.step = spy
    return seen


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-batches"])
def test_greedy_trees_on_a_mixed_window_model_equal_plain_decoding(mixed, graphs):
    target, drafter = mixed
    device = {"device": "cpu"} if graphs else {}  # static batches: the CPU's; else a GPU's real graphs if any
    plain = LLM(target, block_size=BLOCK, kv_cache_memory=KV_MEMORY, **device)
    want = ids(plain.generate(prompts(), GREEDY, use_tqdm=False))
    llm = tree_llm(target, drafter, 12, **device, **({"cuda_graphs": True} if graphs else {}))
    if graphs:
        runner = llm.engine.runner
        runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                        replace(llm.engine._graph_settings(), capture=False), runner.group_scratch)
    cache = llm.engine.scheduler.cache
    assert cache.windows == [WINDOW] and llm.engine.speculator.every_step
    seen = watch_window_tables(llm)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert ids(outs) == want
    assert sum(o.metrics.num_drafts for o in outs) > 0
    if graphs:
        assert sum(llm.engine.runner.graphs.tree_replays.values()) > 0
    released = cache.window_pools[0].released
    # Exactly the blocks behind the window of the next position are released, the rest held, none past it.
    for computed, table in seen:
        behind = max(0, computed - WINDOW + 1) // BLOCK
        assert len(table) == -(-(computed + 1) // BLOCK)
        assert all(b == released for b in table[:behind]) and released not in table[behind:]
    assert any(computed >= WINDOW + BLOCK for computed, _ in seen)  # some blocks were released
    for pool in [cache.blocks, *cache.window_pools]:
        assert pool.num_free_blocks == pool.num_blocks


def test_windows_shorter_than_a_tree_row_are_refused(tokenizer_dir, tmp_path):
    target = mixed_model(tokenizer_dir, tmp_path / "short", 32)
    drafter = write_dflash_drafter(Path(target), tmp_path / "drafter", block_size=4)
    with pytest.raises(UnsupportedError, match=r"windows of at least 64 .*\[32\]; drop tree_budget"):
        tree_llm(target, drafter, 8)
    assert LLM(target, block_size=BLOCK, kv_cache_memory=KV_MEMORY, speculative_config={
        "method": "dflash", "model": str(drafter)}).engine.speculator.tree_budget is None  # chains still work


# ----------------------------------------------------------------------------- Gemma 4 and Laguna

def off_chain_oracle(spec, want: dict, vocab: int) -> list[int]:
    """The drafter runs as usual, then each draft becomes a tree whose first three children are wrong
    and whose fourth starts the plain run's continuation (wrong again at a place moving step to step):
    accepted paths leave the top-1 chain, so every accepting verify compacts K/V (in every group).
    Returns the list of accepted-path lengths seen by the engine's compaction."""
    from lucebox.sampling.acceptance import Draft
    propose = spec.proposer.propose

    def oracle(seqs, ks):
        drafts = propose(seqs, ks)
        out = []
        for i, (seq, k, draft) in enumerate(zip(seqs, ks, drafts)):
            n = len(seq.output_token_ids)
            right = list(want[tuple(seq.prompt_token_ids)][n:n + k])
            if not right:
                out.append(draft)
                continue
            wrong_at = (n + i) % (len(right) + 1)
            if wrong_at < len(right):
                right[wrong_at] = (right[wrong_at] + 1) % vocab
            # rows 1-3: wrong children (row 1 the top-1 chain's); rows 4..: the path
            tokens = [(right[0] + j) % vocab for j in (2, 3, 4)] + right
            out.append(Draft(tokens, parents=[0, 0, 0, 0] + list(range(4, len(tokens)))))
        return out
    spec.proposer.propose = oracle


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-batches"])
@pytest.mark.parametrize("family", ["gemma4", "laguna"])
def test_greedy_trees_on_gemma4_and_laguna_with_64_token_windows(family, graphs, tokenizer_dir, tmp_path_factory):
    """Gemma 4 (KV-shared layers reading their source's compacted cache, per-layer inputs) and Laguna
    with windows of 64: trees whose accepted paths leave the top-1 chain, past the window, in a batch;
    eagerly and through the tree buckets' padded static batches (every group's tables)."""
    from tests.model.test_gemma4 import DENSE, build
    from tests.model.test_laguna import build_laguna
    if family == "gemma4":
        target = build(tmp_path_factory, tokenizer_dir, "gemma4-w64", dict(DENSE, sliding_window=WINDOW))[0]
    else:
        target = build_laguna(tmp_path_factory.mktemp("laguna-w64"), tokenizer_dir, sliding_window=WINDOW)
    drafter = write_dflash_drafter(Path(target), tmp_path_factory.mktemp("d"), taps=(0, 2), block_size=4)
    device = {"device": "cpu"} if graphs else {}  # static batches: the CPU's; else a GPU's real graphs if any
    plain = LLM(str(target), block_size=BLOCK, kv_cache_memory=KV_MEMORY, enable_prefix_caching=False, **device)
    vocab = plain.engine.loaded.config.vocab_size
    g = random.Random(4)
    batch = [[g.randrange(vocab) for _ in range(g.randint(50, 70))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = {tuple(p): o.outputs[0].token_ids
            for p, o in zip(batch, plain.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False))}
    llm = tree_llm(str(target), drafter, 8, **device, **({"cuda_graphs": True} if graphs else {}))
    if graphs:
        llm.engine.runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
    assert llm.engine.scheduler.cache.windows  # a mixed-window model: window groups beside the full one
    off_chain_oracle(llm.engine.speculator, want, vocab)
    moved = []
    compact = llm.engine.runner.compact_tree_rows
    llm.engine.runner.compact_tree_rows = lambda *a: (moved.extend(a[2]), compact(*a))[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[tuple(p)] for p in batch]
    assert len(moved) >= 10 and sum(o.metrics.num_accepted_tokens for o in outs) >= 20
    if graphs:
        assert sum(llm.engine.runner.graphs.tree_replays.values()) > 0
    cache = llm.engine.scheduler.cache
    for pool in [cache.blocks, *cache.window_pools]:
        assert pool.num_free_blocks == pool.num_blocks
