"""The one generation engine every adapter uses: chat template, left-padded batches, stop strings,
streaming, token counting, a per-call rescaling method, and one lock per model.

    engine = Engine.load(method="mspoe")
    engine.generate("What is the capital of France?").text        # 'The capital of France is Paris.'
    for piece in engine.stream("Tell me a story", stop=["THE END"]):
        print(piece, end="")

Calls run one at a time per model, so concurrent callers (threads or asyncio tasks) get exactly
the answers they would get one after another. Async calls run the model in a worker thread and
never block the event loop.

The engine's jobs live in their own modules; this one puts them together and keeps the names
code imports from it:

    engine_types       settings, results, errors, ENGINE_DEFAULT
    engine_base        the model, its lock, the default method, the chat template
    engine_generation  generate, generate_batch, stream and their async forms
    joined_decode      prompts prefilled one at a time, then decoded as one batch
    engine_scoring     loglikelihood, score_continuations, prefill
    scored_generation  generate_and_score: answers and continuation scores from one prefill
    text_stream        the stream a generation's text pieces arrive on
"""

from __future__ import annotations

import os
import threading

import torch

from rag_mspoe.engine.engine_types import (
    ENGINE_DEFAULT,
    CallMethod,
    EngineDefault,
    FinishReason,
    GenerationCancelled,
    GenerationResult,
    GenerationSettings,
    GenerationTimeout,
    Prefill,
    PromptTooLongError,
    Truncation,
)
from rag_mspoe.engine.scored_generation import ScoredGeneratingEngine
from rag_mspoe.engine.text_stream import AsyncTextStream, TextPiece, TextStream
from rag_mspoe.engine.token_logprobs import TokenLogprob
from rag_mspoe.methods.method_spec import AUTO, MethodSpec

__all__ = [
    "ENGINE_DEFAULT",
    "AsyncTextStream",
    "CallMethod",
    "Engine",
    "EngineDefault",
    "FinishReason",
    "GenerationCancelled",
    "GenerationResult",
    "GenerationSettings",
    "GenerationTimeout",
    "MethodSpec",
    "Prefill",
    "PromptTooLongError",
    "TextPiece",
    "TextStream",
    "TokenLogprob",
    "Truncation",
    "shared_engine",
]


class Engine(ScoredGeneratingEngine):
    """Generation and scoring over one loaded causal LM and its tokenizer.

    method: the default rescaling method, any spec `parse_method` takes ("mspoe", "pi:2",
    "layerwise+pi", a config, a saved config's path); None or "none" is the unmodified model.
    Left out (ENGINE_DEFAULT), the engine keeps the model's method as it was handed over
    (whatever `rescale` applied to it, or nothing). Each call can pass its own `method`; it
    applies for that call only, and ENGINE_DEFAULT (a call's default) means the engine's.

    compile: decode on a static KV cache with a compiled forward (the prompt's prefill stays
    eager, where Ms-PoE ranks heads). "auto" turns it on for models on a CUDA GPU and off on
    the CPU, where compiling costs more than it saves (measured on one thread: compiled decoding
    0.97x eager on Qwen2.5-Coder-0.5B and 0.91x on the 1.5B, after 5-35 s of compiling per new
    prompt length; `benchmarks/bench_cpu_inference.py --parts decode`). The first call per batch size, and the
    first call under each other method, compiles (seconds to a minute); later ones reuse it.
    Past torch's recompile limit (8 by default) decoding falls back to eager.
    compile_backend: torch.compile's backend (default inductor, with CUDA graphs on a GPU).

    joined_decoding (attribute): whether `generate_batch` prefills each prompt alone and decodes
    the rows together (`joined_decode`; True on the CPU when not compiled) or prefills one
    left-padded batch.
    shared_prompt_starts (attribute): whether the unmodified model prefills a start it has read
    before once: a prompt's start shared with an earlier one of a joined batch, and a single
    answer's start that a calibrated reordering's ranking pass read (default True).
    """


# Engines built from a model source, shared process-wide (see `shared_engine`).
_shared_engines: dict[tuple[str, str, str], Engine] = {}
_shared_engines_guard = threading.Lock()


def shared_engine(
    source: str | os.PathLike[str] | None = None,
    device: str | None = "auto",
    dtype: torch.dtype | str | None = None,
) -> Engine:
    """The process-wide engine for a model source (None: the embedded model) on a device and in a
    dtype (as `load_model` takes them), loaded on first use, its default method "auto" (the model's
    shipped method on prompts of the document counts it was validated at; none where none ships).

    Adapters built from a source name share it, so a second chat model does not load the
    weights again.
    """
    key = (str(source) if source is not None else "", str(device), str(dtype))
    with _shared_engines_guard:
        if key not in _shared_engines:
            _shared_engines[key] = Engine.load(source, method=AUTO, device=device, dtype=dtype)
        return _shared_engines[key]
