"""The hooks find a forward's KV cache under the name its transformers release uses: `cache` from
5.24 on, `past_key_values` before. Read under the wrong name, a decoding step looks like a fresh
prefill and the document methods refuse its spans (the demo failed so on 5.24). The package hands
a model its cache and reads it back under that name too, so the renamed release has nothing to
warn about."""

from __future__ import annotations

import logging
import warnings

import torch
from tiny_models import tiny_model
from transformers import DynamicCache

from rag_mspoe.attention.reorder import document_attention
from rag_mspoe.engine import prefix_scoring
from rag_mspoe.engine.document_prefix import DocumentPrefixCache
from rag_mspoe.rope.hooks import kv_cache


def test_the_cache_is_found_under_either_name():
    cache = DynamicCache()
    assert kv_cache({"cache": cache}) is cache
    assert kv_cache({"past_key_values": cache}) is cache
    assert kv_cache({"cache": None, "past_key_values": cache}) is cache
    assert kv_cache({}) is None


def test_work_on_a_shared_cache_raises_no_deprecation_notice(monkeypatch):
    # transformers warns of a renamed argument with a FutureWarning and of a renamed output field
    # with a logged line (once per process, hence the patched logger).
    logged: list[str] = []
    monkeypatch.setattr(
        logging.Logger, "warning_once", lambda _self, message, *_args, **_kwargs: logged.append(str(message))
    )
    model = tiny_model("llama")
    ids = list(range(1, 17))
    requests = [
        prefix_scoring.Continuations(ids, [[*ids, 20, 21]]),
        prefix_scoring.Continuations([*ids[:12], 30], [[*ids[:12], 30, 31, 32]]),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.inference_mode():
            prefix_scoring.score(model, requests, pad_id=0)
        cache = DocumentPrefixCache(model).copy_of(ids[:10])
        document_attention(model, cache, ids, [(2, 6), (6, 10)], [0, 1])
    notices = [str(warning.message) for warning in caught] + logged
    assert not [notice for notice in notices if "past_key_values" in notice], notices
