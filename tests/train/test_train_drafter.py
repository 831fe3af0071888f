"""lucebox train-drafter: the training forward is the inference drafter, a drafter trained here
speeds up the real engine losslessly, runs resume exactly, the output is the published layout,
and bad flags are clear errors."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open

from lucebox import LLM, SamplingParams
from lucebox.cli import main
from lucebox.errors import RequestError
from lucebox.model.loader import load_model
from lucebox.spec.dflash import load_drafter
from lucebox.train import TrainDrafterArgs, blocks, default_taps, train_drafter
from lucebox.train import drafter as drafter_module
from lucebox.train.data import render_conversation
from lucebox.kernels.rope import apply_rope
from lucebox.train.lm import dense_forward
from lucebox.train.prepare import drafter_config, init_drafter, resolve_mask_token

from tests.conftest import TRAINING_TEXT

WORDS = TRAINING_TEXT.split()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread is as fast as two, and immune to thread contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_lines(seed: int, lines: int, words: int = 8) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(lines)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Files of random code words: varied prompts, so the target's continuations vary too."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(10):
        (root / f"part{i}.py").write_text("\n".join(random_lines(i, 40)))
    return root


@pytest.fixture(scope="module")
def trained(hf_models, corpus, tmp_path_factory):
    """A 2-layer, block-8 drafter for the random qwen3 target, trained on its regenerated text."""
    out = tmp_path_factory.mktemp("drafter")
    code = main(["train-drafter", "--target", str(hf_models["qwen3"]), "--data", str(corpus), "--out", str(out),
                 "--block-size", "8", "--seq-len", "48", "--prompt-len", "12", "--regenerate", "--max-samples", "192",
                 "--batch-size", "16", "--anchors", "32", "--steps", "60", "--lr", "3e-3", "--eval-fraction", "0.2",
                 "--eval-every", "0"])
    assert code == 0
    return out


def test_default_taps_follow_the_reference_spread():
    assert default_taps(36) == [1, 9, 17, 25, 33]
    assert default_taps(64) == [1, 16, 31, 46, 61]
    assert default_taps(32) == [1, 8, 15, 22, 29]
    assert default_taps(4) == [1, 2, 3]
    assert default_taps(2) == [1]


def test_slot_weights_decay_with_gamma():
    w = blocks.slot_weights(16, 7.0, "cpu")
    assert w[0] == 1 and torch.allclose(w[7], torch.tensor(float(torch.exp(torch.tensor(-1.0)))))
    assert blocks.default_gamma(16) == 7 and blocks.default_gamma(8) == 4


def test_mask_token_is_a_named_mask_or_the_last_embedding_row(hf_models):
    loaded = load_model(str(hf_models["qwen3"]))
    vocab = loaded.config.vocab_size
    assert resolve_mask_token("auto", loaded.tokenizer, vocab) == vocab - 1

    class Named:
        def token_to_id(self, name):
            return 7 if name == "<|MASK|>" else None

    assert resolve_mask_token("auto", Named(), vocab) == 7
    with pytest.raises(RequestError, match="outside the target's embedding"):
        resolve_mask_token(str(vocab), loaded.tokenizer, vocab)


@pytest.mark.parametrize("causal", [False, True])
def test_training_forward_equals_the_inference_drafter_per_anchor(hf_models, causal):
    """Every block of the batched forward sees exactly what DFlashDrafter.blocks sees at inference:
    the context strictly before its anchor, and its own block (up to each row, in causal layers)."""
    loaded = load_model(str(hf_models["qwen3"]))
    args = TrainDrafterArgs(target="", data=["x"], out="", layers=2, block_size=5, taps="0,1")
    cfg = drafter_config(loaded.config, loaded.tokenizer, args)
    cfg.is_causal = causal
    drafter = init_drafter(cfg, "cpu", seed=3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))  # beyond the tiny init, so every path matters
    S, T = 2, 23
    g = torch.Generator().manual_seed(0)
    features = torch.randn(S, T, 2 * loaded.config.hidden_size, generator=g)
    ids = torch.randint(0, loaded.config.vocab_size, (S, T), generator=g)
    anchors = torch.tensor([[1, 7, 20], [4, 5, 22]])
    embed = loaded.model.embed_tokens
    with torch.no_grad():
        batched = blocks.draft_hidden(drafter, embed, features, ids, anchors, cfg.mask_token_id)
        for s in range(S):
            for n, a in enumerate(anchors[s].tolist()):
                context = drafter.context_kv(features[s, :a], torch.arange(a))
                block = torch.tensor([int(ids[s, a])] + [cfg.mask_token_id] * (cfg.block_size - 1))
                one = drafter.blocks(embed(block), torch.arange(a, a + cfg.block_size), context, torch.arange(a))
                torch.testing.assert_close(batched[s, n], one, atol=2e-5, rtol=1e-4)


def test_init_from_target_gives_the_first_draft_layer_the_targets_own_context_keys(hf_models):
    """--init-from-target: draft layers copy the target's last layers, and fc + hidden_norm make
    the first draft layer's cached context K/V exactly the target's K/V at its layer L-n."""
    loaded = load_model(str(hf_models["qwen3"]))
    target, tcfg = loaded.model, loaded.config
    L = tcfg.num_layers
    args = TrainDrafterArgs(target="", data=["x"], out="", layers=1, block_size=4, taps=f"{L - 2},{L - 1}")
    cfg = drafter_config(tcfg, loaded.tokenizer, args)
    drafter = init_drafter(cfg, "cpu", seed=0, target=target)
    ids = torch.randint(0, tcfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, features = dense_forward(target, ids, capture_layers=(L - 2, L - 1))
        (k, v), = drafter.context_kv(features[0], torch.arange(11))
        layer = target.layers[L - 1]
        attn = layer.self_attn
        h = layer.input_layernorm(features[0, :, :tcfg.hidden_size])
        cos, sin = target.rope.lookup(torch.arange(11), h.dtype)
        want_k = apply_rope(attn.k_norm(attn.k_proj(h).view(11, attn.num_kv_heads, attn.head_dim)), cos, sin)
        want_v = attn.v_proj(h).view(11, attn.num_kv_heads, attn.head_dim)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, want_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter.layers[0].mlp.down_proj.weight, layer.mlp.down_proj.weight)
    with pytest.raises(RequestError, match=f"needs layer {L - 2}"):
        init_drafter(drafter_config(tcfg, loaded.tokenizer, TrainDrafterArgs(
            target="", data=["x"], out="", layers=1, taps=f"{L - 1}")), "cpu", seed=0, target=target)


def test_anchors_need_context_and_a_trained_token_after_them():
    lengths = torch.tensor([6, 3])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    ok = blocks.anchor_candidates(lengths, mask)
    assert ok.tolist() == [[False, True, False, True, True, False], [False, True, False, False, False, False]]
    anchors, keep = blocks.sample_anchors(ok, 8, torch.Generator().manual_seed(0))
    assert anchors[0][keep[0]].tolist() == [1, 3, 4] and anchors[1][keep[1]].tolist() == [1]


def test_walk_replays_speculation_one_verify_step_at_a_time():
    # anchor 1 accepts 3 drafts (commits 4 tokens), anchor 5 accepts 1 (commits 2), then the end
    assert blocks.walk([0, 3, 0, 0, 0, 1, 0, 0], start=1, length=8) == (6, 2)


def test_chat_records_train_only_on_assistant_tokens(hf_models):
    tokenizer = load_model(str(hf_models["qwen3"])).tokenizer
    messages = [{"role": "user", "content": "push"}, {"role": "assistant", "content": "self.items"},
                {"role": "user", "content": "pop"}, {"role": "assistant", "content": "return a"}]
    ids, mask, prompt_len = render_conversation(tokenizer, messages, "chat.jsonl:1")
    trained = tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert trained == "self.items<|im_end|>\nreturn a<|im_end|>\n"
    assert tokenizer.decode(ids[:prompt_len].tolist(), skip_special_tokens=False).endswith(
        "pop<|im_end|>\n<|im_start|>assistant\n")


def test_trained_drafter_speeds_up_the_engine_losslessly(hf_models, trained):
    """tau well above 1 on prompts the training never saw, and output token-identical to plain greedy."""
    prompts = random_lines(1234, 6, words=5)  # whole words, like the training prompts; never in the data
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(hf_models["qwen3"]), block_size=4).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(hf_models["qwen3"]), block_size=4,
               speculative_config={"method": "dflash", "model": str(trained), "adaptive": False})
    outs = spec.generate(prompts, params, use_tqdm=False)
    for p, o in zip(plain, outs):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
    drafts = sum(o.metrics.num_drafts for o in outs)
    tau = (sum(o.metrics.num_accepted_tokens for o in outs) + drafts) / drafts
    assert tau >= 1.5, f"tau {tau:.2f}"
    log = [json.loads(line) for line in (trained / "training_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 60 and log[-1]["tau"] >= 1.5  # the offline estimate agrees


def test_output_is_the_published_layout(hf_models, trained):
    raw = json.loads((trained / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert raw["dflash_config"]["target_layer_ids"] == [1]  # default_taps(2)
    assert raw["dflash_config"]["mask_token_id"] == raw["vocab_size"] - 1
    with safe_open(str(trained / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in names)
    drafter, _ = load_drafter(trained, torch.float32, "cpu")
    assert drafter.config.target_layer_ids == [1] and len(drafter.layers) == 2


def test_resume_continues_exactly_from_the_saved_step(hf_models, corpus, tmp_path, monkeypatch):
    common = dict(target=str(hf_models["qwen3"]), data=[str(corpus)], block_size=4, seq_len=24, batch_size=4,
                  anchors=8, steps=6, eval_every=0, save_every=3, max_samples=24, eval_samples=4, progress=False)
    straight = train_drafter(TrainDrafterArgs(out=str(tmp_path / "a"), **common))

    calls = {"n": 0}
    original = blocks.draft_hidden

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # after the step-3 checkpoint
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(blocks, "draft_hidden", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(TrainDrafterArgs(out=str(tmp_path / "b"), **common))
    monkeypatch.setattr(blocks, "draft_hidden", original)
    with pytest.raises(RequestError, match="--resume"):
        train_drafter(TrainDrafterArgs(out=str(tmp_path / "b"), **common))
    resumed = train_drafter(TrainDrafterArgs(out=str(tmp_path / "b"), resume=True, **common))
    assert (resumed.start_step, resumed.step) == (3, 6)
    a, b = (load_drafter(r.out, torch.float32, "cpu")[0].state_dict() for r in (straight, resumed))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_max_seconds_fits_the_schedule_to_the_budget_and_stops(hf_models, corpus, tmp_path):
    args = TrainDrafterArgs(target=str(hf_models["qwen3"]), data=[str(corpus)], out=str(tmp_path / "t"), block_size=4,
                            seq_len=24, batch_size=4, anchors=8, steps=1_000_000, eval_every=0, max_samples=24,
                            eval_samples=4, max_seconds=2.0, progress=False)
    result = train_drafter(args)
    assert 20 < result.step < 1_000_000  # past the timed probe, far short of --steps
    assert result.seconds < 30


def test_exported_weights_are_bf16_by_default(trained):
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


@pytest.mark.parametrize("flags, message", [
    (["--taps", "0,5"], "outside the target's 2 layers"),
    (["--taps", "one"], "comma-separated"),
    (["--mask-token-id", "100000"], "outside the target's embedding"),
    (["--block-size", "1"], "--block-size"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-seconds", "0"], "--max-seconds"),
    (["--seq-len", "100000"], "exceeds the target's context"),
    (["--resume"], "no training run to continue"),
    (["--data", "/nonexistent/file.txt"], "no such file"),
])
def test_bad_flags_are_clear_errors(hf_models, corpus, tmp_path, capsys, flags, message):
    argv = ["train-drafter", "--target", str(hf_models["qwen3"]), "--data", str(corpus), "--out",
            str(tmp_path / "out"), "--steps", "1", "--seq-len", "32", *flags]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_jsonl_text_and_chat_records_train(hf_models, tmp_path):
    records = [{"text": line} for line in random_lines(5, 12, words=20)]
    records += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in zip(random_lines(6, 12, words=4), random_lines(7, 12, words=10))]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    result = train_drafter(TrainDrafterArgs(target=str(hf_models["qwen3"]), data=[str(data)], out=str(tmp_path / "o"),
                                            block_size=4, seq_len=48, batch_size=4, anchors=8, steps=2,
                                            eval_fraction=0.2, progress=False))
    assert result.step == 2 and result.final is not None and result.final.steps > 0


def test_eval_data_is_the_held_out_set_and_all_of_data_trains(hf_models, corpus, tmp_path, monkeypatch):
    """--eval-data: the held-out samples are exactly those files' text, and no --data file is held out
    (--eval-fraction, which would hold out 2 of the 10 corpus files, is ignored)."""
    held_dir = tmp_path / "held"
    held_dir.mkdir()
    held_texts = ["\n".join(random_lines(100 + i, 20)) for i in range(2)]
    for i, text in enumerate(held_texts):
        (held_dir / f"unseen{i}.py").write_text(text)
    seen = {}
    original = drafter_module._samples

    def spy(*args, **kwargs):
        seen["train"], seen["held"] = original(*args, **kwargs)
        return seen["train"], seen["held"]

    monkeypatch.setattr(drafter_module, "_samples", spy)
    result = train_drafter(TrainDrafterArgs(
        target=str(hf_models["qwen3"]), data=[str(corpus)], out=str(tmp_path / "o"), eval_data=[str(held_dir)],
        eval_fraction=0.2, eval_samples=1000, block_size=4, seq_len=32, batch_size=4, anchors=8, steps=1,
        progress=False))
    assert result.final is not None and result.final.steps > 0
    tokenizer = load_model(str(hf_models["qwen3"])).tokenizer

    def text(samples):  # packed windows in order: together they are the documents back to back
        return tokenizer.decode(torch.cat([s.ids for s in samples]).tolist(), skip_special_tokens=False)

    trained, held = text(seen["train"]), text(seen["held"])
    data_texts = [f.read_text() for f in sorted(corpus.iterdir())]
    assert all(t in held and t not in trained for t in held_texts)
    assert all(t[:200] in trained and t[:200] not in held for t in data_texts)


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file or directory"),
    ("empty", "the directory holds no files"),
    ("binary", "none of the files holds UTF-8 text"),
    ("tiny", "gives no held-out sample"),
])
def test_bad_eval_data_is_a_clear_error_naming_it(hf_models, corpus, tmp_path, capsys, kind, message):
    bad = tmp_path / kind
    if kind == "empty":
        bad.mkdir()
    elif kind == "binary":
        bad.write_bytes(b"\0\1\2" * 100)
    elif kind == "tiny":
        bad.write_text("x")
    argv = ["train-drafter", "--target", str(hf_models["qwen3"]), "--data", str(corpus), "--eval-data", str(bad),
            "--out", str(tmp_path / "out"), "--steps", "1", "--seq-len", "32"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --eval-data") and message in err and "Traceback" not in err
    assert kind == "tiny" or str(bad) in err


def test_regenerated_data_is_keyed_by_the_eval_data(hf_models, corpus, tmp_path, monkeypatch):
    """regenerated.pt is reused by a resumed run with the same --eval-data, never with other eval files."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "unseen.py").write_text("\n".join(random_lines(ord(name), 10)))
    common = dict(target=str(hf_models["qwen3"]), data=[str(corpus)], regenerate=True, seq_len=24, prompt_len=8,
                  max_samples=8, eval_samples=4, block_size=4, batch_size=4, anchors=8, steps=1, progress=False)
    train_drafter(TrainDrafterArgs(out=str(tmp_path / "run_a"), eval_data=[str(tmp_path / "a")], **common))
    calls = []
    original = drafter_module.regenerate
    monkeypatch.setattr(drafter_module, "regenerate", lambda *a, **k: calls.append(1) or original(*a, **k))
    resumed = train_drafter(TrainDrafterArgs(out=str(tmp_path / "run_a"), eval_data=[str(tmp_path / "a")],
                                             resume=True, **common))
    assert resumed.start_step == 1 and resumed.final is not None and calls == []
    (tmp_path / "run_b").mkdir()
    shutil.copy(tmp_path / "run_a" / "regenerated.pt", tmp_path / "run_b")  # as REGEN_FROM does
    train_drafter(TrainDrafterArgs(out=str(tmp_path / "run_b"), eval_data=[str(tmp_path / "b")], **common))
    assert len(calls) == 2  # train and held-out regenerated anew


def test_eval_data_may_not_also_be_trained_on(hf_models, corpus, tmp_path, capsys):
    argv = ["train-drafter", "--target", str(hf_models["qwen3"]), "--data", str(corpus), "--eval-data",
            str(corpus / "part3.py"), "--out", str(tmp_path / "out"), "--steps", "1", "--seq-len", "32"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "part3.py is also in --data" in err and "Traceback" not in err


def test_bad_jsonl_record_names_the_line(hf_models, tmp_path, capsys):
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"prompt": 1}\n')
    argv = ["train-drafter", "--target", str(hf_models["qwen3"]), "--data", str(bad), "--out", str(tmp_path / "o"),
            "--seq-len", "32"]
    assert main(argv) == 1
    assert f"{bad}:2" in capsys.readouterr().err
