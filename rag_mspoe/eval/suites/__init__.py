"""Long-context suites (LongBench, ZeroSCROLLS formats) and a knowledge check (MMLU format)."""
