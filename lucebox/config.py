"""Every engine setting in one place, with the names vLLM users know: EngineArgs, SpeculativeConfig,
and the readers of lucebox's environment variables (LUCEBOX_*; no other module reads the environment)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path

from .errors import RequestError

KV_POOL_CHUNK = 64  # KVFlash's unit of residency, in tokens


@dataclass
class EngineArgs:
    model: str | None = None  # HF dir, .gguf file or hub id; None = the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Layer ranges on devices, e.g. "cuda:0:0-27,cpu:28-35", or "auto" (engine/placement.py); None: all on `device`.
    device_map: str | None = None
    draft_device: str | None = None  # the drafter's (DFlash or draft model) device; None: the target's
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 8192  # new tokens in one step
    kv_cache_memory: int | None = None  # bytes of KV pool; default: enough for max_num_seqs x max_model_len, capped
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory lucebox may use (weights + KV)
    seed: int = 0
    enable_prefix_caching: bool = True
    # Hybrids (Gated DeltaNet): recurrent-state snapshots kept at block boundaries, what prefix reuse
    # needs with recurrent layers (engine/state_snapshots.py); each is one sequence's state (Qwen3.6-27B:
    # ~150 MB), counted in the memory plan; 0 turns prefix caching off for such models.
    recurrent_prefix_snapshots: int = 8
    cache_type_k: str = "auto"  # llama.cpp's names: auto f32 f16 bf16 fp8 q8_0 q4_0
    cache_type_v: str = "auto"
    cache_rotate_k: bool = False  # Walsh-Hadamard rotation of K before quantising it
    # A SpeculativeConfig or vLLM's dict shape of it ({"method": "dflash", "model": ..., ...}), typed on
    # construction. None: the default model speculates with its drafter, any other model does not;
    # {} (or SpeculativeConfig()): off.
    speculative_config: SpeculativeConfig | dict | None = None
    # KVFlash on the DFlash drafter's side (spec/draft_pool.py; lossless, the target verifies over its whole
    # context): each draft pass reads at most this many context positions (sink, recent tail and the
    # best-scored 64-token chunks); 0: every position, as without a pool.
    draft_kv_pool_tokens: int = 0
    max_queue: int = 1024  # waiting sequences (a request counts its n) before new ones are refused
    # CUDA graphs for decode / verify steps. None: on for CUDA devices (an eager step there is several
    # times slower), off on CPU; True on CPU runs the padded static batches without capture (how CPU
    # tests check them); False: vLLM's enforce_eager.
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int = 32  # largest batch (in sequences) replayed through a CUDA graph
    # One-sequence prefill steps of up to PREFILL_GRAPH_LENS[-1] tokens through CUDA graphs too (short
    # prompts, agents' turns on a cached prefix; engine/cuda_graphs.py).
    prefill_graphs: bool = True
    # Overlapped decoding: the next decode step is launched (its input tokens fed on the device)
    # before the current one's tokens are read, so the host's work hides behind the GPU's
    # (bench speed --async-decode / --no-async-decode, H200, 2026-12-03). Plain decode steps through
    # CUDA graphs, including a speculator's while its policy decodes plainly (Speculator.plain_run).
    async_decode: bool = True
    # Ranks of tensor parallelism (engine/tensor_parallel.py): one process each, started by lucebox; rank r on
    # cuda:r (or the CPU, over gloo); rank 0 schedules, samples and serves.
    tensor_parallel_size: int = 1
    # PFlash speculative prefill (engine/pflash, lossy): None keeps every prompt exact; a ratio in (0, 1]
    # prefills that share of a long prompt's 32-token chunks, picked by the scorer's tail attention.
    prefill_keep_ratio: float | None = None
    prefill_min_tokens: int = 8192  # shorter prompts are always prefilled exactly
    prefill_scorer: str | None = None  # the scoring model (its own tokenizer); None: the target scores itself
    prefill_scorer_window: int = 4096  # keys each prompt position attends to in the scorer's pass; 0: all
    # KVFlash (engine/kv_pool.py, LOSSY on the target): a pooled sequence keeps at most kv_pool_tokens of
    # KV resident on the device (sinks, tail, best-scored 64-token chunks, reselected every
    # kv_reselect_interval tokens), the whole of it in host memory; 0: off.
    kv_pool_tokens: int = 0
    kv_pool_target: bool = False  # pool every request's target KV unless it says kv_pool: false
    kv_reselect_interval: int = 64
    kv_pool_host_memory: int | None = None  # bytes of host backing; default: max_num_seqs full contexts, capped

    HELP = {
        "model": "HF model directory, .gguf file or hub id (default: the bundled default model)",
        "dtype": "activation / weight dtype: auto, float32, bfloat16 or float16 (auto: float32 on CPU, "
                 "the checkpoint's dtype on GPU)",
        "device": "auto, cpu, cuda or cuda:N",
        "device_map": "layer ranges on devices, e.g. cuda:0:0-27,cpu:28-35 (inclusive ranges), or auto (fill the "
                      "first GPU from its free memory, the rest on the next device); split models run eagerly",
        "draft_device": "device of the speculative drafter (DFlash drafter or draft model), e.g. cpu or cuda:1 "
                        "(default: the target's)",
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
        "draft_kv_pool_tokens": "DFlash drafter KV pool (lossless): each draft pass attends to at most this many "
                                "context tokens (sink, recent tail, best-scored 64-token chunks; a multiple of 64, "
                                "at least 320); 0: the whole context",
        "enable_prefix_caching": "reuse the KV of shared prompt prefixes across requests",
        "recurrent_prefix_snapshots": "hybrid (Gated DeltaNet) models: recurrent-state snapshots kept at block "
                                      "boundaries for prefix reuse, least recently used evicted (each one "
                                      "sequence's state; 0: no prefix reuse for these models)",
        "max_queue": "most sequences waiting for a slot (a request counts n); more are refused with an overload error",
        "cuda_graphs": "replay decode and verify steps through CUDA graphs (default: on for CUDA devices)",
        "enforce_eager": "run every step eagerly: no CUDA graphs (slower at small batches; for debugging)",
        "async_decode": "launch each plain decode step before the previous one's tokens are read (through "
                        "CUDA graphs; --no-async-decode waits for each step's tokens first)",
        "tensor_parallel_size": "split the model over this many ranks (one process each, started by lucebox: "
                                "cuda:0..N-1, or CPU processes over gloo); Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE models",
        "prefill_keep_ratio": "speculative prefill (PFlash, LOSSY; default off): prefill only this share (0..1] of "
                              "a long prompt's chunks, chosen by a scorer model's attention",
        "prefill_min_tokens": "speculative prefill: prompts shorter than this many tokens stay exact",
        "prefill_scorer": "speculative prefill: the scoring model (HF dir, .gguf or hub id; default: the target)",
        "prefill_scorer_window": "speculative prefill: keys each prompt position attends to in the scorer's pass "
                                 "(0: all; the question's last tokens always see the whole prompt)",
        "kv_pool_tokens": "KVFlash: resident KV tokens per pooled sequence (multiple of 64; the rest in host memory; "
                          "0: off); contexts past GPU KV capacity need it",
        "kv_pool_target": "KVFlash (LOSSY): pool every request's target KV by default (a request's kv_pool field "
                          "overrides)",
        "kv_reselect_interval": "KVFlash: tokens between choices of the resident chunks",
        "kv_pool_host_memory": "KVFlash: bytes of host memory backing pooled KV (default: max_num_seqs full "
                               "contexts, at most half the host's available memory)",
        "cuda_graph_max_batch": "largest batch of sequences whose decode / verify steps replay a CUDA graph "
                                "(larger batches run eagerly)",
        "prefill_graphs": "replay one-sequence prefill steps of up to 2,048 new tokens (512 on hybrids) through "
                          "CUDA graphs too (short prompts; not with KVFlash or a drafter on its own device: those "
                          "run eagerly)",
    }

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue", "cuda_graph_max_batch",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.recurrent_prefix_snapshots, int) or self.recurrent_prefix_snapshots < 0:
            raise RequestError(f"recurrent_prefix_snapshots must be an integer >= 0, got "
                               f"{self.recurrent_prefix_snapshots!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise RequestError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise RequestError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.device_map is not None and self.device not in (None, "auto"):
            raise RequestError(f"give --device ({self.device}) or --device-map ({self.device_map}), not both: the map "
                               f"names every layer's device")
        if self.tensor_parallel_size > 1 and (self.device_map is not None or self.draft_device is not None):
            raise RequestError(f"tensor_parallel_size {self.tensor_parallel_size} with --device-map / --draft-device "
                               "is not supported: tensor parallelism places every rank's shard on its own device")
        if self.tensor_parallel_size > 1 and (self.prefill_keep_ratio is not None or self.prefill_scorer is not None):
            raise RequestError(f"tensor_parallel_size {self.tensor_parallel_size} with speculative prefill "
                               "(--prefill-keep-ratio / --prefill-scorer) is not supported yet")
        self._check_kv_pool()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_draft_pool_tokens(self.draft_kv_pool_tokens)
        check_keep_ratio(self.prefill_keep_ratio, "prefill_keep_ratio")
        if not isinstance(self.prefill_min_tokens, int) or self.prefill_min_tokens < 1:
            raise RequestError(f"prefill_min_tokens must be a positive integer, got {self.prefill_min_tokens!r}")
        window = self.prefill_scorer_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise RequestError(f"prefill_scorer_window must be a non-negative integer (0: the whole prompt), "
                               f"got {window!r}")

    def _check_kv_pool(self) -> None:
        for name in ("kv_pool_tokens", "kv_reselect_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "kv_pool_tokens" else 1):
                raise RequestError(f"{name} must be a{' non-negative' if name == 'kv_pool_tokens' else ' positive'} "
                                   f"integer, got {value!r}")
        if self.kv_pool_tokens % KV_POOL_CHUNK:
            raise RequestError(f"kv_pool_tokens must be a multiple of {KV_POOL_CHUNK} (the pool's chunk), got "
                               f"{self.kv_pool_tokens}")
        if self.kv_pool_host_memory is not None and self.kv_pool_host_memory <= 0:
            raise RequestError(f"kv_pool_host_memory must be a positive number of bytes, got "
                               f"{self.kv_pool_host_memory!r}")
        if self.kv_pool_target and not self.kv_pool_tokens:
            raise RequestError("kv_pool_target needs kv_pool_tokens (the resident pool's size)")
        if self.kv_pool_tokens and self.tensor_parallel_size > 1:
            raise RequestError("kv_pool_tokens (KVFlash) with tensor parallelism is not supported yet")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# The drafter-side pool's chunk and its smallest size: one sink chunk, a tail of the partial chunk and the
# two before it, and two chunks to choose (spec/draft_pool.py's Protection).
DRAFT_POOL_CHUNK_TOKENS = 64
DRAFT_POOL_MIN_TOKENS = 5 * DRAFT_POOL_CHUNK_TOKENS


def check_draft_pool_tokens(value) -> None:
    """draft_kv_pool_tokens: 0 (off) or a multiple of the chunk, at least the protected minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"draft_kv_pool_tokens must be an integer >= 0 (0: off), got {value!r}")
    if value and value % DRAFT_POOL_CHUNK_TOKENS:
        below = max(value // DRAFT_POOL_CHUNK_TOKENS * DRAFT_POOL_CHUNK_TOKENS, DRAFT_POOL_MIN_TOKENS)
        raise RequestError(f"draft_kv_pool_tokens {value} is not a multiple of the pool's {DRAFT_POOL_CHUNK_TOKENS}-"
                           f"token chunk (e.g. {below})")
    if value and value < DRAFT_POOL_MIN_TOKENS:
        raise RequestError(f"draft_kv_pool_tokens {value} is below the smallest pool of {DRAFT_POOL_MIN_TOKENS} "
                           f"tokens (a sink chunk, the recent tail and two chosen chunks)")


def check_keep_ratio(value, name: str) -> None:
    """A speculative-prefill keep ratio: None (exact prefill) or a number in (0, 1]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise RequestError(f"{name} must be a number in (0, 1] (the share of prompt chunks kept), got {value!r}")


SPEC_METHODS = ("dflash", "draft_model", "ngram")
# Draft tokens per step when num_speculative_tokens is not given (dflash: its block's drafts, block - 1).
DEFAULT_DRAFT_TOKENS = {"draft_model": 4, "ngram": 5}
MAX_TREE_BUDGET = 63  # a tree verify row: the pending token and up to 63 nodes (spec/tree.py)
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")  # the loader's names


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings; `parse` reads vLLM's dict shape. method None: speculation off."""
    method: str | None = None  # dflash | draft_model | ngram; given only a model: draft_model
    model: str | None = None  # the drafter: a DFlash directory / .gguf (dflash) or a smaller model (draft_model)
    num_speculative_tokens: int | None = None  # drafts per step; None: draft_tokens()' default
    adaptive: bool = True  # adapt the draft length per step to the measured acceptance and costs
    ngram_first: bool = False  # with a drafter model: n-gram lookup drafts where the text repeats
    prompt_lookup_min: int = 3  # n-gram lookup: the shortest suffix matched
    prompt_lookup_max: int = 5  # n-gram lookup: the longest suffix matched (tried first)
    draft_dtype: str | None = None  # draft_model's dtype; None: the target's
    # dflash: verify a DDTree of this many nodes built from each drafter pass (spec/tree.py) instead of
    # the chain; None: chains. Dense targets only for now.
    tree_budget: int | None = None

    @classmethod
    def parse(cls, config: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """None stays None (unset); a dict in vLLM's shape becomes a SpeculativeConfig ({}: off)."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise RequestError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(config).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = set(config) - set(known)
        if unknown:
            raise RequestError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(sorted(known))}")
        return cls(**config)

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if self.method is None and self.model:
            self.method = "draft_model"
        if self.method is None:
            if any(getattr(self, f.name) != f.default for f in fields(self)):
                raise RequestError(f"speculative_config needs a method: one of {', '.join(SPEC_METHODS)}")
            return
        if self.method not in SPEC_METHODS:
            raise RequestError(f"speculative_config['method'] {self.method!r} does not exist; choose one of "
                               f"{', '.join(SPEC_METHODS)}")
        if self.model is not None and not isinstance(self.model, str):
            raise RequestError(f"speculative_config['model'] must be a path or hub id, got {self.model!r}")
        if self.method == "ngram" and self.ngram_first:
            raise RequestError("speculative_config['ngram_first'] puts n-gram lookup before a drafter model "
                               "(method dflash or draft_model); method 'ngram' has none")
        if self.method != "ngram" and not self.model:
            raise RequestError(f"speculative method {self.method!r} needs a draft model (speculative_config['model'] "
                               f"or --draft)")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise RequestError(f"speculative_config['num_speculative_tokens'] must be a positive integer, got {k!r}")
        for name in ("adaptive", "ngram_first"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"speculative_config['{name}'] must be true or false, got {getattr(self, name)!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"speculative_config['{name}'] must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise RequestError(f"n-gram lookup needs prompt_lookup_min ({self.prompt_lookup_min}) <= "
                               f"prompt_lookup_max ({self.prompt_lookup_max})")
        budget = self.tree_budget
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_TREE_BUDGET:
                raise RequestError(f"speculative_config['tree_budget'] must be an integer 1..{MAX_TREE_BUDGET} "
                                   f"(draft tree nodes verified beside the pending token), got {budget!r}")
            if self.method != "dflash":
                raise RequestError(f"speculative_config['tree_budget'] builds draft trees from a DFlash drafter's "
                                   f"pass; method {self.method!r} drafts chains only")
        if self.draft_dtype is not None and self.draft_dtype not in DRAFT_DTYPES:
            raise RequestError(f"speculative_config['draft_dtype'] {self.draft_dtype!r} is not one of "
                               f"{', '.join(DRAFT_DTYPES)}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def draft_tokens(self, dflash_block_size: int | None = None) -> int:
        """num_speculative_tokens, else the method's default: all of a DFlash block's drafts
        (dflash_block_size - 1), 4 for a draft model, 5 for n-gram lookup."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.method == "dflash":
            return dflash_block_size - 1
        return DEFAULT_DRAFT_TOKENS[self.method]


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


def bucket_chunks_setting() -> bool:
    """LUCEBOX_BUCKET_CHUNKS (0 | 1; default 0): 1 sends a hybrid's prefill graph buckets' Gated DeltaNet
    rows through the chunked rule instead of token by token (kernels/routing.bucket_chunks). Read at
    engine build and at each bucket's capture."""
    return _switch(os.environ.get("LUCEBOX_BUCKET_CHUNKS")) is True


def dp4a_runs_setting() -> bool:
    """LUCEBOX_DP4A_RUNS (0 | 1; default 0): 1 sends one-row products of Q4_K and split Q8_0 / Q6_K
    rows to int8 activations and the kernels that keep each thread's sums apart until the end
    (kernels/triton_dp4a_runs.py; Q5_K and IQ4_XS take them anyway). Read at each product
    (kernels/routing.dp4a_runs)."""
    return _switch(os.environ.get("LUCEBOX_DP4A_RUNS")) is True


def int8_activations_setting() -> bool | None:
    """LUCEBOX_INT8_ACTIVATIONS (0 | 1; default unset): whether quantised decode and verify products
    may round their activation rows to int8 where that is faster. Unset (None): yes on CUDA, no on
    ROCm; 0: never; 1: also on ROCm. Read at each product (kernels/dispatch.int8_activations)."""
    return _switch(os.environ.get("LUCEBOX_INT8_ACTIVATIONS"))


def cache_dir() -> Path:
    """LUCEBOX_CACHE (a directory; default ~/.cache/lucebox): where the random-weight demo model is built
    when the bundled default model is absent. Read each time the default model is resolved."""
    return Path(os.environ.get("LUCEBOX_CACHE", Path.home() / ".cache" / "lucebox"))


def child_environment(package_root: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child process (a server bench serve or launch starts), with
    `package_root` first on PYTHONPATH so that the child imports this same lucebox."""
    path = os.pathsep.join(filter(None, [str(package_root), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path) | extra


def rank_environment() -> dict[str, str] | None:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which lucebox sets for
    the tensor-parallel ranks it starts (engine/tensor_parallel.py); None when any is missing."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    values = {name: os.environ.get(name) for name in names}
    return None if None in values.values() else values


def client_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a coding client lucebox launch runs."""
    return dict(os.environ) | extra


def openai_api_key() -> str | None:
    """OPENAI_API_KEY, the key bench serve sends when --api-key is not given (as OpenAI's tools do)."""
    return os.environ.get("OPENAI_API_KEY")
