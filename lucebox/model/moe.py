"""Sparse mixture-of-experts FFN: top-k routing over stacked experts, plus an optional shared expert
behind a sigmoid gate (Qwen3-MoE has none; Qwen3.5-MoE has one).

Routing (how a router's logits choose and weigh each token's experts) is Qwen's softmax top-k by
default; Routing also describes sigmoid scoring, an expert-selection bias (the aux-loss-free
`e_score_correction_bias`), tanh soft-capping of the logits, a scale on the routed experts' sum
and weights applied to each expert's input instead of its output (Laguna, DeepSeek-V3 style).

Experts are stacked tensors [E, out, in] (`experts.gate_up_proj` [E, 2 * I, H] and `experts.down_proj`
[E, H, I], the layout transformers 5 holds in memory), so a stacked quantised tensor can replace
either one. Checkpoints that store one matrix per expert (`experts.N.gate_proj.weight`, as the
published Qwen MoE files and transformers' save_pretrained do) are stacked on load: stack_experts.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..kernels import dequant
from ..kernels.activation import gelu_tanh_and_mul, silu_and_mul
from ..kernels.linear import linear, linears, norm_rows
from ..kernels.moe import Shared, add_shared, expert_kernel, expert_matmul, route_experts
from ..kernels.routing import MOE_PAIRS, TORCH
from ..weights.quant import QuantLinear, QuantTensor
from .config import ModelConfig

# The torch reference (the CPU; GPUs without Triton): up to this many routed (token, expert) rows,
# a step gathers the routed experts' matrices and runs one batched product: no host sync (CUDA-graph
# safe). Above it, tokens are sorted by expert and each expert the batch touches runs one product
# over its tokens. On GPUs the Triton kernels (kernels/moe.py) read the routed experts in place.
GATHER_ROWS = 16
# The experts' gated activation by config name; the Triton expert kernels fuse both.
ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class Experts(nn.Module):
    """E gated experts (SwiGLU, or GeGLU with activation="gelu_pytorch_tanh") as two stacked tensors;
    forward mixes each token's routed experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.activation, self.act = activation, ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                weights_on_input: bool = False, shared: Shared | None = None,
                shared_pair: tuple | None = None) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k]: sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]), or
        with weights_on_input, of expert_{ids[t, j]}(weights[t, j] * x[t]); shared: a shared expert
        to combine that sum with (kernels.moe.Shared); shared_pair: the shared expert's (gate_up,
        down) as one-expert stacks, expert id E of the ids (the pairs kernel's)."""
        kernel = expert_kernel(x, ids, self.gate_up_proj, self.down_proj, self.activation)
        if kernel != TORCH:
            return expert_matmul(x, ids, weights, self.gate_up_proj, self.down_proj, kernel,
                                 activation=self.activation, weights_on_input=weights_on_input, shared=shared,
                                 shared_pair=shared_pair)
        out = self._reference(x, ids, weights, weights_on_input)
        return out if shared is None else add_shared(out, shared)

    def _reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   weights_on_input: bool) -> torch.Tensor:
        tokens, k = ids.shape
        rows, per_row = tokens * k, k
        if weights_on_input:  # one pre-weighted row per (token, expert), each its own token
            x, per_row = (x.unsqueeze(1) * weights.unsqueeze(-1).to(x.dtype)).reshape(rows, -1), 1
        if rows <= GATHER_ROWS or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            out = self._gathered(x, ids.reshape(-1), per_row)
        else:
            out = self._grouped(x, ids.reshape(-1), per_row)
        out = out.view(tokens, k, out.shape[-1])
        if not weights_on_input:
            out = out * weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)

    def _gathered(self, x: torch.Tensor, flat_ids: torch.Tensor, k: int) -> torch.Tensor:
        """[T*k, H]: row r is expert flat_ids[r] of token r // k, from the gathered routed matrices."""
        h = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        gate_up = torch.bmm(expert_weights(self.gate_up_proj, flat_ids, x.dtype), h).squeeze(-1)
        act = self.act(*gate_up.split(self.intermediate_size, dim=-1))
        return torch.bmm(expert_weights(self.down_proj, flat_ids, x.dtype), act.unsqueeze(-1)).squeeze(-1)

    def _grouped(self, x: torch.Tensor, flat_ids: torch.Tensor, k: int) -> torch.Tensor:
        """[T*k, H] as _gathered, with the rows sorted by expert: one product per expert touched."""
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # the one host sync
        sorted_x = x[order // k]
        sorted_out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                gate_up = F.linear(sorted_x[rows], expert_weights(self.gate_up_proj, expert, x.dtype))
                act = self.act(*gate_up.split(self.intermediate_size, dim=-1))
                sorted_out[rows] = F.linear(act, expert_weights(self.down_proj, expert, x.dtype))
                start += count
        out = torch.empty_like(sorted_out)
        out[order] = sorted_out
        return out


def shared_expert_stacks(mlp: nn.Module, experts: Experts) -> tuple | None:
    """A fused shared expert's (gate | up, down) as stacks of one expert in its experts' formats and
    sizes, for the pairs kernel to run it as one more routed pair; None where they differ. Views of
    its weights, except quantised rows that the GPU's split layout has reordered or may reorder in
    place: those are copied in ggml's layout."""
    gate_up = getattr(mlp.gate_up, "__self__", mlp.gate_up)  # a quantised projection's module
    stacks = []
    for module, stacked in ((gate_up, experts.gate_up_proj), (mlp.down_proj, experts.down_proj)):
        if getattr(module, "bias", None) is not None:
            return None
        if isinstance(stacked, QuantTensor) and type(module) is QuantLinear and module.qtype == stacked.qtype:
            moves = module.split_rows or module.splits_rows()
            rows = module._raw_rows() if module.split_rows or not moves else module.qweight.clone()
            stack = QuantTensor(rows, stacked.qtype, (1, module.out_features, module.in_features), "shared expert")
        elif isinstance(stacked, torch.Tensor) and isinstance(getattr(module, "weight", None), torch.Tensor) \
                and module.weight.dtype == stacked.dtype and not isinstance(module, QuantLinear):
            stack = module.weight.detach()[None]
        else:
            return None
        if tuple(stack.shape) != (1, *stacked.shape[1:]):
            return None
        stacks.append(stack)
    return tuple(stacks)


def expert_weights(w: torch.Tensor | QuantTensor, ids: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """The selected experts' matrices of a stacked [E, out, in] weight: [len(ids), out, in] for an id tensor,
    [out, in] for one id. A QuantTensor (GGUF experts kept quantised, data [E * out, row bytes])
    dequantises only the selected experts' rows, to `dtype`; float weights are indexed as they are."""
    if not isinstance(w, QuantTensor):
        return w[ids]
    experts, out, cols = w.shape
    rows = w.data.view(experts, out, -1)[ids]
    values = dequant.dequantize(rows.reshape(-1, rows.shape[-1]), w.qtype, dtype)
    return values.reshape(*rows.shape[:-1], cols)


@dataclass(frozen=True)
class Routing:
    """How a router's logits [T, E] become each token's top-k experts and their weights."""
    top_k: int
    norm_topk_prob: bool = True  # renormalise the chosen weights to sum to 1
    scoring: str = "softmax"  # or "sigmoid": one independent score per expert
    logit_softcap: float = 0.0  # > 0: logits -> softcap * tanh(logits / softcap) before scoring
    selection_bias: bool = False  # experts chosen by score + experts.e_score_correction_bias, weighed by score
    routed_scaling_factor: float = 1.0  # scales the routed experts' sum (not the shared expert)
    weights_on_input: bool = False  # expert e reads weight_e * x; its output is summed unweighted

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"routing scoring must be softmax or sigmoid, got {self.scoring!r}")

    def choose(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], float32 weights [T, k]) of float32 logits [T, E]."""
        if self.logit_softcap > 0:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        if bias is None:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        else:
            ids = torch.topk(scores + bias.to(scores.dtype), self.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class SparseMoE(nn.Module):
    """The FFN of a MoE layer. Module names follow the HF checkpoints: `gate` is the router, a
    selection bias is `experts.e_score_correction_bias` (where Laguna's files keep it). `routing`
    defaults to the config's softmax top-k; the shared expert (where the config sizes one) is added
    behind a sigmoid gate (`shared_expert_gate`, Qwen 3.5) or, with shared_expert_gated=False, as is."""

    def __init__(self, cfg: ModelConfig, routing: Routing | None = None, shared_expert_gated: bool = True):
        super().__init__()
        from .transformer import MLP  # the shared expert is a dense SwiGLU MLP of its own width

        self.routing = routing or Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if self.routing.selection_bias:
            self.experts.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        self.router = None  # gate | shared_expert_gate as one projection, after fuse()
        self.shared_fused = False  # after fuse(): the shared expert combined by the routed experts' sum
        self.shared_pair = None  # after fuse(), where it fits: the shared expert as one more routed pair
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            if shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def norm_topk_prob(self) -> bool:
        return self.routing.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype), computed in float32."""
        return self.choose(linear(x, self.gate), x.dtype)

    def choose(self, logits: torch.Tensor, dtype: torch.dtype, shared: str | None = None):
        """route's (ids, weights in dtype) of the router's logits [T, E]. shared ("gated": logits
        [T, E + 1], or "ungated"): also route k + 1 to the shared expert (kernels.moe.route_experts),
        where the Triton kernel runs, else None."""
        bias = self.experts.e_score_correction_bias if self.routing.selection_bias else None
        r = self.routing
        chosen = route_experts(logits, r.top_k, softmax=r.scoring == "softmax", softcap=r.logit_softcap, bias=bias,
                               norm=r.norm_topk_prob, dtype=dtype, shared=shared,
                               routed_scale=r.routed_scaling_factor if shared else 1.0)  # one kernel where Triton runs
        if chosen is not None or shared is not None:
            return chosen
        ids, weights = r.choose(logits.float(), bias)
        return ids, weights.to(dtype)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' part of the output."""
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights, self.routing.weights_on_input)
        if self.routing.routed_scaling_factor != 1.0:
            out = out * self.routing.routed_scaling_factor
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._combined():
            return self._fused(x)
        out = self.routed(x)
        if self.shared_expert_gate is not None:
            out = add_shared(out, Shared(self.shared_expert(x), linear(x, self.shared_expert_gate)))
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def fuse(self) -> None:
        """Fuse the shared expert's projections and the router with the shared expert's gate (both
        read x); the shared expert is then combined by the launch that sums the routed experts."""
        from .transformer import fuse_linears
        if self.shared_expert is None:
            return
        self.shared_expert.fuse()
        if self.shared_expert_gate is not None and self.router is None:
            self.router = fuse_linears([self.gate, self.shared_expert_gate])
        self.shared_fused = True
        if not self.routing.weights_on_input:  # a gate on the input would not be the gate on the output
            self.shared_pair = self.shared_pair or shared_expert_stacks(self.shared_expert, self.experts)

    def _combined(self) -> bool:
        """fuse() has run (and a gated shared expert's gate is in the router: a move unfuses it)."""
        return self.shared_fused and (self.shared_expert_gate is None or self.router is not None)

    def after_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(moe(norm(x + residual)), x + residual), as MLP.after_norm; fused, the norm's launch also
        rounds the rows the shared expert's int8 product takes."""
        if self._combined():
            h, residual, rows = norm_rows(x, residual, norm.weight, norm.eps, self._shared_projections())
            return self._fused(h, rows), residual
        h, residual = norm(x, residual)
        return self(h), residual

    def _pairs(self, x: torch.Tensor) -> bool:
        """Whether the shared expert runs as one more pair of the experts' pairs kernel (decode rows) for x:
        its stacks made by fuse() and still on x's device (a move after fuse() keeps it separate)."""
        pair = self.shared_pair
        if pair is None or any(getattr(w, "data", w).device != x.device for w in pair):
            return False
        return expert_kernel(x, x, self.experts.gate_up_proj, self.experts.down_proj, self.experts.activation) == MOE_PAIRS

    def _shared_projections(self) -> tuple:
        """The shared expert's gate | up, where they are one projection (the norm rounds its rows)."""
        gate_up = self.shared_expert.gate_up
        return () if gate_up is None else (gate_up,)

    def _fused(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """forward after fuse(): the router's product (with the shared expert's gate logit, if gated)
        and the shared expert's, then the experts, whose sum combines the shared expert (the routed
        scaling factor applied). rows: x rounded to int8, if it was."""
        gated = self.shared_expert_gate is not None
        logits = linear(x, self.router if gated else self.gate)
        experts = self.experts.num_experts
        if self._pairs(x):  # the shared expert as route k + 1
            chosen = self.choose(logits, x.dtype, "gated" if gated else "ungated")
            if chosen is not None:
                return self.experts(x, *chosen, shared_pair=self.shared_pair)
        ids, weights = self.choose(logits[:, :experts], x.dtype)
        projections = self._shared_projections()
        value = (self.shared_expert.down(linears(x, projections, rows)[0]) if projections
                 else self.shared_expert(x))
        shared = Shared(value, logits[:, experts:] if gated else None, self.routing.routed_scaling_factor)
        return self.experts(x, ids, weights, self.routing.weights_on_input, shared)


# ---------------------------------------------------------------------------------------- checkpoints
_PER_EXPERT = re.compile(r"((?:.+\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def stack_experts(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, source: str
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our-named tensors with per-expert matrices (`layers.L.mlp.experts.N.gate_proj.weight`) stacked
    into Experts' two tensors, each yielded once all of its layer's experts have come (shards may
    split a layer). Other tensors pass through unchanged."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, kind = match[1], int(match[2]), match[3]
        if expert >= cfg.num_experts:
            raise CheckpointError(f"{source}: tensor {name} is expert {expert}, but num_experts is "
                                  f"{cfg.num_experts}")
        parts = pending.setdefault(prefix, {})
        parts[kind, expert] = tensor
        if len(parts) == 3 * cfg.num_experts:
            del pending[prefix]
            gate_up = [torch.cat([parts["gate_proj", e], parts["up_proj", e]]) for e in range(cfg.num_experts)]
            yield f"{prefix}.gate_up_proj", torch.stack(gate_up)
            yield f"{prefix}.down_proj", torch.stack([parts["down_proj", e] for e in range(cfg.num_experts)])
    for prefix, parts in pending.items():
        kind, expert = next((k, e) for e in range(cfg.num_experts) for k in ("gate_proj", "up_proj", "down_proj")
                            if (k, e) not in parts)
        raise CheckpointError(f"{source}: missing tensor {prefix}.{expert}.{kind}.weight "
                              f"(num_experts is {cfg.num_experts})")


def check_expert_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str,
                         keys: dict[str, str]) -> None:
    """The first MoE layer's router and experts agree with num_experts, moe_intermediate_size and
    hidden_size, per-expert or stacked, before anything is allocated."""
    if not any(cfg.moe_layers):
        return
    layer = cfg.moe_layers.index(True)
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    stacked = f"layers.{layer}.mlp.experts.gate_up_proj"
    if stacked in shapes:
        _expect(shapes, stacked, (experts, 2 * inter, hidden),
                f"{keys['num_experts']} ({experts}) and {keys['moe_intermediate_size']} ({inter})", source)
    else:
        _check_per_expert(shapes, layer, experts, (inter, hidden), source, keys)
    _expect(shapes, f"layers.{layer}.mlp.gate.weight", (experts, hidden), f"{keys['num_experts']} ({experts})",
            source)


def _check_per_expert(shapes, layer: int, experts: int, gate_shape: tuple[int, int], source: str, keys) -> None:
    prefix = f"layers.{layer}.mlp.experts"
    held = sorted({int(m[2]) for name in shapes if (m := _PER_EXPERT.fullmatch(name)) and m[1] == prefix})
    if held != list(range(experts)):
        extra = [e for e in held if e >= experts]
        missing = [e for e in range(experts) if e not in held]
        what = f"unexpected tensor {prefix}.{extra[0]}" if extra else f"missing tensor {prefix}.{missing[0]}"
        raise CheckpointError(f"{source}: {keys['num_experts']} is {experts}, but the weights hold {len(held)} "
                              f"experts in layer {layer} ({what}.gate_proj.weight)")
    _expect(shapes, f"{prefix}.0.gate_proj.weight", gate_shape, f"{keys['moe_intermediate_size']} ({gate_shape[0]})",
            source)


def _expect(shapes, name: str, want: tuple[int, ...], because: str, source: str) -> None:
    if name not in shapes:
        raise CheckpointError(f"{source}: missing tensor {name}")
    if tuple(shapes[name]) != want:
        raise CheckpointError(f"{source}: tensor {name} has shape {list(shapes[name])}, but {because} "
                              f"makes it {list(want)}")
