"""Compile lucebox's Triton kernels for a GPU this machine need not have (no GPU needed).

    python scripts/compile_kernels.py                  # every variant the wrappers launch, for sm_90
    python scripts/compile_kernels.py --kernels REGEX  # only variants whose label matches
    python scripts/compile_kernels.py --arch gfx942    # an AMD target
    python scripts/compile_kernels.py --kernels dp4a --sass /tmp/sass  # also each variant's SASS, with
                                                       # its loops' barriers, shuffles and loads counted

The interpreter the CPU tests use never lowers a kernel, so this is what catches code that only
the GPU compiler rejects: each variant's registers and spills (cuobjdump, when Triton ships it) and
its shared memory against the arch's limit (a launch asking more fails with OutOfResources). The
launches are recorded by running the Python wrappers on CPU tensors of real shapes with every
kernel replaced by a Recorder: the dense kernels at qwen3-8b-like shapes and Gemma 4's wide heads
(kernel_launches.record_dense), the Gated DeltaNet kernels at Qwen3.6-27B's (record_gated_delta);
scripts/bench_moe.py --compile-only records the MoE expert kernels.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

_SIG_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
              torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
              torch.float8_e4m3fn: "fp8e4nv"}


# Shared memory one block may take (bytes, opt-in maximum) by CUDA compute capability: a variant asking
# more compiles but fails at launch (triton's OutOfResources).
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def loop_stats(sass: str) -> str:
    """What the loops of a kernel's SASS (nvdisasm) hold: instructions, barriers, shuffles and global
    loads by width, summed over every backward branch's body. A barrier or shuffle inside a GEMV's
    loop over K says partial sums cross threads every iteration; a wide load moves 16 bytes."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L\w+):", line))}
    body = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*`\((\.L\w+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body += lines[labels[m.group(1)]:i + 1]
    ops = [m.group(1) for line in body if (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line))]
    count = lambda prefix: sum(op.startswith(prefix) for op in ops)  # noqa: E731
    return (f"loops: {len(ops)} instr, {count('BAR')} BAR, {count('SHFL')} SHFL, "
            f"{count('LDG.E.128')} LDG.128 / {count('LDG') - count('LDG.E.128')} narrower")


def compile_launches(launches: list, arch: str, kernels: str | None = None, sass_dir: str | None = None) -> None:
    """Compile every distinct variant among recorded launches for `arch` (e.g. 90, or gfx942), those whose
    label (kernel name, then its constexprs as NAME=value) matches the regex `kernels` if given; exit 1
    if any fails or asks more shared memory than the arch has. sass_dir: also write each variant's SASS
    there (NVIDIA) and print its loop_stats."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", int(arch), 32) if arch.isdigit() else GPUTarget("hip", arch, 64)
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    nvdisasm = cuobjdump.with_name("nvdisasm")
    seen, failures, done = set(), 0, 0
    shared_limit = SHARED_LIMIT.get(int(arch)) if arch.isdigit() else None
    for fn, args, kw in tqdm(launches, desc="compile"):
        names = fn.arg_names
        bound = dict(zip(names, args)) | {k: v for k, v in kw.items() if k in names}
        bound |= {n: p.default for n, p in zip(names, fn.params) if n not in bound}  # defaulted constexprs
        options = {k: v for k, v in kw.items() if k not in names}
        if "PDL" in names and target.backend == "cuda":  # as launched on Hopper (dispatch.pdl_launch)
            bound["PDL"], options["launch_pdl"] = True, True
        if "ASM" in names and target.backend == "hip":  # as an AMD GPU launches the dp4a GEMVs (no PTX)
            bound["ASM"] = False
        constexprs = {n: bound[n] for n, p in zip(names, fn.params) if p.is_constexpr}
        sig, attrs = {}, {}
        for i, n in enumerate(names):
            v = bound[n]
            if n in constexprs:
                sig[n] = "constexpr"
            elif isinstance(v, torch.Tensor):
                sig[n] = "*" + _SIG_TYPES[v.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
            elif isinstance(v, bool):
                sig[n] = "i1"
            elif isinstance(v, int):
                sig[n] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:  # Triton specialises such ints the same way at launch
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[n] = "fp32"
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())), tuple(sorted(attrs)))
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} " + " ".join(f"{k}={v}" for k, v in constexprs.items()
                                              if k.isupper()) + f" {sig[names[0]]} {options}"
        if kernels and not re.search(kernels, label):
            continue
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                      target=target, options=options)
        except Exception as e:  # report every failing variant, not just the first
            failures += 1
            while e.__cause__ is not None:  # a jit helper's error: its own message names the line
                e = e.__cause__
            tqdm.write(f"FAIL {label}\n  {type(e).__name__}: {str(e)[-900:]}")
            continue
        usage = ""
        if "cubin" in compiled.asm and cuobjdump.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                out = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
                sass = (subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True).stdout
                        if sass_dir and nvdisasm.exists() else "")
            found = re.search(r"REG:(\d+) STACK:(\d+)", out)
            usage = f"regs={found.group(1)} stack={found.group(2)}B" if found else ""
            if sass:
                name = re.sub(r"[^\w=.-]+", "_", label).strip("_")[:180]
                (Path(sass_dir) / f"{name}.sass").write_text(sass)
                usage += " " + loop_stats(sass)
        if shared_limit is not None and compiled.metadata.shared > shared_limit:
            failures += 1
            tqdm.write(f"FAIL {label} {usage} smem={compiled.metadata.shared} > {shared_limit} (sm_{arch}'s limit)")
            continue
        done += 1
        tqdm.write(f"ok   {label} {usage} smem={compiled.metadata.shared}")
    print(f"\n{done} variants compiled for {target.backend} {target.arch}, {failures} failed")
    if failures:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="90", help="CUDA compute capability (90) or an AMD target (gfx942)")
    p.add_argument("--kernels", help="only variants whose label (kernel name, then NAME=value constexprs) "
                                     "matches this regex")
    p.add_argument("--sass", metavar="DIR", help="write each variant's SASS into DIR and count what its loops hold")
    args = p.parse_args()
    from kernel_launches import record_dense, record_gated_delta

    launches: list = []
    record_dense(launches)
    record_gated_delta(launches)
    if args.sass:
        Path(args.sass).mkdir(parents=True, exist_ok=True)
    compile_launches(launches, args.arch, args.kernels, args.sass)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
