"""What the CUDA graphs of a runner are captured for (engine/cuda_graphs.py): the bucket lengths of
decode, verify, catch-up, tree and prefill steps, the batch sizes, and what a replay also does."""
from __future__ import annotations

from dataclasses import dataclass

# A step whose bucket holds more than this many tokens per real token runs eagerly: padding that
# wide costs more compute than the launch overhead it saves.
MAX_PADDING = 2


@dataclass(frozen=True)
class GraphSettings:
    max_model_len: int
    max_batch: int = 32  # largest batch bucket (vLLM's max capture size, in sequences)
    query_lens: tuple[int, ...] = (1,)  # query-length buckets: 1 (decode) and 1 + k per draft length k
    # Query lengths of one sequence whose taps a dormant drafter has missed, recomputed without
    # writing K/V (StepPlan.write_kv=False); captured with taps only, besides query_lens.
    catch_up_lens: tuple[int, ...] = ()
    # Query lengths of tree verify buckets: 1 + the node count of every tree shape the policy may draft.
    tree_lens: tuple[int, ...] = ()
    # Query lengths of one-sequence prefill buckets (a short prompt, or a chunk's remainder, longer than
    # any step): the forward's launches in one replay, only the last token's logits (module docstring).
    prefill_lens: tuple[int, ...] = ()
    # False: run the padded static batches eagerly instead of replaying graphs. The padding and the
    # static buffers are then exercised on any device (how CPU tests check them).
    capture: bool = True
    # Graphs that also sample and accept (sampling.acceptance.accept_in_graph): a decode or verify step of
    # graph-samplable rows with deterministic drafts copies back (accepted, token) per sequence, not
    # logits to process with the host's launches.
    sample: bool = True
    # KVFlash: graphs that also hand back each row's last-token queries of every paged layer
    # (StepPlan.capture_queries, before a pooled sequence's resident set is chosen), beside the others.
    queries: bool = False


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    return [b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]
