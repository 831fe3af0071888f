"""Small helpers shared by unrelated parts of lucebox."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token lists, strings): slices compared
    in C, 4K items at a time, then halves of what is left."""
    n, i, step = min(len(a), len(b)), 0, 4096
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while step > 1:
        step //= 2
        if i + step <= n and a[i:i + step] == b[i:i + step]:
            i += step
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


def move(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device` (itself when there already): asynchronous towards a GPU (ordered on its stream),
    blocking towards the host, whose next op would not wait for an asynchronous copy to land."""
    device = torch.device(device)
    return t.to(device, non_blocking=device.type == "cuda")


def smallest_at_least(n: int, sizes) -> int | None:
    return next((s for s in sorted(sizes) if s >= n), None)


class StagedBuffer:
    """A device buffer a graph reads, written through host staging: on CUDA the staging is pinned
    and each upload is one asynchronous copy; an event keeps the host from rewriting the staging
    while the previous copy may still be reading it."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device):
        pinned = torch.device(device).type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        self._copied = torch.cuda.Event() if pinned else None

    def staging(self) -> np.ndarray:
        """The host staging, free to write (the previous upload has read it: done by now in practice)."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        return self.host.numpy()

    def upload(self, rows: int | None = None) -> None:
        """Copy the staging (its first `rows` rows) to the device buffer, in stream order."""
        src, dst = (self.host, self.device) if rows is None else (self.host[:rows], self.device[:rows])
        dst.copy_(src, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
