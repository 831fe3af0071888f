"""Layer split across devices (`--device-map`): contiguous layer ranges on devices, hidden states
crossing once per boundary per step.

`cuda:0:0-27,cpu:28-35` puts layers 0..27 on cuda:0 and 28..35 on the CPU; `auto` fills the first
GPU from its free memory and puts the rest on the next device (the second GPU, else the CPU).
Each layer's weights, paged K/V and recurrent state live on its device (the runner and the cache
manager build them through `layer_device`); block tables are shared, so every device's pool has the
same blocks. Embeddings go with the first range; the final norm and LM head with the last, which
is `model.device`: batches are built there and logits come out there, so nothing past the model
changes. A tied LM head keeps the embedding table with it (one tensor serves both).

The model code is unaware of all this: a forward pre-hook on every layer hands it its arguments
on its device (hidden state, residual, RoPE rows, Gemma 4's per-layer input) and its segment's copy
of the ForwardBatch (made once per step and segment; every segment gets its own copy, even on the
same device, so the boundary path runs in CPU tests). A Gemma 4 KV-shared layer whose source layer
sits on another device runs its attention on the source's device (its queries cross, its output
comes back): the K/V it reads never move. Split models run eagerly (no CUDA graphs)."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RequestError
from ..kernels.forward_batch import ForwardBatch
from ..model.loader import check_device
from ..model.transformer import fused_projections
from ..util import move

log = logging.getLogger("lucebox")

_ENTRY = re.compile(r"^(?P<device>cpu|cuda(?::\d+)?):(?P<first>\d+)(?:-(?P<last>\d+))?$")
_HEAD_MODULES = ("norm", "lm_head")  # with the last range: they make model.device


@dataclass(frozen=True)
class Segment:
    device: torch.device
    first: int
    last: int  # inclusive

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)


def parse_device_map(text: str, num_layers: int) -> list[Segment]:
    """`DEVICE:FIRST-LAST,...` (inclusive layer ranges, every layer placed exactly once) -> the
    segments in layer order."""
    entries = [e.strip() for e in str(text).split(",")]
    segments = []
    for entry in entries:
        match = _ENTRY.match(entry)
        if match is None:
            raise RequestError(f"--device-map entry {entry!r} is not DEVICE:FIRST-LAST (e.g. cuda:0:0-27,cpu:28-35; "
                               f"or 'auto')")
        first = int(match["first"])
        last = int(match["last"]) if match["last"] is not None else first
        if first > last:
            raise RequestError(f"--device-map entry {entry!r}: the range {first}-{last} runs backwards")
        if last >= num_layers:
            raise RequestError(f"--device-map entry {entry!r}: layer {last} does not exist (the model has "
                               f"{num_layers} layers, 0-{num_layers - 1})")
        segments.append(Segment(check_device(match["device"], "--device-map"), first, last))
    segments.sort(key=lambda s: s.first)
    for before, after in zip(segments, segments[1:]):
        if after.first <= before.last:
            raise RequestError(f"--device-map: layers {after.first}-{min(before.last, after.last)} are placed twice "
                               f"({before.device} and {after.device})")
    placed = {i for s in segments for i in s.layers}
    missing = [i for i in range(num_layers) if i not in placed]
    if missing:
        raise RequestError(f"--device-map leaves layers {_ranges(missing)} unplaced (the model has {num_layers} "
                           f"layers, 0-{num_layers - 1})")
    return segments


def _ranges(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if start != prev else str(start))
            start = cur
    return ", ".join(runs)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def auto_segments(model: nn.Module, kv_bytes_per_layer: list[int], gpu_memory_utilization: float) -> list[Segment]:
    """`auto`: layers fill the first GPU (its free memory x gpu_memory_utilization, less the
    embeddings and head) with their weights and their share of the KV/state plan; the rest go to the
    next device (the second GPU, else the CPU). CPU-only machines: everything on the CPU."""
    n = len(model.layers)
    if not torch.cuda.is_available():
        return [Segment(torch.device("cpu"), 0, n - 1)]
    free, _ = torch.cuda.mem_get_info(0)
    budget = free * gpu_memory_utilization
    budget -= sum(module_bytes(m) for name, m in model.named_children() if name != "layers")
    fits = 0
    for layer, kv in zip(model.layers, kv_bytes_per_layer):
        budget -= module_bytes(layer) + kv
        if budget < 0:
            break
        fits += 1
    if fits == 0:
        raise RequestError("--device-map auto: not even one layer fits cuda:0's free memory with its KV cache; "
                           "lower --max-model-len / --max-num-seqs or give an explicit map")
    if fits == n:
        return [Segment(torch.device("cuda", 0), 0, n - 1)]
    rest = torch.device("cuda", 1) if torch.cuda.device_count() > 1 else torch.device("cpu")
    return [Segment(torch.device("cuda", 0), 0, fits - 1), Segment(rest, fits, n - 1)]


def batch_copy(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch's tensors on `device` (util.move; the host lists shared), sharing the
    `captured` dict so every segment's taps land where the runner reads them."""
    def field(value):
        if isinstance(value, torch.Tensor):
            return move(value, device)
        if isinstance(value, tuple):
            return tuple(field(v) for v in value)
        return value
    moved = {f.name: field(getattr(batch, f.name)) for f in dataclasses.fields(batch)
             if f.name not in ("captured", "layer_cache")}
    return ForwardBatch(**moved, captured=batch.captured, layer_cache={})


def _move(value, device: torch.device, batch_of):
    if isinstance(value, torch.Tensor):
        return move(value, device)
    if isinstance(value, ForwardBatch):
        return batch_of(value)
    if isinstance(value, dict):  # Laguna's RoPE rows per layer kind
        return {k: _move(v, device, batch_of) for k, v in value.items()}
    return value


class Placement:
    """Where each layer runs, and the hooks that carry a step across the boundaries."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        self.segment_of = {i: s for s, seg in enumerate(segments) for i in seg.layers}
        self.crossings = 0  # segment entries with a batch copy made (tests count them)
        self.hooks: list = []

    @property
    def split(self) -> bool:
        return len(self.segments) > 1

    def layer_device(self, i: int) -> torch.device:
        return self.segments[self.segment_of[i]].device

    def _batch_for(self, segment: int, device: torch.device):
        def batch_of(batch: ForwardBatch) -> ForwardBatch:
            copies = batch.layer_cache.setdefault("placement", {})
            if segment not in copies:
                copies[segment] = batch_copy(batch, device)
                self.crossings += 1
            return copies[segment]
        return batch_of

    def apply(self, model: nn.Module) -> None:
        """Move the model's parts to their devices and install the boundary hooks."""
        unfuse(model)
        model.placement = self
        if not self.split:  # one range: the whole model on its device, nothing crosses
            model.to(self.segments[0].device)
            return
        first, last = self.segments[0].device, self.segments[-1].device
        tied = getattr(model.config, "tie_word_embeddings", False)
        for name, child in model.named_children():
            if name == "layers":
                continue
            device = last if name in _HEAD_MODULES or (tied and name == "embed_tokens") else first
            child.to(device)
            self.hooks.append(child.register_forward_pre_hook(self._args_to(device, None)))
        for i, layer in enumerate(model.layers):
            segment = self.segment_of[i]
            device = self.layer_device(i)
            layer.to(device)
            self.hooks.append(layer.register_forward_pre_hook(self._args_to(device, self._batch_for(segment, device))))
        for i, layer in enumerate(model.layers):  # after the moves: a shared layer follows its source
            attn = getattr(layer, "self_attn", None)
            shares = getattr(attn, "shares", ())
            if shares:
                source = self.segment_of[attn.source]
                if source != self.segment_of[i]:
                    self._attend_on(attn, source)

    def remove(self, model: nn.Module) -> None:
        """Take the hooks out (the parts stay where they are): a bench places one model several ways."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        del model.placement

    def _attend_on(self, attn: nn.Module, segment: int) -> None:
        """A KV-shared attention reads its source's K/V where they are: it runs on that device."""
        device = self.segments[segment].device
        attn.to(device)
        home = {}

        def inputs(module, args):
            home["device"] = args[0].device
            return tuple(_move(a, device, self._batch_for(segment, device)) for a in args)

        def output(module, args, out):
            return move(out, home["device"])
        self.hooks += [attn.register_forward_pre_hook(inputs), attn.register_forward_hook(output)]

    @staticmethod
    def _args_to(device: torch.device, batch_of):
        def hook(module, args):
            return tuple(_move(a, device, batch_of or (lambda b: b)) for a in args)
        return hook

    def describe(self, model: nn.Module) -> list[str]:
        """One line per segment (its layers and bytes), and the memory of each device."""
        lines = []
        for seg in self.segments:
            weights = sum(module_bytes(model.layers[i]) for i in seg.layers)
            caches = sum(cache_bytes(model.layers[i]) for i in seg.layers)
            lines.append(f"layers {seg.first}-{seg.last} on {seg.device}: {weights / 2**20:.1f} MiB of weights, "
                         f"{caches / 2**20:.1f} MiB of KV cache and state")
        for device in dict.fromkeys(s.device for s in self.segments):
            lines.append(f"{device}: {device_memory(device)}")
        return lines


def unfuse(model: nn.Module) -> None:
    """Undo fuse_projections before the parts move (a fused projection is a plain object the move
    would leave behind): each linear's weight becomes its own tensor again, so the fused tensor goes;
    the engine fuses again on the new devices."""
    for module in model.modules():
        fused = fused_projections(module)
        for name in fused:
            setattr(module, name, None)
        for child in module.children() if fused else ():
            for name, tensor in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]:
                if tensor is not None and not _owns_storage(tensor):  # a row slice of the fused tensor
                    copy = tensor.detach().clone()
                    setattr(child, name, nn.Parameter(copy, requires_grad=False) if
                            isinstance(tensor, nn.Parameter) else copy)


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def cache_bytes(layer: nn.Module) -> int:
    """Bytes of the K/V stores and recurrent state the runner installed in a layer (a KV-shared layer's: none)."""
    attn = getattr(layer, "self_attn", None)
    stores = [] if attn is None or getattr(attn, "shares", ()) else [attn.k_cache, attn.v_cache]
    mixer = getattr(layer, "linear_attn", None)
    stores += [mixer.state] if mixer is not None else []
    return sum(t.numel() * t.element_size() for store in stores if store is not None
               for t in vars(store).values() if isinstance(t, torch.Tensor))


def device_memory(device: torch.device) -> str:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return f"{(total - free) / 2**30:.2f} GiB used of {total / 2**30:.2f} GiB"
    try:  # POSIX: the host's pages, without a dependency
        page = os.sysconf("SC_PAGE_SIZE")
        total, free = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return "host memory"
    return f"{(total - free) / 2**30:.2f} GiB used of {total / 2**30:.2f} GiB host memory"


def placement_of(model) -> Placement | None:
    return getattr(model, "placement", None)


def layer_device(model, i: int) -> torch.device:
    """The device of layer i's weights and caches: its segment's, or the model's when not split."""
    placement = placement_of(model)
    return placement.layer_device(i) if placement is not None else model.device


def is_split(model) -> bool:
    placement = placement_of(model)
    return placement is not None and placement.split


def load_dtype(args) -> str:
    """The dtype a split model is loaded in (on the host, before its parts move): `auto` picks for
    the map's GPUs when it names one (bfloat16), else float32 as on any CPU."""
    if args.dtype not in (None, "auto"):
        return args.dtype
    names_gpu = "cuda" in str(args.device_map) or (args.device_map == "auto" and torch.cuda.is_available())
    return "bfloat16" if names_gpu else "float32"


def place(loaded, args) -> Placement | None:
    """Place a loaded model's layers as args.device_map says (once: an engine sharing a placed model
    keeps its placement) and log where each layer went."""
    model = loaded.model
    if placement_of(model) is not None:
        return placement_of(model)
    if args.device_map == "auto":
        specs = model.cache_specs(args.cache_type_k, args.cache_type_v, args.cache_rotate_k)
        max_len = args.max_model_len or loaded.config.max_position_embeddings
        kv = [round(s.bytes_per_token * max_len) + s.bytes_per_sequence(1) * args.max_num_seqs for s in specs]
        segments = auto_segments(model, kv, args.gpu_memory_utilization)
    else:
        segments = parse_device_map(args.device_map, len(model.layers))
    placement = Placement(segments)
    placement.apply(model)
    log.info("device map%s: %s", " (split: eager steps, no CUDA graphs)" if placement.split else "",
             "; ".join(placement.describe(model)))
    return placement


def split_kv_budget(specs, spec_devices: list[torch.device], device_budget) -> int:
    """The KV/state budget of a model whose layers' caches lie on several devices: every device
    holds its layers' share of the same block count, so the whole pool may grow until the device
    whose share fills its own budget first (device_budget(device) -> bytes) is full."""
    share: dict[torch.device, float] = {}
    for spec, device in zip(specs, spec_devices):
        share[device] = share.get(device, 0.0) + spec.bytes_per_token
    total = sum(share.values()) or 1.0
    return int(min(device_budget(d) * total / s for d, s in share.items() if s > 0))
