"""Every engine setting in one place, with the names vLLM users know: EngineArgs, SpeculativeConfig,
and the readers of lucebox's environment variables (LUCEBOX_*; no other module reads the environment)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path


from .errors import RequestError


@dataclass
class EngineArgs:
    model: str | None = None  # HF dir, .gguf file or hub id; None = the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 8192  # new tokens in one step
    kv_cache_memory: int | None = None  # bytes of KV pool; default: enough for max_num_seqs x max_model_len, capped
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory lucebox may use (weights + KV)
    seed: int = 0
    enable_prefix_caching: bool = True
    cache_type_k: str = "auto"  # llama.cpp's names: auto f32 f16 bf16 fp8 q8_0 q4_0
    cache_type_v: str = "auto"
    cache_rotate_k: bool = False  # Walsh-Hadamard rotation of K before quantising it
    # vLLM's shape: {"method": "dflash"|"draft_model"|"ngram", "model": ..., "num_speculative_tokens": k, ...}
    speculative_config: dict | None = None
    max_queue: int = 1024  # waiting requests before new ones are refused
    # CUDA graphs for decode / verify steps. None: on for CUDA devices (validated on the H200, where an
    # eager 8B bf16 step is several times slower), off on CPU; True on CPU runs the padded static
    # batches without capture (how CPU tests check them); False: vLLM's enforce_eager.
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int = 32  # largest batch (in sequences) replayed through a CUDA graph
    # Overlapped decoding: the next decode step is launched (its input tokens fed on the device)
    # before the current one's tokens are read, so the host's work hides behind the GPU's (H200:
    # 0.6b shape 683 -> 891 tok/s, 8b 204 -> 212). Plain decode steps through CUDA graphs, including
    # a speculator's while its policy decodes plainly (Speculator.plain_run).
    async_decode: bool = True

    HELP = {
        "model": "HF model directory, .gguf file or hub id (default: the bundled default model)",
        "dtype": "activation / weight dtype: auto, float32, bfloat16 or float16 (auto: float32 on CPU, "
                 "the checkpoint's dtype on GPU)",
        "device": "auto, cpu, cuda or cuda:N",
        "max_model_len": "context window in tokens (default: the model's)",
        "block_size": "tokens per paged KV block",
        "max_num_seqs": "most sequences batched in one step",
        "max_num_batched_tokens": "most new tokens computed in one step",
        "kv_cache_memory": "bytes for the KV pool on CPU (default: enough for max_num_seqs full contexts, "
                           "at most 2 GiB)",
        "gpu_memory_utilization": "fraction of GPU memory for weights and KV pool",
        "seed": "global random seed (per-request seeds override it)",
        "cache_type_k": "KV cache type of keys: auto (the model dtype), f32, f16, bf16, fp8, q8_0 or q4_0",
        "cache_type_v": "KV cache type of values: auto (the model dtype), f32, f16, bf16, fp8, q8_0 or q4_0",
        "cache_rotate_k": "rotate keys with a Walsh-Hadamard transform before quantising (tames outlier channels)",
        "speculative_config": "speculative decoding settings",
        "enable_prefix_caching": "reuse the KV of shared prompt prefixes across requests",
        "max_queue": "most requests waiting for a slot; more are refused with an overload error",
        "cuda_graphs": "replay decode and verify steps through CUDA graphs (default: on for CUDA devices)",
        "enforce_eager": "run every step eagerly: no CUDA graphs (slower at small batches; for debugging)",
        "async_decode": "launch each plain decode step before the previous one's tokens are read (through "
                        "CUDA graphs; --no-async-decode waits for each step's tokens first)",
        "cuda_graph_max_batch": "largest batch of sequences whose decode / verify steps replay a CUDA graph "
                                "(larger batches run eagerly)",
    }

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue", "cuda_graph_max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise RequestError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise RequestError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# ---------------------------------------------------------------------- environment (README: Environment)
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@functools.cache
def _switch(raw: str | None) -> bool | None:
    """True for 1/true/yes/on, False for 0/false/no/off (any case, spaces ignored), None otherwise."""
    value = (raw or "").strip().lower()
    return True if value in ON else False if value in OFF else None


def triton_setting() -> bool | None:
    """LUCEBOX_TRITON (0 | 1; default unset): which implementation of each op runs. Unset: the
    Triton kernels for CUDA/ROCm tensors, the torch references for CPU tensors. 0: always the torch
    references (e.g. to bisect a numerical difference on the GPU). 1: Triton also for CPU tensors,
    only under TRITON_INTERPRET=1 (how CI runs the kernels without a GPU). Read at each op outside
    a model forward, once per forward inside one (kernels/dispatch.py)."""
    return _switch(os.environ.get("LUCEBOX_TRITON"))


def triton_interpret() -> bool:
    """TRITON_INTERPRET (Triton's own variable; 1 = Triton's numpy interpreter, default off): lucebox
    then keeps GPU tensors on compiled kernels and may run Triton on CPU tensors (LUCEBOX_TRITON=1)."""
    return _switch(os.environ.get("TRITON_INTERPRET")) is True


def pdl_enabled() -> bool:
    """LUCEBOX_PDL (0 | 1; default 1): programmatic dependent launch of the Triton kernels on NVIDIA
    Hopper and later, each kernel starting while the one before it drains; 0 turns it off. Read at
    each kernel launch (and so at each CUDA-graph capture)."""
    return _switch(os.environ.get("LUCEBOX_PDL")) is not False


def pdl_tiles() -> bool:
    """LUCEBOX_PDL_TILES (0 | 1; default 0): 1 launches the float kernel's quantised verify tiles with
    programmatic dependent launch too (they were slower with it on qwen3-8b Q4_K_M). Read at launch."""
    return _switch(os.environ.get("LUCEBOX_PDL_TILES")) is True


def int8_activations_setting() -> bool | None:
    """LUCEBOX_INT8_ACTIVATIONS (0 | 1; default unset): whether quantised decode and verify products
    may round their activation rows to int8 where that is faster. Unset (None): yes on CUDA, no on
    ROCm; 0: never; 1: also on ROCm. Read at each product (kernels/dispatch.int8_activations)."""
    return _switch(os.environ.get("LUCEBOX_INT8_ACTIVATIONS"))


def cache_dir() -> Path:
    """LUCEBOX_CACHE (a directory; default ~/.cache/lucebox): where the random-weight demo model is built
    when the bundled default model is absent. Read each time the default model is resolved."""
    return Path(os.environ.get("LUCEBOX_CACHE", Path.home() / ".cache" / "lucebox"))
