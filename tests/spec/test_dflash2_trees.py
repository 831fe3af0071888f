"""DFlash2 draft trees grow over the selector's lattice: a node's children are scored given its token."""
from __future__ import annotations

import torch

from lucebox import LLM, SamplingParams
from lucebox.spec.dflash import load_drafter
from lucebox.spec.tree import BRANCHES, build_lattice_tree, build_tree
from tests.spec.test_dflash2 import record_drafts, target, write_dflash2_drafter  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _selector(target_dir, out, seed):
    drafter, _ = load_drafter(write_dflash2_drafter(target_dir, out, top_k=BRANCHES, seed=seed), torch.float64, "cpu")
    return drafter, drafter.candidate_selector


def test_tree_log_probs_are_the_selector_q_times_the_top_k_share(target, tmp_path):
    drafter, sel = _selector(target, tmp_path / "d", 3)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, drafter.config.model.hidden_size, generator=g, dtype=torch.float64)
    logits = torch.randn(3, drafter.config.model.vocab_size, generator=g, dtype=torch.float64)
    candidates, log_probs = sel.tree_log_probs(hidden, 9, logits)
    _, scores = sel.lattice(hidden, 9, logits)
    share = logits.softmax(-1).gather(1, candidates).sum(-1).float()
    torch.testing.assert_close(log_probs.exp(), scores.softmax(-1) * share[:, None, None])
    # Without a transition (a DFlash drafter grown into DFlash2) they are the drafter's own log-probs,
    # and the tree is the one the per-slot distributions grow.
    with torch.no_grad():
        sel.successor_codebook.zero_()
    candidates, log_probs = sel.tree_log_probs(hidden, 9, logits)
    own = logits.float().log_softmax(-1)
    torch.testing.assert_close(log_probs, own.gather(1, candidates)[:, None, :].expand_as(log_probs))
    a, b = build_lattice_tree(candidates, log_probs, 20), build_tree(own, 20)
    assert (a.tokens, a.parents) == (b.tokens, b.parents)


def test_the_proposer_drafts_the_lattice_tree_and_output_equals_plain_decoding(target, tmp_path):
    from tests.spec.test_spec import prompts
    drafter = write_dflash2_drafter(target, tmp_path / "d", block_size=4, top_k=BRANCHES, seed=4)
    plain = [o.outputs[0].token_ids for o in LLM(str(target), block_size=4).generate(prompts(4), GREEDY,
                                                                                      use_tqdm=False)]
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(drafter),
                                                             "adaptive": False, "tree_budget": 8})
    prop = llm.engine.speculator.proposer
    passes, draft_pass = [], prop._draft_pass

    def recording(seq, k):
        logits, hidden = draft_pass(seq, k)
        passes.append((logits.clone(), hidden.clone(), seq.last_token))
        return logits, hidden

    prop._draft_pass = recording
    drafts = record_drafts(prop)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY, use_tqdm=False)]
    assert got == plain
    assert len(passes) == len(drafts) and any(len(d) > 3 for d in drafts)
    sel, differs = prop.drafter.candidate_selector, 0
    for (logits, hidden, last), tokens in zip(passes, drafts):
        with torch.inference_mode():  # the engine's tensors
            expected = build_lattice_tree(*sel.tree_log_probs(hidden, last, logits), 8)
        assert tokens == expected.tokens
        differs += tokens != build_tree(logits.float().log_softmax(-1), 8).tokens
    assert differs  # the transition reorders the tree somewhere: not the per-slot tree
