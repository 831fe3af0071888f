"""The first instruction of every Triton kernel here: with programmatic dependent launch
(dispatch.pdl_launch) a kernel's programs start before the previous kernel has finished, so they
wait for its writes to be visible before reading or writing anything, then let the next kernel
launch in turn. A no-op when PDL is False (other GPUs, the CPU interpreter)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
