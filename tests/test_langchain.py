"""The LangChain adapters with real LangChain objects: an LCEL chain on the embedded model, and
the mechanics (settings, stop strings, usage, async, errors) on a tiny random Llama."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, FunctionMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from pydantic import BaseModel, Field, ValidationError
from tiny_models import tiny_model

from rag_mspoe import current_method
from rag_mspoe.connectors.langchain import ChatRagMsPoE, RagMsPoELLM
from rag_mspoe.engine import Engine, GenerationTimeout
from rag_mspoe.tools.json_output import UnsupportedSchemaError

QUESTION = "Name three colours."


@pytest.fixture(scope="module")
def tiny(embedded):
    tokenizer = embedded[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, initializer_range=0.3)
    return Engine(model, tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def real(embedded):
    return Engine(*embedded)


def test_invoke_reports_usage_and_metadata_from_the_engine(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=12)
    message = chat.invoke([SystemMessage("Be brief."), HumanMessage(QUESTION)])
    expected = tiny.generate(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], max_new_tokens=12
    )
    assert message.content == expected.text
    assert message.usage_metadata == {
        "input_tokens": expected.prompt_tokens,
        "output_tokens": expected.completion_tokens,
        "total_tokens": expected.prompt_tokens + expected.completion_tokens,
    }
    assert message.response_metadata == {
        "model_name": "tiny-llama",
        "method": "none",
        "finish_reason": "length",
    }


def test_stream_gives_the_invoke_answer_piece_by_piece(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=12)
    chunks = list(chat.stream(QUESTION))
    assert len(chunks) > 2
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    invoked = chat.invoke(QUESTION)
    assert full.content == invoked.content
    assert full.usage_metadata == invoked.usage_metadata
    assert full.response_metadata["method"] == "none"
    through_stream = ChatRagMsPoE(engine=tiny, max_tokens=12, streaming=True).invoke(QUESTION)
    assert through_stream.content == invoked.content
    assert through_stream.usage_metadata == invoked.usage_metadata


def test_stop_strings_of_any_length_in_invoke_and_stream(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=20)
    full = chat.invoke(QUESTION).content
    stop = full[5:13]
    expected = full[: full.index(stop)]
    assert chat.invoke(QUESTION, stop=[stop]).content == expected
    assert "".join(c.content for c in chat.stream(QUESTION, stop=[stop])) == expected
    assert ChatRagMsPoE(engine=tiny, max_tokens=20, stop=[stop]).invoke(QUESTION).content == expected


def test_call_settings_override_the_instance(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=20, temperature=1.0, seed=3)
    sampled = chat.invoke(QUESTION)
    assert sampled.content == tiny.generate(QUESTION, max_new_tokens=20, temperature=1.0, seed=3).text
    greedy = chat.invoke(QUESTION, temperature=0, max_tokens=5)
    assert greedy.content == tiny.generate(QUESTION, max_new_tokens=5).text
    assert greedy.usage_metadata["output_tokens"] == 5


def test_method_is_a_field_and_a_call_argument_and_never_leaks(tiny):
    plain = ChatRagMsPoE(engine=tiny, max_tokens=12)
    mspoe = ChatRagMsPoE(engine=tiny, max_tokens=12, method="mspoe")
    prompt = " ".join(f"item {i}" for i in range(40))
    expected = tiny.generate(prompt, max_new_tokens=12, method="mspoe")
    for message in (
        mspoe.invoke(prompt),
        plain.invoke(prompt, method="mspoe"),
        plain.bind(method="mspoe").invoke(prompt),
    ):
        assert message.content == expected.text
        assert message.response_metadata["method"] == "mspoe"
    assert current_method(tiny.model) is None
    assert plain.invoke(prompt).content == tiny.generate(prompt, max_new_tokens=12).text


def test_async_calls_match_sync_ones_and_leave_the_loop_free(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=12)
    prompts = [QUESTION, "Why is the sky blue?", "Count to three."]
    sequential = [chat.invoke(p).content for p in prompts]

    async def streamed(prompt):
        return "".join([chunk.content async for chunk in chat.astream(prompt)])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        clock = asyncio.create_task(ticker())
        invoked = await asyncio.gather(*(chat.ainvoke(p) for p in prompts))
        streamed_texts = await asyncio.gather(*(streamed(p) for p in prompts))
        batched = await chat.abatch(prompts)
        clock.cancel()
        return invoked, streamed_texts, batched, ticks

    invoked, streamed_texts, batched, ticks = asyncio.run(main())
    assert [m.content for m in invoked] == sequential
    assert streamed_texts == sequential
    assert [m.content for m in batched] == sequential
    assert ticks > 20


def test_timeout_and_retries_while_the_model_is_busy(tiny):
    busy = threading.Event()

    def hold_the_model():
        for _ in tiny.stream(QUESTION, max_new_tokens=150):
            busy.set()

    # The timeout covers the wait and the answer: 0.05 s cannot outlast a 150-token answer (0.5-1.2
    # s); 0.2 s is shorter too, but leaves a loaded machine time for 4 tokens (about 0.03 s) once the
    # model is free, and 2,000 retries outlast the answer held.
    for retries, timeout, expect_timeout in ((0, 0.05, True), (2000, 0.2, False)):
        worker = threading.Thread(target=hold_the_model)
        busy.clear()
        worker.start()
        busy.wait(10)
        chat = ChatRagMsPoE(engine=tiny, max_tokens=4, timeout=timeout, max_retries=retries)
        if expect_timeout:
            with pytest.raises(GenerationTimeout):
                chat.invoke(QUESTION)
        else:
            assert chat.invoke(QUESTION).content == tiny.generate(QUESTION, max_new_tokens=4).text
        worker.join()


def test_text_llm_continues_plain_text_and_batches(tiny):
    llm = RagMsPoELLM(engine=tiny, max_tokens=8)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    assert llm.invoke(prompts[0]) == tiny.generate(prompts[0], raw=True, max_new_tokens=8).text
    result = llm.generate(prompts)
    singles = [tiny.generate(p, raw=True, max_new_tokens=8) for p in prompts]
    assert [g[0].text for g in result.generations] == [r.text for r in singles]
    assert result.llm_output["token_usage"] == {
        "prompt_tokens": sum(r.prompt_tokens for r in singles),
        "completion_tokens": sum(r.completion_tokens for r in singles),
        "total_tokens": sum(r.prompt_tokens + r.completion_tokens for r in singles),
    }
    assert "".join(llm.stream(prompts[1])) == singles[1].text
    templated = RagMsPoELLM(engine=tiny, max_tokens=8, use_chat_template=True)
    assert templated.invoke(QUESTION) == tiny.generate(QUESTION, max_new_tokens=8).text


def test_bad_input_is_named(tiny):
    chat = ChatRagMsPoE(engine=tiny, max_tokens=4)
    with pytest.raises(ValidationError, match="api_key"):
        ChatRagMsPoE(engine=tiny, api_key="x")
    with pytest.raises(ValueError, match="Unknown method 'bogus'"):
        ChatRagMsPoE(engine=tiny, method="bogus")
    with pytest.raises(TypeError, match=r"Unknown call argument\(s\) \['frequency_penalty'\]"):
        chat.invoke(QUESTION, frequency_penalty=1.0)
    with pytest.raises(ValueError, match="cannot switch to model 'gpt-4o'"):
        chat.invoke(QUESTION, model="gpt-4o")
    with pytest.raises(ValueError, match="FunctionMessage is not supported"):
        chat.invoke([HumanMessage("hi"), FunctionMessage("3", name="add")])
    image = {"type": "image", "url": "https://example.com/cat.png"}
    with pytest.raises(ValueError, match=r"\['image'\] is not supported: this model reads text only"):
        chat.invoke([HumanMessage(content=[{"type": "text", "text": "What is this?"}, image])])
    with pytest.raises(ValueError, match="truncate='middle'"):
        chat.invoke("word " * 400)
    cut = chat.invoke("word " * 400, truncate="middle")
    assert cut.response_metadata["truncated_tokens"] > 0


def test_structured_output_refuses_schemas_it_cannot_fill(tiny):
    basket = {"title": "Basket", "type": "object", "properties": {"fruits": {"type": "frobnicate"}}}
    with pytest.raises(UnsupportedSchemaError, match="Invalid type: frobnicate"):
        ChatRagMsPoE(engine=tiny).with_structured_output(basket)


@pytest.mark.slow
def test_lcel_chain_prompt_model_parser(real):
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You answer in one short sentence."), ("human", "What is the capital of {country}?")]
    )
    chain = prompt | ChatRagMsPoE(engine=real, max_tokens=30, method="mspoe") | StrOutputParser()
    assert "Paris" in chain.invoke({"country": "France"})
    france, italy = chain.batch([{"country": "France"}, {"country": "Italy"}])
    assert "Paris" in france and "Rome" in italy
    assert "Paris" in "".join(chain.stream({"country": "France"}))


@pytest.mark.slow
def test_structured_output_fills_a_schema_from_the_request(real):
    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(description="first name")
        age: int
        likes_cats: bool
        mood: Literal["happy", "sad"]

    chat = ChatRagMsPoE(engine=real, max_tokens=48)  # the whole JSON answer, not one value
    text = "Alice is 31 years old, loves cats and is cheerful today. Describe her."
    person = chat.with_structured_output(Person).invoke(text)
    assert person == Person(name="Alice", age=31, likes_cats=True, mood="happy")
    raw = chat.with_structured_output(Person.model_json_schema(), include_raw=True).invoke(text)
    assert isinstance(raw["raw"], AIMessage) and raw["parsing_error"] is None
    assert raw["parsed"] == person.model_dump()


def test_a_chain_that_formats_its_documents_runs_the_methods_that_read_them(tiny):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    from rag_mspoe.connectors import format_documents

    documents = [
        Document("The Danube reaches the Black Sea.", metadata={"title": "Rivers"}),
        Document("Paris is the capital of France.", metadata={"source": "france.txt"}),
    ]
    prompt = ChatPromptTemplate.from_messages(
        [("human", "Answer from these search results.\n\n{context}\n\nQuestion: {question}\nAnswer:")]
    )
    chat = ChatRagMsPoE(engine=tiny, method="pine", max_tokens=8)
    chain = (
        {"context": RunnableLambda(lambda _: documents) | format_documents, "question": RunnablePassthrough()}
        | prompt
        | chat
        | StrOutputParser()
    )
    question = "What is the capital of France?"
    text = prompt.invoke({"context": format_documents(documents), "question": question}).messages[0].content
    assert "Document [2](Title: france.txt) Paris is the capital" in text
    expected = tiny.generate(text, max_new_tokens=8, method="pine").text
    assert chain.invoke(question) == expected
    assert expected != tiny.generate(text, max_new_tokens=8, method="none").text
    # Spans given with the message say the same as the 'Document [i]' lines.
    starts = [text.index("Document [1]"), text.index("Document [2]")]
    spans = [[starts[0], starts[1] - 1], [starts[1], text.index("\n", starts[1])]]
    message = HumanMessage(text, additional_kwargs={"document_spans": spans})
    assert chat.invoke([message]).content == expected


def test_the_method_is_resolved_once_when_the_adapter_is_made(tiny, tmp_path):
    from rag_mspoe.rope.uniform import Uniform

    path = Uniform(factor=2.0).save(tmp_path)
    chat = ChatRagMsPoE(engine=tiny, method=str(path), max_tokens=6)
    path.unlink()  # later calls need the config, not the file
    assert chat.invoke(QUESTION).content == tiny.generate(QUESTION, max_new_tokens=6, method="pi:2").text


def test_under_invariant_reorder_a_chain_answers_alike_whatever_order_retrieval_gives(tiny):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    from rag_mspoe.connectors import format_documents

    documents = [
        Document("The Danube reaches the Black Sea.", metadata={"title": "Rivers"}),
        Document("Paris is the capital of France.", metadata={"title": "France"}),
        Document("Mont Blanc is in the Alps.", metadata={"title": "Mountains"}),
    ]
    prompt = ChatPromptTemplate.from_messages(
        [("human", "Answer from these search results.\n\n{context}\n\nQuestion: {question}\nAnswer:")]
    )
    answers = {}
    for method in ("invariant-reorder", "none"):
        chat = ChatRagMsPoE(engine=tiny, method=method, max_tokens=8)
        for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
            retrieved = [documents[i] for i in order]
            chain = (
                {
                    "context": RunnableLambda(lambda _, r=retrieved: r) | format_documents,
                    "question": RunnablePassthrough(),
                }
                | prompt
                | chat
                | StrOutputParser()
            )
            answers.setdefault(method, set()).add(chain.invoke("What is the capital of France?"))
    assert len(answers["invariant-reorder"]) == 1
    assert len(answers["none"]) > 1  # the order does change what the unmodified model answers
    # The message says which retrieved document each one the model read was, to cite by.
    text = prompt.invoke({"context": format_documents(documents), "question": "Capital of France?"})
    read = ChatRagMsPoE(engine=tiny, method="invariant-reorder", max_tokens=2).invoke(text)
    assert sorted(read.response_metadata["documents_read"]) == [0, 1, 2]
    plain = ChatRagMsPoE(engine=tiny, method="none", max_tokens=2).invoke(text)
    assert "documents_read" not in plain.response_metadata
