"""`lucebox train-drafter --arch dflash2`: the batched training forward is the inference DFlash2
drafter per anchor, a fresh DFlash2 drafter computes its DFlash backbone, the selector loss is the
teacher-forced top-K cross-entropy, and a 2-step run writes a loadable DFlash2 checkpoint."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lucebox.cli import main
from lucebox.model.loader import load_model
from lucebox.spec.dflash import load_drafter
from lucebox.spec.dflash2_model import DFlash2Drafter
from lucebox.train import TrainDrafterArgs, blocks
from lucebox.train.prepare import drafter_config, init_drafter
from lucebox.train.selector import SELECTOR_WEIGHT, selector_loss
from tests.conftest import TRAINING_TEXT


@pytest.fixture(scope="module")
def loaded(hf_models):
    return load_model(str(hf_models["qwen3"]))


def dflash2_args(**kw) -> TrainDrafterArgs:
    return TrainDrafterArgs(target="", data=["x"], out="", layers=2, block_size=5, taps="0,1", arch="dflash2",
                            selector_rank=8, selector_top_k=4, **kw)


def test_training_forward_equals_the_inference_drafter_per_anchor(loaded):
    cfg = drafter_config(loaded.config, loaded.tokenizer, dflash2_args())
    drafter = init_drafter(cfg, "cpu", seed=3)
    assert isinstance(drafter, DFlash2Drafter)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))  # the convs away from identity, so every path matters
    S, T = 2, 19
    g = torch.Generator().manual_seed(0)
    features = torch.randn(S, T, 2 * loaded.config.hidden_size, generator=g)
    ids = torch.randint(0, loaded.config.vocab_size, (S, T), generator=g)
    anchors = torch.tensor([[1, 6, 13], [3, 4, 17]])
    embed = loaded.model.embed_tokens
    with torch.no_grad():
        batched = blocks.draft_hidden(drafter, embed, features, ids, anchors, cfg.mask_token_id)
        for s in range(S):
            for n, a in enumerate(anchors[s].tolist()):
                context = drafter.context_kv(features[s, :a], torch.arange(a))
                block = torch.tensor([int(ids[s, a])] + [cfg.mask_token_id] * (cfg.block_size - 1))
                one = drafter.blocks(embed(block), torch.arange(a, a + cfg.block_size), context, torch.arange(a))
                torch.testing.assert_close(batched[s, n], one, atol=2e-5, rtol=1e-4)


def test_a_fresh_dflash2_drafter_computes_its_dflash_backbone(loaded):
    """Identity convs and a zero transition: the DFlash forward and the plain argmax chain."""
    cfg = drafter_config(loaded.config, loaded.tokenizer, dflash2_args())
    v2 = init_drafter(cfg, "cpu", seed=5)
    v1_args = TrainDrafterArgs(target="", data=["x"], out="", layers=2, block_size=5, taps="0,1")
    v1 = init_drafter(drafter_config(loaded.config, loaded.tokenizer, v1_args), "cpu", seed=5)
    v1.load_state_dict({k: v for k, v in v2.state_dict().items() if k in v1.state_dict()})
    d, a = loaded.config.hidden_size, 7
    g = torch.Generator().manual_seed(1)
    features, x = torch.randn(a, 2 * d, generator=g), torch.randn(cfg.block_size, d, generator=g)
    with torch.no_grad():
        h1 = v1.blocks(x, torch.arange(a, a + 5), v1.context_kv(features, torch.arange(a)), torch.arange(a))
        h2 = v2.blocks(x, torch.arange(a, a + 5), v2.context_kv(features, torch.arange(a)), torch.arange(a))
        torch.testing.assert_close(h2, h1)
        logits = torch.randn(4, loaded.config.vocab_size, generator=g)
        assert v2.candidate_selector.walk(h2[1:], 3, logits).tokens.tolist() == logits.argmax(-1).tolist()


def test_selector_loss_is_the_teacher_forced_top_k_cross_entropy(loaded):
    cfg = drafter_config(loaded.config, loaded.tokenizer, dflash2_args())
    sel = init_drafter(cfg, "cpu", seed=2).candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.5)
    V, D, B = loaded.config.vocab_size, loaded.config.hidden_size, 3
    g = torch.Generator().manual_seed(4)
    head_w = torch.randn(V, D, generator=g)
    head = lambda h: h @ head_w.T
    hidden = torch.randn(1, 2, B, D, generator=g)
    anchor_ids = torch.tensor([[11, 12]])
    logits = head(hidden[0, :, 1:])
    labels = torch.stack([logits[0].argmax(-1), torch.tensor([5, 6])])[None]  # block 1: most likely outside top-4
    valid = torch.tensor([[[True, True], [True, False]]])
    weights = torch.tensor([1.0, 0.5])
    got = selector_loss(sel, head, hidden, anchor_ids, labels, valid, weights, V)
    want = 0.0
    for n in range(2):
        for k in range(B - 1):
            if not valid[0, n, k]:
                continue
            row, y = logits[n, k], int(labels[0, n, k])
            pred = int(anchor_ids[0, n]) if k == 0 else int(labels[0, n, k - 1])
            unary, cand = row.topk(4)
            if y not in cand.tolist():
                cand[-1], unary[-1] = y, row[y]
            ph = sel.hidden_projection.weight @ hidden[0, n, k + 1]
            scores = unary + (sel.predecessor_codebook[pred] * ph * sel.successor_codebook[cand]).sum(-1)
            want += float(weights[k]) * -float(torch.log_softmax(scores.detach(), 0)[cand.tolist().index(y)])
    assert math.isclose(float(got.detach()), SELECTOR_WEIGHT * want, rel_tol=1e-5)
    got.backward()
    assert sel.successor_codebook.grad.abs().sum() > 0 and sel.hidden_projection.weight.grad.abs().sum() > 0


def test_two_step_run_writes_a_dflash2_checkpoint(hf_models, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(TRAINING_TEXT)
    out = tmp_path / "out"
    code = main(["train-drafter", "--arch", "dflash2", "--target", str(hf_models["qwen3"]), "--data", str(data),
                 "--out", str(out), "--block-size", "4", "--seq-len", "32", "--batch-size", "2", "--anchors", "4",
                 "--steps", "2", "--selector-rank", "8", "--selector-top-k", "4", "--lr", "1e-2",
                 "--save-dtype", "float32", "--device", "cpu", "--eval-every", "0"])
    assert code == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                         "selector_rank": 8, "selector_top_k": 4}
    drafter, _ = load_drafter(out, torch.float32, "cpu")
    assert isinstance(drafter, DFlash2Drafter)
    assert drafter.candidate_selector.successor_codebook.abs().sum() > 0  # the selector trained off its zero start
    conv = drafter.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0


def test_arch_flag_is_checked():
    with pytest.raises(Exception, match="--arch"):
        TrainDrafterArgs(target="t", data=["x"], out="o", arch="dflash3").validate()


def test_evaluation_drafts_are_the_selectors_chain(loaded):
    """selector_drafts (batched over blocks, for tau at evaluation) equals the engine's walk per block."""
    from lucebox.train.selector import selector_drafts
    cfg = drafter_config(loaded.config, loaded.tokenizer, dflash2_args())
    sel = init_drafter(cfg, "cpu", seed=2).candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 1.0)
        sel.hidden_projection.weight.normal_(0, 0.5)
    V, D = loaded.config.vocab_size, loaded.config.hidden_size
    g = torch.Generator().manual_seed(8)
    head_w = torch.randn(V, D, generator=g) * 0.05
    hidden, anchors = torch.randn(2, 3, 5, D, generator=g), torch.randint(0, V, (2, 3), generator=g)
    got = selector_drafts(sel, lambda h: h @ head_w.T, hidden, anchors, V, budget_bytes=4 * V * 4)  # 4-block chunks
    plain = (hidden[:, :, 1:] @ head_w.T).argmax(-1)
    assert not torch.equal(got, plain)  # the transition changed some drafts
    for s in range(2):
        for n in range(3):
            walk = sel.walk(hidden[s, n, 1:], anchors[s, n], hidden[s, n, 1:] @ head_w.T)
            assert got[s, n].tolist() == walk.tokens.tolist()


def test_a_dflash_drafter_grows_into_dflash2_computing_the_same(loaded):
    """--init-drafter DFLASH --arch dflash2: the trained DFlash weights, identity DFlash2 parts."""
    v1_args = TrainDrafterArgs(target="", data=["x"], out="", layers=2, block_size=5, taps="0,1")
    v1 = init_drafter(drafter_config(loaded.config, loaded.tokenizer, v1_args), "cpu", seed=9)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.2 * torch.randn_like(p))
    cfg = drafter_config(loaded.config, loaded.tokenizer, dflash2_args(), start=v1.config)
    v2 = init_drafter(cfg, "cpu", seed=1, start=v1)
    assert isinstance(v2, DFlash2Drafter) and cfg.selector_top_k == 4
    d, a = loaded.config.hidden_size, 6
    g = torch.Generator().manual_seed(3)
    features, x = torch.randn(a, 2 * d, generator=g), torch.randn(5, d, generator=g)
    with torch.no_grad():
        want = v1.blocks(x, torch.arange(a, a + 5), v1.context_kv(features, torch.arange(a)), torch.arange(a))
        got = v2.blocks(x, torch.arange(a, a + 5), v2.context_kv(features, torch.arange(a)), torch.arange(a))
    torch.testing.assert_close(got, want)
