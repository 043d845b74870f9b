"""One layer's attention over a tree of ranking prompts: SDPA's kernel under the tree's mask against
blocks of query rows over the keys they may see (`blocked_masked_attention`, what a tree read takes
on the CPU), in one run on one thread, with the 1.5B's heads (12 query heads, 2 KV heads of 128).

    python benchmarks/bench_tree_attention.py --documents 10

The tree is the shape position-invariant reordering reads: a template, then per document its
tokens, the question after it, and the judge's question after the question's first words. Random
bf16 tensors: the time does not depend on the values. One JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_int8_prefill import milliseconds

from rag_mspoe.attention.token_tree import TokenTree
from rag_mspoe.models.prompt_attention import blocked_masked_attention

HEADS, KV_HEADS, WIDTH = 12, 2, 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--document-tokens", type=int, default=130)
    parser.add_argument("--template-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    template = list(range(args.template_tokens))
    question = list(range(2000, 2021))
    prompts = []
    for _ in range(args.documents):
        document = torch.randint(100, 1000, (args.document_tokens,), generator=generator).tolist()
        prompts.append(template + document + question)
        prompts.append(template + document + question[:15] + list(range(3000, 3020)))
    tree = TokenTree.of(prompts, len(template))
    mask = tree.mask()[None, None]
    rows, keys = mask.shape[2], mask.shape[3]
    query = torch.randn(1, HEADS, rows, WIDTH, generator=generator).bfloat16()
    key, value = (torch.randn(1, KV_HEADS, keys, WIDTH, generator=generator).bfloat16() for _ in range(2))
    group = HEADS // KV_HEADS
    every_key, every_value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    kernel = milliseconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            query, every_key, every_value, attn_mask=mask
        ),
        args.repeats,
    )
    scale = WIDTH**-0.5
    blocks = milliseconds(lambda: blocked_masked_attention(query, key, value, mask, scale), args.repeats)
    print(
        json.dumps(
            {
                "documents": args.documents,
                "tree_rows": rows,
                "ms_per_layer": {"sdpa_with_mask": round(kernel, 1), "blocks": round(blocks, 1)},
                "speed_up": round(kernel / blocks, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
