"""The dense forward used for drafter training (target features, regenerated continuations) is the
paged engine's model: same hidden states, same captured taps, same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.engine.step_plan import StepPlan
from lucebox.model.loader import load_model
from lucebox.train.lm import DenseCache, dense_forward, greedy_generate
from lucebox.train.prepare import TargetFeatures


def paged_features(model, seqs: list[list[int]], taps: tuple[int, ...]):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    blocks = BlockManager(64, 8, enable_prefix_caching=False)
    tables = []
    for s in seqs:
        table: list[int] = []
        blocks.allocate(table, len(s))
        tables.append(table)
    result = runner.run(StepPlan.forward(seqs, [0] * len(seqs), tables, all_logits=True, capture_layers=taps))
    return result.logits.cpu(), result.features.cpu()


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_dense_forward_matches_the_paged_forward_with_taps(hf_models, family):
    """mistral's fixture has a sliding window shorter than the sequences: the dense mask honours it."""
    model = load_model(str(hf_models[family]), dtype="float32").model
    taps = (0, model.config.num_layers - 1)
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 21, 9]
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    logits, captured = paged_features(model, seqs, taps)
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    features, greedy = TargetFeatures(model, list(taps))(ids.to(model.device), torch.tensor(lengths, device=model.device),
                                                         greedy=True)
    features, greedy = features.cpu(), greedy.cpu()
    rows = torch.cat([features[i, :n] for i, n in enumerate(lengths)])
    torch.testing.assert_close(rows, captured, atol=2e-5, rtol=1e-4)
    assert all(float(features[i, n:].abs().sum()) == 0 for i, n in enumerate(lengths))
    expected = torch.cat([l.argmax(-1) for l in logits.split(lengths)])
    assert torch.equal(torch.cat([greedy[i, :n] for i, n in enumerate(lengths)]), expected)


def test_cached_decode_equals_the_full_forward(hf_models):
    model = load_model(str(hf_models["mistral"]), dtype="float32").model
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1)).to(model.device)
    full = dense_forward(model, ids)
    cache = DenseCache(model, 2, 30)
    parts = [dense_forward(model, ids[:, :20], cache=cache)]
    parts += [dense_forward(model, ids[:, t:t + 1], cache=cache, start=t) for t in range(20, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)


def test_greedy_generate_equals_the_engine(hf_models):
    path = str(hf_models["qwen3"])
    llm = LLM(path, dtype="float32", kv_cache_memory=64 << 20)  # not a share of a GPU earlier tests fill
    model = llm.engine.runner.model
    prompts = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params)]
    got = greedy_generate(model, prompts.to(model.device), 24)
    assert got == [list(e) for e in expected]


def test_greedy_generate_ends_each_row_after_its_stop_token(hf_models):
    model = load_model(str(hf_models["qwen3"]), dtype="float32").model
    prompts = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3)).to(model.device)
    free = greedy_generate(model, prompts, 12)
    stop = free[0][4]
    stopped = greedy_generate(model, prompts, 12, {stop})
    first = free[0].index(stop)
    assert stopped[0] == free[0][:first + 1]
    cut = free[1].index(stop) + 1 if stop in free[1] else 12
    assert stopped[1] == free[1][:cut]
