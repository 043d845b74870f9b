"""Positional hidden-state scaling: the `HiddenScale` config and its hooks.

In each scaled layer:
- During a prefill the layer runs unchanged; a hook on `self_attn` then recomputes the last
  `last_rows` rows of attention with query and keys from the scaled input (values unscaled),
  causal mask aligned bottom-right, and swaps the scaled keys into the KV cache.
- During decoding (or any forward that continues a cache), pre-hooks on `q_proj` and `k_proj`
  scale their input, so new tokens use the scaled query and keys; `v_proj` is left alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rag_mspoe.methods.method_config import MethodConfig, check_finite, number_argument
from rag_mspoe.rope.hooks import ModelHooks, kv_cache


class HiddenScaleState(ModelHooks):
    # A prefill leaves its scaled keys in the cache, nothing in the hooks.
    joins_prefills = True

    def __init__(self, model: nn.Module, method: Any) -> None:
        super().__init__(model, method)
        assert isinstance(method, HiddenScale)
        self.scale: HiddenScale = method
        config: Any = model.config
        self.layers = method.layer_indices(config.num_hidden_layers, config.hidden_size)

    def _install(self) -> None:
        for index in self.layers:
            attention = self.decoder.layers[index].self_attn
            for projection in (attention.q_proj, attention.k_proj):
                self._handles.append(projection.register_forward_pre_hook(self._scale_when_continuing))
            hook = functools.partial(self._recompute_last_rows, index)
            self._handles.append(attention.register_forward_hook(hook, with_kwargs=True))

    def scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.clone()
        out[..., self.scale.dimension] *= self.scale.factor
        return out

    def _scale_when_continuing(self, _module: nn.Module, args: tuple) -> tuple | None:
        if self.forward.starts_fresh:
            return None
        return (self.scaled(args[0]), *args[1:])

    def _recompute_last_rows(
        self, index: int, module: Any, args: tuple, kwargs: dict, output: tuple
    ) -> tuple | None:
        if not self.forward.starts_fresh:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        batch, length, _ = hidden.shape
        rows = min(self.scale.last_rows, length)
        head_dim = module.head_dim
        scaled = self.scaled(hidden)

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, x.shape[1], -1, head_dim).transpose(1, 2)

        q = heads(module.q_proj(scaled[:, -rows:]))
        k = heads(module.k_proj(scaled))
        q, k = self.arch.normalise_qk(module, q, k)
        apply_rotary = self.arch.module().apply_rotary_pos_emb
        q, _ = apply_rotary(q, q, cos[:, -rows:], sin[:, -rows:])
        k, _ = apply_rotary(k, k, cos, sin)
        v = heads(module.v_proj(hidden))

        groups = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        logits = (q.float() @ keys.float().transpose(-1, -2)) * module.scaling
        weights = self.last_rows_weights(module, logits)
        attended = (weights @ values.float()).to(hidden.dtype)  # [B, H, rows, D]
        last = module.o_proj(attended.transpose(1, 2).reshape(batch, rows, -1))

        attn_output = output[0].clone()
        attn_output[:, -rows:] = last
        self._replace_cached_keys(kv_cache(kwargs), module.layer_idx, k)
        return (attn_output, *output[1:])

    @staticmethod
    def _replace_cached_keys(cache: Any, layer_idx: int, keys: torch.Tensor) -> None:
        """Put the scaled keys where the layer just cached its unscaled ones (the newest tokens).

        A dynamic cache ends with them. A static cache is preallocated: a prefill (which starts
        it fresh) fills its first slots with the newest tokens that fit.
        """
        if cache is None:
            return
        # Imported here, not at the top: importing transformers would slow `import rag_mspoe` by ~1 s.
        from transformers.cache_utils import StaticLayer

        layer = cache.layers[layer_idx]
        cached = layer.keys
        kept = min(cached.shape[-2], keys.shape[-2])
        newest = keys[:, :, -kept:].to(cached.dtype)
        if isinstance(layer, StaticLayer):
            cached[:, :, :kept] = newest
        else:
            cached[:, :, -kept:] = newest


@dataclass
class HiddenScale(MethodConfig):
    """Positional hidden-state scaling: one dimension of the attention input scaled by `factor`.

    In `layers` (default: the middle of the model, layers 10-25 of 32 as in the paper, scaled to
    the model's depth), the query of the last prompt token and the keys it reads are computed
    from the input with `dimension` multiplied by `factor`; every other row of attention stays
    as it was. Those scaled keys go to the KV cache and generated tokens use the scaled query
    and keys too. Values are never scaled. `last_rows` > 1 gives the scaled path to more of the
    final prompt rows (with the causal mask aligned bottom-right). Find `dimension` with the
    calibration search; factors the paper used: 0, -1, 0.2.
    """

    kind: ClassVar[str] = "hidden"
    alone_because: ClassVar[str] = (
        "it scales hidden states through hooks of its own, which do not stack with the attention hooks "
        "the RoPE methods use"
    )
    hooks: ClassVar[Any] = HiddenScaleState
    argument_name: ClassVar[str] = "hidden"
    dimension: int = -1
    factor: float = 0.0
    layers: list[int] | None = None
    last_rows: int = 1

    def __post_init__(self) -> None:
        check_finite("factor", self.factor)
        if self.dimension < 0:
            raise ValueError(
                "HiddenScale needs the hidden `dimension` to scale; find it with the calibration search."
            )
        if self.last_rows < 1:
            raise ValueError(f"last_rows must be at least 1, got {self.last_rows}")
        if self.layers is not None and any(i < 0 for i in self.layers):
            raise ValueError(f"layers must be non-negative layer indices, got {self.layers}")

    @classmethod
    def from_argument(cls, part: str, argument: str) -> MethodConfig:
        dimension, _, factor = argument.partition(",")
        return cls(
            dimension=int(number_argument(part, dimension)), factor=number_argument(part, factor or "0")
        )

    def reads_last_row(self) -> bool:
        return True  # the scaled path starts from the last prompt rows

    def layer_indices(self, num_layers: int, hidden_size: int) -> list[int]:
        if self.dimension >= hidden_size:
            raise ValueError(f"dimension {self.dimension} is outside the model's hidden size {hidden_size}.")
        if self.layers is None:
            return list(range(round(num_layers * 10 / 32), round(num_layers * 25 / 32) + 1))
        bad = [i for i in self.layers if i >= num_layers]
        if bad:
            raise ValueError(f"HiddenScale.layers has {bad}; the model has {num_layers} layers.")
        return sorted(set(self.layers))
