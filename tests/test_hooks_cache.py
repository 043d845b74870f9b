"""The hooks find a forward's KV cache under the name its transformers release uses: `cache` from
5.24 on, `past_key_values` before. Read under the wrong name, a decoding step looks like a fresh
prefill and the document methods refuse its spans (the demo failed so on 5.24)."""

from __future__ import annotations

from transformers import DynamicCache

from rag_mspoe.rope.hooks import kv_cache


def test_the_cache_is_found_under_either_name():
    cache = DynamicCache()
    assert kv_cache({"cache": cache}) is cache
    assert kv_cache({"past_key_values": cache}) is cache
    assert kv_cache({"cache": None, "past_key_values": cache}) is cache
    assert kv_cache({}) is None
