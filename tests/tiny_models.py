"""Tiny randomly initialised models of every supported architecture, for mechanics tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from rag_mspoe import ARCHITECTURES

ARCH_NAMES = list(ARCHITECTURES)
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_config(arch: str, attn: str = "sdpa", **overrides: Any) -> Any:
    if arch == "llama":
        config = transformers.LlamaConfig(**COMMON)
    elif arch == "mistral":
        config = transformers.MistralConfig(**COMMON, sliding_window=12)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=12, max_window_layers=2
        )
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**COMMON, head_dim=16)
    elif arch == "gemma3_text":
        config = transformers.Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    return config


def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    config = tiny_config(arch, attn, **overrides)
    model_cls = transformers.Gemma3ForCausalLM if arch == "gemma3_text" else transformers.AutoModelForCausalLM
    if model_cls is transformers.AutoModelForCausalLM:
        model = model_cls.from_config(config)
    else:
        model = model_cls(config)
    return model.float().eval()


def with_rope_parameters(model: Any, **rope: Any) -> Any:
    """A copy of `model` (same weights) whose config sets `rope` in every RoPE parameter set."""
    config = copy.deepcopy(model.config)
    params = config.rope_parameters
    targets = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    for target in targets:
        target.update(rope)
    clone = type(model)(config).float().eval()
    clone.load_state_dict(model.state_dict())
    return clone


def prompt_ids(length: int = 20, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def tiny_tokenizer() -> Any:
    """A 28-token character-level fast tokenizer (a-z, <unk>, <eos>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{chr(97 + i): i + 2 for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )


def fake_gguf_conversion(monkeypatch: Any, gguf_name: str) -> list[bytes]:
    """Make transformers 'convert' any GGUF file called `gguf_name` into a tiny Llama in milliseconds.

    Returns a list that receives the bytes of every such file transformers is asked to read.
    """
    from pathlib import Path

    seen: list[bytes] = []
    tokenizer = tiny_tokenizer()
    real_model_loader = transformers.AutoModelForCausalLM.from_pretrained
    real_tokenizer_loader = transformers.AutoTokenizer.from_pretrained

    def fake_model(folder, gguf_file=None, **kwargs):
        if gguf_file != gguf_name:
            return real_model_loader(folder, **kwargs)
        seen.append((Path(folder) / gguf_file).read_bytes())
        return tiny_model("llama")

    def fake_tokenizer(folder, gguf_file=None, **kwargs):
        return tokenizer if gguf_file else real_tokenizer_loader(folder, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(fake_model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(fake_tokenizer))
    return seen
