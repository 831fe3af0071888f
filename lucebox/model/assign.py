"""Put checkpoint tensors into a Transformer built on the meta device (no double allocation)."""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ..errors import CheckpointError
from ..util import on_meta
from ..weights.quant import QuantTensor
from .transformer import Transformer

log = logging.getLogger("lucebox")


def model_class(cfg) -> type[Transformer]:
    """The model class of a config's family: the one place a family picks its modules."""
    from .gemma4 import Gemma4Model
    from .gemma4_config import is_gemma4
    from .laguna import LagunaTransformer
    from .qwen3_5 import HybridTransformer, is_hybrid
    if is_gemma4(cfg):
        return Gemma4Model
    if cfg.family == "laguna":
        return LagunaTransformer
    return HybridTransformer if is_hybrid(cfg) else Transformer


def empty_model(cfg, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    with on_meta():
        model = model_class(cfg)(cfg)
    return model.to(dtype=dtype).to_empty(device=device)


def assign(model: Transformer, tensors: Iterable[tuple[str, torch.Tensor | nn.Module]], source: str,
           dtype: torch.dtype, device: torch.device | str | None = None) -> Transformer:
    """Copy each (our parameter name, tensor) into the model, or swap in a quantised module.

    A module value (QuantLinear / QuantEmbedding) replaces the module that owns `name`; a bias of
    that module may come before or after it and ends up on the new module. Parameters still on the
    meta device (a model built without memory, so quantised layers never get a float copy) are
    replaced by the loaded tensor on `device`."""
    params = dict(model.named_parameters())
    expected = {name: tuple(p.shape) for name, p in params.items()}
    loaded: set[str] = set()
    for name, value in tensors:
        if name not in expected:
            log.warning("%s: ignoring tensor %s (not used by this architecture)", source, name)
            continue
        if name in loaded:
            raise CheckpointError(f"{source}: tensor {name} appears twice")
        prefix, leaf = name.rsplit(".", 1)
        owner = model.get_submodule(prefix)
        target_device = _target_device(params[name], device)
        if isinstance(value, QuantTensor):  # stacked experts kept quantised (model/moe.py: expert_weights)
            if value.shape != expected[name]:
                raise _shape_error(source, name, value.shape, expected[name])
            delattr(owner, leaf)
            setattr(owner, leaf, value.to(target_device))
        elif isinstance(value, nn.Module):
            if tuple(value.weight.shape) != expected[name]:
                raise _shape_error(source, name, value.weight.shape, expected[name])
            value = value.to(target_device)
            bias = getattr(owner, "bias", None)
            if f"{prefix}.bias" in loaded and getattr(value, "bias", None) is None:
                value.bias = bias.detach()
            model.set_submodule(prefix, value)
        else:
            if tuple(value.shape) != expected[name]:
                raise _shape_error(source, name, value.shape, expected[name])
            current = getattr(owner, leaf)
            if not isinstance(current, nn.Parameter):
                # The owner is a quantised module swapped in earlier; only its bias is a float buffer.
                setattr(owner, leaf, value.to(device=target_device, dtype=dtype))
            elif current.is_meta:
                setattr(owner, leaf, nn.Parameter(value.to(device=target_device, dtype=dtype),
                                                  requires_grad=current.requires_grad))
            else:
                with torch.no_grad():
                    current.copy_(value.to(dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{source}: missing tensors {shown}")
    return model


def _target_device(param: torch.Tensor, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if param.is_meta:
        raise ValueError("assign: pass `device` when the model was built on the meta device")
    return param.device


def _shape_error(source, name, got, expected) -> CheckpointError:
    return CheckpointError(f"{source}: tensor {name} has shape {list(got)}, "
                           f"the config needs {list(expected)}")
