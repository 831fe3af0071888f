"""DFlash2 drafting: the DFlash proposer (context K/V, graphs, feature capture all shared) whose
drafts are the candidate selector's chain instead of each slot's own argmax, and whose trees grow
over the selector's lattice: a node's children are scored given the node's own token.

Greedy sequences get the selector's argmax walk (deterministic drafts, one-hot q). Sampled ones
get the walk drawn slot by slot from q over the candidates, and that q (zero outside them) goes to
chain rejection sampling as the draft probabilities: accept d with probability min(1, p(d) / q(d)),
else sample norm(max(0, p - q)), so the committed tokens follow the target exactly.
"""
from __future__ import annotations

import torch

from ..sampling.acceptance import Draft
from ..sampling.sampler import SamplingState
from ..util import move
from .dflash import DFlashProposer
from .tree import build_lattice_tree


class DFlash2Proposer(DFlashProposer):
    method = "dflash"

    def _draft_one(self, seq, k: int) -> Draft:
        logits, hidden = self._draft_pass(seq, k)
        logits = move(logits, hidden.device)  # --draft-device: the walk runs beside the drafter's selector
        if self.tree_budget is not None:  # over the selector's conditional scores, temperature 1 (deterministic)
            candidates, log_probs = self.drafter.candidate_selector.tree_log_probs(hidden, seq.last_token, logits)
            tree = build_lattice_tree(candidates, log_probs, self.tree_budget)
            return Draft(tree.tokens, parents=tree.parents)
        out = list(seq.output_token_ids)
        params, generator = seq.params, seq.generator
        if self.graphs is not None and params.is_greedy and params.keeps_argmax(len(out)):
            return Draft(self.graphs.tokens[:k].tolist())  # the chain the graph walked over unprocessed logits

        def state(drafted: list[int]) -> SamplingState:
            return SamplingState(params, seq.prompt_token_ids, out + drafted, generator)

        if params.reads_history(len(out)):  # each slot processed with the drafts before it
            def rows(slot: int, drafted: list[int]) -> torch.Tensor:
                return self.sampler.process_logits(logits[slot:slot + 1], [state(drafted)])[0]
        else:
            rows = self.sampler.process_logits(logits, [state([])] * k)
        temperature = 0.0 if params.is_greedy else params.temperature
        walk = self.drafter.candidate_selector.walk(hidden, seq.last_token, rows, temperature, generator)
        tokens = walk.tokens.tolist()
        if walk.q is None:
            return Draft(tokens)
        probs = torch.zeros(k, logits.shape[1], dtype=torch.float32, device=logits.device)
        return Draft(tokens, move(probs.scatter_(1, walk.candidates, walk.q), self.target.model.device))
