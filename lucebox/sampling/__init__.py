"""Sampling: request parameters, the batched sampler, and acceptance of speculative drafts
(greedy and lossless rejection sampling, on the host and inside CUDA graphs)."""
from .params import Logprob, SamplingParams

__all__ = ["Logprob", "SamplingParams"]
