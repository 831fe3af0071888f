"""Draft trees on a Qwen 3.5 hybrid target: a tree verify row computes every DeltaNet node from the
state after its ancestors only (conv window included), so each node's logits equal a chain verify of
its root-to-node path; the commit advances the state over the accepted path's stashed rows, leaving
plain decoding's state; greedy tree speculation through the engine is token-identical to plain
decoding in a batch, with prefix-cache hits served from state snapshots."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import (
    BLOCK_SIZE,
    HYBRID,
    KV,
    prompts,
    reference_logits,
    runner_for,
)
from tests.model.test_qwen3_5_moe import HYBRID_MOE
from tests.spec_fixtures import write_dflash_drafter
from tests.tree_paths import path_of

TREE = [-1, 0, 1, 2, 1, 0, 5, 6, 6, 0]  # pending token + 9 nodes in DFS order
TAPS = (0, 2)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hybrid_path(request, tmp_path_factory, tokenizer_dir):
    layout = HYBRID if request.param == "qwen3_5" else HYBRID_MOE
    return build_hf_model("qwen3", tmp_path_factory.mktemp(request.param), tokenizer_dir, **layout)


@pytest.fixture(scope="module")
def loaded(hybrid_path):
    return load_model(str(hybrid_path), dtype="float32")


def verify(runner, tokens, start, table, slot, parents=None):
    row = PlanRow(list(tokens), start, table, RowKind.VERIFY)
    row.parents = parents
    return runner.run_eager(StepPlan([row], all_logits=True, state_slots=[slot])).logits


def setup(loaded, positions: int = 10):  # the stash holds a TREE row
    runner, blocks = runner_for(loaded)
    layers = [loaded.model.layers[i].linear_attn for i in runner.recurrent_layers]
    states = [layer.cache_spec().build(4, positions, loaded.model.device) for layer in layers]
    runner.install_recurrent(states, None)
    return runner, blocks, states


def test_every_node_equals_a_chain_verify_of_its_path(loaded):
    """Tree verify logits of each node = a chain verify of the pending token and its ancestors."""
    vocab = loaded.config.vocab_size
    prompt, tokens = prompts(vocab, [9, len(TREE)], seed=3)
    runner, blocks, states = setup(loaded)
    table = []
    blocks.allocate(table, len(prompt) + len(TREE) + 1)
    runner.reset_states([2])
    runner.forward([prompt], [0], [table], state_slots=[2])
    before = [(s.state.clone(), s.conv.clone()) for s in states]
    tree = verify(runner, tokens, len(prompt), table, 2, TREE)
    assert all(torch.equal(s.state, a) and torch.equal(s.conv, b) for s, (a, b) in zip(states, before))
    leaves = [i for i in range(len(TREE)) if i not in TREE]
    checked = set()
    for leaf in leaves:
        path = path_of(TREE, leaf)
        chain = verify(runner, [tokens[i] for i in path], len(prompt), table, 2)
        for depth, node in enumerate(path):
            assert (tree[node] - chain[depth]).abs().max().item() <= 1e-4, node
            checked.add(node)
    assert checked == set(range(len(TREE)))


@pytest.mark.parametrize("leaf", [3, 4, 8, 9])
def test_commit_along_the_accepted_path_leaves_plain_decodings_state(loaded, hybrid_path, leaf):
    """After a tree verify, compacting the accepted path (K/V and stash) and committing gives the
    state (and conv window) of prefilling prompt + path, and the next token's transformers logits."""
    from transformers import AutoModelForCausalLM
    vocab = loaded.config.vocab_size
    prompt, tokens = prompts(vocab, [10, len(TREE)], seed=5)
    runner, blocks, states = setup(loaded)
    table, plain_table = [], []
    blocks.allocate(table, len(prompt) + len(TREE) + 1)
    blocks.allocate(plain_table, len(prompt) + len(TREE) + 1)
    runner.reset_states([1, 3])
    runner.forward([prompt], [0], [table], state_slots=[1])
    verify(runner, tokens, len(prompt), table, 1, TREE)
    path = path_of(TREE, leaf)
    runner.compact_tree_rows([table], [len(prompt)], [path])
    device = loaded.model.device
    moves = [(len(TREE) + row, len(TREE) + k) for k, row in enumerate(path) if row != k]  # slot 1's stash rows
    for state in states:
        if moves:
            state.compact_stash(*(torch.tensor(rows, device=device) for rows in zip(*moves)))
        state.commit(torch.tensor([1], device=device), torch.tensor([len(path) - 1], device=device))
    kept = prompt + [tokens[i] for i in path]
    runner.forward([kept], [0], [plain_table], state_slots=[3])
    for state in states:
        assert (state.state[1] - state.state[3]).abs().max().item() <= 1e-5
        assert (state.conv[1] - state.conv[3]).abs().max().item() <= 1e-6
    nxt = (kept[-1] + 7) % vocab
    got = runner.forward([[nxt]], [len(kept)], [table], state_slots=[1])
    reference = AutoModelForCausalLM.from_pretrained(hybrid_path, dtype=torch.float32).eval()
    assert (got[0].cpu() - reference_logits(reference, kept + [nxt])[-1]).abs().max().item() <= 1e-4


def test_rollback_checks_the_path(loaded):
    from lucebox.engine.cache_manager import CacheManager
    from lucebox.engine.sequence import Sequence
    runner, _, _ = setup(loaded)
    specs = [loaded.model.layers[i].linear_attn.cache_spec() for i in runner.recurrent_layers]
    cache = CacheManager(specs, 8, BLOCK_SIZE, num_slots=2, verify_positions=4)
    cache.build_recurrent(loaded.model.device)
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams())
    cache.admit(seq, [])
    for bad in ([0, 2, 1], [1, 2, 3], [0, 1]):
        with pytest.raises(ValueError, match="increasing rows from 0"):
            cache.rollback(seq, 3, 2, bad)
    with pytest.raises(ValueError, match="past the 4 stashed"):
        cache.rollback(seq, 3, 2, [0, 2, 5])


# ---------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def drafter(hybrid_path, tmp_path_factory):
    return write_dflash_drafter(hybrid_path, tmp_path_factory.mktemp("hybrid_tree_dflash"), taps=TAPS, block_size=4)


def greedy(llm, batch, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                          use_tqdm=False)]


def branch_oracle(monkeypatch, speculator, want: dict, vocab: int):
    """Drafter trees whose tokens are rewritten: the plain run's continuation lies along a path that
    leaves the top-1 chain (a later sibling), wrong from a place that moves step to step, other
    nodes hold tokens it never continues with. Accepts 0..depth nodes, off the chain."""
    propose, calls = speculator.proposer.propose, iter(range(10**6))

    def oracle(seqs, ks):
        drafts = propose(seqs, ks)
        for seq, draft in zip(seqs, drafts):
            if draft.parents is None or not draft.tokens:
                continue
            n = len(seq.output_token_ids)
            cont = list(want[tuple(seq.prompt_token_ids)][n:])
            parents = [-1] + draft.parents  # verify rows: 0 the pending token
            off_chain = [path_of(parents, row)[1:] for row in range(1, len(parents))
                         if path_of(parents, row)[1] != 1]  # below a later child of the root than row 1
            if not off_chain:
                continue
            path = max(off_chain, key=len)  # the deepest
            wrong = next(calls) % (len(path) + 1)
            tokens = [(t + 1 + row) % vocab for row, t in enumerate(draft.tokens)]  # distinct, rarely right
            for depth, row in enumerate(path):
                if depth < len(cont):
                    tokens[row - 1] = cont[depth] if depth != wrong else (cont[depth] + 1) % vocab
            for row in range(1, len(parents)):  # nothing else continues the plain output
                if row not in path:
                    d = len(path_of(parents, row)) - 2
                    if d < len(cont) and tokens[row - 1] == cont[d]:
                        tokens[row - 1] = (cont[d] + 2) % vocab
            draft.tokens = tokens
        return drafts
    monkeypatch.setattr(speculator.proposer, "propose", oracle)


def assert_snapshots_match(spec, plain, batch, outputs):
    """Prefix snapshots the tree run took (after committed paths) hold plain decoding's states of the
    same prefixes, among them states at block boundaries inside the generated tokens."""
    from lucebox.engine.block_manager import prefix_chunks
    generated = {h for p, out in zip(batch, outputs)
                 for i, (h, _) in enumerate(prefix_chunks(p + out, BLOCK_SIZE)) if (i + 1) * BLOCK_SIZE > len(p)}
    common = [key for key in spec.entries if key in plain.entries]
    for key in common:
        for got, want in zip(spec.storage, plain.storage):
            for a, b in zip(got, want):
                assert (a[spec.entries[key]] - b[plain.entries[key]]).abs().max().item() <= 1e-5
    assert any(key in generated for key in common)


@pytest.mark.parametrize("budget", [{}, {"max_num_batched_tokens": 24}])
def test_greedy_tree_speculation_on_a_hybrid_equals_plain_decoding(hybrid_path, drafter, monkeypatch, budget):
    """A continuous batch of tree verifies (plus a sequence decoding plainly), accepted paths off the
    top-1 chain of every length; then prompts extending the first ones hit the prefix cache (state
    snapshots) and still match plain decoding. A small token budget puts prompt chunks beside tree
    rows and cuts trees to DFS prefixes."""
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    vocab = plain.engine.loaded.config.vocab_size
    a, b, c = prompts(vocab, [9, 6, 13], seed=21)
    batch = [a, b, c, a[:5]]
    want = greedy(plain, batch, 16)
    config = {"method": "dflash", "model": str(drafter), "tree_budget": 20, "adaptive": False}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=config,
               **budget)
    engine = spec.engine
    oracle_want = {tuple(p): w for p, w in zip(batch, want)}
    branch_oracle(monkeypatch, engine.speculator, oracle_want, vocab)
    moved = []
    compact = engine.runner.compact_tree_rows
    monkeypatch.setattr(engine.runner, "compact_tree_rows",
                        lambda t, s, acc, *rest: (moved.extend(acc), compact(t, s, acc, *rest)))
    mixed = []  # steps with a prompt chunk beside a tree row
    run_eager = engine.runner.run_eager
    monkeypatch.setattr(engine.runner, "run_eager", lambda plan: (
        mixed.append(plan.has_trees and any(r.kind is RowKind.CHUNK for r in plan.rows)), run_eager(plan))[1])
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    outs = spec.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == want[:3]
    assert outs[3].outputs[0].token_ids == want[3][:1]
    assert engine.step_counts["verify"] > 0 and moved  # accepted paths left the top-1 chain
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert len({len(p) for p in moved}) > 1  # several accepted lengths
    assert any(mixed) == bool(budget)
    cache = engine.scheduler.cache
    assert len(cache.free_slots) == 4 and cache.snapshots is not None
    assert_snapshots_match(cache.snapshots, plain.engine.scheduler.cache.snapshots, batch, want)
    # Next turns: the prompts plus their outputs, served from cached blocks and a state snapshot.
    longer = [p + w[:10] for p, w in zip(batch[:3], want[:3])]
    want_longer = greedy(plain, longer, 10)
    loaded_before = cache.snapshots.loaded
    oracle_want.update({tuple(p): w for p, w in zip(longer, want_longer)})
    assert greedy(spec, longer, 10) == want_longer
    assert cache.snapshots.loaded > loaded_before
    assert engine.scheduler.blocks.num_free_blocks == engine.runner.num_blocks


def test_sampled_trees_follow_the_hybrid_target_distribution(tmp_path):
    """tests/spec/test_spec.py's chi-square test of speculative sampling with draft trees verified on a
    peaked hybrid target (fewer samples, as tests/model/test_qwen3_5_spec.py's chain version)."""
    from tests.spec.test_spec import PROMPT, chi_square_rejects, exact_pair_distribution, sample_pairs
    from tests.spec_fixtures import peaked_model, small_vocab_tokenizer
    tok = small_vocab_tokenizer(tmp_path / "tok", ["a", "b", "c", "d", "e", "f"])
    layout = {k: v for k, v in HYBRID.items() if k not in ("model_type", "num_hidden_layers", "head_dim")}
    target = peaked_model(tmp_path / "t", tok, layers=4, seed=1, model_type="qwen3_5_text", **layout)
    drafter = write_dflash_drafter(target, tmp_path / "d", taps=TAPS, block_size=3)
    config = {"method": "dflash", "model": str(drafter), "tree_budget": 6, "adaptive": False}
    llm = LLM(str(target), speculative_config=config, kv_cache_memory=KV, max_num_seqs=1024,
              max_num_batched_tokens=8192)
    samples = 1000
    counts = sample_pairs(llm, PROMPT, samples)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), samples)
    assert not rejected, (stat, critical)
    assert llm.engine.speculator.overall["model"].alpha > 0  # trees were accepted, not just drafted


def test_trees_beside_lookup_chains_on_a_hybrid(hybrid_path, drafter):
    """n-gram lookups draft chains where the text repeats, the drafter trees elsewhere: chain verify
    rows and tree rows share DeltaNet steps (and their commits) and the output stays plain decoding's."""
    plain = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4)
    vocab = plain.engine.loaded.config.vocab_size
    a, b, c = prompts(vocab, [5, 3, 7], seed=11)
    batch = [a * 4, b * 5 + a, c, a + c * 2]
    want = greedy(plain, batch, 16)
    config = {"method": "dflash", "model": str(drafter), "tree_budget": 10, "adaptive": False,
              "ngram_first": True, "prompt_lookup_min": 1}
    spec = LLM(str(hybrid_path), block_size=BLOCK_SIZE, kv_cache_memory=KV, max_num_seqs=4, speculative_config=config)
    assert greedy(spec, batch, 16) == want
    steps = spec.engine.speculator.steps_by_source
    assert steps["model"] > 0 and steps["lookup"] > 0
