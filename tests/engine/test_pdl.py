"""Programmatic dependent launch: every kernel that may start early waits for the previous one first,
and graphs launched with it compute what graphs without it do.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_cuda_graphs import (  # noqa: I001  (sets TRITON_INTERPRET=1 first)
    gpu, prefilled, step_tokens, tiny_model)

from lucebox.engine.graph_settings import GraphSettings


# ----------------------------------------------------------------------------- programmatic dependent launch

def test_every_kernel_that_may_start_early_waits_for_the_previous_one_first():
    """dispatch.pdl_launch lets a kernel start while the one before it drains; that is safe only if
    the kernel waits for the previous kernel's writes before it reads or writes anything: every
    Triton kernel taking PDL makes wait_for_previous_kernel(PDL) its first statement, and every
    launch passing pdl_launch's options goes to such a kernel."""
    import ast
    from pathlib import Path

    import lucebox.kernels
    kernels_dir = Path(lucebox.kernels.__file__).parent
    with_pdl, launches = set(), 0
    for path in sorted(kernels_dir.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args]:
                body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if fn.name != "wait_for_previous_kernel":
                    assert ast.unparse(body[0]) == "wait_for_previous_kernel(PDL)", f"{path.name}:{fn.name}"
                    with_pdl.add(fn.name)
            spread = [ast.unparse(k.value) for k in getattr(fn, "keywords", ()) if k.arg is None]
            if isinstance(fn, ast.Call) and any(s.startswith("pdl_launch(") for s in spread):
                launches += 1
                launched = ast.unparse(fn.func.value if isinstance(fn.func, ast.Subscript) else fn.func)
                known = {"_kernel()", "chunk_kernel", "row_kernel", "first_rejection", "kernel"} | with_pdl
                assert launched in known, f"{path.name}: {launched} launched with pdl_launch"
    assert len(with_pdl) >= 13 and launches >= 13


def test_pdl_is_off_for_the_cpu_for_verify_tiles_and_when_the_environment_says_so(monkeypatch):
    from lucebox.kernels.dispatch import pdl_launch
    assert pdl_launch(torch.device("cpu")) == {}
    monkeypatch.delenv("LUCEBOX_PDL_TILES", raising=False)
    assert pdl_launch(torch.device("cuda"), tiles=True) == {}  # quantised verify tiles: slower with it
    monkeypatch.setenv("LUCEBOX_PDL", "0")
    assert pdl_launch(torch.device("cuda")) == {}


@gpu
def test_graphs_launched_with_pdl_compute_bit_for_bit_what_graphs_without_it_do(monkeypatch):
    """A race between overlapping kernels (one reading what the previous one has not yet written)
    would change logits: decode steps replayed many times with PDL equal those without it."""
    from lucebox.kernels.dispatch import pdl_launch
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    assert pdl_launch(torch.device("cuda"))["launch_pdl"]
    settings = GraphSettings(64, max_batch=32, query_lens=(1, 4))
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("LUCEBOX_PDL", pdl)
        runner, tables, lens = prefilled(tiny_model("cuda", torch.bfloat16), settings, 8, room=28)
        results[pdl] = [runner.forward(step_tokens([1] * 8 if step % 2 else [4] * 8), [n + 4 * step for n in lens],
                                       tables, all_logits=True).clone()  # a graph's output buffer is reused
                        for step in range(6) for _ in range(3)]
    assert len(results["1"]) == 18
    for got, want in zip(results["1"], results["0"]):
        assert torch.equal(got, want)
