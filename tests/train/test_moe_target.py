"""Training a DFlash drafter for MoE targets: Qwen3.5-MoE (Gated DeltaNet + gated attention, a
sparse MoE FFN with a shared expert in every layer) and Qwen3-MoE (plain attention, sparse MoE).
The target's tapped features are transformers' hidden states, one training step runs and writes a
drafter the engine speculates with losslessly, and --regenerate's greedy text is the target's."""
from __future__ import annotations

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.cli import main
from lucebox.errors import RequestError
from lucebox.model.loader import load_model
from lucebox.spec.dflash import load_drafter
from lucebox.train import TrainDrafterArgs
from lucebox.train.lm import greedy_generate
from lucebox.train.prepare import TargetFeatures, drafter_config, init_drafter
from tests.conftest import TRAINING_TEXT, build_hf_model
from tests.model.test_qwen3_5_moe import HYBRID_MOE

TARGETS = {"qwen3_5_moe": ("qwen3", HYBRID_MOE), "qwen3_moe": ("qwen3_moe", {})}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory, tokenizer_dir):
    family, overrides = TARGETS[request.param]
    return build_hf_model(family, tmp_path_factory.mktemp(request.param), tokenizer_dir, **overrides)


@pytest.fixture(scope="module")
def reference(target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def test_target_features_are_transformers_hidden_states(target, reference):
    """Right-padded rows of different lengths: each real position's taps and greedy token equal
    transformers' on that row alone (padding after a row never reaches it)."""
    loaded = load_model(str(target), dtype="float32")
    taps = (0, 2, 3)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([13, 7, 10])
    ids = torch.randint(0, loaded.config.vocab_size, (3, 13), generator=g)
    features, greedy = TargetFeatures(loaded.model, list(taps))(ids, lengths, greedy=True)
    for row, n in enumerate(lengths.tolist()):
        with torch.no_grad():
            out = reference(ids[row:row + 1, :n], output_hidden_states=True)
        want = torch.cat([out.hidden_states[t + 1][0] for t in taps[:-1]], dim=-1)
        # The last layer's tap is the residual stream before the final norm; transformers' last
        # hidden state is after it: compare the others and the greedy tokens.
        width = want.shape[-1]
        assert (features[row, :n, :width] - want).abs().max().item() <= 1e-4
        assert greedy[row, :n].tolist() == out.logits[0].argmax(-1).tolist()
        assert features[row, n:].abs().sum() == 0


def test_regenerated_text_is_the_targets_greedy_continuation(target, reference):
    loaded = load_model(str(target), dtype="float32")
    prompts = torch.tensor([[5, 9, 14, 2], [7, 7, 30, 1]])
    got = greedy_generate(loaded.model, prompts, 6)
    for row, continuation in zip(prompts, got):
        with torch.no_grad():
            want = reference.generate(row[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, 4:].tolist()
        assert continuation == want


def test_one_training_step_writes_a_drafter_that_speculates_losslessly(target, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_text(TRAINING_TEXT * 4)
    out = tmp_path / "drafter"
    code = main(["train-drafter", "--target", str(target), "--data", str(data), "--out", str(out),
                 "--block-size", "4", "--seq-len", "32", "--layers", "1", "--taps", "0,2", "--batch-size", "4",
                 "--anchors", "8", "--steps", "1", "--eval-fraction", "0.2", "--eval-every", "0"])
    assert code == 0
    drafter, _ = load_drafter(out, torch.float32, "cpu")
    assert drafter.config.target_layer_ids == [0, 2]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = [{"prompt_token_ids": [5, 9, 14, 2 + i]} for i in range(2)]
    plain = [o.outputs[0].token_ids for o in LLM(str(target)).generate(batch, params, use_tqdm=False)]
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(out), "adaptive": False,
                                               "num_speculative_tokens": 3})
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_init_from_target_names_what_it_cannot_copy(target):
    loaded = load_model(str(target), dtype="float32")
    args = TrainDrafterArgs(target="", data=["x"], out="", layers=1, block_size=4, taps="0,2")
    cfg = drafter_config(loaded.config, loaded.tokenizer, args)
    with pytest.raises(RequestError, match="--init-from-target"):
        init_drafter(cfg, "cpu", seed=0, target=loaded.model)
