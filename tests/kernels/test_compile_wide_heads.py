"""What only the GPU compiler sees, checked without a GPU: the paged-attention variants the wrapper
launches for Gemma 4's wide heads (256 on sliding layers, 512 on full attention) compile for sm_90
within its shared memory (a launch would fail with OutOfResources), and with 16-bit K/V without
register spills. `scripts/compile_kernels.py` does every kernel; this is its wide-head slice.

A subprocess: other test modules switch Triton's interpreter on, whose kernels cannot be compiled."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton ships no ptxas here")
def test_wide_head_attention_variants_fit_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "scripts/compile_kernels.py", "--kernels",
                          r"_paged_attn_kernel.*HEAD_DIM=(256|512).*bf16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout.replace("\r", "\n") + run.stderr.replace("\r", "\n")
    assert run.returncode == 0, out[-3000:]
    compiled = re.search(r"(\d+) variants compiled for cuda 90, 0 failed", out)
    assert compiled and int(compiled.group(1)) >= 30, out[-3000:]  # decode, verify, trees, prefill tiles
    bf16_kv = [line for line in out.splitlines() if line.startswith("ok ") and "K_FMT=0" in line]
    assert bf16_kv and all("stack=0B" in line or "stack=" not in line for line in bf16_kv), bf16_kv
