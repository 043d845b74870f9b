"""A candidate for a quicker prefill: int8 weights times int8 activations (W8A8), against bf16.

    python benchmarks/bench_int8_prefill.py                      # the 0.5B's layer shapes, one thread
    python benchmarks/bench_int8_prefill.py --model qwen2.5-coder-1.5b-instruct --drift-prompts 20

A RAG answer is mostly its prompt's prefill, and the bf16 matmul that reads it runs near this
CPU's bf16 peak; llama.cpp reads its 4-bit files with int8 dot products instead. This measures,
not yet ships, the same idea in torch: each row of a layer's input quantised to int8 with its own
scale, multiplied with the int8 weight (one scale per output channel, `quantize="int8"`'s codes)
by `torch._int_mm`, and the int32 product scaled back in bf16.

- layers: milliseconds per call of each of the model's Linear shapes at `--rows` rows (a
  1,300-token prompt): the bf16 matmul, the W8A8 product and its parts; and, for decoding, the
  int8 weight-only kernel against the bf16 matmul at 1-16 rows (a drafted step checks 11).
- drift (`--drift-prompts N`): the gold answer's log-likelihood per token on N real 10-document
  prompts (the search half), the stock bf16 model (SDPA's kernel) against the model attending as
  `load_model` makes it attend, with every Linear layer (but those `--keep`
  names) W8A8 for calls over 16 rows (the prompt) and weight-only int8 below (the answer), and
  each one's seconds, the two alternating prompt by prompt; `--outlier-threshold` multiplies the
  input columns holding larger activations in bf16, `--smoothing` smooths each layer's inputs as
  SmoothQuant does. docs/cpu-inference.md has the results: quick enough, drift too large.

One JSON line on stdout; one thread; compare within one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_cpu_inference import DATA, GOLD_POSITION, prompt_ids
from torch import nn

from rag_mspoe.models.int8_prompt import quantize_rows, scale_back, w8a8

DECODE_ROWS = (1, 2, 4, 11, 16)
CALIBRATION_PROMPTS = 8  # the smoothing's, after the drift prompts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--rows", type=int, default=1300, help="prompt tokens of the layer timings")
    parser.add_argument("--drift-prompts", type=int, default=0, help="real prompts of the drift part")
    parser.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="drift: the search half's prompts from this one on (20: none the layer choice read)",
    )
    parser.add_argument(
        "--shipped",
        nargs="?",
        const="int8-prompt",
        choices=("none", "int8-prompt", "int8-prompt+int4", "int8-prompt+int4-decoding"),
        metavar="SCHEME",
        help='drift: the model as quantize=SCHEME makes it instead of the variants below: "int8-prompt" '
        "(the default; gate and up projections W8A8 for the prompt, every call of 16 tokens or fewer on the "
        'bf16 weight), "int8-prompt+int4" (those calls on the file\'s 4-bit codes where it has them) or '
        '"int8-prompt+int4-decoding" (and on int8 codes elsewhere); "none": the bf16 weights, so the drift '
        "is the attention's alone",
    )
    parser.add_argument(
        "--decode-int8",
        nargs="*",
        choices=("mlp", "head"),
        metavar="PART",
        help="with --shipped: short calls (decoding, the scored answer) on int8-rounded weights too, in the "
        "gate and up projections (mlp) and/or the output layer (head)",
    )
    parser.add_argument(
        "--keep",
        nargs="*",
        default=[],
        metavar="NAME",
        help="drift: Linear layers whose name ends so stay bf16 (e.g. down_proj, whose inputs hold outliers)",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        metavar="ALPHA",
        help="drift: SmoothQuant's factors max|x|^ALPHA / max|w|^(1-ALPHA) per input channel (0.5 in its "
        "paper), fitted on the 8 prompts after the drift prompts",
    )
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="drift: the candidate's residual stream turned by a random orthogonal matrix first (QuaRot's "
        "idea, folded into the weights: no cost at run time), so no input channel of the layers reading it "
        "holds the large activations alone",
    )
    parser.add_argument(
        "--prompt-blocks",
        choices=["model", "on", "off"],
        default="model",
        help="drift: whether the candidate reads bf16 prompts in blocks of query rows (model: as "
        "`load_model` chooses for it) or through SDPA's kernel",
    )
    parser.add_argument(
        "--outlier-threshold",
        type=float,
        metavar="T",
        help="drift: input columns with an activation above T multiply in bf16 (LLM.int8() used 6)",
    )
    args = parser.parse_args()
    # Flags that do not go together fail before the model loads.
    if args.shipped and (
        args.keep or args.outlier_threshold is not None or args.smoothing is not None or args.rotate
    ):
        parser.error(
            "--shipped measures the shipped scheme: "
            "drop --keep, --outlier-threshold, --smoothing and --rotate"
        )
    if args.decode_int8 and args.shipped != "int8-prompt":
        parser.error("--decode-int8 changes int8-prompt's decoding: add --shipped int8-prompt")
    torch.set_num_threads(1)
    from rag_mspoe import load_model
    from rag_mspoe.models.embedded_models import prompt_blocks
    from rag_mspoe.models.step_attention import use_step_attention

    # The reference is the stock model (torch's SDPA kernel throughout); the candidate attends as
    # `load_model` makes it attend (float32 steps, bf16 prompt blocks where the model takes them), so
    # the drift counts both.
    model, tokenizer = load_model(args.model, dtype="bfloat16", threads=1, attn_implementation="sdpa")
    result: dict[str, Any] = {"model": args.model, "threads": 1, "rows": args.rows}
    result["layers"] = layer_timings(model, args.rows)
    if args.drift_prompts:
        prompts = range(args.first_prompt, args.first_prompt + args.drift_prompts)
        if args.shipped:
            candidate = shipped(model, args.model, args.shipped)
            decode_on_int8_weights(candidate, args.decode_int8 or [])
        else:
            factors = {}
            if args.smoothing is not None:
                after = range(prompts.stop, prompts.stop + CALIBRATION_PROMPTS)
                factors = smoothing_factors(model, tokenizer, _prompts(after)[1], args.smoothing)
            base = rotated(model) if args.rotate else model
            candidate = variant(base, tuple(args.keep), args.outlier_threshold, factors)
        blocks = prompt_blocks(args.model) if args.prompt_blocks == "model" else args.prompt_blocks == "on"
        use_step_attention(candidate, prompt_blocks=blocks)
        result["drift"] = {
            "scheme": args.shipped or "variant",
            "reference_attention": model.config._attn_implementation,
            "candidate_attention": candidate.config._attn_implementation,
            "decode_int8": args.decode_int8 or [],
            "first_prompt": args.first_prompt,
            "kept_bf16": args.keep,
            "outlier_threshold": args.outlier_threshold,
            "smoothing_alpha": args.smoothing,
            "rotated": args.rotate,
            "calibration_prompts": CALIBRATION_PROMPTS if args.smoothing is not None else 0,
            **drift(model, candidate, tokenizer, prompts),
        }
    print(json.dumps(result), flush=True)


class Int8ActivationLinear(nn.Module):
    """int8 weights (per output channel) times int8 activations (per row) for calls over 16 rows.

    With `outlier_threshold`, the input columns whose largest magnitude exceeds it multiply in
    bf16 with their de-quantised weight columns instead (LLM.int8()'s decomposition), so a few
    very large activations do not set every row's int8 step. With `smoothing` (per input channel),
    the rows are divided and the weight multiplied by it before both are quantised (SmoothQuant).
    """

    def __init__(
        self,
        linear: nn.Linear,
        outlier_threshold: float | None = None,
        smoothing: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.outlier_threshold = outlier_threshold
        self.outlier_columns: list[int] = []  # per call over 16 rows, for the report
        from rag_mspoe.models.weight_only import WeightOnlyLinear

        self.weight_only = WeightOnlyLinear(linear, 8)
        # Large input channels hand part of their range over to the weight's columns.
        self.smoothing = smoothing
        if smoothing is not None:
            smoothed = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            smoothed.weight = nn.Parameter(linear.weight.detach() * smoothing.to(linear.weight.dtype))
            smoothed.bias = linear.bias
            self.smoothed = WeightOnlyLinear(smoothed.to(linear.weight.dtype), 8)
        self.codes_t = self.weight_only.packed.t()  # [in, out], as torch._int_mm takes it
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.weight_only.kernel_rows:
            return self.weight_only(x)
        if self.smoothing is not None:
            smoothed = (rows / self.smoothing.to(rows.dtype)).contiguous()
            weights = self.smoothed
            out = _biased(w8a8(smoothed, weights.packed.t(), weights.scales), weights.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        scales, bias = self.weight_only.scales, self.weight_only.bias
        outliers = None
        if self.outlier_threshold is not None:
            outliers = (rows.abs().amax(0) > self.outlier_threshold).nonzero().squeeze(1)
            self.outlier_columns.append(outliers.numel())
        if outliers is None or outliers.numel() == 0:
            return _biased(w8a8(rows, self.codes_t, scales), bias).reshape(*x.shape[:-1], self.out_features)
        columns = self.weight_only.packed[:, outliers].to(rows.dtype) * scales[:, None]
        out = _biased(w8a8(rows.index_fill(1, outliers, 0), self.codes_t, scales), bias)
        out += rows[:, outliers] @ columns.T
        return out.reshape(*x.shape[:-1], self.out_features)


def _biased(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def layer_timings(model: Any, rows: int) -> dict[str, Any]:
    linears = [m for m in model.model.layers[0].modules() if type(m) is nn.Linear]
    shapes = sorted({(m.in_features, m.out_features) for m in linears})
    return {f"{inputs}x{outputs}": shape_timings(inputs, outputs, rows) for inputs, outputs in shapes}


def shape_timings(inputs: int, outputs: int, rows: int) -> dict[str, Any]:
    """One Linear shape's timings (module docstring), on random weights and inputs."""
    torch.manual_seed(0)
    linear = nn.Linear(inputs, outputs, bias=False).to(torch.bfloat16)
    layer = Int8ActivationLinear(linear)
    codes_t, scales = layer.codes_t, layer.weight_only.scales
    x = torch.randn(rows, inputs, dtype=torch.bfloat16)
    quantized, row_scale = quantize_rows(x)
    product = torch._int_mm(quantized, codes_t)
    bf16 = milliseconds(lambda: torch.nn.functional.linear(x, linear.weight))
    int8 = milliseconds(lambda: w8a8(x, codes_t, scales))
    return {
        "bf16_ms": round(bf16, 2),
        "w8a8_ms": round(int8, 2),
        "w8a8_speedup": round(bf16 / int8, 2),
        "int_mm_ms": round(milliseconds(lambda: torch._int_mm(quantized, codes_t)), 2),
        "quantize_rows_ms": round(milliseconds(lambda: quantize_rows(x)), 2),
        "scale_back_bf16_ms": round(milliseconds(lambda: scale_back(product, row_scale, scales, x.dtype)), 2),
        "scale_back_fp32_ms": round(
            milliseconds(lambda: (product.float() * row_scale * scales.float()).to(x.dtype)), 2
        ),
        "int8_kernel_time_vs_bf16_by_rows": {
            count: round(_kernel_vs_bf16(layer, linear, count), 2) for count in DECODE_ROWS
        },
    }


def _kernel_vs_bf16(layer: Int8ActivationLinear, linear: nn.Linear, rows: int) -> float:
    """The weight-only int8 kernel's time over the bf16 matmul's, at `rows` rows (decoding)."""
    step = torch.randn(rows, linear.in_features, dtype=torch.bfloat16)
    packed, scales = layer.weight_only.packed, layer.weight_only.scales
    kernel = milliseconds(lambda: torch.ops.aten._weight_int8pack_mm(step, packed, scales))
    return kernel / milliseconds(lambda: torch.nn.functional.linear(step, linear.weight))


def shipped(model: Any, name: str, scheme: str) -> Any:
    """A copy of the embedded model `name` as `quantize=scheme` makes it (its grid read from its folder)."""
    from rag_mspoe.models.embedded_models import prepare
    from rag_mspoe.models.quantization import quantize_model

    return quantize_model(copy.deepcopy(model), scheme, prepare(name))


def decode_on_int8_weights(model: Any, parts: list[str]) -> None:
    """The weights short calls run rounded to int8 per output channel, as a weight-only int8 kernel
    would read them: the int8-prompt layers' own weights ("mlp") and the output layer ("head",
    untied from the input embeddings, which stay as they are)."""
    from rag_mspoe.models.int8_prompt import Int8PromptLinear
    from rag_mspoe.models.weight_only import int8_per_channel

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        codes, scales = int8_per_channel(weight)
        return (codes.float() * scales.float()[:, None]).to(weight.dtype)

    with torch.no_grad():
        if "mlp" in parts:
            for layer in model.modules():
                if isinstance(layer, Int8PromptLinear):
                    layer.linear.weight.copy_(rounded(layer.linear.weight))
        if "head" in parts:
            head = model.get_output_embeddings()
            head.weight = nn.Parameter(rounded(head.weight.detach().clone()), requires_grad=False)


def variant(
    model: Any, keep: tuple[str, ...], outlier_threshold: float | None, factors: dict[str, torch.Tensor]
) -> Any:
    """A copy of the model with every Linear layer but those named `keep` `Int8ActivationLinear`."""
    candidate = copy.deepcopy(model)
    for parent_name, parent in list(candidate.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and not (keep and name.endswith(keep)):
                smoothing = factors.get(f"{parent_name}.{name}")
                setattr(parent, name, Int8ActivationLinear(child, outlier_threshold, smoothing))
    return candidate


def rotated(model: Any, seed: int = 0) -> Any:
    """A copy of the model computing the same function with its residual stream turned by a random
    orthogonal Q: every hidden state h becomes h Q. Each RMSNorm's weight moves into the layers
    reading it (an RMSNorm without weight commutes with Q), the layers reading the stream take W Q,
    those writing it Q^T W, the embeddings E Q; the output layer is untied from them."""
    candidate = copy.deepcopy(model)
    width = candidate.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    turn, _ = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))

    def reading(linear: nn.Linear, norm_weight: torch.Tensor) -> None:
        weight = linear.weight.double() * norm_weight.double()
        linear.weight = nn.Parameter((weight @ turn).to(linear.weight.dtype), requires_grad=False)

    def writing(linear: nn.Linear) -> None:
        weight = turn.T @ linear.weight.double()
        linear.weight = nn.Parameter(weight.to(linear.weight.dtype), requires_grad=False)
        if linear.bias is not None:
            bias = (linear.bias.double() @ turn).to(linear.bias.dtype)
            linear.bias = nn.Parameter(bias, requires_grad=False)

    def unweighted(norm: nn.Module) -> torch.Tensor:
        weight = norm.weight.detach().clone()
        norm.weight = nn.Parameter(torch.ones_like(weight), requires_grad=False)
        return weight

    with torch.no_grad():
        inner = candidate.model
        head = candidate.get_output_embeddings()
        # A new Parameter each for the embeddings and (below) the output layer unties them.
        embeddings = inner.embed_tokens.weight.double() @ turn
        inner.embed_tokens.weight = nn.Parameter(embeddings.to(head.weight.dtype), requires_grad=False)
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            weight = unweighted(layer.input_layernorm)
            for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
                reading(linear, weight)
            writing(attention.o_proj)
            weight = unweighted(layer.post_attention_layernorm)
            for linear in (mlp.gate_proj, mlp.up_proj):
                reading(linear, weight)
            writing(mlp.down_proj)
        reading(head, unweighted(inner.norm))
    candidate.config.tie_word_embeddings = False
    return candidate


def _prompts(numbers: range) -> tuple[list[Any], list[str]]:
    """The search half's examples numbered so, and their 10-document prompts (gold in the middle)."""
    from rag_mspoe.eval.data.loaders import load_qa
    from rag_mspoe.eval.data.prompts import qa_prompt
    from rag_mspoe.eval.data.records import with_gold_at

    examples = load_qa(DATA)[numbers.start : numbers.stop]
    return examples, [qa_prompt(with_gold_at(example, GOLD_POSITION)) for example in examples]


def drift(model: Any, candidate: Any, tokenizer: Any, numbers: range) -> dict[str, Any]:
    """The gold answer's log-likelihood per token, bf16 against the candidate, and their seconds."""
    from rag_mspoe.engine import Engine

    engines = {
        "bf16": Engine(model, tokenizer, method="none"),
        "w8a8": Engine(candidate, tokenizer, method="none"),
    }
    per_token: dict[str, list[float]] = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    examples, prompts = _prompts(numbers)
    for number, (example, prompt) in enumerate(zip(examples, prompts, strict=True)):
        for name in list(engines) if number % 2 == 0 else list(reversed(engines)):
            started = time.perf_counter()
            total, tokens = engines[name].score_continuations(prompt, [example.answers[0]])[0]
            seconds[name] += time.perf_counter() - started
            per_token[name].append(total / tokens)
        print(f"drift, prompt {number + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    moved = [abs(a - b) for a, b in zip(per_token["w8a8"], per_token["bf16"], strict=True)]
    return {
        "prompts": len(prompts),
        "mean_outlier_columns": _mean_outlier_columns(candidate),
        "mean_abs_loglik_diff_per_token": round(statistics.fmean(moved), 4),
        "max_abs_loglik_diff_per_token": round(max(moved), 4),
        "abs_loglik_diff_per_token": [round(value, 4) for value in moved],
        "seconds": {name: round(s, 1) for name, s in seconds.items()},
        "w8a8_speedup": round(seconds["bf16"] / seconds["w8a8"], 2),
    }


def smoothing_factors(
    model: Any, tokenizer: Any, prompts: list[str], alpha: float
) -> dict[str, torch.Tensor]:
    """Per Linear layer, SmoothQuant's per-input-channel factors from its inputs on `prompts`."""
    largest: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            seen = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
            largest[name] = torch.maximum(largest[name], seen) if name in largest else seen

        return hook

    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    handles = [m.register_forward_pre_hook(record(name)) for name, m in linears.items()]
    try:
        with torch.inference_mode():
            for prompt in prompts:
                model(prompt_ids(tokenizer, prompt), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    tiny = torch.finfo(torch.float32).tiny
    return {
        name: (
            largest[name].clamp(min=tiny).pow(alpha)
            / linear.weight.detach().float().abs().amax(0).clamp(min=tiny).pow(1 - alpha)
        ).clamp(min=1e-5)
        for name, linear in linears.items()
        if name in largest
    }


def _mean_outlier_columns(model: Any) -> float | None:
    """Input columns per W8A8 call that multiplied in bf16, on average (None: no threshold)."""
    counts = [n for m in model.modules() if isinstance(m, Int8ActivationLinear) for n in m.outlier_columns]
    return round(statistics.fmean(counts), 1) if counts else None


def milliseconds(call: Callable[[], Any], repeats: int = 5) -> float:
    """Mean milliseconds a call takes over `repeats` calls, after one to warm up."""
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e3


if __name__ == "__main__":
    main()
