"""Which implementation of an op runs: the Triton kernel or the plain-torch reference.

Model code calls one function per op; the op's module asks `use_triton(...)` and picks. Triton runs
when every tensor is on a CUDA/ROCm device and Triton imports. `LUCEBOX_TRITON` overrides:
  0   always the torch reference (e.g. to bisect a numerical difference on the GPU)
  1   Triton also for CPU tensors -- only meaningful under TRITON_INTERPRET=1, Triton's numpy
      interpreter, which is how CI runs the kernels without a GPU
The Triton modules are imported lazily, so a machine without Triton never imports them.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def _mode() -> str:
    return os.environ.get("LUCEBOX_TRITON", "").strip().lower()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when the op should run its Triton kernel on these tensors (None entries are ignored)."""
    mode = _mode()
    if mode in ("0", "false", "no", "off"):
        return False
    devices = {t.device.type for t in tensors if t is not None}
    if not devices or not triton_available():
        return False
    if devices == {"cuda"}:  # ROCm builds of torch report their GPUs as "cuda" too
        return not interpreting()  # interpreted kernels want host tensors; keep GPU runs compiled
    if devices == {"cpu"}:
        return mode in ("1", "true", "yes", "on") and interpreting()
    return False


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on AMD) of `device`; a nominal 4 on the CPU interpreter, so
    the launch heuristics still exercise split paths at test sizes."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
