"""Device and dtype choice: resolution, the errors users see before any weights load, and the options
reaching `load_model` from every command and adapter."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
import transformers
from tiny_models import tiny_config, tiny_model, tiny_tokenizer

from rag_mspoe import DeviceError, load_model
from rag_mspoe.cli import build_parser, main
from rag_mspoe.models import devices, quantization
from rag_mspoe.models.command_options import (
    DTYPE_CHOICES,
    QUANTIZE_CHOICES,
    engine_options,
    model_load_options,
)


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend torch sees `count` GPUs with `free` bytes each and bf16 as asked."""

    def install(count: int = 1, free: int = 80 * devices.GIB, bf16: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4" if not bf16 else "H100")
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))

    return install


def test_auto_picks_the_cpu_without_a_gpu_and_the_gpu_with_one(monkeypatch, fake_gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")
    assert devices.resolve_device(None) == torch.device("cpu")
    fake_gpus()
    assert devices.resolve_device("auto") == torch.device("cuda", 0)
    assert devices.resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16


def test_cpu_default_dtype_is_unchanged():
    expected = torch.bfloat16 if devices._CPU_BF16 else torch.float32
    assert devices.resolve_dtype(None, torch.device("cpu")) == expected
    assert devices.resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    assert devices.resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16


def test_asking_for_a_gpu_that_is_not_there_names_the_fix(monkeypatch, fake_gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"sees no CUDA device.*--device cpu"):
        devices.resolve_device("cuda")
    fake_gpus(count=2)
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"has 2 GPU\(s\), cuda:0 to cuda:1"):
        devices.resolve_device("cuda:2")
    with pytest.raises(DeviceError, match="cuda or cuda:N"):
        devices.resolve_device("cuda:x")
    with pytest.raises(DeviceError, match="auto, cpu, cuda, cuda:N"):
        devices.resolve_device("tpu")


def test_a_dtype_the_device_cannot_compute_is_refused(fake_gpus):
    fake_gpus(bf16=False)
    gpu = torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"Tesla T4 cannot compute bfloat16.*--dtype float16"):
        devices.resolve_dtype("bfloat16", gpu)
    assert devices.resolve_dtype(None, gpu) == torch.float16
    with pytest.raises(DeviceError, match="dtype 'int8' is not supported"):
        devices.resolve_dtype("int8", torch.device("cpu"))


def test_weights_are_counted_without_allocating_them():
    config = tiny_config("llama")
    params = sum(p.numel() for p in tiny_model("llama").parameters())
    assert devices.weight_bytes(config, torch.bfloat16) == 2 * params
    assert devices.weight_bytes(config, torch.float32) == 4 * params


def test_a_model_larger_than_the_memory_is_refused_or_spread_over_gpus(monkeypatch, fake_gpus):
    config = tiny_config("llama")
    needed = devices.weight_bytes(config, torch.bfloat16)
    fake_gpus(count=1, free=needed // 2)
    with pytest.raises(DeviceError, match=r"need .* GiB in bfloat16, but cuda:0 \(H100\) has .* GiB free"):
        devices.place(config, "cuda", "bfloat16")
    fake_gpus(count=2, free=needed * 3 // 4)
    assert devices.place(config, "auto", "bfloat16").device_map == "auto"
    with pytest.raises(DeviceError):  # one named GPU is never spread over others
        devices.place(config, "cuda:0", "bfloat16")
    fake_gpus(count=1, free=needed * 4)
    one_gpu = devices.Placement(torch.device("cuda", 0), torch.bfloat16)
    assert devices.place(config, "cuda", "bfloat16") == one_gpu
    monkeypatch.setattr(devices, "free_memory", lambda device: needed // 2)
    with pytest.raises(DeviceError, match="RAM has .* or float16/bfloat16"):
        devices.place(config, "cpu", "float32")


def test_load_model_honours_device_and_dtype_and_fails_before_loading_weights(model_folder, monkeypatch):
    model, _ = load_model(model_folder, device="cpu", dtype="float32")
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    model, _ = load_model(model_folder, device="auto", dtype="bfloat16")
    assert model.dtype == torch.bfloat16

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the device was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(no_loading))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="--device cpu"):
        load_model(model_folder, device="cuda")
    monkeypatch.setattr(devices, "free_memory", lambda device: 1024)
    with pytest.raises(DeviceError, match="RAM has 0.0 GiB free"):
        load_model(model_folder, device="cpu")


def _model_commands(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> dict[str, Any]:
    """Every (sub)command that takes --model, by its full name ("calibrate heads")."""
    found = {}
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                if any("--model" in a.option_strings for a in command._actions):
                    found[prefix + name] = command
                found.update(_model_commands(command, f"{prefix}{name} "))
    return found


def test_every_command_that_loads_a_model_takes_device_and_dtype():
    commands = _model_commands()
    assert {"ask", "demo", "serve", "sweep", "suite", "harness", "perplexity", "e2e"} <= set(commands)
    assert {"calibrate layers", "calibrate heads", "calibrate hidden"} <= set(commands)
    for name, command in commands.items():
        options = {o for action in command._actions for o in action.option_strings}
        assert {"--device", "--dtype", "--threads", "--quantize"} <= options, name
        dtype_action = next(a for a in command._actions if "--dtype" in a.option_strings)
        assert tuple(dtype_action.choices) == DTYPE_CHOICES == devices.DTYPE_CHOICES, name
        quantize_action = next(a for a in command._actions if "--quantize" in a.option_strings)
        assert tuple(quantize_action.choices) == QUANTIZE_CHOICES == quantization.QUANTIZE_CHOICES, name


def test_engine_commands_take_compile():
    commands = _model_commands()
    for name in ("ask", "demo", "serve"):  # the commands that generate through one engine
        options = {o for action in commands[name]._actions for o in action.option_strings}
        assert "--compile" in options, name
    args = build_parser().parse_args(["serve", "--compile", "off", "--device", "cpu"])
    assert engine_options(args) == {
        "device": "cpu",
        "dtype": None,
        "threads": None,
        "quantize": "auto",  # answering: the model's measured scheme (load_model resolves it)
        "compile": False,
    }
    args = build_parser().parse_args(["sweep", "--out", "run", "--device", "cpu", "--quantize", "int4"])
    assert model_load_options(args)["quantize"] == "int4"
    # Evaluations read the model as it is unless told otherwise: their numbers are published.
    assert model_load_options(build_parser().parse_args(["sweep", "--out", "run"]))["quantize"] is None


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--out", "{tmp}/run", "--samples", "1", "--documents", "3", "--no-progress"],
        ["perplexity", "{tmp}/book.txt", "--lengths", "64", "--out", "{tmp}/ppl", "--no-progress"],
        ["serve", "--port", "0"],
    ],
    ids=["sweep", "perplexity", "serve"],
)
def test_the_device_option_reaches_load_model(argv, tmp_path, monkeypatch, capsys, fake_gpus):
    fake_gpus(count=2)
    (tmp_path / "book.txt").write_text("Once upon a time. " * 100)
    seen = {}

    def fake_load(source=None, **kwargs):
        seen.update(kwargs)
        raise DeviceError("stop here")

    monkeypatch.setattr("rag_mspoe.load_model", fake_load)
    monkeypatch.setattr("rag_mspoe.models.loading.load_model", fake_load)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = main([*argv, "--device", "cuda:1", "--dtype", "float16", "--threads", "1"])
    assert code == 1 and "stop here" in capsys.readouterr().err
    quantize = "auto" if argv[0] == "serve" else None  # answering commands take the model's scheme
    assert seen == {"device": "cuda:1", "dtype": "float16", "threads": 1, "quantize": quantize}


def test_a_missing_gpu_fails_before_any_long_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["ask", "What is it?", "--index", str(tmp_path / "no-index"), "--device", "cuda"])
    assert code == 1 and "sees no CUDA device" in capsys.readouterr().err  # not the missing index


def test_adapters_take_device_and_dtype(model_folder, monkeypatch):
    pytest.importorskip("langchain_core")
    from rag_mspoe.connectors.langchain import ChatRagMsPoE

    chat = ChatRagMsPoE(source=str(model_folder), device="cpu", dtype="float32")
    assert chat.engine.model.dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        ChatRagMsPoE(source=str(model_folder), device="cuda")


def test_gpu_benchmark_refuses_without_cuda_and_says_what_to_do():
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the benchmark would run")
    script = Path(__file__).parents[1] / "benchmarks" / "bench_gpu.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "measures on a CUDA GPU" in done.stderr and "--smoke" in done.stderr


def test_int8_on_a_gpu_fails_before_any_long_work(tmp_path, monkeypatch, capsys, fake_gpus):
    fake_gpus()
    monkeypatch.setattr("rag_mspoe.models.loading.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code = main(["ask", "What is it?", "--index", str(tmp_path / "no-index"), "--quantize", "int8"])
    error = capsys.readouterr().err
    assert code == 1 and "runs on the CPU only" in error and "--device cpu" in error  # not the missing index
