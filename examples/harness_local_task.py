"""lm-evaluation-harness on a rescaled model, with a task defined in a local YAML file.

Writes an MMLU-format knowledge file (general questions: capitals, sums,
opposites), a harness task over it, and runs that task under the unmodified model and each
method, one table at the end. Offline; about a minute on a laptop CPU.

    pip install ".[harness]" && python examples/harness_local_task.py [--methods none pi mspoe layerwise]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rag_mspoe.eval.harness import HarnessConfig, run_harness
from rag_mspoe.eval.suites.data import write_suite_data

TASK_YAML = """\
task: general_knowledge
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/harness-local", help="run folder (resumed if it exists)")
    parser.add_argument("--methods", nargs="+", default=["none", "pi", "mspoe", "layerwise"])
    parser.add_argument("--questions", type=int, default=60)
    args = parser.parse_args()

    out = Path(args.out).resolve()
    files = write_suite_data(out / "data", examples=max(1, args.questions // 3))
    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "general_knowledge.yaml").write_text(TASK_YAML.format(data=files["mmlu"]))
    config = HarnessConfig(tasks=("general_knowledge",), methods=tuple(args.methods), include_path=str(tasks))
    summary = run_harness(config, out / "run")
    print(summary["markdown"])


if __name__ == "__main__":
    main()
