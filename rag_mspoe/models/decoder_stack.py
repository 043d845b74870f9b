"""Running a decoder's layers in two parts: the first few, then, from their output, the rest.

A pass that reads only the lower layers (a ranking by the attention of layers 12-17 of 24) can
stop there and save the upper layers' cost; when its rows turn out to be wanted whole after all
(the answer reads the same prompt), the upper layers run from the hidden states the first part
left, and the rows are those of one full forward: each layer sees the same inputs either way.

Only decoders whose forward is the plain loop (embed, same-mask layers, norm) are split: the
Llama and Qwen2 families, without sliding-window layers. For any other model
`splits_layers` is False and callers run it whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Their forward feeds `inputs_embeds` to the layers unscaled and gives every layer the same mask.
_PLAIN_LOOP_TYPES = ("llama", "qwen2")


def splits_layers(model: Any) -> bool:
    """Whether `model`'s decoder can run its first layers alone and the rest later."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (
        getattr(config, "model_type", None) in _PLAIN_LOOP_TYPES
        and layer_types == {"full_attention"}
        and isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleList)
    )


def cuts_at(model: Any, count: int) -> bool:
    """Whether running `model`'s first `count` layers leaves some out: it splits, and has more."""
    return splits_layers(model) and count < int(model.config.num_hidden_layers)


@contextmanager
def first_layers(model: Any, count: int) -> Iterator[list[torch.Tensor]]:
    """Within the block, `model` runs only its first `count` decoder layers (the final norm and
    the output layer still run on their output). Yields a list that receives, for every forward,
    the hidden states the last of them returns: the input the next layer would read."""
    layers = model.model.layers
    if not 0 < count <= len(layers):
        raise ValueError(f"A model of {len(layers)} layers has no first {count}.")
    outputs: list[torch.Tensor] = []
    handle = layers[count - 1].register_forward_hook(
        lambda _module, _args, output: outputs.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with _running_only(model, list(layers)[:count]):
            yield outputs
    finally:
        handle.remove()


@contextmanager
def upper_layers(model: Any, start: int) -> Iterator[None]:
    """Within the block, `model` runs only its decoder layers from `start` on: fed `inputs_embeds`
    = what layer `start - 1` returned for rows 0, 1, ..., and an empty cache, it makes those
    layers' rows (the cache's lower layers stay empty, so positions and the causal mask start at
    0, as in one full forward)."""
    layers = model.model.layers
    if not 0 < start < len(layers):
        raise ValueError(f"A model of {len(layers)} layers has no layers above its first {start}.")
    with _running_only(model, list(layers)[start:]):
        yield


@contextmanager
def _running_only(model: Any, layers: list[torch.nn.Module]) -> Iterator[None]:
    """The decoder's layer list replaced by `layers` for the block (each keeps its own index into
    the KV cache), then put back."""
    decoder = model.model
    kept = decoder.layers
    decoder.layers = torch.nn.ModuleList(layers)
    try:
        yield
    finally:
        decoder.layers = kept
