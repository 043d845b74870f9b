"""A position-bias sweep of an embedded model's GGUF file served by llama.cpp (llama-cpp-python's
server), through `rag-mspoe sweep --endpoint`: the same questions, records and report as a sweep
of our own model.

    pip install "llama-cpp-python[server]"      # builds llama.cpp from source; not a dependency
    python benchmarks/sweep_llama_cpp.py --samples 20 --out runs/llama-cpp-0.5b
    rag-mspoe report runs/llama-cpp-0.5b

It joins the GGUF file from the embedded model's parts (as bench_llama_cpp.py does), starts

    python benchmarks/llama_cpp_server.py --model FILE --model_alias NAME --n_ctx 4096 --n_threads T --port P

(llama-cpp-python's server, its weights left in llama.cpp's plain layout: see that file), asks
it once whether it scores a prompt's own tokens (`has_prompt_logprobs`), prints what it
found, and sweeps the methods that can run there (`none`, and `invariant-reorder` only where
prompts are scored) with `--metrics generate`, the model's own tokenizer rendering the chat
template. The server stops at the end; its log is `llama-server.log` in the run folder. Rerun the
same command to resume a stopped run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench_llama_cpp import joined_gguf

DATA = "docs/results/nq10-split/validation-10.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an embedded model's name")
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--positions", default="0,4,9")
    parser.add_argument("--methods", nargs="+", default=["none", "invariant-reorder"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with joined_gguf(args.model) as gguf, (out / "llama-server.log").open("a") as log:
        alias = gguf.stem
        command = [
            sys.executable, str(Path(__file__).with_name("llama_cpp_server.py")),
            "--model", str(gguf), "--model_alias", alias,
            "--n_ctx", "4096", "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--host", "127.0.0.1", "--port", str(args.port),
        ]  # fmt: skip
        print("$", " ".join(command), file=sys.stderr)
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{args.port}/v1"
            wait_until_up(url, server)
            methods = runnable(url, alias, args.methods)
            sweep = [
                "rag-mspoe", "sweep", "--endpoint", url, "--model", alias, "--tokenizer", args.model,
                "--data", args.data, "--documents", str(args.documents), "--positions", args.positions,
                "--samples", str(args.samples), "--methods", *methods, "--metrics", "generate",
                "--max-new-tokens", str(args.max_new_tokens), "--concurrency", "1", "--out", str(out),
            ]  # fmt: skip
            print("$", " ".join(sweep), file=sys.stderr)
            subprocess.run(sweep, check=True)
        finally:
            server.terminate()
            server.wait(timeout=30)


def wait_until_up(url: str, server: subprocess.Popen[bytes], seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"llama-cpp-python's server exited with code {server.returncode}; see llama-server.log.")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    sys.exit(f"llama-cpp-python's server did not answer at {url} within {seconds:.0f} s.")


def runnable(url: str, alias: str, methods: list[str]) -> list[str]:
    """The methods that can run against the server, by what one probe finds (printed)."""
    from rag_mspoe.engine.remote_client import Endpoint, RemoteClient, has_prompt_logprobs

    scores = has_prompt_logprobs(RemoteClient(Endpoint(url, alias)))
    print(
        f"probe: {url} {'scores' if scores else 'does not score'} a prompt's own tokens "
        "(echo with logprobs, the greedy token the likeliest of its step)",
        file=sys.stderr,
    )
    kept = [m for m in methods if scores or not m.startswith("invariant-reorder")]
    if kept != methods:
        left_out = sorted(set(methods) - set(kept))
        print(f"probe: left out {left_out}, which rank by prompt scores", file=sys.stderr)
    return kept


if __name__ == "__main__":
    main()
