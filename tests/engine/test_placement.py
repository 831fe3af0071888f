"""--device-map: a model split into layer ranges on devices computes what the whole model computes.

This machine has one device, so the splits are `cpu:0-1,cpu:2-3`: every segment still gets its
own copy of the batch and its arguments through the boundary hooks (counted), and its own caches.
Logits equal the unsplit model's within float32 tolerance and greedy speculative (DFlash) output is
token-identical, for a dense model, a hybrid (Gated DeltaNet state across the boundary), an MoE
and Gemma 4 (KV-shared layers whose source layer sits in the segment before)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lucebox import LLM, SamplingParams
from lucebox.config import EngineArgs
from lucebox.engine.block_manager import BlockManager
from lucebox.engine.placement import Placement, is_split, parse_device_map, place, placement_of
from lucebox.engine.runner import ModelRunner
from lucebox.errors import RequestError
from lucebox.model.config import ModelConfig
from lucebox.model.loader import load_model
from lucebox.weights.quant import QuantLinear
from tests.conftest import build_hf_model
from lucebox.convert import convert_hf_to_gguf
from tests.model.test_gemma4 import DENSE
from tests.model.test_laguna import build_laguna
from tests.model.test_qwen3_5 import HYBRID, prompts
from tests.spec_fixtures import write_dflash_drafter

BLOCK = 4
MOE = dict(model_type="qwen3_moe", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True,
           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
DENSE4 = dict(model_type="qwen3", head_dim=24, num_hidden_layers=4, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# family -> (config, device map); gemma4's layers 4-6 share the K/V of layers 2 and 3, across the boundary
MODELS = {"dense": (DENSE4, "cpu:0-1,cpu:2-3"), "hybrid": (HYBRID, "cpu:0-1,cpu:2-3"),
          "moe": (MOE, "cpu:0,cpu:1-2,cpu:3"), "gemma4": (DENSE, "cpu:0-3,cpu:4-6")}
# and the logits of Laguna (per-layer head counts, mixed windows) and a quantised GGUF (Q8_0 weights)
MAPS = {**{family: device_map for family, (_, device_map) in MODELS.items()},
        "laguna": "cpu:0-1,cpu:2-3", "q8_0": "cpu:0-2,cpu:3"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family)
            if family == "laguna":
                made[family] = build_laguna(out, tokenizer_dir)
            elif family == "q8_0":
                made[family] = convert_hf_to_gguf(get("dense"), out / "q8.gguf", "q8_0")
            else:
                made[family] = build_hf_model("qwen3", out, tokenizer_dir, **MODELS[family][0])
        return made[family]
    return get


def split_model(path, device_map: str):
    loaded = load_model(str(path), dtype="float32", device="cpu")
    placement = place(loaded, EngineArgs(model=str(path), device_map=device_map))
    return loaded, placement


def run_steps(loaded, batch):
    """Chunked prefill then two decode steps of a batch; every step's logits, concatenated."""
    runner, blocks = ModelRunner(loaded.model, 64, BLOCK, state_slots=4), BlockManager(64, BLOCK)
    tables = [[] for _ in batch]
    for table, p in zip(tables, batch):
        blocks.allocate(table, len(p) + 2)
    slots = list(range(len(batch)))
    if runner.recurrent_layers:
        runner.reset_states(slots)
    cut = [len(p) // 2 for p in batch]
    out = [runner.forward([p[:c] for p, c in zip(batch, cut)], [0] * len(batch), tables, all_logits=True,
                          state_slots=slots),
           runner.forward([p[c:] for p, c in zip(batch, cut)], cut, tables, all_logits=True, state_slots=slots)]
    ids = [[int(p[-1])] for p in batch]
    for step in range(2):
        logits = runner.forward(ids, [len(p) + step for p in batch], tables, state_slots=slots)
        out.append(logits)
        ids = [[int(t)] for t in logits.argmax(-1)]
    return torch.cat(out), runner


@pytest.mark.parametrize("family", list(MAPS))
def test_a_split_model_computes_the_whole_models_logits(family, models):
    path = models(family)
    whole = load_model(str(path), dtype="float32", device="cpu")
    split, placement = split_model(path, MAPS[family])
    assert is_split(split.model) and len(placement.segments) == MAPS[family].count(",") + 1
    if family == "q8_0":  # its matrices moved as they are: still quantised on their devices
        assert any(isinstance(m, QuantLinear) for m in split.model.layers[3].modules())
    batch = prompts(whole.config.vocab_size, [9, 14, 6], seed=4)
    want, _ = run_steps(whole, batch)
    got, runner = run_steps(split, batch)
    assert (got - want).abs().max().item() <= 1e-5
    # every segment took its own copy of the batch in each of the 4 steps (gemma4: its shared
    # layers' attention one more, on their source's segment)
    segments = len(placement.segments)
    assert placement.crossings >= 4 * segments
    if family == "gemma4":
        assert placement.crossings == 4 * (segments + 1)
    else:
        assert placement.crossings == 4 * segments
    assert len(runner.caches) == len(runner.paged_layers)  # one K/V store per paged layer, on its segment


@pytest.mark.parametrize("family", [*MODELS, "laguna"])
def test_greedy_dflash_speculation_on_a_split_model_equals_plain_decoding(family, models, tmp_path):
    path = models(family)
    layers = ModelConfig.from_hf_dir(path).num_layers
    drafter = write_dflash_drafter(path, tmp_path / "dflash", taps=(0, layers - 2), block_size=4)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    batch = [{"prompt_token_ids": p} for p in prompts(300, [7, 12, 5], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(path), block_size=BLOCK, max_num_seqs=4, speculative_config={})
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    del plain
    llm = LLM(str(path), block_size=BLOCK, max_num_seqs=4, speculative_config=spec, device_map=MAPS[family],
              draft_device="cpu")
    placement = placement_of(llm.engine.model)
    before = placement.crossings
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert placement.crossings > before
    assert llm.engine.speculator.proposer.device == torch.device("cpu")
    assert sum(o.metrics.num_drafts for o in outs) > 0  # the drafter drafted and the split target verified


def test_draft_model_on_its_own_device_keeps_greedy_output(models):
    path = models("dense")
    batch = [{"prompt_token_ids": p} for p in prompts(300, [8, 5], seed=6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), block_size=BLOCK, speculative_config={})
            .generate(batch, params, use_tqdm=False)]
    llm = LLM(str(path), block_size=BLOCK, draft_device="cpu", device_map="cpu:0-2,cpu:3",
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 2})
    assert llm.engine.speculator.proposer.device == torch.device("cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == want


@pytest.mark.parametrize("device_map, message", [
    ("cpu:0-1,cpu:2-4", "layer 4 does not exist"),
    ("cpu:0-2,cpu:2-3", "layers 2-2 are placed twice"),
    ("cpu:0-1", "leaves layers 2-3 unplaced"),
    ("cpu:0,cpu:2-3", "leaves layers 1 unplaced"),
    ("cuda:3:0-1,cpu:2-3", "cuda:3 is absent"),
    ("cpu:0-1;cpu:2-3", "is not DEVICE:FIRST-LAST"),
    ("gpu:0-1,cpu:2-3", "'gpu:0-1' is not DEVICE:FIRST-LAST"),
    ("cpu:3-1,cpu:0", "runs backwards"),
])
def test_impossible_maps_are_refused_naming_what_is_wrong(device_map, message, models):
    if "cuda:3" in device_map and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    with pytest.raises(RequestError, match=message):
        LLM(str(models("dense")), block_size=BLOCK, device_map=device_map)


def test_a_map_parses_to_ordered_segments_and_auto_is_the_cpu_without_gpus(models):
    segments = parse_device_map(" cpu:2-3 , cpu:0-1", 4)
    assert [(s.device.type, s.first, s.last) for s in segments] == [("cpu", 0, 1), ("cpu", 2, 3)]
    if torch.cuda.is_available():
        pytest.skip("auto on a GPU machine fills the GPU")
    llm = LLM(str(models("dense")), block_size=BLOCK, device_map="auto", speculative_config={})
    placement = placement_of(llm.engine.model)
    assert not placement.split and placement.segments[0].device == torch.device("cpu")


def test_the_startup_line_says_where_each_layer_went(models, caplog):
    with caplog.at_level("INFO", logger="lucebox"):
        LLM(str(models("dense")), block_size=BLOCK, device_map="cpu:0-2,cpu:3", speculative_config={})
    text = caplog.text
    assert "layers 0-2 on cpu" in text and "layers 3-3 on cpu" in text and "CUDA graphs off" in text


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a cuda:0 + cpu split")


@gpu
@pytest.mark.parametrize("family", ["hybrid", "gemma4"])
def test_a_gpu_and_cpu_split_computes_the_gpu_models_logits(family, models):
    """Triton kernels on the GPU range, torch references on the host range: float32 agreement."""
    path = models(family)
    whole = load_model(str(path), dtype="float32", device="cuda")
    split, placement = split_model(path, "cuda:0:0-1,cpu:2-3" if family == "hybrid" else "cuda:0:0-3,cpu:4-6")
    assert [s.device.type for s in placement.segments] == ["cuda", "cpu"]
    assert split.model.layers[0].input_layernorm.weight.is_cuda and not split.model.norm.weight.is_cuda
    batch = prompts(whole.config.vocab_size, [9, 14, 6], seed=4)
    want, _ = run_steps(whole, batch)
    got, _ = run_steps(split, batch)
    assert (got.cpu() - want.cpu()).abs().max().item() <= 2e-3


@gpu
@pytest.mark.parametrize("device_map", ["cuda:0:0-1,cpu:2-3", None])
def test_a_drafter_on_the_cpu_keeps_greedy_output_on_a_gpu_target(device_map, models, tmp_path):
    """DFlash with its drafter on the CPU (taps cross to the host, drafts back) equals the same
    target's plain decoding: split over cuda:0 + cpu, or whole on the GPU."""
    path = models("hybrid")
    batch = [{"prompt_token_ids": p} for p in prompts(300, [7, 12], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    where = {"device_map": device_map} if device_map else {"device": "cuda"}
    want = [o.outputs[0].token_ids for o in LLM(str(path), block_size=BLOCK, dtype="float32", speculative_config={},
                                                  **where).generate(batch, params, use_tqdm=False)]
    drafter = write_dflash_drafter(path, tmp_path / "dflash", taps=(0, 2), block_size=4)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(path), block_size=BLOCK, dtype="float32", draft_device="cpu", speculative_config=spec, **where)
    assert llm.engine.speculator.proposer.device == torch.device("cpu")
    # whole on the GPU the drafter has a device of its own; split, it shares the cpu with the target's tail
    assert llm.engine.speculator.proposer.own_device == (device_map is None)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_drafts for o in outs) > 0


def test_placement_keeps_one_placement_per_loaded_model(models):
    loaded, placement = split_model(models("dense"), "cpu:0-1,cpu:2-3")
    again = place(loaded, EngineArgs(model="x", device_map="cpu:0-3"))
    assert again is placement and isinstance(again, Placement)


def test_draft_trees_on_a_split_model_equal_plain_decoding(models, tmp_path):
    """Tree verifies compact the accepted rows' K/V in every range's caches."""
    path = models("dense")
    drafter = write_dflash_drafter(path, tmp_path / "dflash", taps=(0, 2), block_size=4)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False,
            "tree_budget": 6}
    batch = [{"prompt_token_ids": p} for p in prompts(300, [7, 12], seed=8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), block_size=BLOCK, speculative_config={})
            .generate(batch, params, use_tqdm=False)]
    llm = LLM(str(path), block_size=BLOCK, speculative_config=spec, device_map="cpu:0-1,cpu:2-3")
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_drafts for o in outs) > 0


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_cli_flags_reach_engine_args(command):
    from lucebox.cli import build_parser, engine_args
    got = engine_args(build_parser().parse_args([command, "--device-map", "cuda:0:0-27,cpu:28-35",
                                                 "--draft-device", "cpu"]))
    assert (got.device_map, got.draft_device) == ("cuda:0:0-27,cpu:28-35", "cpu")


def test_an_absent_draft_device_is_refused(models):
    if torch.cuda.device_count() > 5:
        pytest.skip("this machine has a cuda:5")
    with pytest.raises(RequestError, match="--draft-device: cuda:5 is absent"):
        LLM(str(models("dense")), block_size=BLOCK, draft_device="cuda:5", speculative_config={"method": "ngram"})


def test_a_device_and_a_device_map_together_are_refused():
    with pytest.raises(RequestError, match="not both"):
        EngineArgs(device="cpu", device_map="cpu:0-1,cpu:2-3")


def test_tensor_parallel_with_a_device_map_or_draft_device_is_refused():
    with pytest.raises(RequestError, match="tensor_parallel_size 2 with --device-map"):
        EngineArgs(tensor_parallel_size=2, device_map="cpu:0-1,cpu:2-3")
    with pytest.raises(RequestError, match="tensor_parallel_size 2 with --device-map"):
        EngineArgs(tensor_parallel_size=2, draft_device="cpu")


def test_the_summary_line_the_cli_and_server_print_names_each_range(models):
    from lucebox.engine.build import summary
    llm = LLM(str(models("hybrid")), block_size=BLOCK, device_map="cpu:0-2,cpu:3", speculative_config={})
    text = summary(llm.engine)
    assert "layers 0-2 on cpu" in text and "layers 3-3 on cpu" in text
    kv = [float(line.split("weights, ")[1].split(" MiB")[0]) for line in text.splitlines() if "layers" in line]
    assert all(size > 0 for size in kv)  # DeltaNet state in 0-2, paged K/V in 3


@pytest.mark.parametrize("family", ["dense", "hybrid", "laguna"])
def test_a_fused_model_placed_again_computes_the_same_logits(family, models):
    """A bench places one model several ways: fused projections are undone before the parts move,
    whatever a layer calls them (q/k/v and gate/up; DeltaNet's four input projections; Laguna's qkvg)."""
    from lucebox.model.transformer import fused_projections
    path = models(family)
    whole = load_model(str(path), dtype="float32", device="cpu")
    batch = prompts(whole.config.vocab_size, [9, 6], seed=5)
    want, _ = run_steps(whole, batch)
    split, placement = split_model(path, "cpu:0-1,cpu:2-3")
    split.model.fuse_projections()
    fused = [(module, name) for module in split.model.modules() for name in fused_projections(module)]
    assert fused
    members = [m for m in split.model.modules() if type(m) is nn.Linear and not _owns_storage(m.weight)]
    assert members  # row slices of the fused tensors
    placement.remove(split.model)
    again = Placement(parse_device_map("cpu:0,cpu:1-3", 4))
    again.apply(split.model)
    assert all(getattr(module, name) is None for module, name in fused)
    assert all(_owns_storage(m.weight) for m in members)  # their own storage again: the fused tensors are gone
    split.model.fuse_projections()
    got, _ = run_steps(split, batch)
    assert (got - want).abs().max().item() <= 1e-5 and again.crossings == 4 * 2


def _owns_storage(weight: torch.Tensor) -> bool:
    return weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def test_auto_fills_the_first_gpu_then_puts_the_rest_on_the_host(models, monkeypatch):
    """auto's arithmetic, with the GPU's free memory given: the embeddings and head first, then each
    layer's weights and KV until the next would not fit (a second GPU takes the rest when present)."""
    from lucebox.engine.placement import auto_segments, module_bytes
    model = load_model(str(models("dense")), dtype="float32", device="cpu").model
    fixed = sum(module_bytes(m) for name, m in model.named_children() if name != "layers")
    layer, kv = module_bytes(model.layers[0]), 1000
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: ((fixed + 2.5 * (layer + kv)) / 0.5, 1 << 40))
    for gpus, rest in ((1, "cpu"), (2, "cuda:1")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        segments = auto_segments(model, [kv] * 4, 0.5)
        assert [(str(s.device), s.first, s.last) for s in segments] == [("cuda:0", 0, 1), (rest, 2, 3)]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: (fixed / 0.5, 1 << 40))
    with pytest.raises(RequestError, match="not even one layer fits"):
        auto_segments(model, [kv] * 4, 0.5)
