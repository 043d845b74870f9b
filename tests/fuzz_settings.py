"""The fuzzers' shared hypothesis settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("RAG_MSPOE_FUZZ_EXAMPLES", "150"))
# CI draws the same cases every run (a failure there is a bug, not luck); benchmarks/fuzz.py sets
# the number of draws and a new seed each round.
fuzzed = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="RAG_MSPOE_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)
