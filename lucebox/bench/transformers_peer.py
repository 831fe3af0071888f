"""The transformers peer of `lucebox bench speed`: transformers `generate` with a static cache over the
very same float tensors as the lucebox model (shared, not copied), as a ratio. Dense models only."""
from __future__ import annotations

import statistics

import torch

from ..model.loader import LoadedModel
from ..util import common_prefix
from . import shapes


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


def peer_phase(loaded, quant: str, args, device, last: dict, at: int, decode: list[dict], clock, say) -> dict:
    """transformers `generate` with a static cache, over the lucebox model's own tensors, at context `at`."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return {"skipped": "transformers is not installed"}
    cfg = loaded.config
    if cfg.layer_types or cfg.num_experts:
        return {"skipped": "the transformers peer runs dense models only; compare hybrids and MoE models with "
                           "--peer llama.cpp"}
    if quant not in shapes.FLOAT_QUANTS or loaded.format == "gguf":
        return {"skipped": f"transformers runs the float weights of HF checkpoints or shapes only (these are {quant})"}
    if at not in last:
        return {"skipped": "the peer runs at a decode context and none was measured"}
    config = (AutoConfig.for_model(**shapes.SHAPES[args.shape]) if args.shape
              else AutoConfig.from_pretrained(loaded.source))
    prompt, lucebox_ids = last[at]
    tokens, per_token = transformers_decode(transformers_twin(loaded, config, device), prompt,
                                                   1 + args.decode_tokens, args.repeats, clock.now)
    ours = next(r["tok_s"] for r in decode if r["context"] == at)
    say(f"transformers peer: {1 / per_token:,.1f} tok/s")
    return {"context": at, "tokens": args.decode_tokens, "tok_s": 1 / per_token, "lucebox_tok_s": ours,
            "ratio": ours * per_token, "greedy_tokens_matching": common_prefix(tokens, lucebox_ids),
            "transformers": shapes.version("transformers")}
