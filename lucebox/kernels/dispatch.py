"""Which implementation of an op runs: the Triton kernel or the plain-torch reference.

Model code calls one function per op; the op's module asks `use_triton(...)` and picks. Triton runs
when every tensor is on a CUDA/ROCm device and Triton imports. `LUCEBOX_TRITON` overrides:
  0   always the torch reference (e.g. to bisect a numerical difference on the GPU)
  1   Triton also for CPU tensors -- only meaningful under TRITON_INTERPRET=1, Triton's numpy
      interpreter, which is how CI runs the kernels without a GPU
The Triton modules are imported lazily, so a machine without Triton never imports them.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ..config import int8_activations_setting, pdl_enabled, pdl_tiles, triton_interpret, triton_setting


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


@functools.cache
def _choice(mode: bool | None, interpreted: bool) -> tuple[bool, bool]:
    """(Triton for CUDA tensors, Triton for CPU tensors) under LUCEBOX_TRITON and TRITON_INTERPRET."""
    if mode is False or not triton_available():
        return False, False
    # Interpreted kernels want host tensors: keep GPU runs compiled. (ROCm builds of torch report
    # their GPUs as "cuda" too.)
    return not interpreted, mode is True and interpreted


def interpreting() -> bool:
    return triton_interpret()


_decided = threading.local()  # .choice: the environment's choice, read once for a whole forward


def _current_choice() -> tuple[bool, bool]:
    return _choice(triton_setting(), triton_interpret())


@contextlib.contextmanager
def decided_once():
    """Within it (a model's forward), use_triton reads the environment once, not at every op (an
    eager forward asks ~10 times a layer). Tests flip the environment between forwards, never inside one."""
    previous = getattr(_decided, "choice", None)
    _decided.choice = _current_choice()
    try:
        yield
    finally:
        _decided.choice = previous


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when the op should run its Triton kernel on these tensors (None entries are ignored).

    Called for every op of every layer in eager steps: the environment is read on each call (tests
    flip it at run time) unless a forward decided it (decided_once); its meaning is cached."""
    cuda, cpu = getattr(_decided, "choice", None) or _current_choice()
    present = [t for t in tensors if t is not None]
    if not present:
        return False
    if all(t.is_cuda for t in present):
        return cuda
    return cpu and all(t.is_cpu for t in present)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on AMD) of `device`; a nominal 4 on the CPU interpreter, so
    the launch heuristics still exercise split paths at test sizes."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may claim on `device` (opt-in maximum); on the CPU
    interpreter a nominal Hopper-sized 227 KiB, so tests exercise the launches the GPU takes."""
    if device.type != "cuda":
        return 227 * 1024
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


@functools.cache
def _pdl_supported(index: int) -> bool:
    if torch.version.hip is not None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:  # the Triton launch option (3.4 and later)
        from dataclasses import fields

        from triton.backends.nvidia.compiler import CUDAOptions
        return any(f.name == "launch_pdl" for f in fields(CUDAOptions))
    except Exception:
        return False


def pdl_launch(device: torch.device, tiles: bool = False) -> dict:
    """Launch options for programmatic dependent launch: on NVIDIA Hopper and later, a kernel is
    launched (and captured into CUDA graphs) so that it starts while the kernel before it drains,
    its programs waiting at their first instruction (triton_pdl.wait_for_previous_kernel) until that
    kernel's writes are visible: the launch and ramp-up of each of a decode step's ~170-250 kernels
    overlap the previous one's tail. {} elsewhere, or when LUCEBOX_PDL=0. Every kernel launched with
    these options calls wait_for_previous_kernel(PDL) before touching memory.
    tiles: the float kernel's quantised verify tiles (triton_quant_matmul, mode 1), which launch
    without PDL unless LUCEBOX_PDL_TILES=1 (slower with it; the int8 verify tiles were not).
    lucebox bench speed --shape qwen3-8b --quant q4_k_m, H200, 2026-12-04"""
    if device.type != "cuda" or not pdl_enabled():
        return {}
    if tiles and not pdl_tiles():
        return {}
    if not _pdl_supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}


def int8_activations() -> bool:
    """Whether quantised decode and verify products may run on int8 activations where that is faster
    (kernels/routing.QUANT_ROUTES: each activation row rounded to int8 per 32 values, as
    llama.cpp does): yes unless LUCEBOX_INT8_ACTIVATIONS=0; on ROCm only with
    LUCEBOX_INT8_ACTIVATIONS=1 (where it is faster was measured on an H200, and AMD GPUs run the
    one-row kernels without PTX dp4a). Prefill stays on bf16."""
    setting = int8_activations_setting()
    if torch.version.hip is not None:
        return setting is True
    return setting is not False


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
