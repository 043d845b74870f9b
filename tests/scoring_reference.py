"""An independent reference for continuation scores: one full forward per option, no cache."""

from __future__ import annotations

import torch

from rag_mspoe import frozen_head_order, parse_method, rescaled
from rag_mspoe.prompts.chat_template import render


def reference_loglikelihood(engine, prompt, continuations, *, prefix="", raw=False, method=None):
    """One full forward per option over prompt + option, no cache: an independent reference.

    Ms-PoE ranks its heads on the prompt alone, then scores every option with that ranking.
    """
    context = render(engine.tokenizer, prompt, raw=raw, prefix=prefix)
    model = engine.model
    scores = []
    with rescaled(model, parse_method(method)), torch.inference_mode():
        model(torch.tensor([context]))
        with frozen_head_order(model):
            for text in continuations:
                ids = render(engine.tokenizer, prompt, raw=raw, prefix=prefix + text)
                start = next(
                    (i for i, (a, b) in enumerate(zip(context, ids, strict=False)) if a != b), len(context)
                )
                start = max(start, 1)
                logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
                targets = torch.tensor(ids[start:])
                scores.append(float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum()))
    return scores
