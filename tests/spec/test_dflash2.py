"""DFlash2 drafters: the network and the selector equal a reference written here from the published
layout (loops over rows, taps and channels; no lucebox modules), a synthetic checkpoint in that
layout loads through the engine, and speculation with it is lossless."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lucebox import LLM, SamplingParams
from lucebox.errors import CheckpointError
from lucebox.model.config import ModelConfig
from lucebox.spec.dflash import load_drafter
from lucebox.spec.dflash2 import DFlash2Proposer
from lucebox.spec.dflash2_model import DFlash2Drafter
from tests.spec.test_spec import (
    PROMPT,
    SAMPLES,
    chi_square_rejects,
    exact_pair_distribution,
    sample_pairs,
)
from tests.spec_fixtures import peaked_model, small_vocab_tokenizer

HEADS, KV_HEADS, HEAD_DIM, FFN, EPS, THETA = 4, 2, 16, 48, 1e-6, 10000.0


def published_tensors(vocab: int, hidden: int, layers: int, taps: int, top_k_rank: int, group: int,
                      seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under the z-lab DFlash2DraftModel names and shapes (dflash.md sections 6 and 7)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + rand(n, std=0.1)

    t = {"fc.weight": rand(hidden, taps * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden),
         "candidate_selector.hidden_projection.weight": rand(top_k_rank, hidden, std=0.3),
         "candidate_selector.predecessor_codebook": rand(vocab, top_k_rank, std=0.5),
         "candidate_selector.successor_codebook": rand(vocab, top_k_rank, std=0.5)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
              p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, hidden),
              p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, hidden),
              p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, hidden),
              p + "self_attn.o_proj.weight": rand(hidden, HEADS * HEAD_DIM),
              p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
              p + "mlp.gate_proj.weight": rand(FFN, hidden), p + "mlp.up_proj.weight": rand(FFN, hidden),
              p + "mlp.down_proj.weight": rand(hidden, FFN)}
        for conv in ("attention_conv", "mlp_conv"):
            base = rand(2, 2, hidden, std=0.3)
            base[:, 0] += 1.0  # near identity, like a trained kernel
            t[p + f"{conv}.base_kernel"] = base
            t[p + f"{conv}.kernel_projection.weight"] = rand(2 * 2 * hidden // group, hidden, std=0.2)
    return t


def write_dflash2_drafter(target_dir: Path, out: Path, block_size: int = 4, layers: int = 2, taps=(0, 1),
                          top_k: int = 16, rank: int = 8, group: int = 16, seed: int = 0) -> Path:
    """A synthetic DFlash2 checkpoint for the HF target in target_dir: config.json as the published
    one spells it, unprefixed safetensors, no embedding or head."""
    t = ModelConfig.from_hf_dir(target_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": t.hidden_size,
        "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": EPS, "rope_theta": THETA,
        "max_position_embeddings": t.max_position_embeddings, "vocab_size": t.vocab_size,
        "num_target_layers": t.num_layers, "tie_word_embeddings": True, "attention_bias": False,
        "layer_types": ["full_attention"] * layers, "use_sliding_window": False, "dtype": "float32",
        "dflash_config": {"block_size": block_size, "mask_token_id": t.vocab_size - 1,
                          "target_layer_ids": list(taps), "conv_kernel_size": 2, "conv_group_size": group,
                          "selector_rank": rank, "selector_top_k": top_k},
    }
    (out / "config.json").write_text(json.dumps(config))
    save_file(published_tensors(t.vocab_size, t.hidden_size, layers, len(taps), rank, group, seed),
              str(out / "model.safetensors"))
    return out


# ------------------------------------------------------------------ the reference, from the layout

def ref_rms(x, w):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS))


def ref_rope(x, pos):
    """x [heads, d] at absolute position pos: rotate-half pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv = THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def ref_conv(v, base, delta, group):
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * v[i - t, c], v[-1] = 0."""
    rows, channels = v.shape
    out = torch.zeros_like(v)
    for i in range(rows):
        for t in range(base.shape[0]):
            if i - t < 0:
                continue
            for c in range(channels):
                out[i, c] += (base[t, c] + delta[i, t, c // group]) * v[i - t, c]
    return out


def ref_block_hidden(w, features, block_embeds, anchor, layers, group):
    """Final-normed hidden states of one block at positions anchor.. over the context 0..anchor-1."""
    c = ref_rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block_embeds.clone()
    for i in range(layers):
        x = ref_layer({k[len(f"layers.{i}."):]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}, x, c,
                      anchor, group)
    return ref_rms(x, w["norm.weight"])


def ref_layer(p, x, c, anchor, group):
    """One DFlash2 layer (p: its tensors by name) over the block rows x and the context c."""
    B = x.shape[0]

    def kv(rows, start):
        k = (rows @ p["self_attn.k_proj.weight"].T).view(len(rows), KV_HEADS, HEAD_DIM)
        v = (rows @ p["self_attn.v_proj.weight"].T).view(len(rows), KV_HEADS, HEAD_DIM)
        k = torch.stack([ref_rope(ref_rms(k[j], p["self_attn.k_norm.weight"]), start + j) for j in range(len(rows))])
        return k, v

    def conv_pair(name, inp, sub_layer):
        proj = (inp @ p[f"{name}.kernel_projection.weight"].T).view(B, 2, 2, -1)  # [row, side, tap, group]
        base = p[f"{name}.base_kernel"]
        y = sub_layer(ref_conv(inp, base[0], proj[:, 0], group))
        return ref_conv(y, base[1], proj[:, 1], group)

    def attention(h):
        kc, vc = kv(c, 0)
        kb, vb = kv(h, anchor)
        keys, values = torch.cat([kc, kb]), torch.cat([vc, vb])
        q = (h @ p["self_attn.q_proj.weight"].T).view(B, HEADS, HEAD_DIM)
        out = torch.zeros(B, HEADS, HEAD_DIM, dtype=h.dtype)
        for r in range(B):
            for hd in range(HEADS):
                qr = ref_rope(ref_rms(q[r, hd], p["self_attn.q_norm.weight"]), anchor + r)
                kvh = hd // (HEADS // KV_HEADS)
                scores = keys[:, kvh] @ qr / math.sqrt(HEAD_DIM)
                out[r, hd] = torch.softmax(scores, 0) @ values[:, kvh]
        return out.reshape(B, -1) @ p["self_attn.o_proj.weight"].T

    def mlp(h):
        gate = h @ p["mlp.gate_proj.weight"].T
        return (gate * torch.sigmoid(gate) * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T

    x = x + conv_pair("attention_conv", ref_rms(x, p["input_layernorm.weight"]), attention)
    return x + conv_pair("mlp_conv", ref_rms(x, p["post_attention_layernorm.weight"]), mlp)


def ref_greedy_walk(w, logits, hidden, anchor, top_k):
    """Per slot: top-K of the logits, score unary + <A[pred] * P h, B[c]>, take the best, walk on."""
    pred, chain = anchor, []
    for s in range(logits.shape[0]):
        unary, cand = logits[s].topk(top_k)
        ph = w["candidate_selector.hidden_projection.weight"] @ hidden[s]
        scores = [float(unary[j]) + float((w["candidate_selector.predecessor_codebook"][pred] * ph
                                            * w["candidate_selector.successor_codebook"][cand[j]]).sum())
                  for j in range(len(cand))]
        pred = int(cand[max(range(len(scores)), key=scores.__getitem__)])
        chain.append(pred)
    return chain


# ------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def target(hf_models):
    return hf_models["qwen3"]


def test_network_and_greedy_walk_equal_the_reference(target, tmp_path):
    path = write_dflash2_drafter(target, tmp_path / "d", block_size=4, top_k=5, seed=3)
    drafter, _ = load_drafter(path, torch.float64, "cpu")
    assert isinstance(drafter, DFlash2Drafter)
    w = {k: v.double() for k, v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(path / "model.safetensors")).items()}
    cfg = drafter.config
    assert (cfg.block_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) \
        == (4, 2, 16, 8, 5)
    g = torch.Generator().manual_seed(0)
    d, anchor = cfg.model.hidden_size, 6
    features = torch.randn(anchor, 2 * d, generator=g, dtype=torch.float64)
    embeds = torch.randn(cfg.block_size, d, generator=g, dtype=torch.float64)
    with torch.no_grad():
        context = drafter.context_kv(features, torch.arange(anchor))
        ours = drafter.blocks(embeds, torch.arange(anchor, anchor + cfg.block_size), context, torch.arange(anchor))
    want = ref_block_hidden(w, features, embeds, anchor, cfg.model.num_layers, cfg.conv_group_size)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)  # RoPE tables are float32
    # the conv matters: without it (identity kernels) the hidden states differ
    head = torch.randn(cfg.model.vocab_size, d, generator=g, dtype=torch.float64)
    logits = ours[1:] @ head.T
    walk = drafter.candidate_selector.walk(ours[1:], 17, logits)
    assert walk.q is None
    assert walk.tokens.tolist() == ref_greedy_walk(w, logits, ours[1:], 17, 5)
    assert walk.tokens.tolist() != logits.argmax(-1).tolist()  # the selector changed the chain here


def test_sampled_walk_returns_q_over_candidates_and_draws_from_it(target, tmp_path):
    path = write_dflash2_drafter(target, tmp_path / "d", top_k=4, seed=1)
    drafter, _ = load_drafter(path, torch.float64, "cpu")
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, drafter.config.model.hidden_size, generator=g, dtype=torch.float64)
    logits = torch.randn(3, drafter.config.model.vocab_size, generator=g, dtype=torch.float64) * 2
    counts: dict[int, int] = {}
    n = 3000
    for i in range(n):
        walk = sel.walk(hidden, 5, logits / 0.7, temperature=0.7, generator=torch.Generator().manual_seed(i))
        assert torch.allclose(walk.q.sum(-1), torch.ones(3, dtype=walk.q.dtype))
        assert walk.tokens[0] in walk.candidates[0]
        counts[int(walk.tokens[0])] = counts.get(int(walk.tokens[0]), 0) + 1
    # slot 1's q is softmax((logit + transition) / T) over the top-4, predecessor = the anchor
    unary, cand = logits[0].topk(4)
    ph = sel.hidden_projection.weight @ hidden[0]
    trans = (sel.predecessor_codebook[5] * ph * sel.successor_codebook[cand]).sum(-1)
    q = torch.softmax((unary + trans) / 0.7, 0)
    torch.testing.assert_close(walk.q[0], q.to(walk.q.dtype))
    for token, p in zip(cand.tolist(), q.tolist()):
        assert abs(counts.get(token, 0) / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_a_dflash1_config_is_not_taken_for_dflash2(target, tmp_path):
    from tests.spec_fixtures import write_dflash_drafter
    drafter, _ = load_drafter(write_dflash_drafter(target, tmp_path / "d1"), torch.float32, "cpu")
    assert not isinstance(drafter, DFlash2Drafter)


def test_missing_selector_key_is_named(target, tmp_path):
    path = write_dflash2_drafter(target, tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    del raw["dflash_config"]["selector_rank"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="selector_rank"):
        load_drafter(path, torch.float32, "cpu")


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                             repetition_penalty=1.3, logit_bias={7: 2.0})],
                         ids=["plain", "reads its history"])
def test_greedy_speculation_is_token_identical_to_plain_decoding(params, target, tmp_path):
    from tests.spec.test_spec import prompts
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=4, top_k=16, seed=4)
    plain = [o.outputs[0].token_ids for o in LLM(str(target), block_size=4).generate(prompts(4), params,
                                                                                      use_tqdm=False)]
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(drafter),
                                                             "adaptive": False})
    assert isinstance(llm.engine.speculator.proposer, DFlash2Proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(4), params, use_tqdm=False)]
    assert got == plain
    assert llm.engine.speculator.steps_by_source  # it did draft


def test_trees_from_a_dflash2_drafter_are_token_identical_to_plain_decoding(target, tmp_path):
    from tests.spec.test_spec import prompts
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=4, top_k=16, seed=4)
    plain = [o.outputs[0].token_ids for o in LLM(str(target), block_size=4).generate(prompts(4), GREEDY,
                                                                                      use_tqdm=False)]
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(drafter),
                                                             "adaptive": False, "tree_budget": 8})
    assert isinstance(llm.engine.speculator.proposer, DFlash2Proposer)
    drafts = record_drafts(llm.engine.speculator.proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY, use_tqdm=False)]
    assert got == plain
    assert any(len(d) > 3 for d in drafts)  # trees: more nodes than a block of 4 holds as a chain


def test_sampled_speculation_follows_the_target_distribution(tmp_path_factory, tmp_path):
    tok = small_vocab_tokenizer(tmp_path_factory.mktemp("tok6"), ["a", "b", "c", "d", "e", "f"])
    target = peaked_model(tmp_path_factory.mktemp("t6"), tok, layers=2, seed=1)
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=3, top_k=3, group=8, seed=2)
    llm = LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter),
                                               "num_speculative_tokens": 2, "adaptive": False},
              max_num_seqs=1024, max_num_batched_tokens=8192)
    assert isinstance(llm.engine.speculator.proposer, DFlash2Proposer)
    counts = sample_pairs(llm, PROMPT, SAMPLES)
    rejected, stat, critical = chi_square_rejects(counts, exact_pair_distribution(target, PROMPT), SAMPLES)
    print(f"\ndflash2: chi-square {stat:.1f} (reject above {critical:.1f})")
    assert not rejected


def record_drafts(prop) -> list[list[int]]:
    """Every draft the proposer makes from now on, appended to the returned list."""
    drafted, propose = [], prop.propose
    prop.propose = lambda seqs, ks: [drafted.append(d.tokens) or d for d in propose(seqs, ks)]
    return drafted


@pytest.mark.parametrize("graphs", ["static", pytest.param("captured", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_through_the_drafter_graphs_equal_the_eager_ones(graphs, temperature, target, tmp_path):
    """The graph bodies hand the selector the same hidden states: greedy and seeded sampled drafts
    (and so the output) equal the eager drafter's; greedy output equals plain decoding."""
    from tests.spec.test_dflash_graphs import static_graphs
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=4, seed=6)
    device = "cuda" if graphs == "captured" else "cpu"
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate((5, 19, 33))]
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=7)
    runs = []
    for use_graphs in (False, True):
        llm = LLM(str(target), device=device, dtype="float32", block_size=4, cuda_graphs=use_graphs,
                  kv_cache_memory=16 << 20,
                  speculative_config={"method": "dflash", "model": str(drafter), "adaptive": False})
        prop = llm.engine.speculator.proposer
        if use_graphs and graphs == "static":
            prop.graphs = static_graphs(prop, llm.engine.runner.num_blocks, llm.engine.max_model_len)
        drafted = record_drafts(prop)
        runs.append(([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], drafted))
        assert (prop.graphs is not None and prop.graphs.replays > 0) == use_graphs
    assert runs[0] == runs[1]
    if temperature == 0:
        plain = LLM(str(target), device=device, dtype="float32", block_size=4, kv_cache_memory=16 << 20)
        assert runs[0][0] == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_the_lattice_holds_every_score_the_walks_use(target, tmp_path):
    """For trees over one pass: following the lattice's best rows is the greedy walk, and its rows
    over T are the sampled walk's q at each slot given the token chosen before."""
    drafter, _ = load_drafter(write_dflash2_drafter(target, tmp_path / "d", top_k=5, seed=8), torch.float64, "cpu")
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, drafter.config.model.hidden_size, generator=g, dtype=torch.float64)
    logits = torch.randn(3, drafter.config.model.vocab_size, generator=g, dtype=torch.float64)
    candidates, scores = sel.lattice(hidden, 9, logits)
    assert scores.shape == (3, 5, 5) and torch.equal(scores[0, 0], scores[0, 4])  # slot 1: the anchor before
    chain, p = [], 0
    for s in range(3):
        c = int(scores[s, p].argmax())
        chain.append(int(candidates[s, c]))
        p = c
    assert sel.walk(hidden, 9, logits).tokens.tolist() == chain
    walk = sel.walk(hidden, 9, logits / 0.5, temperature=0.5, generator=torch.Generator().manual_seed(0))
    p = 0
    for s in range(3):
        torch.testing.assert_close(walk.q[s], torch.softmax(scores[s, p] / 0.5, 0))
        p = candidates[s].tolist().index(int(walk.tokens[s]))
