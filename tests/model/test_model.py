"""The transformer computes what transformers computes, for every supported family."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.model.loader import load_model

from tests.conftest import FAMILIES

PROMPT_LENGTHS = [5, 17, 11]
BLOCK_SIZE = 4  # small, so sequences span several blocks and block tables interleave


def random_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def reference_logits(path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def make_runner(loaded, num_blocks=64):
    return ModelRunner(loaded.model, num_blocks, BLOCK_SIZE), BlockManager(num_blocks, BLOCK_SIZE)


def prefill_logits(loaded, prompts) -> list[torch.Tensor]:
    """Each prompt's logits at every position, from one batched one-shot prefill."""
    runner, blocks = make_runner(loaded)
    tables = [[] for _ in prompts]
    for table, prompt in zip(tables, prompts):
        blocks.allocate(table, len(prompt))
    logits = runner.forward(prompts, [0] * len(prompts), tables, all_logits=True)
    return list(logits.split([len(p) for p in prompts]))


def load(path, fused: bool):
    """The model as loaded, or with q/k/v and gate/up fused into one GEMV each (as engines run it)."""
    loaded = load_model(str(path), dtype="float32")
    if fused:
        params = sum(p.numel() for p in loaded.model.parameters())
        loaded.model.fuse_projections()
        attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
        assert attn.qkv is not None and mlp.gate_up is not None
        # The modules' weights are slices of the fused tensors, k's rows right after q's: nothing is stored twice.
        q = attn.q_proj.weight
        assert attn.k_proj.weight.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
        assert sum(p.numel() for p in loaded.model.parameters()) == params
    return loaded


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_logits_match_transformers(family, fused, hf_models):
    loaded = load(hf_models[family], fused)
    prompts = random_prompts(loaded.config.vocab_size)
    for prompt, got in zip(prompts, prefill_logits(loaded, prompts)):
        expected = reference_logits(hf_models[family], prompt)
        assert (got.cpu() - expected).abs().max().item() <= 1e-4, family


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decode_through_paged_cache_matches_full_forward(family, fused, hf_models):
    """Prefill a prefix, then feed tokens one (and three) at a time: logits equal one full forward."""
    loaded = load(hf_models[family], fused)
    prompt = random_prompts(loaded.config.vocab_size, seed=2)[1]
    expected = reference_logits(hf_models[family], prompt)
    runner, blocks = make_runner(loaded)
    table: list[int] = []
    blocks.allocate(table, len(prompt))
    pos, rows = 6, [runner.forward([prompt[:6]], [0], [table], all_logits=True)]
    for step in (1, 3, 1, 1, 3, 1, 1):
        chunk = prompt[pos:pos + step]
        rows.append(runner.forward([chunk], [pos], [table], all_logits=True))
        pos += len(chunk)
    got = torch.cat(rows).cpu()
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4
