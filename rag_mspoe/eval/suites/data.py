"""Local task files in the LongBench, ZeroSCROLLS and MMLU formats, drawn from a seed.

For a side-effect check without downloading the benchmarks (which stay the real test: see the
README for where to get them). Every file is an ordinary file of its format; the long-context
ones carry their task's prompt, answer length and metric in each record, since the tasks are
not built-in ones:

- longbench/invented_passages_qa.jsonl: multi-document QA over invented facts (numbered
  passages, LongBench's hotpotqa prompt; scored by the gold answer inside the answer's first
  line, the lost-in-the-middle metric), 20 to 50 passages, so some prompts are cut;
- longbench/kv_retrieval.jsonl: a JSON object of 10 to 50 word keys and number values, the value
  of one key asked (the value anywhere in the answer);
- zeroscrolls/invented_story_qa.jsonl: the same facts as one running text, ZeroSCROLLS style
  (the record's input is the whole prompt; token F1);
- mmlu/general_knowledge.jsonl: capitals, arithmetic and word questions with four choices
  (three per long-context example).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rag_mspoe.eval.data.prompts import KV_ANSWER_CUE, KV_INSTRUCTION, kv_json
from rag_mspoe.eval.data.records import QAExample
from rag_mspoe.eval.data.synthetic import generate_invented_qa, generate_kv
from rag_mspoe.eval.suites.long_context import LONGBENCH_TASKS
from rag_mspoe.files import atomic_write

# Sizes at which SmolLM2-135M still answers some questions (a third to a half with the unmodified
# model), from about 1k to 3k tokens, so a 1.5k limit cuts some prompts.
PASSAGE_COUNTS = (20, 35, 50)
KV_PAIRS = (10, 25, 50)
FILLERS = 2
SIMILARITY = 0.0  # distractors of other kinds: a needle to find, not a near-miss to reject

_STORY_INSTRUCTION = (
    "You are given a text and a question. Answer the question as concisely as you can, using a single "
    "phrase if possible. Do not provide any explanation.\n\nText:\n"
)
_CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Australia", "Canberra"),
    ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Turkey", "Ankara"), ("Cuba", "Havana"),
)  # fmt: skip
_OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("early", "late"), ("full", "empty"), ("strong", "weak"), ("open", "closed"), ("high", "low"),
    ("old", "young"), ("rich", "poor"), ("wet", "dry"), ("hard", "soft"), ("loud", "quiet"),
)  # fmt: skip


def write_suite_data(folder: str | Path, examples: int = 20, seed: int = 0) -> dict[str, Path]:
    """Write the four task files under `folder`; returns {kind: path}. Same seed, same bytes."""
    if examples < 1:
        raise ValueError(f"examples must be at least 1, got {examples}.")
    out = Path(folder)
    rng = random.Random(seed)
    passages = _invented_qa(examples, seed)
    files = {
        "longbench": out / "longbench" / "invented_passages_qa.jsonl",
        "longbench-kv": out / "longbench" / "kv_retrieval.jsonl",
        "zeroscrolls": out / "zeroscrolls" / "invented_story_qa.jsonl",
        "mmlu": out / "mmlu" / "general_knowledge.jsonl",
    }
    _write(files["longbench"], [_passages_record(example) for example in passages])
    _write(files["longbench-kv"], _kv_records(examples, seed))
    _write(files["zeroscrolls"], [_story_record(example) for example in passages])
    _write(files["mmlu"], _knowledge_records(rng, 3 * examples))
    return files


def _invented_qa(count: int, seed: int) -> list[QAExample]:
    """`count` examples, their passage counts cycling through PASSAGE_COUNTS."""
    return [
        generate_invented_qa(
            PASSAGE_COUNTS[i % len(PASSAGE_COUNTS)],
            1,
            seed * 100_003 + i,
            SIMILARITY,
            filler_sentences=FILLERS,
        )[0]
        for i in range(count)
    ]


def _passages_record(example: QAExample) -> dict[str, Any]:
    context = "\n\n".join(
        f"Passage {number}:\n{document.title}\n{document.text}"
        for number, document in enumerate(example.documents, start=1)
    )
    return {
        "_id": example.id,
        "dataset": "invented_passages_qa",
        "context": context,
        "input": example.question,
        "answers": list(example.answers),
        "length": len(context.split()),
        "prompt": LONGBENCH_TASKS["hotpotqa"].prompt,  # LongBench's multi-document QA prompt
        "max_new_tokens": 32,
        "metric": "substring_match",
    }


def _story_record(example: QAExample) -> dict[str, Any]:
    document = " ".join(d.text for d in example.documents)
    start = len(_STORY_INSTRUCTION)
    query = f"\n\nQuestion:\n{example.question}\n\nAnswer:"
    return {
        "id": example.id,
        "pid": example.id,
        "input": _STORY_INSTRUCTION + document + query,
        "output": example.answers[0],
        "document_start_index": start,
        "document_end_index": start + len(document),
        "query_start_index": start + len(document) + len("\n\nQuestion:\n"),
        "query_end_index": start + len(document) + len("\n\nQuestion:\n") + len(example.question),
        "truncation_seperator": "... [The rest of the text is omitted]\n\n",
        "prompt": "{input}",
        "max_new_tokens": 32,
        "metric": "qa_f1",
    }


def _kv_records(count: int, seed: int) -> list[dict[str, Any]]:
    records = []
    for i in range(count):
        (example,) = generate_kv(KV_PAIRS[i % len(KV_PAIRS)], 1, seed * 100_003 + i, short_keys=True)
        records.append(
            {
                "_id": example.id,
                "dataset": "kv_retrieval",
                "context": kv_json(example),
                "input": example.key,
                "answers": [example.value],
                "prompt": f'{KV_INSTRUCTION}\n\nJSON data:\n{{context}}\n\nKey: "{{input}}"\n{KV_ANSWER_CUE}',
                "max_new_tokens": 32,
                "metric": "contains",
            }
        )
    return records


def _knowledge_records(rng: random.Random, count: int) -> list[dict[str, Any]]:
    makers = (_capital_question, _arithmetic_question, _opposite_question)
    records = []
    for number in range(count):
        question, right, wrong = makers[number % len(makers)](rng)
        choices = [right, *wrong]
        rng.shuffle(choices)
        records.append(
            {
                "id": f"gk-{number}",
                "question": question,
                "choices": choices,
                "answer": choices.index(right),
                "subject": "general knowledge",
            }
        )
    return records


def _capital_question(rng: random.Random) -> tuple[str, str, list[str]]:
    (country, capital), *others = rng.sample(_CAPITALS, 4)
    return f"What is the capital of {country}?", capital, [city for _, city in others]


def _arithmetic_question(rng: random.Random) -> tuple[str, str, list[str]]:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    total = a + b
    wrong = rng.sample([n for n in range(max(1, total - 6), total + 7) if n != total], 3)
    return f"What is {a} plus {b}?", str(total), [str(n) for n in wrong]


def _opposite_question(rng: random.Random) -> tuple[str, str, list[str]]:
    (word, opposite), *others = rng.sample(_OPPOSITES, 4)
    return f"What is the opposite of '{word}'?", opposite, [o for _, o in others]


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
