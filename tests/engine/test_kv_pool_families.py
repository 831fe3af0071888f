"""KVFlash on the other families: a hybrid (Gated DeltaNet layers keep their state; only the full-attention
layers are pooled), Gemma 4 and Laguna (sliding-window layers beside full ones: the tail spans the window).
Each decodes what transformers decodes with the evicted positions masked out of every step."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.model.kv_pool.score import ChunkSummaries
from tests.conftest import build_hf_model
from tests.engine.test_kv_pool_engine import BLOCK, masked_reference, run_recording_views
from tests.model.test_gemma4 import DENSE
from tests.model.test_laguna import build_laguna
from tests.model.test_qwen3_5 import HYBRID

LONG = dict(max_position_embeddings=2048)


def build(family: str, out, tokenizer_dir):
    if family == "laguna":
        return build_laguna(out, tokenizer_dir, **LONG)
    return build_hf_model("qwen3", out, tokenizer_dir, **{**(HYBRID if family == "qwen3_5" else DENSE), **LONG})


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "laguna"])
def test_pooled_decode_equals_attention_over_the_resident_positions(family, tmp_path, tokenizer_dir, monkeypatch):
    path = build(family, tmp_path / family, tokenizer_dir)
    generator = torch.Generator().manual_seed(1)  # shuffled scores: every choice differs, blocks come back
    monkeypatch.setattr(ChunkSummaries, "scores", lambda self, q: torch.rand(self.count, generator=generator))
    prompt = torch.randint(0, 380, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(path), block_size=BLOCK, max_model_len=1024, kv_pool_tokens=512, kv_pool_target=True,
              kv_reselect_interval=16, max_num_batched_tokens=1024, speculative_config={},
              enable_prefix_caching=False)  # one prompt chunk (a hybrid cuts it at its snapshot boundary)
    steps = 60
    out, resident, _ = run_recording_views(llm, prompt, SamplingParams(temperature=0, max_tokens=steps,
                                                                      ignore_eos=True, logprobs=0))
    assert any(r is not None and len(r) < len(prompt) for r in resident)  # positions were evicted
    tokens, logprobs = masked_reference(path, prompt, resident, steps)
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    got = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
    assert got == pytest.approx(logprobs, abs=5e-4)
