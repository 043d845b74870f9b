"""Does the documents' numbering pull PINE's level down? Gold answer log-likelihood of the
unmodified model (gold first and fifth) and of PINE (gold fifth), each with the benchmark's
`Document [i]` numbers and without them, on the first questions of a lost-in-the-middle file.

    python pine_level_probe.py ../nq10-split/search-10.jsonl.gz 16 [MODEL [THREADS]]

Why it might: PINE re-places every document by its importance, so with numbers the model reads
'Document [7]' before 'Document [2]', a layout no prompt it was trained on has. Without numbers
the re-placed prompt is an ordinary one.

A probe, not part of the package: it calls the engine directly. One line per question, as it
goes, then the means.
"""

import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "nq10-1.5b-em"))

from pine_numbering_probe import prompt  # noqa: E402  (the sibling probe's two layouts)

from rag_mspoe import Engine  # noqa: E402
from rag_mspoe.eval.data.loaders import load_qa  # noqa: E402
from rag_mspoe.eval.data.records import with_gold_at  # noqa: E402

COLUMNS = [  # (method, numbered, gold position)
    ("none", True, 0),
    ("none", True, 4),
    ("none", False, 0),
    ("none", False, 4),
    ("pine", True, 4),
    ("pine", False, 4),
]


def main(path: str, count: int, model: str = "qwen2.5-coder-0.5b-instruct", threads: str = "1") -> None:
    engine = Engine.load(model, method="none", threads=int(threads))
    names = [
        f"{method}-{'numbered' if numbered else 'plain'}-{gold + 1}" for method, numbered, gold in COLUMNS
    ]
    print("# question", " ".join(names), flush=True)
    rows = []
    for example in load_qa(path)[:count]:
        row = [
            engine.score_continuations(
                prompt(with_gold_at(example, gold), numbered), [example.answers[0]], method=method
            )[0][0]
            for method, numbered, gold in COLUMNS
        ]
        rows.append(row)
        print(example.id, " ".join(f"{value:.3f}" for value in row), flush=True)
    print("# mean", " ".join(f"{mean(column):.3f}" for column in zip(*rows, strict=True)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:5])
