"""The unmodified model's answer from some of a question's retrieved chunks, for the scripts of
this folder: greedy, 32 new tokens, the package's QA prompt, best-subspan exact match."""

from rag_mspoe.eval.scoring.metrics import best_subspan_em
from rag_mspoe.prompts.document_prompts import document_message
from rag_mspoe.prompts.qa_prompt import render_qa_prompt


def answer_from(engine, question, chunks, order):
    """{"answer", "em"}: the answer to `question` (a record with "question" and "answers") from
    `chunks[i]` for i in `order`, in that order."""
    documents = [(chunks[i].title, chunks[i].text) for i in order]
    text, spans = render_qa_prompt(question["question"], documents)
    answer = engine.generate([document_message(text, spans)], max_new_tokens=32).text
    return {"answer": answer, "em": best_subspan_em(answer, question["answers"])}
