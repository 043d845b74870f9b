"""method="auto": the config shipped for a model, on the prompts of the document counts it was
validated at, and the unmodified model on the others (no ranking pass run for them); "none" where
no config ships. Configs are written to a temporary folder put on the search path."""

from __future__ import annotations

import json
import warnings

import pytest
from attention_helpers import DOCUMENTS, QUESTION
from eval_run_helpers import tiny_chat_model
from forward_counts import counted_forwards

from rag_mspoe import calibrated as calibrated_configs
from rag_mspoe.engine import Engine
from rag_mspoe.methods import (
    AUTO,
    InvariantReorder,
    LayerWise,
    WhereValidated,
    method_name,
    parse_method,
    validated_documents,
)
from rag_mspoe.methods.method_config import MethodConfig
from rag_mspoe.methods.validated_documents import NoQuestionAfterDocuments, UnvalidatedDocumentCount
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

RANKING = InvariantReorder(score="question")
SETTINGS = {"max_new_tokens": 4}


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty folder searched instead of the package's; `ship(config, counts)` writes the tiny
    model's config into it."""
    monkeypatch.setattr(calibrated_configs, "SEARCH_PATH", [tmp_path])

    def ship(config: MethodConfig, counts: list[int] | None) -> None:
        path = config.save(tmp_path / "tiny-llama.json", base_model="tiny-llama")
        if counts is not None:
            path.write_text(json.dumps({**json.loads(path.read_text()), "validated_documents": counts}))

    return ship


@pytest.fixture(autouse=True)
def nothing_said_yet(monkeypatch):
    """Each test sees the warnings said once per document count afresh."""
    monkeypatch.setattr(validated_documents, "_warned", set())


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny_chat_model()  # named "tiny-llama", as load_model names a model
    return Engine(model, tokenizer, method="none")


def qa(count: int) -> str:
    # The documents in an order the ranking changes: the gold one (France) last.
    return render_qa_prompt(QUESTION, [DOCUMENTS[i] for i in (0, 2, 3, 1)[-count:]])[0]


def test_auto_is_the_shipped_reordering_where_validated_and_none_where_nothing_ships(shipped):
    assert parse_method(AUTO, "tiny-llama") is None
    shipped(RANKING, [3])
    auto = parse_method(AUTO, "tiny-llama")
    assert isinstance(auto, WhereValidated) and auto.shipped == RANKING and auto.counts == (3,)
    assert method_name(auto) == "auto"
    assert auto != parse_method("calibrated", "tiny-llama")  # batched apart from it by the server
    assert MethodConfig.from_dict(json.loads(json.dumps(auto.to_dict()))) == auto
    assert MethodConfig.from_dict(auto.to_dict()).counts == (3,)
    with pytest.raises(ValueError, match="'auto' is the config calibrated for one model"):
        parse_method(AUTO)


def test_a_shipped_config_that_cannot_be_applied_per_prompt_is_applied_as_calibrated_is(shipped):
    rescaling = LayerWise(factors=[1.0, 1.2, 1.4, 1.1])
    shipped(rescaling, [3])
    assert parse_method(AUTO, "tiny-llama") == rescaling  # one method a batch: warned per count
    shipped(RANKING, None)
    assert parse_method(AUTO, "tiny-llama") == RANKING  # no counts recorded: nothing to choose by
    with pytest.raises(TypeError, match="wraps a method that rewrites prompts"):
        WhereValidated(shipped=rescaling)
    with pytest.raises(ValueError, match="records no validated document counts"):
        WhereValidated(shipped=RANKING)


def test_auto_reorders_validated_prompts_and_reads_the_others_as_given(shipped, engine):
    shipped(RANKING, [3])
    calibrated = engine.generate(qa(3), method="calibrated", **SETTINGS)
    assert calibrated.documents_read is not None and calibrated.documents_read[0] != 0  # it moved one
    assert engine.generate(qa(3), method=AUTO, **SETTINGS).text == calibrated.text
    assert engine.generate(qa(3), method=AUTO, **SETTINGS).documents_read == calibrated.documents_read

    unmodified, plain = counted_forwards(engine, lambda: engine.generate(qa(4), method="none", **SETTINGS))
    said = "'auto' answered a prompt of 4 documents with the unmodified model: .* on prompts of 3 documents"
    with pytest.warns(UnvalidatedDocumentCount, match=said):
        answer, counts = counted_forwards(engine, lambda: engine.generate(qa(4), method=AUTO, **SETTINGS))
    assert answer.text == unmodified.text and answer.documents_read is None
    assert counts == plain  # no ranking pass: the prompt was read once, as without a method
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnvalidatedDocumentCount)  # said once per document count
        engine.generate(qa(4), method=AUTO, **SETTINGS)
    with pytest.warns(UnvalidatedDocumentCount, match="It may help less there, or hurt"):
        engine.generate(qa(4), method="calibrated", **SETTINGS)  # asked for: it runs, and says so


def asked_first(count: int) -> str:
    """`qa(count)` with its question before the documents, as LangChain's tutorial prompt asks."""
    asked = f"\n\nQuestion: {QUESTION}"
    moved = qa(count).replace(f"{asked}\nAnswer:", "\nAnswer:")
    return moved.replace("\n\nDocument [1]", f"{asked}\n\nDocument [1]")


def test_auto_reads_a_prompt_that_asks_before_its_documents_as_given(shipped, engine):
    # The shipped reorderings rank by the text after the documents; here only 'Answer:' follows.
    shipped(RANKING, [3])
    prompt = asked_first(3)
    assert prompt.index(QUESTION) < prompt.index("Document [1]") and prompt.endswith("\nAnswer:")
    unmodified, plain = counted_forwards(engine, lambda: engine.generate(prompt, method="none", **SETTINGS))
    _, ranked = counted_forwards(engine, lambda: engine.generate(prompt, method="calibrated", **SETTINGS))
    assert ranked != plain  # asked for, the ranking pass runs
    with pytest.warns(NoQuestionAfterDocuments, match="only 'Answer:' follows its documents"):
        answer, counts = counted_forwards(engine, lambda: engine.generate(prompt, method=AUTO, **SETTINGS))
    assert answer.text == unmodified.text and answer.documents_read is None
    assert counts == plain  # no ranking pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoQuestionAfterDocuments)  # said once
        assert engine.generate(prompt, method=AUTO, **SETTINGS).text == unmodified.text
    # The question in a message after the documents' follows them: ranked, as "calibrated" ranks.
    instruction, documents = qa(3).split(f"\n\nQuestion: {QUESTION}")[0].split("\n\n", 1)
    chat = [
        {"role": "system", "content": f"{instruction}\n\n{documents}"},
        {"role": "user", "content": QUESTION},
    ]
    calibrated = engine.generate(chat, method="calibrated", **SETTINGS)
    assert calibrated.documents_read is not None
    auto = engine.generate(chat, method=AUTO, **SETTINGS)
    assert (auto.text, auto.documents_read) == (calibrated.text, calibrated.documents_read)


def test_auto_chooses_per_prompt_within_a_batch_and_a_stream(shipped, engine):
    shipped(RANKING, [3])
    batch = engine.generate_batch([qa(3), qa(4)], method=AUTO, **SETTINGS)
    assert batch[0].text == engine.generate(qa(3), method="calibrated", **SETTINGS).text
    assert batch[0].documents_read is not None
    assert batch[1].text == engine.generate(qa(4), method="none", **SETTINGS).text
    assert batch[1].documents_read is None
    stream = engine.stream(qa(3), method=AUTO, **SETTINGS)
    assert "".join(stream) == batch[0].text and stream.result.documents_read == batch[0].documents_read


def test_the_server_offers_auto_where_a_config_ships(shipped, engine):
    pytest.importorskip("fastapi")
    from rag_mspoe.connectors.server import ModelRoutes

    assert "tiny-llama+auto" not in ModelRoutes(engine).names()
    shipped(RANKING, [3])
    assert ModelRoutes(engine).method_for("tiny-llama+auto") == parse_method(AUTO, "tiny-llama")


def test_a_server_defaulting_to_auto_reorders_only_requests_of_validated_counts(shipped, engine):
    pytest.importorskip("fastapi")
    import httpx
    from server_helpers import running

    from rag_mspoe.connectors import document_finder
    from rag_mspoe.connectors.server import create_app

    shipped(RANKING, [3])
    served = Engine(engine.model, engine.tokenizer, method=AUTO)  # as `rag-mspoe serve` loads it
    with running(create_app(served, max_tokens_limit=8)) as url:

        def chat(content: str) -> dict:
            body = {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 4,
                "temperature": 0,
            }
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]

        reordered = engine.generate([{"role": "user", "content": qa(3)}], method="calibrated", **SETTINGS)
        assert chat(qa(3))["documents_read"] == list(reordered.documents_read)
        as_given = chat(qa(4))
        assert as_given["documents_read"] == [0, 1, 2, 3]
        unmodified = engine.generate([{"role": "user", "content": qa(4)}], method="none", **SETTINGS)
        assert as_given["message"]["content"] == unmodified.text
        with warnings.catch_warnings():
            warnings.simplefilter("error", document_finder.NoDocumentsFound)  # none expected
            assert chat("Where is Paris?")["documents_read"] == []
        completion = {"model": "tiny-llama", "prompt": "Where is Paris?", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=completion, timeout=60)
        assert reply.status_code == 200  # a plain text prompt: answered, not refused for its spans


def test_auto_answers_a_prompt_that_does_not_say_where_its_documents_are_as_given(shipped, engine):
    # A plain completion prompt or chat: no 'Document [i]' lines, no document_spans. A method that
    # must find documents refuses it; "auto" cannot tell the count, so nothing validated applies.
    shipped(RANKING, [3])
    for prompt, raw in (
        ("Paris is in France. Where is Paris?", True),
        ([{"role": "user", "content": "hi"}], False),
    ):
        answer = engine.generate(prompt, raw=raw, method=AUTO, **SETTINGS)
        assert answer.text == engine.generate(prompt, raw=raw, method="none", **SETTINGS).text
        assert answer.documents_read is None
        assert "".join(engine.stream(prompt, raw=raw, method=AUTO, **SETTINGS)) == answer.text
        with pytest.raises(MissingDocumentSpans):
            engine.generate(prompt, raw=raw, method="calibrated", **SETTINGS)
