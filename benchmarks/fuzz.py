"""The fuzzers of tests/test_fuzz_properties.py and tests/test_fuzz_api.py, run long: rounds of
many draws each, every round from a new random seed, until the time given is spent.

    python benchmarks/fuzz.py --minutes 30
    python benchmarks/fuzz.py --minutes 30 --examples 2000 --findings fuzz-findings.txt

CI runs each property with 150 draws (about a minute in all); this runs them by the thousand.
Each round is one pytest run (a real `rag-mspoe serve` on loopback, restarted per round); a
failing property is printed with hypothesis's smallest failing example and the seed that
reproduces it (`pytest --hypothesis-seed=SEED ...`). Exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_fuzz_properties.py", "tests/test_fuzz_api.py"]


def one_round(examples: int, seed: int, timeout_s: float) -> tuple[bool, str, float]:
    """Whether every fuzzer passed, pytest's output, and the seconds it took."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--hypothesis-seed={seed}",
        *TESTS,
    ]
    env = {**os.environ, "RAG_MSPOE_FUZZ_EXAMPLES": str(examples), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        return (
            False,
            f"round timed out after {timeout_s:.0f} s\n{expired.stdout or ''}",
            time.monotonic() - started,
        )
    return done.returncode == 0, done.stdout + done.stderr, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30, help="time to fuzz for (default 30)")
    parser.add_argument("--examples", type=int, default=1000, help="draws per property per round")
    parser.add_argument("--findings", type=Path, default=None, help="also write each failing round here")
    args = parser.parse_args()

    deadline = time.monotonic() + args.minutes * 60
    rounds, failed, spent = 0, 0, 0.0
    while time.monotonic() < deadline:
        seed = random.SystemRandom().randrange(2**32)
        ok, output, seconds = one_round(args.examples, seed, timeout_s=max(600.0, args.minutes * 60))
        rounds, spent = rounds + 1, spent + seconds
        summary = re.findall(r"^\d+ (?:passed|failed).*$", output, re.MULTILINE)
        print(
            f"round {rounds} (seed {seed}, {seconds:.0f} s): {summary[-1] if summary else 'no summary'}",
            flush=True,
        )
        if not ok:
            failed += 1
            report = f"--- round {rounds}, seed {seed}\n{output[-20000:]}\n"
            print(report, flush=True)
            if args.findings is not None:
                with args.findings.open("a") as handle:
                    handle.write(report)
    print(f"{rounds} rounds of {args.examples} draws per property in {spent / 60:.1f} min; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
