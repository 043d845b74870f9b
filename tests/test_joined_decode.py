"""Prompts prefilled one at a time, then decoded as one batch: in fp32 every row answers as the
prompt does alone, under every method family, and a sweep writes the same records."""

from __future__ import annotations

import pytest
import torch
from eval_run_helpers import embedded_tokenizer, tiny_chat_model
from tiny_models import tiny_model

from rag_mspoe.engine import Engine
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import run_sweep
from rag_mspoe.prompts.qa_prompt import render_qa_prompt

DOCUMENTS = [
    ("Rivers", "The Danube flows through ten countries before it reaches the Black Sea."),
    ("France", "Paris is the capital of France and its largest city."),
    ("Mountains", "Mont Blanc is the highest mountain in the Alps, on the border of France and Italy."),
    ("Deserts", "The Sahara is the largest hot desert in the world."),
    ("Moons", "Titan is the largest moon of Saturn."),
]
# Prompts of different lengths and document counts, so rows are padded by different amounts.
PROMPTS = [
    render_qa_prompt("What is the capital of France?", DOCUMENTS[:2])[0],
    render_qa_prompt("Which is the highest mountain in the Alps?", DOCUMENTS)[0],
    render_qa_prompt("Where does the Danube flow?", DOCUMENTS[::-1][:4])[0],
]
# One per method family: RoPE rescaling per head (ranked per prompt), per layer and uniform,
# hidden-state scaling, attention calibration, PINE, a reordering of the documents; and none.
METHODS = [
    None,
    "mspoe",
    "layerwise",
    "pi",
    "hidden:7,-1",
    "attention-calibration",
    "pine",
    "invariant-reorder",
]


class PrefillCounter:
    """Counts the model's forwards by batch rows and tokens: (rows, tokens) -> calls."""

    def __init__(self, model):
        self.calls: dict[tuple[int, int], int] = {}
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        key = (ids.shape[0], ids.shape[1])
        self.calls[key] = self.calls.get(key, 0) + 1

    def prefills(self):
        """(rows, tokens) of each forward of more than one token."""
        return sorted(key for key, count in self.calls.items() for _ in range(count) if key[1] > 1)

    def remove(self):
        self._handle.remove()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = embedded_tokenizer()
    # Large random weights give a peaked, varied distribution, so each method's change shows.
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), max_position_embeddings=2048, initializer_range=0.3
    )
    return Engine(model, tokenizer, name="tiny-llama")


def answers(results):
    return [(r.text, r.completion_tokens, r.finish_reason, r.documents_read) for r in results]


def answered_together_as_alone(engine, prompts, settings):
    """`generate_batch`'s results, checked equal to each prompt's answer alone, and the counter of
    the batch's forwards."""
    alone = [engine.generate(prompt, **settings) for prompt in prompts]
    counter = PrefillCounter(engine.model)
    try:
        together = engine.generate_batch(prompts, **settings)
    finally:
        counter.remove()
    assert answers(together) == answers(alone)
    return together, counter


@pytest.mark.parametrize("method", METHODS)
def test_joined_rows_answer_as_each_prompt_alone_in_fp32(engine, method, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path))  # attention calibration's bias estimate
    settings = {"method": method, "max_new_tokens": 12, "stop": ["a"]}  # rows stop apart
    together, counter = answered_together_as_alone(engine, PROMPTS, settings)
    if method is None:  # the rows stopped apart (on "a"), each where it stopped alone
        assert len({r.completion_tokens for r in together}) > 1
    # Each prompt was prefilled alone (a reordering also ranks each prompt alone first), and the
    # rows decoded together. (The unmodified model, which reads a reordering's prompts too, prefills
    # a start the prompts share once: below.)
    assert all(rows == 1 for rows, _ in counter.prefills())
    if method not in (None, "invariant-reorder"):
        lengths = sorted(engine.count_tokens(prompt) for prompt in PROMPTS)
        assert sorted(tokens for _, tokens in counter.prefills())[-len(PROMPTS) :] == lengths
    assert any(rows == len(PROMPTS) for rows, _ in counter.calls)


def prompt_ids(engine, prompt):
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    ids = list(getattr(ids, "input_ids", ids))
    assert len(ids) == engine.count_tokens(prompt)
    return ids


def shared_starts(rows):
    """For each row, the longest start (all but its last token at most) an earlier row's kept
    tokens share: what the unmodified model does not prefill again."""

    def shared(a, b):
        length = 0
        while length < min(len(a), len(b)) - 1 and a[length] == b[length]:
            length += 1
        return length

    return [max((shared(row, rows[j]) for j in range(k)), default=0) for k, row in enumerate(rows)]


@pytest.mark.parametrize("method", [None, "mspoe"])
def test_prompts_that_start_alike_prefill_only_what_follows_their_shared_start(engine, method):
    # A sweep's prompts of one question (the gold moved down the documents) and another question
    # on the same documents: the unmodified model prefills each start once; a method whose rows
    # depend on the whole prompt prefills every prompt whole.
    question = "What is the capital of France?"
    prompts = [
        render_qa_prompt(question, [DOCUMENTS[k] for k in (0, 2, 3, 1, 4)])[0],
        render_qa_prompt(question, [DOCUMENTS[k] for k in (0, 2, 3, 4, 1)])[0],
        render_qa_prompt("Which is the largest moon of Saturn?", [DOCUMENTS[k] for k in (0, 2, 3, 1, 4)])[0],
        render_qa_prompt(question, DOCUMENTS[:2])[0],
    ]
    counter = answered_together_as_alone(engine, prompts, {"method": method, "max_new_tokens": 10})[1]
    ids = [prompt_ids(engine, prompt) for prompt in prompts]
    prefilled = [tokens for _, tokens in counter.prefills()]
    if method is None:
        shared = shared_starts(ids)
        assert shared[1] > shared[3] > 16 and shared[2] > shared[1]  # documents, and the template
        assert sorted(prefilled) == sorted(len(row) - start for row, start in zip(ids, shared, strict=True))
    else:
        assert sorted(prefilled)[-4:] == sorted(len(row) for row in ids)


def test_a_padded_batch_is_still_one_prefill_when_asked(engine):
    counter = PrefillCounter(engine.model)
    engine.joined_decoding = False
    try:
        padded = engine.generate_batch(PROMPTS, max_new_tokens=6)
    finally:
        engine.joined_decoding = True
        counter.remove()
    width = max(engine.count_tokens(prompt) for prompt in PROMPTS)
    assert counter.prefills() == [(len(PROMPTS), width)]
    joined = engine.generate_batch(PROMPTS, max_new_tokens=6)
    assert answers(padded) == answers(joined)


def test_a_method_whose_hooks_do_not_join_prefills_decodes_its_padded_batch(engine, monkeypatch):
    from rag_mspoe.rope.rotary_scaling import RotaryScaleState

    monkeypatch.setattr(RotaryScaleState, "joins_prefills", False)
    counter = PrefillCounter(engine.model)
    try:
        engine.generate_batch(PROMPTS, method="mspoe", max_new_tokens=4)
    finally:
        counter.remove()
    assert [rows for rows, _ in counter.prefills()] == [len(PROMPTS)]


def test_a_sweep_decoding_answers_together_writes_the_records_of_one_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_MSPOE_CACHE", str(tmp_path / "cache"))
    model, tokenizer = tiny_chat_model()
    settings = dict(
        num_documents=4,
        positions=(0, 3),
        methods=("none", "mspoe", "pine"),
        samples=3,
        batch_size=6,
        metrics=("generate",),
        max_new_tokens=6,
    )
    for decode_batch in (1, 4):
        config = SweepConfig(decode_batch=decode_batch, **settings)
        run_sweep(config, tmp_path / str(decode_batch), model=model, tokenizer=tokenizer, progress=False)

    def records(folder):
        found = read_records(tmp_path / folder / "results.jsonl")
        return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in found), key=str)

    one_at_a_time = records("1")
    assert len(one_at_a_time) == 3 * 2 * 3
    assert records("4") == one_at_a_time


@pytest.mark.slow
def test_the_embedded_model_answers_rag_prompts_together_as_alone_in_fp32():
    from rag_mspoe import load_model

    model, tokenizer = load_model(dtype=torch.float32)
    engine = Engine(model, tokenizer)
    for method in ("none", "mspoe", "pine"):
        settings = {"method": method, "max_new_tokens": 16, "stop": ["\n"]}
        alone = [engine.generate(prompt, **settings) for prompt in PROMPTS]
        assert answers(engine.generate_batch(PROMPTS, **settings)) == answers(alone), method


def test_a_batch_with_a_one_token_prompt_answers_as_each_alone(engine):
    texts = ["Hi", "The Danube flows through ten countries"]
    assert engine.count_tokens(texts[0], raw=True) == 1  # nothing to prefill before its last token
    alone = [engine.generate(text, raw=True, max_new_tokens=5) for text in texts]
    assert answers(engine.generate_batch(texts, raw=True, max_new_tokens=5)) == answers(alone)
