"""PINE's gold answer log-likelihood with the gold first and fifth, with and without the
documents' numbers, on the first questions of a lost-in-the-middle file.

    python pine_numbering_probe.py float32 ../nq10-split/validation-10.jsonl.gz 3 [MODEL [METHOD]]

MODEL defaults to qwen2.5-coder-1.5b-instruct, METHOD to pine (pine:1 for a smooth sort). In
float64 PINE is exactly order-invariant, so the moves without numbers are ~0 and those with
numbers are the numbering's alone.

A probe, not part of the package: it calls the engine directly.
"""

import sys

from rag_mspoe import Engine
from rag_mspoe.eval.data.loaders import load_qa
from rag_mspoe.eval.data.prompts import QA_ANSWER_CUE, QA_INSTRUCTION, prompt_message
from rag_mspoe.eval.data.records import QAExample, with_gold_at
from rag_mspoe.prompts.document_prompts import document_message, lines_with_spans


def prompt(example: QAExample, numbered: bool) -> list[dict[str, object]]:
    """The sweep's prompt, or the same with every document called just 'Document'."""
    if numbered:
        return prompt_message(example)
    lines = [f"Document (Title: {d.title}) {d.text}" for d in example.documents]
    text, spans = lines_with_spans(f"{QA_INSTRUCTION}\n\n", lines)
    return [document_message(f"{text}\n\nQuestion: {example.question}\n{QA_ANSWER_CUE}", spans)]


def main(
    dtype: str, path: str, count: int, model: str = "qwen2.5-coder-1.5b-instruct", method: str = "pine"
) -> None:
    wide = dtype == "float64"  # not an engine dtype: load fp32, then widen the weights
    engine = Engine.load(model, method=method, dtype="float32" if wide else dtype, threads=2)
    if wide:
        engine.model.double()
    for example in load_qa(path)[:count]:
        row = []
        for numbered in (True, False):
            first, fifth = (
                engine.score_continuations(
                    prompt(with_gold_at(example, position), numbered), [example.answers[0]]
                )[0][0]
                for position in (0, 4)
            )
            row.append(
                f"{'numbered' if numbered else 'unnumbered'} {first:.4f} {fifth:.4f} "
                f"moved {fifth - first:+.4f}"
            )
        print(example.id, " | ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
