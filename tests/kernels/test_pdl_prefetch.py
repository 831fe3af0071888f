"""The GEMVs' L2 prefetch before their wait for the previous kernel (kernels/triton_pdl.prefetch_span):
off unless PDL runs and LUCEBOX_PDL_PREFETCH=1, and where it runs it changes no result."""
from __future__ import annotations

import pytest
import torch

from lucebox.kernels import dispatch

ON_GPU = torch.cuda.is_available()


def test_prefetch_lines_are_powers_of_two_of_128_byte_lines_and_need_pdl_and_the_switch(monkeypatch):
    monkeypatch.setenv("LUCEBOX_PDL_PREFETCH", "1")
    assert dispatch.prefetch_lines(torch.device("cpu"), 576) == 0  # no PDL on the CPU
    monkeypatch.setattr(dispatch, "pdl_launch", lambda device, tiles=False: {"PDL": True, "launch_pdl": True})
    cuda = torch.device("cuda")
    # a Q4_K program of 4 units (576 bytes a row) asks for 5 lines, rounded up to 8
    assert [dispatch.prefetch_lines(cuda, n) for n in (0, 1, 128, 129, 576, 8192, 1 << 20)] == [0, 1, 1, 2, 8, 64, 64]
    monkeypatch.setenv("LUCEBOX_PDL_PREFETCH", "0")
    assert dispatch.prefetch_lines(cuda, 576) == 0
    monkeypatch.delenv("LUCEBOX_PDL_PREFETCH")
    assert dispatch.prefetch_lines(cuda, 576) == 0


@pytest.mark.skipif(not ON_GPU, reason="PDL and the PTX prefetch run on a GPU only")
@pytest.mark.parametrize("qtype", ["bf16", "Q4_K", "Q8_0-split", "Q6_K-split"])
def test_gemvs_prefetching_compute_bit_for_bit_what_they_do_without(monkeypatch, qtype):
    """Shapes whose last row block is partial (the prefetch clamps its rows), split K (a program's span
    starts past unit 0) and the float GEMV's norm prologue (programs walking several row blocks)."""
    from gguf import GGMLQuantizationType as Q

    from lucebox.kernels import split_rows as layout
    from lucebox.kernels import triton_dp4a, triton_gemv
    from tests.kernels.test_triton_kernels import quant_rows
    if not dispatch.pdl_launch(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    gen = torch.Generator(device="cuda").manual_seed(3)
    runs = []
    for setting in ("1", "0"):
        monkeypatch.setenv("LUCEBOX_PDL_PREFETCH", setting)
        assert bool(dispatch.prefetch_lines(torch.device("cuda"), 256)) == (setting == "1")
        outs = []
        for n, k in ((1000, 2048), (3000, 1024), (40, 512)):
            x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            if qtype == "bf16":
                w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                outs.append(triton_gemv.gemv(x, w)[0])
                nw, res = torch.randn(k, device="cuda", dtype=torch.bfloat16), torch.randn_like(x)
                outs += triton_gemv.gemv(x, w, None, triton_gemv.NORM, res, nw, 1e-6)
                continue
            kind = Q[qtype.split("-")[0]]
            raw = quant_rows(kind, n, k, seed=n)
            split = qtype.endswith("split")
            weights = layout.split_rows(raw, kind) if split else raw
            outs += [triton_dp4a.gemv(x, weights, kind, split, k, split_k=s) for s in (1, 2)]
        runs.append(outs)
    for got, want in zip(*runs):
        assert torch.equal(got, want)
