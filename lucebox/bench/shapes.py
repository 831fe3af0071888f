"""Named real model shapes with random weights, so speed can be measured without downloading them.

`build_random_model("qwen3-8b", "q4_k_m", device)` builds the model directly on the device: float
weights drawn from N(0, 0.02) (norms 1), or QuantLinear / QuantEmbedding modules holding valid
random GGUF blocks (random quant bytes, fp16 scales chosen so values have a std near 0.02). Speed
depends on shapes and storage types only, so these models run exactly the kernels and memory
traffic of the real checkpoints. An 8B model builds in seconds on a GPU (all generated there).

Quant mixes follow llama.cpp's names. `q4_k_m` / `q5_k_m` approximate llama-quantize's mixes:
Q4_K / Q5_K everywhere except attn_v, ffn_down and the output head (the tied embedding when the
head is tied), which take Q6_K in every layer (llama.cpp gives Q6_K to only some layers' attn_v /
ffn_down, so real files are a little smaller than these).

Also here, for `lucebox bench speed`: the bytes one decode step reads and the FLOPs of a prefill,
the model under test (a checkpoint or a shape), its transformers twin (the peer, which shares the
lucebox model's tensors) and the record of a run (device, versions, commit) for the JSON.
"""
from __future__ import annotations

import datetime
import math
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..errors import RequestError
from ..kernels.dequant import IQ4_KVALUES
from ..model.assign import assign, empty_model
from ..model.config import ModelConfig
from ..model.loader import LoadedModel
from ..model.transformer import Transformer
from ..util import on_meta
from ..weights.quant import QuantEmbedding, QuantLinear, QuantTensor

_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu", attention_bias=False)
SHAPES: dict[str, dict] = {  # HF config.json fields of the real models
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600, tie_word_embeddings=False),
    # Tests and CPU runs: every dimension a multiple of 256, so the K-quants (256-value blocks) fit.
    "tiny": dict(_QWEN3, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, vocab_size=512, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}

FLOAT_QUANTS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
# name -> (type of most matrices, type of attn_v / ffn_down / output head)
QUANT_MIXES = {
    "q8_0": (Q.Q8_0, Q.Q8_0), "q4_0": (Q.Q4_0, Q.Q4_0), "q4_k": (Q.Q4_K, Q.Q4_K), "q4_k_m": (Q.Q4_K, Q.Q6_K),
    "q5_k": (Q.Q5_K, Q.Q5_K), "q5_k_m": (Q.Q5_K, Q.Q6_K), "q6_k": (Q.Q6_K, Q.Q6_K), "iq4_xs": (Q.IQ4_XS, Q.IQ4_XS),
}
QUANTS = tuple(FLOAT_QUANTS) + tuple(QUANT_MIXES)
STD = 0.02


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise RequestError(f"--shape {name!r} is not a named shape; choose one of: {', '.join(SHAPES)}")
    return ModelConfig.from_hf_dict(SHAPES[name])


def check_quant(quant: str) -> str:
    key = quant.strip().lower()
    if key not in QUANTS:
        raise RequestError(f"--quant {quant!r} is not a weight type the random builder knows; "
                           f"choose one of: {', '.join(QUANTS)}")
    return key


def _uniform_rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def _k_quant_std(levels: int) -> float:
    """Std of d = 1 affine K-quant values, sc * q - mean(q) * m with sc, m, q uniform: that is
    sc * (q - mean q) + mean q * (sc - m), whose two terms are uncorrelated."""
    mean_q = (levels - 1) / 2
    return math.sqrt(_RMS_6BIT ** 2 * _uniform_rms([q - mean_q for q in range(levels)]) ** 2
                     + 2 * mean_q ** 2 * _uniform_rms([s - 31.5 for s in range(64)]) ** 2)


_RMS_6BIT = _uniform_rms(range(64))  # K-quant sub-block scales / mins: 6-bit, 0..63
_RMS_INT8 = _uniform_rms(range(-128, 128))
# qtype -> (byte offset of the fp16 super-scale d, std of d = 1 values, offset of dmin or None, mean q)
# The std of a symmetric value with d = 1 is the rms of its sub-scale times the rms of its quant;
# dmin is set to d * mean(q) so the affine K-quants come out centred on average.
_LAYOUT = {
    Q.Q8_0: (0, _RMS_INT8, None, 0.0),
    Q.Q4_0: (0, _uniform_rms(range(-8, 8)), None, 0.0),
    Q.Q4_K: (0, _k_quant_std(16), 2, 7.5),
    Q.Q5_K: (0, _k_quant_std(32), 2, 15.5),
    Q.Q6_K: (208, _RMS_INT8 * _uniform_rms(range(-32, 32)), None, 0.0),
    Q.IQ4_XS: (0, _uniform_rms(range(-32, 32)) * _uniform_rms(IQ4_KVALUES), None, 0.0),
}


def random_quant_tensor(qtype: Q, rows: int, cols: int, device, name: str = "", std: float = STD) -> QuantTensor:
    """Valid random GGUF blocks of `qtype` for a [rows, cols] matrix: every byte random except the
    fp16 super-scales, which are drawn so the dequantised values have a std near `std`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise RequestError(f"{name}: {cols} columns are not a whole number of {qtype.name} blocks of {block}")
    offset, unit_std, dmin_offset, mean_q = _LAYOUT[qtype]
    blocks = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, device=device)
    d = (std / unit_std) * (0.5 + torch.rand(rows, cols // block, device=device))  # jitter: no two blocks alike
    blocks[..., offset:offset + 2] = d.to(torch.float16).view(torch.uint8).view(rows, -1, 2)
    if dmin_offset is not None:
        # mins are 6-bit like the scales, so mean(dmin * m) = mean(d * sc) * mean_q
        dmin = (d * mean_q).to(torch.float16)
        blocks[..., dmin_offset:dmin_offset + 2] = dmin.view(torch.uint8).view(rows, -1, 2)
    return QuantTensor(blocks.view(rows, -1), qtype, (rows, cols), name)


def _qtype_for(name: str, quant: str, tied: bool) -> Q:
    main, special = QUANT_MIXES[quant]
    head = name == "lm_head.weight" or (tied and name == "embed_tokens.weight")
    return special if head or name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")) else main


def _random_tokenizer(vocab_size: int):
    """A real tokenizer over the whole vocabulary (token i is the word `t<i>`), so the engine's
    detokenizer does the work it does for a real model at every step."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from ..text.tokenizer import Tokenizer
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, name=f"random word-level vocabulary of {vocab_size}")


@torch.no_grad()
def build_random_model(shape: str, quant: str, device: torch.device, dtype: torch.dtype | None = None,
                       seed: int = 0) -> LoadedModel:
    """The named shape with random weights in `quant` storage, built on `device`.

    dtype: activation dtype; float quants (bf16 / f16 / f32) fix it, GGUF quants default to
    bfloat16 on GPU and float32 on CPU."""
    cfg = shape_config(shape)
    quant = check_quant(quant)
    device = torch.device(device)
    torch.manual_seed(seed)
    if quant in FLOAT_QUANTS:
        dtype = FLOAT_QUANTS[quant]
        model = empty_model(cfg, dtype, device)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, STD)
    else:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        with on_meta():  # no float copy of the quantised matrices is ever allocated
            model = Transformer(cfg).to(dtype)
        assign(model, _random_quant_tensors(model, cfg, quant, device, dtype), f"random {shape} {quant}",
               dtype, device)
    model.eval()
    return LoadedModel(model, _random_tokenizer(cfg.vocab_size), cfg, f"random {shape} ({quant})", "random")


def _random_quant_tensors(model, cfg: ModelConfig, quant: str, device, dtype):
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" or name.endswith("_proj.weight") or name == "lm_head.weight":
            rows, cols = p.shape
            qt = random_quant_tensor(_qtype_for(name, quant, cfg.tie_word_embeddings), rows, cols, device, name)
            yield name, (QuantEmbedding(qt, dtype) if name == "embed_tokens.weight" else QuantLinear(qt))
        elif "norm" in name:
            yield name, torch.ones(p.shape, dtype=dtype, device=device)
        else:  # biases (none in Qwen3; kept so other shapes would work)
            yield name, torch.randn(p.shape, device=device).mul_(STD).to(dtype)


# ---------------------------------------------------------------------------- byte / FLOP accounting
def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_bytes(model) -> int:
    """Storage of every weight of the model (float parameters and quantised blocks)."""
    return sum(_bytes(t) for t in model.parameters()) + sum(
        _bytes(m.qweight) + _bytes(getattr(m, "bias", None))
        for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every matrix, norm and bias once, the LM head (the
    embedding table itself when tied), and a single row of the embedding table."""
    total = weight_bytes(model)
    embed = model.embed_tokens
    table = _bytes(embed.qweight) if isinstance(embed, QuantEmbedding) else _bytes(embed.weight)
    row = table // embed.weight.shape[0]
    tied_head = table if model.config.tie_word_embeddings else 0
    return total - table + row + tied_head


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights multiplied per token in the layers, weights of the LM head)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * layer, cfg.hidden_size * cfg.vocab_size


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one prefill: 2 per weight per token, the LM head for the last token only (as the
    runner computes it), and causal attention (QK^T and PV over L(L+1)/2 query-key pairs)."""
    layers, head = matmul_params(cfg)
    pairs = prompt_len * (prompt_len + 1) // 2
    attention = 2 * 2 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2 * layers * prompt_len + 2 * head + attention


# ---------------------------------------------------------------------------- the transformers twin
def transformers_twin(loaded: LoadedModel, hf_config, device: torch.device):
    """A transformers CausalLM whose parameters ARE the lucebox model's float tensors (shared, not
    copied: module names are HF's minus `model.`), so a peer costs no second copy of the weights."""
    from transformers import AutoModelForCausalLM

    # The meta device alone: on_meta's patched initialisers would be captured by transformers' own
    # init wrappers when this first imports a modeling module, breaking every later transformers model.
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=loaded.model.dtype)
    state = {k if k.startswith("lm_head") else "model." + k: v for k, v in loaded.model.state_dict().items()}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    for name, module in list(hf.named_modules()):  # non-persistent buffers (RoPE) were left on meta
        if name and any(b.is_meta for b in module.buffers(recurse=False)):
            hf.set_submodule(name, type(module)(config=hf_config).to(device))
    unfilled = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if unfilled:
        raise RuntimeError(f"transformers twin: tensors not filled from the lucebox model: {unfilled[:3]}")
    return hf.eval()


def transformers_decode(hf, prompt: list[int], new_tokens: int, repeats: int, now) -> tuple[list[int], float]:
    """Greedy `generate` with a static cache: (the tokens, median seconds per token after the first).
    `now` is a clock that waits for the device. The first call is an untimed warm-up: on CUDA,
    transformers compiles its static-cache decode step there."""
    ids, stamps = torch.tensor([prompt], device=hf.device), []

    class Stamps:  # a generate streamer: put() gets the prompt, then each new token as it is made
        def put(self, value):
            stamps.append(now())

        def end(self):
            pass

    def generate() -> tuple[list[int], float]:
        stamps.clear()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                              pad_token_id=0, streamer=Stamps())
        return out[0, len(prompt):].tolist(), (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    tokens, _ = generate()
    return tokens, statistics.median(generate()[1] for _ in range(repeats))


# ---------------------------------------------------------------------------- the model under test
def load_under_test(model: str | None, shape: str | None, quant: str | None, dtype: str, device: torch.device,
                    seed: int = 0) -> tuple[LoadedModel, str]:
    """A checkpoint (--model; the default model when neither is given) or a random --shape.
    Returns the model and its weight label: bf16 / f16 / f32, a GGUF mix name, or `gguf`."""
    from ..model.loader import load_model, resolve_dtype
    if model and shape:
        raise RequestError("give --model or --shape, not both")
    if shape:
        quant = check_quant(quant or "bf16")
        act = None if dtype == "auto" else resolve_dtype(dtype, None, device)
        return build_random_model(shape, quant, device, act, seed=seed), quant
    if quant:
        raise RequestError("--quant applies to --shape; a --model keeps its checkpoint's weight types")
    if model is None:
        from ..default_model import default_model_path
        model = str(default_model_path())
    loaded = load_model(model, dtype=dtype, device=str(device))
    if any(isinstance(m, QuantLinear) for m in loaded.model.modules()):
        return loaded, "gguf"
    return loaded, {v: k for k, v in FLOAT_QUANTS.items()}[loaded.model.dtype]


def describe(loaded: LoadedModel, quant: str) -> dict:
    model, qtypes = loaded.model, {}
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            qtypes[m.qtype.name] = qtypes.get(m.qtype.name, 0) + 1
    return {"source": loaded.source, "quant": quant, "quant_types": qtypes, "config": loaded.config.to_dict(),
            "dtype": str(model.dtype).removeprefix("torch."), "weight_bytes": weight_bytes(model),
            "weight_bytes_per_token": weight_bytes_per_token(model)}


# ---------------------------------------------------------------------------- the record of a run
def version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or a broken install
        return None


def _commit() -> str | None:
    """The checkout's commit, read from .git without running git (None on a copy without .git)."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head  # a detached HEAD names the commit itself
        ref = head.removeprefix("ref: ")
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        return next((x.split()[0] for x in (git / "packed-refs").read_text().splitlines() if x.endswith(" " + ref)),
                    None)
    except OSError:
        return None


def run_metadata(args, device: torch.device) -> dict:
    """Where and how a benchmark ran: device, versions, commit, date, the exact command and options."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": version("triton"), "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([_program(sys.argv[0]), shlex.join(sys.argv[1:])]), "args": dict(vars(args))}


def _program(argv0: str) -> str:
    """`python -m lucebox.cli` shows up as the path of cli.py: say it the way it was typed."""
    return "python -m lucebox.cli" if Path(argv0).parts[-2:] == ("lucebox", "cli.py") else argv0
