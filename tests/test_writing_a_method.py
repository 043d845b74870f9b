"""The method of docs/writing-a-method.md, defined by running the page's code and nothing else,
reaches the engine and an evaluation sweep: a document-reading method needs its own module only."""

from __future__ import annotations

import pytest
from eval_run_helpers import tiny_chat_model
from test_docs import python_blocks

from rag_mspoe.engine import Engine
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep
from rag_mspoe.methods.method_spec import parse_method
from rag_mspoe.methods.registry import METHODS

PAGE = "docs/writing-a-method.md"
DOCUMENTS = (
    "Document [1] Paris is in France.\nDocument [2] Rome is in Italy.\nDocument [3] Oslo is in Norway."
)


@pytest.fixture(scope="module")
def reverse_order():
    # The page's module, compiled as a file of its own (not under this file's __future__ imports):
    # the class, defined and so registered.
    namespace: dict[str, object] = {"__name__": "reverse_order"}
    exec(compile(python_blocks(PAGE)[0], PAGE, "exec", dont_inherit=True), namespace)
    yield namespace["ReverseOrder"]
    del METHODS["reverse-order"]  # other test files must not meet it


def test_the_spec_language_knows_it(reverse_order):
    assert parse_method("reverse-order") == reverse_order()
    assert reverse_order().reorders_documents() and reverse_order().rewrites_prompt()


def test_the_engine_reads_the_documents_reversed(reverse_order):
    engine = Engine(*tiny_chat_model(), method="none")
    prompt = f"{DOCUMENTS}\n\nWhich city is in Norway?"

    answer = engine.generate(prompt, max_new_tokens=4, method="reverse-order")
    _, (read,) = engine.rewritten([prompt], method="reverse-order")

    assert answer.documents_read == (2, 1, 0) and answer.method == "reverse-order"
    assert read[0]["content"].startswith("Document [1] Oslo is in Norway.\nDocument [2] Rome")
    plain = engine.generate(read, max_new_tokens=4, method="none")  # the unmodified model on it
    assert answer.text == plain.text


def test_a_sweep_records_where_the_gold_went(reverse_order, tmp_path):
    config = SweepConfig(
        num_documents=3, positions=(0, 2), methods=("none", "reverse-order"), samples=1, metrics=("loglik",)
    )
    model, tokenizer = tiny_chat_model()
    run_sweep(config, tmp_path, model=model, tokenizer=tokenizer, progress=False, report=False)

    records = read_records(tmp_path / "results.jsonl")
    reversed_records = {r["position"]: r for r in records if r["method"] == "reverse-order"}
    assert {p: r["prompt_position"] for p, r in reversed_records.items()} == {0: 2, 2: 0}
    assert all(r["documents_read"] == [2, 1, 0] for r in reversed_records.values())
    assert len([r for r in records if r["method"] == "none"]) == 2
