"""Qwen 3.5 dense hybrids (Gated DeltaNet + gated attention) compute what transformers computes:
prefill in one shot and in unaligned chunks, decode, batches of sequences in their own recurrent
slots, greedy generation through the engine, and the ConditionalGeneration checkpoint form."""
from __future__ import annotations

import shutil

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.model.deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule
from lucebox.model.loader import load_model
from tests.conftest import build_hf_model

BLOCK_SIZE = 4
KV = 64 << 20  # an engine's KV pool in tests that keep two engines live (the default pool would take the card)
HYBRID = dict(model_type="qwen3_5_text", num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_5"), tokenizer_dir, **HYBRID)


@pytest.fixture(scope="module")
def reference(hybrid_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hybrid_path, dtype=torch.float32).eval()


def reference_logits(reference, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]


def prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def runner_for(loaded, num_blocks: int = 96):
    return ModelRunner(loaded.model, num_blocks, BLOCK_SIZE, state_slots=4), BlockManager(num_blocks, BLOCK_SIZE)


def test_chunked_delta_rule_equals_the_token_scan():
    g = torch.Generator().manual_seed(0)
    heads, length, dk, dv = 3, 37, 8, 5
    q = torch.nn.functional.normalize(torch.randn(heads, length, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(heads, length, dk, generator=g), dim=-1)
    v = torch.randn(heads, length, dv, generator=g)
    decay = -torch.rand(heads, length, generator=g) * 2
    beta = torch.rand(heads, length, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    want, want_state = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    for chunk in (4, 16, 64):  # a partial last block, several blocks, one padded block
        got, got_state = chunked_gated_delta_rule(q, k, v, decay, beta, state, chunk)
        assert (got - want).abs().max() < 1e-5 and (got_state - want_state).abs().max() < 1e-5


def test_batched_prefill_matches_transformers(hybrid_path, reference):
    loaded = load_model(str(hybrid_path), dtype="float32")
    assert [type(layer.mixer).__name__ for layer in loaded.model.layers] == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    batch = prompts(loaded.config.vocab_size, [5, 70, 17])  # 70: past one 64-token block of the chunked rule
    runner, blocks = runner_for(loaded)
    tables = [[] for _ in batch]
    for table, prompt in zip(tables, batch):
        blocks.allocate(table, len(prompt))
    runner.reset_states([2, 0, 3])
    logits = runner.forward(batch, [0] * 3, tables, all_logits=True, state_slots=[2, 0, 3])
    start = 0
    for prompt in batch:
        got = logits[start:start + len(prompt)]
        assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-4
        start += len(prompt)


def test_chunked_prefill_and_decode_carry_the_state(hybrid_path, reference):
    """Unaligned chunks, single-token decodes, and two sequences stepping together in one batch
    (one mid-prefill, one decoding): each slot continues exactly where its last step stopped."""
    loaded = load_model(str(hybrid_path), dtype="float32")
    a, b = prompts(loaded.config.vocab_size, [42, 29], seed=3)
    runner, blocks = runner_for(loaded)
    table_a, table_b = [], []
    blocks.allocate(table_a, len(a))
    blocks.allocate(table_b, len(b))
    runner.reset_states([1, 2])
    rows_a, rows_b, pos_a, pos_b = [], [], 0, 0
    for step_a, step_b in ((7, 1), (1, 3), (13, 1), (1, 1), (3, 11), (1, 1), (15, 5), (1, 7)):
        step_b = min(step_b, len(b) - pos_b)
        out = runner.forward([a[pos_a:pos_a + step_a], b[pos_b:pos_b + step_b]], [pos_a, pos_b], [table_a, table_b],
                             all_logits=True, state_slots=[1, 2])
        rows_a.append(out[:step_a])
        rows_b.append(out[step_a:])
        pos_a, pos_b = pos_a + step_a, pos_b + step_b
    assert (pos_a, pos_b) == (len(a), len(b))
    assert (torch.cat(rows_a) - reference_logits(reference, a)).abs().max().item() <= 1e-4
    assert (torch.cat(rows_b) - reference_logits(reference, b)).abs().max().item() <= 1e-4


def test_greedy_generation_in_a_continuous_batch_equals_transformers(hybrid_path, reference):
    """Requests of different lengths join at different steps, prompts in chunks of 8 tokens."""
    llm = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=3,
              enable_prefix_caching=True)
    engine = llm.engine
    assert engine.scheduler.cache.snapshots is not None  # prefix reuse through recurrent-state snapshots
    batch = prompts(engine.loaded.config.vocab_size, [19, 6, 12], seed=4)
    batch[2][:6] = batch[0][:6]  # a shared prefix, served only where a state snapshot makes it exact
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    arrivals = {0: 0, 2: 1, 5: 2}  # step -> the request that arrives then
    got, step = {}, 0
    while len(got) < len(batch):
        if step in arrivals:
            engine.add_request(str(arrivals[step]), {"prompt_token_ids": batch[arrivals[step]]}, params)
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert len(engine.scheduler.cache.free_slots) == 3  # every slot back
    for i, prompt in enumerate(batch):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      min_new_tokens=10)[0, len(prompt):].tolist()
        assert list(got[i]) == want, i


def test_conditional_generation_checkpoint_loads_the_text_model(tmp_path, tokenizer_dir, hybrid_path, reference):
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration
    text = {k: v for k, v in AutoConfig.from_pretrained(hybrid_path).to_dict().items()
            if k not in ("architectures", "transformers_version", "dtype")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, temporal_patch_size=1, num_position_embeddings=16)
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision,
                                  tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    missing = model.model.language_model.load_state_dict(reference.model.state_dict())
    assert not missing.missing_keys
    model.lm_head.load_state_dict(reference.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, tmp_path / file)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.config.family == "qwen3_5" and loaded.config.num_layers == 4
    prompt = prompts(loaded.config.vocab_size, [9], seed=6)[0]
    runner, blocks = runner_for(loaded)
    table = []
    blocks.allocate(table, len(prompt))
    runner.reset_states([0])
    got = runner.forward([prompt], [0], [table], all_logits=True, state_slots=[0])
    assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


def test_the_prefill_warm_up_runs_the_chunk_route_on_scratch_state(hybrid_path):
    loaded = load_model(str(hybrid_path), dtype="float32")
    before = {name: t.clone() for name, t in loaded.model.state_dict().items()}
    loaded.model.warm_up()  # the engine calls it on CUDA (fla-core's first call compiles there)
    after = loaded.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
