"""PFlash scores: the chunked, paged scorer equals a dense computation from transformers' attention maps."""
from __future__ import annotations

import pytest
import torch

from lucebox.engine.pflash import score as score_module
from lucebox.engine.pflash.score import TailAttentionScorer, pool_scores
from lucebox.model.loader import load_model

from tests.conftest import build_hf_model


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("scorer"), tokenizer_dir, seed=3, num_hidden_layers=3)


def dense_scores(path, ids: list[int], lookahead: int, window: int, attend: int | None = None) -> torch.Tensor:
    """Every layer's full attention map from transformers (eager): the last `lookahead` rows, max over heads
    and layers, mean over those rows, then a plain windowed mean clipped at the edges. attend: rows before
    the last `lookahead` see only their last `attend` keys (a 4D mask); the last rows see every key."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    s = len(ids)
    mask = None
    if attend is not None:
        row, key = torch.arange(s)[:, None], torch.arange(s)[None, :]
        seen = (key <= row) & ((row - key < attend) | (row >= s - lookahead))
        mask = torch.zeros(1, 1, s, s).masked_fill_(~seen, torch.finfo(torch.float32).min)
    with torch.no_grad():
        maps = model(torch.tensor([ids]), attention_mask=mask, output_attentions=True).attentions  # [1, H, S, S]
    tail = torch.stack([m[0, :, -lookahead:, :] for m in maps])  # [layers, H, L, S]
    per_token = tail.amax(dim=(0, 1)).mean(0)
    half = window // 2
    return torch.stack([per_token[max(0, i - half):min(s, i + half + 1)].mean() for i in range(s)])


@pytest.mark.parametrize("chunk,key_chunk", [(4096, 16384), (17, 23)])
def test_scores_equal_dense_reference(qwen3_path, monkeypatch, chunk, key_chunk):
    monkeypatch.setattr(score_module, "KEY_CHUNK", key_chunk)
    loaded = load_model(str(qwen3_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, loaded.model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    scorer = TailAttentionScorer(loaded.model, max_tokens=128, block_size=4, chunk=chunk, window=None)
    got = scorer.score(ids)
    want = dense_scores(qwen3_path, ids, 8, 13)
    assert got.shape == (90,)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # the tail queries attend causally: the attention mass they spread sums to 1 per query
    unpooled = TailAttentionScorer(loaded.model, max_tokens=128, block_size=4, chunk=chunk, pool_window=1).score(ids)
    assert unpooled[-1] > 0 and unpooled.sum() >= 1 - 1e-5


@pytest.mark.parametrize("chunk", [64, 17])
def test_a_windowed_pass_equals_the_reference_with_that_mask(qwen3_path, chunk):
    """Positions before the tail attend to their last `window` keys; the tail's queries to every key."""
    loaded = load_model(str(qwen3_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, loaded.model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    got = TailAttentionScorer(loaded.model, max_tokens=160, block_size=4, chunk=chunk, window=24).score(ids)
    torch.testing.assert_close(got, dense_scores(qwen3_path, ids, 8, 13, attend=24), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got, dense_scores(qwen3_path, ids, 8, 13), rtol=1e-3, atol=1e-5)  # the window bit
    assert all(layer.self_attn.sliding_window is None for layer in loaded.model.layers)  # put back
    # a window past the prompt changes nothing
    whole = TailAttentionScorer(loaded.model, max_tokens=160, block_size=4, chunk=chunk, window=150).score(ids)
    torch.testing.assert_close(whole, dense_scores(qwen3_path, ids, 8, 13), rtol=1e-4, atol=1e-6)


def test_scorer_is_reusable_and_checks_length(qwen3_path):
    loaded = load_model(str(qwen3_path), dtype=torch.float32, device="cpu")
    scorer = TailAttentionScorer(loaded.model, max_tokens=32, block_size=4, chunk=8)
    first = scorer.score(list(range(3, 30)))
    assert torch.equal(first, scorer.score(list(range(3, 30))))
    assert "attend" not in loaded.model.layers[0].self_attn.__dict__  # the query taps are removed
    with pytest.raises(ValueError, match="holds 1..32 tokens"):
        scorer.score(list(range(40)))


def test_pool_scores_edges():
    x = torch.tensor([3.0, 0.0, 0.0, 0.0, 6.0])
    torch.testing.assert_close(pool_scores(x, 3), torch.tensor([1.5, 1.0, 0.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="odd"):
        pool_scores(x, 4)
