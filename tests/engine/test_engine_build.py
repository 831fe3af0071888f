"""LLMEngine.from_args, the one way to build an engine: the default pair, a shared loaded model, args left alone."""
from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

from lucebox.config import EngineArgs
from lucebox.default_model import default_model_path, default_speculative_config
from lucebox.engine import engine as engine_module
from lucebox.engine.build import resolve_args
from lucebox.engine.engine import LLMEngine
from lucebox.engine.memory_plan import plan_kv_blocks
from lucebox.model.loader import load_model
from lucebox.sampling import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "lucebox"


def test_no_model_names_the_default_pair_in_a_copy():
    args = EngineArgs(max_model_len=256)
    resolved = resolve_args(args)
    assert resolved.model == str(default_model_path()) and resolved.max_model_len == 256
    assert resolved.speculative_config == default_speculative_config()
    assert args.model is None and args.speculative_config is None  # the caller's args are not changed


def test_speculation_turned_off_stays_off_for_the_default_model():
    resolved = resolve_args(EngineArgs(speculative_config={}))
    assert resolved.model == str(default_model_path()) and not resolved.speculative_config.enabled


def test_a_named_model_gets_no_default_speculation():
    args = EngineArgs(model="some/model")
    assert resolve_args(args) is args and args.speculative_config is None


def test_engines_built_from_one_loaded_model_share_it(hf_models):
    loaded = load_model(str(hf_models["qwen3"]))
    beside = {"kv_cache_memory": 64 << 20}  # both stay alive: on a GPU the first would take 90% of the card
    first = LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=128, **beside), loaded)
    second = LLMEngine.from_args(EngineArgs(max_model_len=128, speculative_config={"method": "ngram"}, **beside),
                                 loaded)
    assert first.loaded is loaded and second.model is loaded.model
    assert second.args.model == loaded.source and second.speculator is not None and first.speculator is None


def test_a_new_engine_frees_the_kv_an_earlier_one_left_in_the_shared_model(hf_models, monkeypatch):
    """The runner installs its K/V in the model's layers; a dropped engine's pool must be gone when the next
    engine sizes its own (on a GPU from the free memory: it would find almost none)."""
    loaded = load_model(str(hf_models["qwen3"]))
    first = LLMEngine.from_args(EngineArgs(model=loaded.source, max_model_len=128, speculative_config={}), loaded)
    first.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2))
    while first.has_unfinished():
        first.step()  # its runner installs its caches in the layers
    k_cache = weakref.ref(first.runner.caches[0][0])
    del first
    gc.collect()
    assert k_cache() is not None  # the model's layers still hold it
    alive_when_planned = []

    def planning(*args):
        alive_when_planned.append(k_cache() is not None)
        return plan_kv_blocks(*args)
    monkeypatch.setattr(engine_module, "plan_kv_blocks", planning)
    LLMEngine.from_args(EngineArgs(max_model_len=128, speculative_config={}), loaded)
    assert alive_when_planned == [False]


def test_from_args_loads_the_named_model(hf_models):
    engine = LLMEngine.from_args(EngineArgs(model=str(hf_models["qwen3"]), max_model_len=128, dtype="float32"))
    assert engine.loaded.source == str(hf_models["qwen3"]) and engine.max_model_len == 128


def _constructions(path: Path) -> list[str]:
    """Calls of LLMEngine(...) or load_model(...) in a module."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("LLMEngine",
                                                                                               "load_model"):
            calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.func.id}")
    return calls


def test_the_faces_build_engines_only_through_from_args():
    faces = [PACKAGE / "cli.py", PACKAGE / "llm.py", *sorted((PACKAGE / "server").glob("*.py"))]
    assert [c for p in faces for c in _constructions(p)] == []
    bench = [c for p in sorted((PACKAGE / "bench").glob("*.py")) for c in _constructions(p)]
    assert not [c for c in bench if c.endswith("LLMEngine")]
