"""Attention-level methods that see the documents of a prompt, and what they share.

spans                        DocumentSpans, character -> token spans, `document_spans(model, spans)`
attention_calibration        AttentionCalibration ("Found in the Middle"): the config, and the
                             estimate of its positional bias
attention_calibration_hooks  its hooks: each document's share of attention rescaled by calibrated relevance
bias                         the positional bias it subtracts, per model and number of documents
pine                         Pine (position-invariant inference): the config
pine_hooks                   its hooks: bidirectional attention between documents, positions by importance
reorder                      DocumentReordering, the base of methods that reorder documents, and
                             CalibratedReorder: ranked by calibrated attention, read again reordered
invariant_reorder            InvariantReorder: documents ranked each read alone, read again sorted by rank
document_hooks               what both hooks share: the attention function they install, spans, positions

The method classes are exported by `rag_mspoe.methods` (and `rag_mspoe`); this package exports
what running them by hand needs:

rescale(model, AttentionCalibration())      # or Pine(), "attention-calibration", "pine"
ids, spans = prompt_with_spans(tokenizer, packed.prompt, packed.document_spans)
with document_spans(model, [spans]):
    model(torch.tensor([ids]))
"""

from rag_mspoe.attention.attention_calibration import estimate_positional_bias
from rag_mspoe.attention.bias import PositionalBias, bias_cache_path
from rag_mspoe.attention.spans import DocumentSpans, document_spans, prompt_with_spans
from rag_mspoe.prompts.document_prompts import char_to_token_spans

__all__ = [
    "DocumentSpans",
    "PositionalBias",
    "bias_cache_path",
    "char_to_token_spans",
    "document_spans",
    "estimate_positional_bias",
    "prompt_with_spans",
]
