"""Issue 31 item 5: a layer split cuda:0 + cpu on the qwen3-8b shape, prefill and decode rates for
several split points (how much of the model can live on the host at what cost; --rest cuda:1: on a
second GPU instead, issue 32), and a DFlash
drafter on the CPU beside the target on the GPU. Random weights of the real shapes
(lucebox/bench/shapes.py), built once on the host and placed again for each row.

    python scripts/bench_device_map.py --gpu-layers 36 32 28 18 --json out.json   (a GPU machine)

Each row: `cuda:0:0-(N-1),cpu:N-35`; N = all layers runs twice, through CUDA graphs and eagerly
(split models run eagerly, so that row is the split rows' baseline). Drafter rows: a random 5-layer
DFlash drafter of the qwen3-8b target's width, 15 drafts a step, on cuda:0 and on the CPU
(--draft-device); its drafts are never accepted, so a row's rate is one token a step: the step's cost."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lucebox.bench.drafter_shapes import random_dflash_drafter  # noqa: E402
from lucebox.bench.shapes import build_random_model  # noqa: E402
from lucebox.config import EngineArgs  # noqa: E402
from lucebox.engine.engine import LLMEngine  # noqa: E402
from lucebox.engine.placement import Placement, parse_device_map  # noqa: E402
from lucebox.sampling import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_request(engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill seconds to the first token, seconds of the remaining tokens) of one greedy request."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    engine.add_request("bench", {"prompt_token_ids": prompt}, params)
    while not any(engine.step()):
        pass
    sync()
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return first - start, time.perf_counter() - first


def row(loaded, label: str, device_map: str, args, prompt, **engine_args) -> dict:
    layers = len(loaded.model.layers)
    placement = Placement(parse_device_map(device_map, layers))
    placement.apply(loaded.model)
    engine = LLMEngine.from_args(EngineArgs(model="random", device_map=device_map, dtype="bfloat16",
                                            max_model_len=args.prompt_len + args.decode_tokens + 32, max_num_seqs=1,
                                            kv_cache_memory=1 << 30, **engine_args), loaded)
    timed_request(engine, prompt, 4)  # warm-up at the timed length: its prefill kernels compiled, graphs captured
    prefill, decode = timed_request(engine, prompt, args.decode_tokens)
    out = {"row": label, "device_map": device_map, "prefill_tok_s": len(prompt) / prefill,
           "decode_tok_s": (args.decode_tokens - 1) / decode, "host_layers": len(
               [i for i in range(layers) if placement.layer_device(i).type == "cpu"]),
           "gpu_memory_gib": torch.cuda.memory_allocated(0) / 2**30 if torch.cuda.is_available() else 0.0}
    del engine  # the next row's engine frees the KV this one left in the model's layers
    placement.remove(loaded.model)
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--gpu-layers", type=int, nargs="+", default=[36, 32, 28, 24, 18])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--skip-drafter", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--gpu", default="cuda:0", help="the device of the first range (cpu: a smoke run of the script)")
    p.add_argument("--rest", default="cpu", help="the device of the layers past --gpu-layers (cuda:1: a two-GPU split)")
    args = p.parse_args()
    if args.gpu != "cpu" and not torch.cuda.is_available():
        raise SystemExit("bench_device_map.py measures a cuda:0 + cpu split: it needs a GPU")
    loaded = build_random_model(args.shape, args.quant, torch.device("cpu"), torch.bfloat16)
    layers = len(loaded.model.layers)
    prompt = torch.randint(0, loaded.config.vocab_size, (args.prompt_len,)).tolist()
    rows = []
    for n in args.gpu_layers:
        device_map = f"{args.gpu}:0-{n - 1}" + (f",{args.rest}:{n}-{layers - 1}" if n < layers else "")
        if n >= layers:
            rows.append(row(loaded, f"{n} on GPU, graphs", device_map, args, prompt, speculative_config={}))
            rows.append(row(loaded, f"{n} on GPU, eager", device_map, args, prompt, speculative_config={},
                            cuda_graphs=False))
        else:
            rows.append(row(loaded, f"{n} on {args.gpu}, {layers - n} on {args.rest}", device_map, args, prompt,
                            speculative_config={}))
    if not args.skip_drafter:
        with tempfile.TemporaryDirectory() as tmp:
            drafter = random_dflash_drafter(loaded.config, Path(tmp) / "dflash")
            spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15, "adaptive": False}
            whole = f"{args.gpu}:0-{layers - 1}"
            for where in (args.gpu, "cpu"):
                rows.append(row(loaded, f"target on GPU, drafter on {where}", whole, args, prompt,
                                speculative_config=spec, draft_device=where, cuda_graphs=False))
    print("| row | device map | prefill tok/s | decode tok/s | GPU GiB |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['row']} | `{r['device_map']}` | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.2f} | "
              f"{r['gpu_memory_gib']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
