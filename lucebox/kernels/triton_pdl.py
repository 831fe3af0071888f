"""The first instruction of every Triton kernel here: with programmatic dependent launch
(dispatch.pdl_launch) a kernel's programs start before the previous kernel has finished, so they
wait for its writes to be visible before reading or writing anything, then let the next kernel
launch in turn. A no-op when PDL is False (other GPUs, the CPU interpreter).

A GEMV's weights do not depend on the kernel before it: `prefetch_span`, called before the wait, asks
L2 for the first bytes its program will read, so the weight stream starts while the previous kernel
drains (dispatch.prefetch_lines says how many lines; 0 compiles it out)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_span(row, start, length, LINES: tl.constexpr):
    """Ask L2 for bytes [start, start + length) of each row at byte pointers `row` (a tensor), LINES
    128-byte lines of each (a power of two; lines past the span re-ask for its last byte)."""
    if LINES > 0:
        at = tl.minimum(tl.arange(0, LINES) * 128, tl.maximum(length, 1) - 1)
        ptrs = row[:, None] + (start + at)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
