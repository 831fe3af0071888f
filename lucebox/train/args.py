"""The flags of `lucebox train-drafter`, kept free of torch imports so the CLI starts fast."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import RequestError

SAVE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class TrainDrafterArgs:
    target: str
    data: list[str]
    out: str
    layers: int = 2
    arch: str = "dflash"  # or "dflash2": + grouped dynamic convs and the candidate selector
    selector_rank: int = 256  # dflash2: the selector's codebook rank
    selector_top_k: int = 16  # dflash2: candidates kept per slot
    block_size: int = 16
    taps: str = "auto"
    mask_token_id: str | int = "auto"
    heads: int | None = None  # drafter attention shape; default: the target's
    kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    init_from_target: bool = False  # draft layers start as copies of the target's last layers
    init_drafter: str | None = None  # start from this trained drafter (its shape; the target's RoPE)
    steps: int | None = None  # default: one pass over the training samples
    batch_size: int = 16
    seq_len: int = 1024
    lr: float = 6e-4
    gamma: float | None = None  # default: 7 for B=16, 4 for B=8
    anchors: int = 512
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    regenerate: bool = False
    prompt_len: int | None = None  # with --regenerate: prompt tokens per text sample (default seq_len // 4)
    regen_tokens: int | None = None  # with --regenerate: tokens the target writes per prompt (default: up to seq_len)
    regen_batch: int = 128
    max_samples: int | None = None
    eval_fraction: float = 0.02
    eval_data: list[str] | None = None  # held-out files; then nothing is split off `data`
    eval_samples: int = 64
    eval_every: int | None = None  # default: about ten evaluations per run
    save_every: int = 500
    max_seconds: float | None = None  # a wall-clock budget: the schedule is fitted to the steps it allows
    resume: bool = False
    device: str = "auto"
    dtype: str = "auto"
    save_dtype: str = "bfloat16"  # the drafter's exported weights (the published checkpoints are bf16)
    seed: int = 0
    progress: bool | None = None  # None: a progress bar when attached to a terminal

    def validate(self) -> None:
        positive = {"layers": self.layers, "batch_size": self.batch_size, "seq_len": self.seq_len,
                    "anchors": self.anchors, "save_every": self.save_every, "regen_batch": self.regen_batch,
                    "eval_samples": self.eval_samples}
        if self.arch not in ("dflash", "dflash2"):
            raise RequestError(f"--arch {self.arch!r}: choose dflash or dflash2")
        positive |= {"selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}
        for name in ("steps", "max_samples", "heads", "kv_heads", "head_dim", "intermediate_size", "prompt_len",
                     "regen_tokens"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.block_size < 2:
            raise RequestError(f"--block-size must be at least 2 (the anchor and one draft), got {self.block_size}")
        if self.seq_len < 8:
            raise RequestError(f"--seq-len must be at least 8 tokens, got {self.seq_len}")
        if self.prompt_len is not None and self.prompt_len >= self.seq_len:
            raise RequestError(f"--prompt-len {self.prompt_len} leaves no room to regenerate within "
                               f"--seq-len {self.seq_len}")
        if self.init_drafter is not None and self.init_from_target:
            raise RequestError("--init-drafter and --init-from-target both say where the drafter starts: give one")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise RequestError(f"--max-seconds must be positive, got {self.max_seconds!r}")
        for name in ("lr", "grad_clip"):
            if not getattr(self, name) > 0:
                raise RequestError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise RequestError(f"--save-dtype {self.save_dtype!r}: choose one of {', '.join(SAVE_DTYPES)}")
        if self.gamma is not None and not self.gamma > 0:
            raise RequestError(f"--gamma must be positive, got {self.gamma!r}")
        if not 0 <= self.warmup < 1:
            raise RequestError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup!r}")
        if not 0 <= self.eval_fraction < 1:
            raise RequestError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction!r}")
        if self.weight_decay < 0:
            raise RequestError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if self.eval_every is not None and self.eval_every < 0:
            raise RequestError(f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every!r}")
        if not self.data:
            raise RequestError("--data: give at least one text or .jsonl file (or a directory of them)")



def add_arguments(p) -> None:
    d = TrainDrafterArgs(target="", data=[], out="")
    p.add_argument("--target", required=True, default=argparse.SUPPRESS,
                   help="the target model: HF directory, .gguf file or hub id")
    p.add_argument("--data", nargs="+", required=True, default=argparse.SUPPRESS,
                   help="text files, .jsonl files ({'text'} or {'messages'} records) or directories of them")
    p.add_argument("--out", required=True, default=argparse.SUPPRESS,
                   help="output directory: the drafter (z-lab layout) and training state")
    p.add_argument("--arch", default=d.arch, choices=["dflash", "dflash2"],
                   help="dflash, or dflash2 (DFlash2DraftModel: grouped dynamic convs around attention and MLP, "
                        "a candidate selector trained with a teacher-forced top-K cross-entropy)")
    p.add_argument("--selector-rank", type=int, default=d.selector_rank, help="dflash2: selector codebook rank")
    p.add_argument("--selector-top-k", type=int, default=d.selector_top_k,
                   help="dflash2: candidates the selector keeps per slot")
    p.add_argument("--layers", type=int, default=d.layers, help="draft layers")
    p.add_argument("--block-size", type=int, default=d.block_size, help="block width B (anchor + B-1 drafts)")
    p.add_argument("--taps", default=d.taps,
                   help="target layers to tap: 'auto' (min(5, L-1) layers at 1 + k*floor((L-2)/(N-1)), "
                        "L//2 for one) or comma-separated indices")
    p.add_argument("--mask-token-id", default=d.mask_token_id,
                   help="'auto' (a <|mask|>-like token if the vocabulary has one, else the last embedding row) "
                        "or an id")
    for name, text in (("heads", "attention heads"), ("kv-heads", "key/value heads"), ("head-dim", "head size"),
                       ("intermediate-size", "FFN width")):
        p.add_argument(f"--{name}", type=int, default=argparse.SUPPRESS,
                       help=f"drafter {text} (default: the target's)")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the draft layers as copies of the target's last layers (the tap feeding the "
                        "first of them must be in --taps) instead of random weights")
    p.add_argument("--init-drafter", default=argparse.SUPPRESS,
                   help="start from this trained DFlash drafter (a directory): its layers, taps, block size and "
                        "mask token are kept (--layers, --taps, --block-size and the shape flags are ignored); its "
                        "RoPE and context become the target's, e.g. to extend a drafter to a YaRN-extended target")
    p.add_argument("--steps", type=int, default=argparse.SUPPRESS,
                   help="optimizer steps (default: one pass over the data)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--gamma", type=float, default=argparse.SUPPRESS,
                   help="slot weight decay w_k = exp(-(k-1)/gamma) (default: 7 for B=16, 4 for B=8)")
    p.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence, re-drawn every step")
    p.add_argument("--warmup", type=float, default=d.warmup, help="warm-up fraction of the cosine schedule")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--regenerate", action="store_true",
                   help="train on the target's own greedy continuations of the data (recipe default)")
    p.add_argument("--prompt-len", type=int, default=argparse.SUPPRESS,
                   help="with --regenerate: prompt tokens per text sample (default: seq-len / 4)")
    p.add_argument("--regen-tokens", type=int, default=argparse.SUPPRESS,
                   help="with --regenerate: tokens the target writes after each prompt (default: up to --seq-len); "
                        "prompts of every length up to --prompt-len then get continuations of one length")
    p.add_argument("--regen-batch", type=int, default=d.regen_batch, help="sequences generated at once")
    p.add_argument("--max-samples", type=int, default=argparse.SUPPRESS,
                   help="use at most this many training samples (default: all)")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction,
                   help="share of --data files held out for evaluation (0: none; ignored with --eval-data)")
    p.add_argument("--eval-data", nargs="+", default=argparse.SUPPRESS,
                   help="evaluate on these files or directories (same formats and processing as --data, "
                        "--regenerate included) instead of holding out --data files: all of --data is "
                        "trained on and --eval-fraction is ignored. Text the target never trained on makes "
                        "the held-out tau predict the engine's")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="held-out sequences evaluated")
    p.add_argument("--eval-every", type=int, default=argparse.SUPPRESS,
                   help="steps between evaluations (default: steps/10; 0: only at the end)")
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--max-seconds", type=float, default=argparse.SUPPRESS,
                   help="stop after this much training time; the LR schedule is fitted to the steps that "
                        "fit, measured over the first steps (with --steps: at most that many)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=d.dtype,
                   help="target dtype: auto (bfloat16 on GPU with bf16 autocast, float32 on CPU), float32, "
                        "bfloat16 or float16")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=SAVE_DTYPES,
                   help="dtype of the exported drafter weights (training keeps float32 master weights)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for initialisation, data order and anchors")


