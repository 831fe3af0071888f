"""LLM: the offline API (vLLM's names): LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from .config import EngineArgs
from .engine.engine import LLMEngine
from .errors import RequestError
from .outputs import RequestOutput
from .sampling import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        if engine_kwargs.pop("enforce_eager", False):  # vLLM's name for cuda_graphs=False
            engine_kwargs["cuda_graphs"] = False
        unknown = set(engine_kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise RequestError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        # Offline, every prompt given is wanted: no overload queue limit (a server's protection).
        engine_kwargs.setdefault("max_queue", sys.maxsize)
        # No model: the bundled default pair, speculating with its drafter (speculative_config={}: plainly).
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_kwargs))
        self.args, self.tokenizer = self.engine.args, self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts batched; returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        params = [_final_only(p) for p in params]
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:  # one bad prompt leaves no half-added batch behind
                self.engine.abort(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             tools: list | None = None, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs) for c in conversations]
        # The template already holds any BOS token: do not add a second one.
        token_prompts = [{"prompt": p, "prompt_token_ids": self.tokenizer.encode_prompt(p)}
                         for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[r] for r in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """generate() returns finished outputs only: the engine need not build one every step (a copy
    of the whole output so far each time). A copy keeps which fields the caller set."""
    params = copy.copy(params)
    params.output_kind = "final_only"
    return params
