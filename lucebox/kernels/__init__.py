"""Ops: a plain-torch reference per op, with faster device kernels dispatched from the same module.

The model says what to compute (`norm -> linear(s)`, `silu * up -> linear`, `linear`); kernels/
decides how. Module conventions:

- `<op>.py` (norm, activation, rope, linear, attention, dequant, kv_quant): the op's torch
  reference and its dispatch -- the functions the model calls. They import no Triton at module
  level; a Triton module is imported inside the function that launches it, so a machine without
  Triton never imports one.
- `triton_<op>.py`: Triton kernels and their launch wrappers (shapes, launch configs, split-K);
  which wrapper runs is decided by the op's module. Every kernel's first statement is
  `wait_for_previous_kernel(PDL)` (triton_pdl.py) and every launch passes
  `**dispatch.pdl_launch(device)`: under programmatic dependent launch each kernel waits for the
  previous one before touching memory.
- `routing.py`: the routing table of the linear ops -- (op, weights, rows) -> kernel, with one
  provenance line for the measured choices; decisions only, so tests pin it on the CPU.
- `dispatch.py`: Triton or torch for given tensors, device facts (SMs, PDL support), settings.
- Tuned constants carry one line of provenance: the script and date that measured them (the
  numbers are in docs/benchmarks-log.md).
"""
