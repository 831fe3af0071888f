"""Tensor parallelism, the model's side: one rank's shard of a model (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE here;
the Qwen 3.5 / 3.6 hybrids' DeltaNet, gated attention and shared experts in model/tensor_parallel_hybrid.py,
Gemma 4's and Laguna's layers in model/tensor_parallel_gemma4_laguna.py).

Megatron's layout: q/k/v and gate/up column-parallel (each rank keeps whole heads -- query heads of
its own KV heads, so GQA groups stay together -- and a slice of the MLP width), o_proj and down_proj
row-parallel (each rank multiplies its slice of the input features; one all-reduce sums the
partials), the embedding and LM head vocabulary-parallel (a masked lookup plus an all-reduce; each
rank's logits of its vocabulary slice, all-gathered). MoE experts keep a slice of their intermediate
width on every rank (the router replicated), their summed output one all-reduce. Everything else
(norms, RoPE) is replicated, so the residual stream is the same on every rank after each all-reduce.

The projections are sharded before fuse_projections, so a fused q/k/v or gate/up is the fusion of
this rank's shards. Quantised (GGUF) weights are sliced in whole quantisation blocks: row slices
are always whole rows; column slices must start and end on a block boundary (32 or 256 values).
Collectives run on torch.distributed's default group, which the caller initialised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from torch import nn

from ..errors import UnsupportedError
from ..kernels.linear import linear
from ..weights.quant import (
    PermutedInputQuantLinear,
    QuantEmbedding,
    QuantLinear,
    QuantTensor,
)
from .assign import model_class
from .deltanet import GatedDeltaNet
from .gated_attention import GatedAttention
from .gemma4 import GeGLU, Gemma4DecoderLayer, Gemma4Model
from .laguna import LagunaAttention, LagunaDecoderLayer, LagunaTransformer
from .moe import SparseMoE
from .qwen3_5 import HybridDecoderLayer, HybridTransformer
from .transformer import MLP, Attention, DecoderLayer, Transformer, fused_projections


@dataclass
class FullVocab:
    """The unsharded embedding and LM head, kept on rank 0 for a DFlash drafter, which embeds its
    block and projects its drafts there alone (the other ranks do not take part)."""
    embed_tokens: nn.Module
    lm_head: nn.Module | None


class RowParallel(nn.Module):
    """y = all_reduce(x_r @ W_r.T) + bias: this rank's input features x_r times its columns W_r."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.local = local
        self.register_buffer("bias", bias)
        self.out_features = local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.local)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class ParallelMoE(nn.Module):
    """A SparseMoE whose experts keep a slice of their intermediate width (router replicated, so every
    rank routes alike); each rank's output is a partial sum, and one all-reduce adds them."""

    def __init__(self, moe: SparseMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.moe(x)
        dist.all_reduce(y)
        return y

    def fuse(self) -> None:
        self.moe.fuse()

    def after_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        return self(h), residual


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table: a lookup zeroes the ids outside them and one
    all-reduce sums the ranks' rows (exactly one is non-zero). `project` is the tied LM head."""

    def __init__(self, table: nn.Module, start: int, vocab_size: int, shard_rows: int):
        super().__init__()
        self.table, self.start, self.vocab_size, self.shard_rows = table, start, vocab_size, shard_rows
        self.rows = table.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self.table(local.clamp(0, self.rows - 1)) * inside.unsqueeze(-1)
        dist.all_reduce(x)
        return x

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, QuantEmbedding):
            local = self.table.project(hidden)
        else:
            local = F.linear(hidden, self.table.weight)
        return gather_vocab(local, self.shard_rows, self.vocab_size)


class VocabParallelHead(nn.Module):
    """The untied LM head's rows of this rank's vocabulary slice; the logits all-gathered."""

    def __init__(self, local: nn.Module, vocab_size: int, shard_rows: int):
        super().__init__()
        self.local, self.vocab_size, self.shard_rows = local, vocab_size, shard_rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(linear(hidden, self.local), self.shard_rows, self.vocab_size)


def gather_vocab(local: torch.Tensor, shard_rows: int, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [.., shard] side by side; the last shard is padded to the others' width."""
    if local.shape[-1] < shard_rows:
        local = F.pad(local, (0, shard_rows - local.shape[-1]))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]


LAYERS = {Transformer: DecoderLayer, HybridTransformer: HybridDecoderLayer, LagunaTransformer: LagunaDecoderLayer,
          Gemma4Model: Gemma4DecoderLayer}  # the models shard_model splits, and their layers


def check_shardable(model: nn.Module, size: int) -> None:
    """check_config, and the modules are the ones shard_model knows."""
    check_config(model.config, size)
    layers = LAYERS.get(type(model))
    if layers is None or not all(type(layer) is layers and type(layer.mlp) in (MLP, SparseMoE, GeGLU)
                                 for layer in model.layers):
        raise UnsupportedError(f"tensor parallelism cannot split a {type(model).__name__}")


def check_config(cfg, size: int) -> None:
    """UnsupportedError unless a model of this config splits over `size` ranks: its query heads (every
    layer's), KV heads (every layer's), DeltaNet heads and MLP / expert widths fit size (quantised column
    slices are checked as they are cut). Needs the config alone, so a launch can refuse before any rank starts."""
    family = model_class(cfg)
    if family not in LAYERS:
        raise UnsupportedError(f"tensor parallelism does not split {family.__name__} models ({cfg.family}) yet: "
                               f"run it with --tensor-parallel-size 1")
    for kv in sorted(set(getattr(cfg, "layer_kv_heads", None) or [cfg.num_kv_heads])):
        if kv % size and size % kv:
            raise UnsupportedError(f"--tensor-parallel-size {size} does not fit the model's {kv} KV heads "
                                   f"(num_key_value_heads): each rank keeps whole KV heads, either a share of them "
                                   f"(the size divides {kv}) or one replicated over size / {kv} ranks (the size "
                                   f"is a multiple of {kv}); choose such a size")
    widths = [("num_attention_heads", cfg.num_heads)]
    widths += [(f"num_attention_heads_per_layer[{i}]", n) for i, n in enumerate(getattr(cfg, "heads_per_layer", ()))]
    if family is HybridTransformer:  # Gated DeltaNet: whole key heads, their value heads with them
        widths += [("linear_num_key_heads", cfg.linear_num_key_heads),
                   ("linear_num_value_heads", cfg.linear_num_value_heads)]
    if not all(cfg.moe_layers) or family is Gemma4Model:  # Gemma 4's MoE block runs beside a dense MLP
        widths.append(("intermediate_size", cfg.intermediate_size))
    if any(cfg.moe_layers):
        widths.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        if cfg.shared_expert_intermediate_size:
            widths.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    for what, count in widths:
        if count % size:
            raise UnsupportedError(f"--tensor-parallel-size {size} does not divide the model's {what} ({count}): "
                                   f"each rank keeps whole heads and an equal share of each MLP; choose a "
                                   f"size that divides {what}")


def shard_model(model: Transformer, rank: int, size: int, keep_full_vocab: bool = False) -> FullVocab | None:
    """Replace model's projections, embedding and LM head by rank's shards, in place (before
    fuse_projections). keep_full_vocab: return the unsharded embedding and head (FullVocab)."""
    check_shardable(model, size)
    if any(fused_projections(m) for m in model.layers.modules()):
        raise RuntimeError("shard_model: shard the projections before fuse_projections")
    for layer in model.layers:
        _shard_layer(layer, rank, size)
    cfg = model.config
    full = FullVocab(model.embed_tokens, getattr(model, "lm_head", None)) if keep_full_vocab else None
    shard = -(-cfg.vocab_size // size)
    start, end = min(rank * shard, cfg.vocab_size), min((rank + 1) * shard, cfg.vocab_size)
    if end <= start:
        raise UnsupportedError(f"--tensor-parallel-size {size} leaves rank {rank} no vocabulary rows "
                               f"({cfg.vocab_size} tokens)")
    model.embed_tokens = VocabParallelEmbedding(rows_of(model.embed_tokens, start, end), start, cfg.vocab_size, shard)
    if not cfg.tie_word_embeddings:
        model.lm_head = VocabParallelHead(rows_of(model.lm_head, start, end), cfg.vocab_size, shard)
    return full


def _shard_layer(layer: nn.Module, rank: int, size: int) -> None:
    # the other families' modules build on this module's helpers: imported here, not at the top
    from . import tensor_parallel_gemma4_laguna as gemma4_laguna
    from . import tensor_parallel_hybrid as hybrid
    if isinstance(layer, Gemma4DecoderLayer):
        gemma4_laguna.shard_gemma4_layer(layer, rank, size)
        return
    mixer = layer.mixer if isinstance(layer, HybridDecoderLayer) else layer.self_attn
    if isinstance(mixer, GatedDeltaNet):
        hybrid.shard_deltanet(mixer, rank, size)
    elif isinstance(mixer, GatedAttention):
        hybrid.shard_gated_attention(mixer, rank, size)
    elif isinstance(mixer, LagunaAttention):
        gemma4_laguna.shard_laguna_attention(mixer, rank, size)
    else:
        _shard_attention(mixer, rank, size)
    if isinstance(layer.mlp, SparseMoE):
        shard_experts(layer.mlp.experts, rank, size)
        if layer.mlp.shared_expert is not None:
            hybrid.shard_shared_expert(layer.mlp, rank, size)
        layer.mlp = ParallelMoE(layer.mlp)
    else:
        shard_mlp(layer.mlp, rank, size)


def attention_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of rank: query heads split evenly; KV heads split too, or (more
    ranks than KV heads) each KV head kept by the size / num_kv_heads consecutive ranks whose query heads
    read it, so GQA groups never straddle ranks."""
    if num_kv_heads >= size:
        return num_heads // size, num_kv_heads // size, rank * (num_kv_heads // size)
    return num_heads // size, 1, rank // (size // num_kv_heads)


def _shard_attention(attn: Attention, rank: int, size: int) -> None:
    q_heads, kv_heads, first_kv = attention_heads(attn.num_heads, attn.num_kv_heads, rank, size)
    d = attn.head_dim
    attn.q_proj = rows_of(attn.q_proj, rank * q_heads * d, (rank + 1) * q_heads * d)
    attn.k_proj = rows_of(attn.k_proj, first_kv * d, (first_kv + kv_heads) * d)
    attn.v_proj = rows_of(attn.v_proj, first_kv * d, (first_kv + kv_heads) * d)
    attn.o_proj = row_parallel(attn.o_proj, rank * q_heads * d, (rank + 1) * q_heads * d)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads


def shard_mlp(mlp: MLP, rank: int, size: int) -> None:
    width = mlp.gate_proj.out_features // size
    mlp.gate_proj = rows_of(mlp.gate_proj, rank * width, (rank + 1) * width)
    mlp.up_proj = rows_of(mlp.up_proj, rank * width, (rank + 1) * width)
    mlp.down_proj = row_parallel(mlp.down_proj, rank * width, (rank + 1) * width)


def shard_experts(experts: nn.Module, rank: int, size: int) -> None:
    """Each expert's gate and up rows of this rank's slice of the intermediate width, and those columns of
    its down projection: [E, 2I, H] -> [E, 2I/N, H] (gate slice, then up slice), [E, H, I] -> [E, H, I/N]."""
    width = experts.intermediate_size // size
    gate = torch.arange(rank * width, (rank + 1) * width)
    rows = torch.cat([gate, gate + experts.intermediate_size])
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if isinstance(gate_up, QuantTensor):
        count, out, _ = gate_up.shape
        raw = gate_up.data.view(count, out, -1)[:, rows].reshape(count * len(rows), -1)
        new_gate_up = QuantTensor(raw.clone(), gate_up.qtype, (count, len(rows), gate_up.shape[2]), gate_up.name)
    else:
        new_gate_up = nn.Parameter(gate_up.detach()[:, rows].clone(), requires_grad=False)
    if isinstance(down, QuantTensor):
        start, end = _block_columns(down.name, down.qtype, down.shape[2], rank * width, (rank + 1) * width)
        new_down = QuantTensor(down.data[:, start:end].clone(), down.qtype, (*down.shape[:2], width), down.name)
    else:
        new_down = nn.Parameter(down.detach()[:, :, rank * width:(rank + 1) * width].clone(), requires_grad=False)
    for name, value in (("gate_up_proj", new_gate_up), ("down_proj", new_down)):
        delattr(experts, name)
        setattr(experts, name, value)
    experts.intermediate_size = width


def move_quantised_experts(model: nn.Module, device: torch.device) -> None:
    """Stacked experts kept quantised are plain QuantTensor attributes, which module.to() does not move."""
    for module in model.modules():
        for name in ("gate_up_proj", "down_proj"):
            value = getattr(module, name, None)
            if isinstance(value, QuantTensor):
                setattr(module, name, value.to(device))


def rows_of(module: nn.Module, start: int, end: int) -> nn.Module:
    """A copy of output rows [start, end) of a linear or embedding table (float or quantised)."""
    return rows_at(module, [(start, end)])


def rows_at(module: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """A copy of output rows [start, end) of each range, one after another, of a linear or embedding table."""
    index = torch.cat([torch.arange(start, end) for start, end in ranges])
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(module.weight.detach()[index].clone(), freeze=True)
    if isinstance(module, nn.Linear):
        bias = module.bias.detach()[index].clone() if module.bias is not None else None
        return _float_linear(module.weight.detach()[index].clone(), bias)
    if isinstance(module, QuantEmbedding):
        return QuantEmbedding(_quant(module.weight, module.qweight[index], len(index)), module.dtype,
                              module.chunk_bytes)
    if isinstance(module, QuantLinear) and type(module) is QuantLinear:
        bias = module.bias[index].clone() if module.bias is not None else None
        return QuantLinear(_quant(module.weight, module.qweight[index], len(index)), bias, module.chunk_bytes)
    raise UnsupportedError(f"tensor parallelism cannot shard a {type(module).__name__}")


def row_parallel(module: nn.Module, start: int, end: int) -> RowParallel:
    """Input features [start, end) of a linear, as a RowParallel (its bias added once, after the sum)."""
    bias = module.bias.detach().clone() if module.bias is not None else None
    if isinstance(module, nn.Linear):
        return RowParallel(_float_linear(module.weight.detach()[:, start:end].clone(), None), bias)
    if type(module) is PermutedInputQuantLinear:
        return RowParallel(_permuted_columns(module, start, end), bias)
    if type(module) is not QuantLinear:
        raise UnsupportedError(f"tensor parallelism cannot shard a {type(module).__name__}")
    first, last = _block_columns(module.name, module.qtype, module.in_features, start, end)
    raw = module.weight.data[:, first:last].clone()
    local = QuantLinear(QuantTensor(raw, module.qtype, (module.out_features, end - start), module.name),
                        None, module.chunk_bytes)
    return RowParallel(local, bias)


def _permuted_columns(module: PermutedInputQuantLinear, start: int, end: int) -> PermutedInputQuantLinear:
    """The stored columns that read input features [start, end) (llama.cpp's tiled value heads: several
    runs), each run cut on whole quantisation blocks, and their input order within the slice."""
    order = module.input_order.cpu()
    columns = torch.nonzero((order >= start) & (order < end)).flatten()
    breaks = torch.nonzero(columns.diff() != 1).flatten() + 1
    pieces = []
    for run in torch.tensor_split(columns, breaks):
        first, last = _block_columns(module.name, module.qtype, module.in_features, int(run[0]), int(run[-1]) + 1)
        pieces.append(module.weight.data[:, first:last])
    weight = QuantTensor(torch.cat(pieces, dim=1).clone(), module.qtype, (module.out_features, end - start),
                         module.name)
    return PermutedInputQuantLinear(weight, order[columns] - start, None, module.chunk_bytes)


def _block_columns(name: str, qtype, in_features: int, start: int, end: int) -> tuple[int, int]:
    """The byte range of input features [start, end) in a quantised row; refused inside a block."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if start % block or end % block:
        cut = start if start % block else end
        raise UnsupportedError(
            f"tensor {name!r} ({qtype.name}, {in_features} input features): a tensor-parallel shard would "
            f"cut its rows at column {cut}, inside a {block}-value quantisation block; quantised weights are "
            f"split along whole blocks only (each rank's share of {in_features} must be a multiple of {block}): "
            f"use a smaller --tensor-parallel-size or a GGUF with a smaller block type (Q8_0, Q4_0: 32)")
    return start // block * type_size, end // block * type_size


def _quant(weight: QuantTensor, rows: torch.Tensor, count: int) -> QuantTensor:
    return QuantTensor(rows.clone(), weight.qtype, (count, weight.shape[1]), weight.name)


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


class FullVocabView:
    """The sharded model as a DFlash drafter on rank 0 sees it: everything the model's, but the embedding
    and LM head unsharded (FullVocab), so its block embedding and draft logits need no other rank."""

    def __init__(self, model: Transformer, full: FullVocab):
        self._model, self.embed_tokens, self.lm_head = model, full.embed_tokens, full.lm_head

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return type(self._model).embed(self, ids)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return type(self._model).head_logits(self, hidden)
