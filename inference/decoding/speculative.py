"""Tree speculative decoding: propose a tree, verify it in one forward, keep the best path.

``TreeDecoder`` runs every kind of draft heads through one interface, ``drafters.protocol.Proposer``:
it hands them the positions accepted since they last drafted and gets a ``Proposal`` back, without
asking which kind they are.

One step, starting from the pending token t0 (chosen but not yet in the cache) and the hidden state
h of the last cached position:

1. The heads read h and propose top-k tokens for positions +2, +3, ... past the cache: Medusa heads
   one list per depth (computed inside the previous step), Hydra heads a list per drafted path,
   expanded level by level from h and t0 (``HydraHeads.expand``). A Hydra drafter
   (``attention_drafter.py``) first reads the positions the last step accepted and proposes level 1.
2. The policy picks a tree of rank paths; node 0 is t0, every other node holds its path's draft.
3. One forward writes every node into the cache at slots ``offset + node`` with position
   ``offset + depth``, each attending to the prefix and its own ancestors.
4. Verification walks the tree (greedy, exact sampling, or typical) to the longest accepted path
   and draws the bonus token from the base model at its end.
5. The accepted nodes' K/V move to contiguous slots; the path's tokens plus the bonus are
   committed; the last accepted node's hidden state feeds the heads next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from elesium.inference.constraints import ConstrainedDrafts, GrammarState
from elesium.inference.decoding.drafts import DraftSet, draft_set
from elesium.inference.decoding.expanded_tree import Expansion
from elesium.inference.decoding.tree import Tree
from elesium.inference.decoding.tree_chain import ChainStep, TreeChain, TreeShape, start_tree_chain
from elesium.inference.decoding.tree_policy import TreePolicy
from elesium.inference.decoding.verify import Verdict, verify_greedy, verify_sampled, verify_typical
from elesium.inference.drafters.protocol import DraftContext, Proposal, Proposer
from elesium.inference.records import DecodeMode, DraftTree, StepRecord, normalize_mode
from elesium.inference.runtime.forward import ForwardRunner
from elesium.inference.runtime.step_outputs import StepOutputs
from elesium.inference.sampling import Sampler, SamplingParams, greedy_token


class TreeDecoder:
    """Holds one generation's decode state between tree steps (``engine.Decoder``'s speculative kind)."""

    def __init__(self, runner: ForwardRunner, heads: Proposer, params: SamplingParams, sampler: Sampler,
                 policy: TreePolicy, mode: DecodeMode | str = "speculative",
                 grammar: GrammarState | None = None) -> None:
        mode = normalize_mode(mode)
        if mode == "vanilla":
            raise ValueError("TreeDecoder runs 'speculative' or 'typical'; vanilla is VanillaDecoder's")
        self.runner = runner
        self.model = runner.model
        self.heads = heads
        self.params = params
        self.sampler = sampler
        self.policy = policy
        self.mode: DecodeMode = mode
        # Constrained output: the grammar state after every committed token (the pending one too).
        # Each step gives every tree node the state along its own path (``ConstrainedDrafts``), drops
        # drafts the grammar forbids before the tree is chosen, and verifies against masked logits.
        self.grammar = grammar
        self.offset = 0
        self.pending = -1
        self.hidden: torch.Tensor | None = None  # h_t: the last cached position's hidden state
        # Positions written since the heads last drafted: hidden states, the token after each, first slot.
        self.rows: torch.Tensor | None = None
        self.row_tokens: list[int] = []
        self.row_start = 0
        # The heads' drafts at the kept node where the last verify forward computed them ([heads, k], CPU).
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0
        self.emitted = 0  # tokens committed by the steps so far
        # Hydra steps on CUDA (greedy, or exact sampling) come from a self-feeding graph
        # (decoding.tree_chain) until the cache is too full for another fixed-size step; None where
        # the runner has none.
        self._chain: TreeChain | None = None
        self._chain_tried = False

    def prefill(self, prompt_ids: list[int]) -> int:
        hidden = self.runner.prefill(prompt_ids)
        self.offset = len(prompt_ids)
        self.hidden = hidden[-1]
        logits = self.model.logits(self.hidden)
        if self.grammar is None:
            self.pending = self.sampler.pick(logits, self.params)
        else:
            self.pending = self.sampler.pick(logits, self.params,
                                             self.grammar.mask(logits.shape[-1], logits.device))
            self.grammar.advance(self.pending)
        # Every prompt position but the last goes to the heads now (those that keep a cache); the last
        # pairs with the pending token and opens the first step's drafting.
        self.heads.prefill(self.runner, hidden[:-1], prompt_ids[1:])
        self.rows, self.row_tokens, self.row_start = hidden[-1:], [self.pending], self.offset - 1
        return self.pending

    def propose(self) -> Proposal:
        """This step's candidates from the heads, as they read the positions accepted since last time."""
        assert self.rows is not None, "prefill() first"
        context = DraftContext(self.rows, self.row_tokens, self.row_start, self.fused)
        return self.heads.propose(self.runner, context, self.policy.draft_topk(), self.policy.expand_width,
                                  self.policy.draft_levels(self.heads.num_heads))

    def draft(self) -> DraftSet:
        """This step's candidates as rank paths, scored by log-probability over the draft temperature."""
        return draft_set(self.propose(), self.policy.draft_temperature)

    def _array_tree(self) -> bool:
        """Whether an expanded proposal's tree is chosen in array operations (``expanded_tree.py``): the
        dynamic policy without a grammar; static trees and grammars take the general path."""
        return self.grammar is None and self.policy.kind == "dynamic"

    def _chainable(self) -> bool:
        """Steps with the runner's own heads (a chain drafts with those), the array tree and exact
        acceptance (greedy or sampled; typical acceptance stays on the host). Whether the heads' drafting
        can be captured in a chain at all is ``start_tree_chain``'s to say."""
        return (self._array_tree() and self.mode == "speculative"
                and self.rows is not None and self.heads is self.runner.heads)

    def _chain_step(self, room: int | None, start: float) -> tuple[list[int], StepRecord] | None:
        """The next step from the device chain, or None when there is (no longer) one: then the
        chain's state is the host's again and the caller takes the host path."""
        if not self._chain_tried:
            self._chain_tried = True
            if self._chainable():
                assert self.rows is not None
                shape = TreeShape(self.policy.max_nodes, self.policy.expand_width, self.policy.draft_topk())
                limit = self.runner.cache.max_len if room is None else self.offset + room
                self._chain = start_tree_chain(
                    self.runner, shape, self.pending, self.offset, self.rows, self.row_tokens, self.row_start,
                    self.policy.draft_temperature, limit, self.params,
                    None if self.params.greedy else self.sampler.uniforms,
                    max(1, self.params.max_tokens - 1 - self.emitted), record_trees=self.policy.record_trees)
        if self._chain is None:
            return None
        wanted = max(1, self.params.max_tokens - 1 - self.emitted)
        got = self._chain.next_step(wanted)
        if got is None:
            self.pending, self.offset, self.row_start, self.row_tokens, self.rows = self._chain.hand_back()
            self.hidden = self.rows[-1]
            self._chain = None
            return None
        return got.tokens, self._chain_record(got, self._chain.nodes, start)

    def _chain_record(self, got: ChainStep, nodes: int, start: float) -> StepRecord:
        self.offset += len(got.tokens)
        self.pending = got.tokens[-1]
        accepted_depth = len(got.path) - 1
        record = StepRecord(
            step=self.steps, mode=self.mode, tree_size=nodes, tree_depth=got.tree_depth,
            accepted_length=len(got.tokens), accepted_nodes=tuple(got.path), tokens=tuple(got.tokens),
            accepted_by_depth=tuple(d <= accepted_depth for d in range(1, got.tree_depth + 1)),
            draft_temperature=self.policy.draft_temperature, elapsed_s=time.perf_counter() - start,
            predicted=0.0, calibration=0.0,
            tree=None if got.tree is None else DraftTree(tuple(int(t) for t in got.tree[0]),
                                                         tuple(int(p) for p in got.tree[1]),
                                                         tuple(float(q) for q in got.tree[2])))
        self.steps += 1
        self.emitted += len(got.tokens)
        return record

    def step(self, room: int | None = None) -> tuple[list[int], StepRecord]:
        """One tree step; ``room`` caps the tree at the cache slots left before the context limit."""
        start = time.perf_counter()
        chained = self._chain_step(room, start)
        if chained is not None:
            return chained
        draft_temperature = self.policy.draft_temperature
        calibration = self.policy.calibration if self.policy.kind == "dynamic" else 0.0
        drafts: DraftSet | None = None
        proposal = self.propose()
        expansion = Expansion.of(proposal, draft_temperature) if self._array_tree() else None
        if expansion is not None:
            # An expanded proposal under the dynamic policy: the tree in array operations.
            tree, drafted, ancestors = self.policy.build_expanded(expansion)
            if room is not None and tree.size > room:
                tree, drafted, ancestors = tree.truncated(room), drafted[:room - 1], ancestors[:room, :room]
            node_tokens = [self.pending] + drafted
        else:
            drafts = draft_set(proposal, draft_temperature)
            if self.grammar is not None:
                drafts = ConstrainedDrafts(drafts, self.grammar)
            tree = self.policy.build(drafts)
            if room is not None and tree.size > room:
                tree = tree.truncated(room)
            node_tokens = [self.pending] + [drafts.token(p) for p in tree.paths[1:]]
            ancestors = tree.ancestors()
        # Read before the verify forward: it may draft the next step into the proposal's buffers.
        recorded = None
        if self.policy.record_trees:
            shown = drafts if drafts is not None else draft_set(proposal, draft_temperature)
            recorded = drafted_tree(tree, node_tokens, shown, draft_temperature)
        dev = self.runner.device
        out = self.runner.decode(node_tokens, [self.offset + d for d in tree.depths], self.offset,
                                 ancestors, drafts=True)
        verdict = self._verify(tree, node_tokens, out, drafts)
        path = verdict.path
        if path != list(range(len(path))):
            src = torch.tensor([self.offset + n for n in path], device=dev)
            dst = torch.arange(self.offset, self.offset + len(path), device=dev)
            self.runner.cache.move(src, dst)
        committed = [node_tokens[n] for n in path[1:]] + [verdict.bonus]
        last = path[-1]
        # Accepted node i is followed by committed[i]: its child on the path, or the bonus.
        # index_select copies: the runner's buffers are reused next step.
        self.rows = out.hidden.index_select(0, torch.tensor(path, device=dev))
        self.row_tokens, self.row_start = committed, self.offset
        self.hidden = self.rows[-1]
        self.offset += len(path)
        self.fused = None if out.draft_tokens is None or out.draft_logprobs is None else (
            out.draft_tokens[last].cpu(), out.draft_logprobs[last].float().cpu())
        self.pending = verdict.bonus
        if isinstance(drafts, ConstrainedDrafts):
            # The last accepted node's state is this step's own copy: advance it by the bonus.
            self.grammar = drafts.state(tree.paths[last])
            self.grammar.advance(verdict.bonus)
        accepted_depth = len(path) - 1
        record = StepRecord(
            step=self.steps, mode=self.mode, tree_size=tree.size, tree_depth=tree.depth,
            accepted_length=len(committed), accepted_nodes=tuple(path), tokens=tuple(committed),
            accepted_by_depth=tuple(d <= accepted_depth for d in range(1, tree.depth + 1)),
            draft_temperature=draft_temperature, elapsed_s=time.perf_counter() - start,
            predicted=round(self.policy.predicted, 6), calibration=round(calibration, 6), tree=recorded)
        self.policy.observe(record)
        self.steps += 1
        self.emitted += len(committed)
        return committed, record

    def _verify(self, tree: Tree, node_tokens: list[int], out: StepOutputs,
                drafts: DraftSet | None) -> Verdict:
        if not isinstance(drafts, ConstrainedDrafts):
            if self.params.greedy:
                return verify_greedy(tree, node_tokens, out.greedy.tolist())
            if self.mode == "typical":
                return verify_typical(tree, node_tokens, out.logits, self.params, self.sampler)
            return verify_sampled(tree, node_tokens, out.logits, self.params, self.sampler)
        logits, paths = out.logits, tree.paths

        def masks(node: int) -> torch.Tensor:
            """Only the nodes verification visits pay for a mask (~0.15 ms each)."""
            return drafts.state(paths[node]).mask(logits.shape[-1], logits.device)

        if self.params.greedy:
            return verify_greedy(tree, node_tokens, _MaskedArgmax(logits, masks))
        if self.mode == "typical":
            return verify_typical(tree, node_tokens, logits, self.params, self.sampler, masks=masks)
        return verify_sampled(tree, node_tokens, logits, self.params, self.sampler, masks=masks)


def drafted_tree(tree: Tree, node_tokens: Sequence[int], drafts: DraftSet, temperature: float) -> DraftTree:
    """The step's tree as its record keeps it: each node's token, parent and draft probability.

    Only runs that record trees pay for this (the drafts are already on the host, and an expanded
    proposal's are read into rank paths once more). A draft's score is its log-probability over the
    draft temperature, so the heads' own probability is ``exp(score * temperature)``.
    """
    probs = [1.0] + [round(math.exp(drafts.score(p) * temperature), 4) for p in tree.paths[1:]]
    return DraftTree(tuple(int(t) for t in node_tokens), tuple(tree.parents), tuple(probs))


class _MaskedArgmax(Sequence[int]):
    """``best[node]`` for ``verify_greedy`` under a grammar: the argmax of the node's masked logits,
    computed for the nodes the walk visits only."""

    def __init__(self, logits: torch.Tensor, masks: Callable[[int], torch.Tensor]) -> None:
        self.logits = logits
        self.masks = masks

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, node: int) -> int:
        return greedy_token(self.logits[node], self.masks(node))
