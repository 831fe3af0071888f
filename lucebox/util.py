"""Small helpers shared by unrelated parts of lucebox."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


def _keep(tensor, *args, **kwargs):
    return tensor


@contextlib.contextmanager
def on_meta():
    """Build modules on the meta device without running their initialisers: the weights come from a
    checkpoint (or are drawn later), and on meta tensors torch routes `normal_` through its compiler
    stack, whose first use imports torch._dynamo (about 2 s of every start)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, _keep)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def host_to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device` without stalling the host: on CUDA it is
    staged in pinned memory and copied asynchronously, where `torch.tensor(values, device=cuda)`
    copies from pageable memory and so waits for all queued GPU work (the step's forward) first,
    serialising the host's next launches behind it."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
