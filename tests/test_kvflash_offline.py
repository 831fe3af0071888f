"""KVFlash offline: LLM.generate takes the prompt-dict field kv_pool per prompt (a batch may mix them), the
pool's counters say what it did, an unpooled request stays exact even after a pooled one over the same
prompt (a pooled sequence's lossy blocks are not shared through the prefix cache), and `lucebox generate
--kv-pool-tokens N --kv-pool-target` pools the bundled default model's long prompt."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.cli import main
from lucebox.default_model import BUNDLED
from lucebox.engine.kv_pool import KVPool

from tests.conftest import build_hf_model

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("kvflash-offline"), tokenizer_dir, seed=3,
                          max_position_embeddings=4096)


def prompt(seed: int, n: int = 1400) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logprobs(out) -> list[float]:
    completion = out.outputs[0]
    return [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]


def pool_llm(model) -> LLM:
    """A pool for requests that ask (no --kv-pool-target), and device KV for whole contexts too."""
    return LLM(str(model), block_size=BLOCK, max_model_len=2048, kv_pool_tokens=512, kv_reselect_interval=16,
               max_num_batched_tokens=256, kv_cache_memory=64 << 20, speculative_config={})


def test_a_batch_mixes_pooled_and_exact_prompts_and_the_pool_counts_its_work(model):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = pool_llm(model)
    pool = llm.engine.kv_pool
    empty = pool.stats()
    assert (empty.sequences, empty.host_blocks_used, empty.reselects, empty.evicted, empty.paged_in) == (0, 0, 0, 0, 0)
    assert empty.pool_tokens == 512 and empty.host_blocks * BLOCK >= 2048
    a, b = prompt(1), prompt(2)
    pooled, exact, default = llm.generate([{"prompt_token_ids": a, "kv_pool": True},
                                           {"prompt_token_ids": b, "kv_pool": False},
                                           {"prompt_token_ids": b}], params, use_tqdm=False)
    stats = pool.stats()
    assert stats.sequences == stats.host_blocks_used == 0  # all finished: host blocks given back
    assert stats.reselects >= 1 and stats.evicted >= (len(a) - 512 - 256) // BLOCK  # only the pooled one
    assert stats.paged_in <= stats.evicted

    plain = LLM(str(model), block_size=BLOCK, max_model_len=2048, max_num_batched_tokens=256, speculative_config={})
    want_a, want_b = plain.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params, use_tqdm=False)
    assert logprobs(exact) == pytest.approx(logprobs(want_b), abs=1e-5)
    assert logprobs(default) == pytest.approx(logprobs(want_b), abs=1e-5)  # no --kv-pool-target: not pooled
    assert logprobs(pooled) != pytest.approx(logprobs(want_a), abs=1e-5)  # evicted KV: lossy


def test_an_exact_request_after_a_pooled_one_on_the_same_prompt_stays_exact(model):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    ids = prompt(3)
    reference = pool_llm(model).generate({"prompt_token_ids": ids, "kv_pool": False}, params, use_tqdm=False)[0]
    llm = pool_llm(model)
    llm.generate({"prompt_token_ids": ids, "kv_pool": True}, params, use_tqdm=False)
    assert llm.engine.kv_pool.stats().evicted > 0
    again = llm.generate({"prompt_token_ids": ids, "kv_pool": False}, params, use_tqdm=False)[0]
    assert 0 < again.num_cached_tokens < len(ids) - 512  # the exact prefix is shared, the lossy rest is not
    assert logprobs(again) == pytest.approx(logprobs(reference), abs=1e-6)


@pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="models/ is not in this checkout")
def test_cli_generate_pools_the_default_models_long_prompt(monkeypatch, capsys):
    pools = []
    original = KVPool.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(KVPool, "__init__", spy)
    code = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(90))
    assert main(["generate", "--kv-pool-tokens", "512", "--kv-pool-target", "--max-model-len", "4096",
                 "--prompt", code, "--max-tokens", "24", "--temperature", "0", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(code) and "[24 tokens in" in captured.err
    (pool,) = pools
    stats = pool.stats()
    assert stats.pool_tokens == 512 and stats.reselects >= 1 and stats.evicted > 0
