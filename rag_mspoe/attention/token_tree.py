"""Several prompts that start alike, read in one forward pass as a tree of their tokens.

Ranking documents one at a time reads many short prompts: the template, one document, then the
question (or the judge's question about it). Read one by one, each is a call of the model (on the
CPU every call streams all of the model's weights for a few dozen rows), and the rows a
document's question and judge prompts share are read twice. Laid out as a tree, each token a
prompt shares with another (the template, a document, the question's first words) is one node;
every node attends to the nodes on its path from the root and sits at its depth as its position.
One call then reads them all, and each prompt's rows are the rows it has read alone, up to
rounding. The 1.5B's ranking of a 10-document prompt took 19.9 s so against 26.5 one by one
(docs/cpu-inference.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_mspoe.models.prompt_attention import sparse_mask_reads
from rag_mspoe.rope.hooks import cache_argument, cache_grows_plainly


@dataclass
class TokenTree:
    """The tokens after a shared start of several prompts, each token once per distinct path.

    tokens / parents / depths: one entry a node, in an order where a parent comes before its
    children (parent -1: the node follows the shared start directly; depth 0 there). paths: for
    each prompt, the node of each of its tokens after the start."""

    start: int
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    paths: list[list[int]]

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], start: int) -> TokenTree:
        """The tree of `prompts`, which all begin with the same `start` tokens."""
        tree = cls(start, [], [], [], [])
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for prompt in prompts:
            if len(prompt) < start:
                raise ValueError(f"a prompt of {len(prompt)} tokens is shorter than the start ({start})")
            path: list[int] = []
            for token in prompt[start:]:
                parent = path[-1] if path else -1
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(tree.tokens)
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    tree.depths.append(len(path))
                path.append(node)
            tree.paths.append(path)
        return tree

    def mask(self) -> torch.Tensor:
        """[nodes, start + nodes] booleans, True where a node may attend: the whole start, and
        the nodes on its own path (itself included)."""
        count = len(self.tokens)
        own = torch.zeros(count, count, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                own[node] = own[parent]
            own[node, node] = True
        return torch.cat([torch.ones(count, self.start, dtype=torch.bool), own], dim=1)

    def node(self, prompt: int, position: int) -> int:
        """The node of `prompt`'s token at `position` (counted from the prompt's first token)."""
        if not self.start <= position < self.start + len(self.paths[prompt]):
            raise ValueError(
                f"position {position} is not in the tree (from {self.start} to the prompt's end)"
            )
        return self.paths[prompt][position - self.start]


def tree_logits(
    model: Any, tree: TokenTree, start_cache: Any, rows: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Each prompt's logits (float) at its `rows` (positions in the prompt: row i predicts token
    i + 1), read in one forward over the tree after `start_cache` (the model's cache of the
    shared start, a copy it uses up; None when the start is empty). The model's cache must grow
    plainly (`rag_mspoe.rope.hooks.grows_plainly`): a sliding window is a mask this one replaces."""
    if not tree.tokens:
        raise ValueError("every prompt ends within the shared start: there are no tokens to read")
    if not cache_grows_plainly(model):
        raise ValueError(
            "this model attends through a sliding window (or a fixed-size cache), which a tree's mask "
            "would replace: read its prompts one at a time"
        )
    wanted = [[tree.node(p, r) for r in prompt_rows] for p, prompt_rows in enumerate(rows)]
    kept = sorted({node for nodes in wanted for node in nodes})
    where = {node: i for i, node in enumerate(kept)}
    device = model.device
    # On the CPU each block of rows attends to the keys of its own branches only.
    with torch.inference_mode(), sparse_mask_reads():
        out = model(
            torch.tensor([tree.tokens], device=device),
            position_ids=torch.tensor([[tree.start + d for d in tree.depths]], device=device),
            attention_mask=tree.mask()[None, None].to(device),
            use_cache=start_cache is not None,
            logits_to_keep=torch.tensor(kept, device=device),
            **(cache_argument(start_cache) if start_cache is not None else {}),
        )
    logits = out.logits[0].float()
    return [logits[[where[n] for n in nodes]] for nodes in wanted]
