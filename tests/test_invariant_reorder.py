"""Position-invariant reordering: every order of the same documents becomes the same prompt, sorted
by scores each document gets alone; on a tiny model for the mechanics, on the embedded one as the
integration check, and on the real SmolLM2 and Qwen2.5 tokenizers' chat templates."""

from __future__ import annotations

import itertools
import json
import unittest.mock
from collections import Counter

import pytest
import torch
from attention_helpers import DOCUMENTS, QUESTION
from eval_run_helpers import tiny_chat_model
from tiny_models import tiny_model

from rag_mspoe import rescaled
from rag_mspoe.attention import document_spans, invariant_reorder
from rag_mspoe.attention.invariant_reorder import JUDGE_NUMBERED, NO, YES, standardised
from rag_mspoe.attention.reorder import documents_read, moved_slot, prompt_with_documents
from rag_mspoe.engine import Engine
from rag_mspoe.eval.data.records import with_gold_at
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.sweep.batch_scorer import candidates_of, prompt_of
from rag_mspoe.eval.sweep.plan import SweepConfig
from rag_mspoe.eval.sweep.run import frozen_examples, run_sweep
from rag_mspoe.methods import AttentionCalibration, InvariantReorder
from rag_mspoe.methods.method_config import load_method
from rag_mspoe.methods.method_spec import parse_method
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans, document_message, render_with_spans
from rag_mspoe.prompts.qa_prompt import render_qa_prompt
from rag_mspoe.rope.rescaling import STATE_ATTR


def _qa(order):
    return render_qa_prompt(QUESTION, [DOCUMENTS[i] for i in order])[0]


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny_chat_model()
    return Engine(model, tokenizer, method="none")


def test_a_prompt_with_some_documents_keeps_them_numbered_and_separated():
    text, spans = render_qa_prompt(QUESTION, DOCUMENTS)
    for prompt in (text, [document_message(text, spans)]):
        (alone,) = prompt_with_documents(prompt, [2])
        # Exactly the prompt the packer writes for that document alone.
        assert alone["content"] == render_qa_prompt(QUESTION, [DOCUMENTS[2]])[0]
        assert [alone["content"][s:e] for s, e in alone["document_spans"]] == [
            "Document [1](Title: Mountains) Mont Blanc is the highest mountain in the Alps."
        ]
        (two,) = prompt_with_documents(prompt, [3, 0])
        assert two["content"] == render_qa_prompt(QUESTION, [DOCUMENTS[3], DOCUMENTS[0]])[0]
    with pytest.raises(ValueError, match="distinct indices in 0..3"):
        prompt_with_documents(text, [1, 1])
    with pytest.raises(ValueError, match="distinct indices in 0..3"):
        prompt_with_documents(text, [4])


@pytest.mark.parametrize("score", ["question", "attention", "judge", "question+judge"])
def test_every_order_of_the_documents_gives_the_same_prompt_and_answer(engine, score):
    method = InvariantReorder(score=score)
    orders = list(itertools.permutations(range(4)))[::5]  # 5 of the 24 orders, the first one included
    rewritten = [engine.rewritten([_qa(order)], method=method)[1][0] for order in orders]
    assert all(prompt == rewritten[0] for prompt in rewritten)
    scores = [engine.score_continuations(_qa(order), [" Paris"], method=method)[0][0] for order in orders]
    assert len(set(scores)) == 1
    unmodified = {engine.score_continuations(_qa(order), [" Paris"], method="none")[0][0] for order in orders}
    assert len(unmodified) > 1  # the order does change what the unmodified model reads
    answers = {engine.generate(_qa(order), method=method, max_new_tokens=6).text for order in orders}
    assert len(answers) == 1
    assert engine.generate(_qa(orders[0]), method=method, max_new_tokens=2).method == "invariant-reorder"


@pytest.mark.parametrize("which", ["engine", "qwen_engine", "qwen_tree_engine"])
def test_the_documents_are_sorted_by_how_well_each_alone_predicts_the_question(request, which):
    engine = request.getfixturevalue(which)
    scores = []
    for index in range(len(DOCUMENTS)):
        # A full forward of the document's own prompt: the log-likelihood of every token after it.
        ids, spans = render_with_spans(engine.tokenizer, render_qa_prompt(QUESTION, [DOCUMENTS[index]])[0])
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0].float()
        log_p = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        scores.append(float(log_p[spans[0][1] - 1 :].sum()))
    method = InvariantReorder()
    assert method.scores(engine, _qa((0, 1, 2, 3))) == pytest.approx(scores, abs=1e-3)
    assert method.scores(engine, _qa((3, 1, 0, 2))) == pytest.approx(
        [scores[i] for i in (3, 1, 0, 2)], abs=1e-3
    )
    ranked = sorted(range(4), key=lambda k: -scores[k])
    (message,) = engine.rewritten([_qa((2, 3, 0, 1))], method=method)[1][0]
    assert message["content"] == _qa(ranked)


def _judged_by_a_full_forward(engine, index, raw=False):
    """log p(yes) - log p(no) for the first token of the reply to the document's own prompt with the
    judge's question after it, from one full forward of that prompt."""
    text = render_qa_prompt(QUESTION, [DOCUMENTS[index]])[0] + "\n\n" + JUDGE_NUMBERED
    if raw:
        ids = engine.tokenizer(text + "\nAnswer:")["input_ids"]
    else:
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    firsts = [{engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in words} for words in (YES, NO)]
    yes, no = sorted(firsts[0] - firsts[1]), sorted(firsts[1] - firsts[0])
    return float(torch.logsumexp(logprobs[yes], 0) - torch.logsumexp(logprobs[no], 0))


@pytest.fixture(scope="module")
def qwen_engine(qwen_tokenizer):
    # The Qwen tokenizer's template writes a system turn and has special tokens of its own.
    model = tiny_model("qwen2", seed=3, vocab_size=len(qwen_tokenizer), max_position_embeddings=1024)
    model._rag_mspoe_name = "tiny-qwen2"
    return Engine(model, qwen_tokenizer, method="none")


@pytest.fixture(scope="module")
def qwen_tree_engine(qwen_tokenizer):
    # Without its sliding window the tiny Qwen's cache grows plainly: its documents' prompts are
    # read as one tree (a window reads each prompt alone, as `qwen_engine` does).
    vocab = len(qwen_tokenizer)
    model = tiny_model(
        "qwen2", seed=3, vocab_size=vocab, max_position_embeddings=1024, use_sliding_window=False
    )
    model._rag_mspoe_name = "tiny-qwen2"
    return Engine(model, qwen_tokenizer, method="none")


@pytest.mark.parametrize("which", ["engine", "qwen_engine", "qwen_tree_engine"])
def test_the_documents_are_sorted_by_the_models_judgement_of_each_alone(request, which):
    engine = request.getfixturevalue(which)
    judged = [_judged_by_a_full_forward(engine, index) for index in range(len(DOCUMENTS))]
    method = InvariantReorder(score="judge")
    assert method.scores(engine, _qa((0, 1, 2, 3))) == pytest.approx(judged, abs=1e-3)
    assert method.scores(engine, _qa((2, 0, 3, 1))) == pytest.approx(
        [judged[i] for i in (2, 0, 3, 1)], abs=1e-3
    )
    ranked = sorted(range(4), key=lambda k: -judged[k])
    assert engine.rewritten([_qa((3, 1, 2, 0))], method=method)[1][0][0]["content"] == _qa(ranked)
    raw = [_judged_by_a_full_forward(engine, index, raw=True) for index in range(len(DOCUMENTS))]
    assert method.scores(engine, _qa((0, 1, 2, 3)), raw=True) == pytest.approx(raw, abs=1e-3)


def test_a_tokenizer_that_spells_yes_and_no_alike_is_refused_by_name(engine, monkeypatch):
    engine.document_prefixes.clear()
    monkeypatch.setattr(engine, "encode", lambda text: [7, 8])  # every word starts with token 7
    with pytest.raises(ValueError, match="rank by score='question'"):
        InvariantReorder(score="judge").scores(engine, _qa((0, 1, 2, 3)))


def test_question_and_judgement_are_standardised_and_summed(engine):
    likelihood = InvariantReorder().scores(engine, _qa((0, 1, 2, 3)))
    judged = InvariantReorder(score="judge").scores(engine, _qa((0, 1, 2, 3)))
    both = InvariantReorder(score="question+judge").scores(engine, _qa((0, 1, 2, 3)))
    a, b = torch.tensor(likelihood, dtype=torch.float64), torch.tensor(judged, dtype=torch.float64)
    expected = (a - a.mean()) / a.std(unbiased=False) + (b - b.mean()) / b.std(unbiased=False)
    assert both == pytest.approx(expected.tolist(), abs=1e-4)
    assert standardised([2.0, 2.0]) == [0.0, 0.0]  # equal scores: no spread to divide by


def test_the_documents_are_sorted_by_the_questions_attention_to_each_alone(engine):
    method = InvariantReorder(score="attention", layers=[1, 2])
    scores = []
    for index in range(len(DOCUMENTS)):
        # A full forward of the document's own prompt, recorded by attention calibration's hooks.
        ids, spans = render_with_spans(engine.tokenizer, render_qa_prompt(QUESTION, [DOCUMENTS[index]])[0])
        with rescaled(engine.model, AttentionCalibration(bias="zero", layers=[1, 2])), torch.no_grad():
            state = getattr(engine.model, STATE_ATTR)
            state.recorded = {}
            with document_spans(engine.model, [spans]):
                engine.model(torch.tensor([ids]))
            scores.append(float(torch.stack([state.recorded[layer] for layer in (1, 2)]).mean()))
    assert method.scores(engine, _qa((0, 1, 2, 3))) == pytest.approx(scores, rel=1e-4)
    ranked = sorted(range(4), key=lambda k: -scores[k])
    (message,) = engine.rewritten([_qa((0, 1, 2, 3))], method=method)[1][0]
    assert message["content"] == _qa(ranked)
    last = InvariantReorder(score="attention", layers=[1, 2], best="last")
    assert engine.rewritten([_qa((0, 1, 2, 3))], method=last)[1][0][0]["content"] == _qa(ranked[::-1])
    # A raw prompt (plain text, documents found by their lines) is rewritten the same way.
    assert engine.rewritten([_qa((3, 2, 1, 0))], method=method, raw=True)[1][0] == _qa(ranked)


def test_a_document_scored_again_runs_no_model_pass(engine, monkeypatch):
    # A sweep scores each document once per gold position and label: the same single-document
    # prompt, so its score is kept (exactly the number the pass gave) and the pass not run again.
    engine.document_prefixes.clear()
    passes = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: passes.append(1) or forward(*a, **k))
    first = InvariantReorder().scores(engine, _qa((0, 1, 2, 3)))
    # The template once, then every document's prompt in one pass over the tree of their tokens.
    assert len(passes) == 2
    assert InvariantReorder(keep=2).scores(engine, _qa((2, 0, 3, 1))) == [first[i] for i in (2, 0, 3, 1)]
    assert len(passes) == 2
    # The judgement's prompts: one more pass, from the template's kept rows.
    computed = engine.document_prefixes.computed
    InvariantReorder(score="judge").scores(engine, _qa((0, 1, 2, 3)))
    assert engine.document_prefixes.computed == computed and len(passes) == 3
    # Other scores of the same prompts (the question's attention) are other numbers: they run.
    InvariantReorder(score="attention").scores(engine, _qa((0, 1, 2, 3)))
    assert len(passes) > 3 + len(DOCUMENTS)
    engine.document_prefixes.clear()
    assert InvariantReorder().scores(engine, _qa((0, 1, 2, 3))) == first
    # Both scores of a fresh prompt: one pass after the template.
    engine.document_prefixes.clear()
    passes.clear()
    InvariantReorder(score="question+judge").scores(engine, _qa((0, 1, 2, 3)))
    assert len(passes) == 2


def test_past_the_tree_limit_the_prompts_are_read_in_several_passes_alike(engine, monkeypatch):
    method = InvariantReorder(score="question+judge")
    engine.document_prefixes.clear()
    whole = method.scores(engine, _qa((0, 1, 2, 3)))
    engine.document_prefixes.clear()
    monkeypatch.setattr(invariant_reorder, "MAX_TREE_TOKENS", 1)  # every prompt a tree of its own
    passes = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: passes.append(1) or forward(*a, **k))
    assert method.scores(engine, _qa((0, 1, 2, 3))) == pytest.approx(whole, abs=1e-4)
    assert len(passes) == 1 + 2 * len(DOCUMENTS)  # the template, then each prompt


def test_equal_scores_are_ordered_by_the_documents_text_not_their_place():
    method = InvariantReorder()
    texts = ["b", "a", "c"]
    assert method.order([0.5, 0.5, 0.1], texts) == [1, 0, 2]
    assert method.order([0.5, 0.5, 0.1], ["a", "b", "c"]) == [0, 1, 2]
    assert InvariantReorder(best="last").order([0.5, 0.5, 0.1], texts) == [2, 0, 1]


def test_keep_reads_only_the_best_ranked_documents_whatever_their_order(engine):
    scores = InvariantReorder().scores(engine, _qa((0, 1, 2, 3)))
    ranked = sorted(range(4), key=lambda k: -scores[k])
    for spec, kept in (
        ("invariant-reorder:2", ranked[:2]),
        (InvariantReorder(keep=2, best="last"), ranked[:2][::-1]),
        ("invariant-reorder:1", ranked[:1]),
        ("invariant-reorder:9", ranked),  # more than there are: all of them
    ):
        expected, spans = render_qa_prompt(QUESTION, [DOCUMENTS[k] for k in kept])
        for order in ((0, 1, 2, 3), (3, 1, 2, 0), (2, 3, 0, 1)):
            (message,) = engine.rewritten([_qa(order)], method=spec)[1][0]
            assert message["content"] == expected
            assert [tuple(span) for span in message["document_spans"]] == [tuple(span) for span in spans]
    assert parse_method("invariant-reorder:3") == InvariantReorder(keep=3)
    # Where the gold went: its slot in the prompt read, or None when it was left out.
    original = _qa((0, 1, 2, 3))
    (shorter,) = engine.rewritten([original], method="invariant-reorder:1")[1][0]
    assert moved_slot(original, [shorter], ranked[0]) == 0
    assert moved_slot(original, [shorter], ranked[1]) is None


def test_answers_say_which_given_document_each_one_read_was(engine):
    scores = InvariantReorder().scores(engine, _qa((0, 1, 2, 3)))
    ranked = sorted(range(4), key=lambda k: -scores[k])
    given = (2, 0, 3, 1)
    expected = tuple(given.index(k) for k in ranked[:2])  # 'Document [1]' read = given[expected[0]]
    prompt = _qa(given)
    assert engine.generate(prompt, method="invariant-reorder:2", max_new_tokens=2).documents_read == expected
    batch = engine.generate_batch([prompt, _qa((0, 1, 2, 3))], method="invariant-reorder:2", max_new_tokens=2)
    assert [r.documents_read for r in batch] == [expected, tuple(ranked[:2])]
    stream = engine.stream(prompt, method="invariant-reorder:2", max_new_tokens=2)
    "".join(stream)
    assert stream.result.documents_read == expected
    assert engine.generate(prompt, method="none", max_new_tokens=2).documents_read is None


def test_the_read_order_matches_equal_documents_in_turn_and_refuses_strangers():
    twice = [DOCUMENTS[0], DOCUMENTS[1], DOCUMENTS[0]]
    given = render_qa_prompt(QUESTION, twice)[0]
    assert documents_read(given, prompt_with_documents(given, [2, 1, 0])) == (0, 1, 2)
    assert documents_read(given, prompt_with_documents(given, [1, 2])) == (1, 0)
    with pytest.raises(ValueError, match="holds a document the given prompt does not"):
        documents_read(given, _qa((3,)))


def test_a_sweep_records_where_a_kept_gold_was_read_and_when_it_was_left_out(tmp_path):
    model, tokenizer = tiny_chat_model()
    config = SweepConfig(
        num_documents=4,
        positions=(0, 3),
        methods=("none", "invariant-reorder:2"),
        samples=4,
        metrics=("loglik",),
    )
    run_sweep(config, tmp_path, model=model, tokenizer=tokenizer, progress=False)
    records = [r for r in read_records(tmp_path / "results.jsonl") if r["method"] == "invariant-reorder:2"]
    examples = {e.id: e for e in frozen_examples(config, tmp_path)}
    engine = Engine(model, tokenizer, method="none")
    assert len(records) == 8
    for record in records:
        placed = with_gold_at(examples[record["example_id"]], record["position"])
        prompt = prompt_of(placed)
        (rewritten,) = engine.rewritten([prompt], method="invariant-reorder:2")[1]
        assert record["prompt_position"] == moved_slot(prompt, rewritten, record["position"])
        ((expected, _),) = engine.score_continuations(
            prompt, [candidates_of(placed)[1]], method="invariant-reorder:2"
        )
        assert record["gold_logprob"] == pytest.approx(expected, abs=1e-4)
    # The tiny model keeps the gold for some examples, not for others: both are recorded.
    assert {r["prompt_position"] for r in records} == {1, None}
    # One prompt per example whatever the gold's position: the same scores at both.
    by_example = {}
    for record in records:
        by_example.setdefault(record["example_id"], set()).add(round(record["gold_logprob"], 4))
    assert all(len(scores) == 1 for scores in by_example.values())


def _read(engine, order, method):
    """The text the model reads under `method` of the prompt with the documents in `order`."""
    (read,) = engine.rewritten([_qa(order)], method=method)[1]
    return read if isinstance(read, str) else read[0]["content"]


def test_first_margin_keeps_the_given_order_unless_another_document_leads_the_first_by_it(engine):
    scores = InvariantReorder().scores(engine, _qa((0, 1, 2, 3)))
    ranked = sorted(range(4), key=lambda k: -scores[k])
    top, runner_up = ranked[0], ranked[1]
    sorted_prompt = _qa(ranked)
    gated = InvariantReorder(first_margin=0.0)
    # The top-ranked document given first: the prompt stays as it came, distractors' order too.
    kept = (top, *[k for k in ranked[::-1] if k != top])
    assert kept != tuple(ranked)
    assert _read(engine, kept, gated) == _qa(kept)
    # Another document first: reordered as without the margin.
    for given in ((runner_up, top, *[k for k in range(4) if k not in (top, runner_up)]), (3, 2, 1, 0)):
        if given[0] == top:
            continue
        assert _read(engine, given, gated) == sorted_prompt
        # ... unless the top one leads the first by less than the margin.
        lead = scores[top] - scores[given[0]]
        wide = InvariantReorder(first_margin=lead + 1e-3)
        assert _read(engine, given, wide) == _qa(given)
        assert _read(engine, given, InvariantReorder(first_margin=lead - 1e-3)) == sorted_prompt
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="first_margin"):
            InvariantReorder(first_margin=bad)


@pytest.mark.parametrize("order_recorded", [True, False])
def test_a_sweep_label_that_writes_prompts_other_labels_read_takes_their_scores(tmp_path, order_recorded):
    # The margin keeps the unmodified model's prompt or writes the invariant label's: run after
    # both, it takes every score from their records. The invariant label reads its one prompt per
    # example once, whatever the gold position. A record that does not say the order its documents
    # were read in (from an older build) is not trusted to be the same prompt.
    model, tokenizer = tiny_chat_model()
    gated = InvariantReorder(first_margin=0.0).save(tmp_path / "gated.json")
    settings = dict(num_documents=4, positions=(0, 2, 3), samples=6, metrics=("loglik", "generate"))
    settings["max_new_tokens"] = 3
    calls = []
    original = Engine.generate_and_score

    def counted(self, items, **settings):
        calls.append(len(items))
        return original(self, items, **settings)

    with unittest.mock.patch.object(Engine, "generate_and_score", counted):
        run_sweep(
            SweepConfig(methods=("none", "invariant-reorder"), **settings),
            tmp_path / "run",
            model=model,
            tokenizer=tokenizer,
            progress=False,
        )
    results = tmp_path / "run" / "results.jsonl"
    first = read_records(results)
    examples = {
        e.id: e for e in frozen_examples(SweepConfig(methods=("none",), **settings), tmp_path / "run")
    }
    invariant = [r for r in first if r["method"] == "invariant-reorder"]
    copied = [r for r in invariant if "same_prompt_as" in r]
    read = Counter(r["example_id"] for r in invariant if "same_prompt_as" not in r)
    assert len(invariant) == 18 and max(read.values()) == 1  # at most one prompt read per example
    by_key = {(r["method"], r["position"], r["example_id"]): r for r in first}
    for record in copied:
        label, position = record["same_prompt_as"]
        source = by_key[label, position, record["example_id"]]
        assert label in ("invariant-reorder", "none") and source["prediction"] == record["prediction"]
        assert source["gold_logprob"] == record["gold_logprob"]

    assert sum(calls) == 18 + len(read)  # the unmodified model's prompts and one per example
    engine = Engine(model, tokenizer, method="none")
    for record in invariant:
        given = prompt_of(with_gold_at(examples[record["example_id"]], record["position"]))
        assert record["documents_read"] == list(
            documents_read(given, engine.rewritten([given], method="invariant-reorder")[1][0])
        )
    if not order_recorded:
        older = [{k: v for k, v in r.items() if k != "documents_read"} for r in first]
        results.write_text("".join(json.dumps(r) + "\n" for r in older))
    calls.clear()
    with unittest.mock.patch.object(Engine, "generate_and_score", counted):
        run_sweep(
            SweepConfig(methods=("none", "invariant-reorder", f"gated={gated}"), **settings),
            tmp_path / "run",
            model=model,
            tokenizer=tokenizer,
            progress=False,
        )
    records = [r for r in read_records(results) if r["method"] == "gated"]
    fresh = [r for r in records if "same_prompt_as" not in r]
    # Read anew: nothing, or one reordered prompt per example that reorders (the rest as given).
    assert sum(calls) == len(fresh) == (0 if order_recorded else len({r["example_id"] for r in fresh}))
    sources = set()
    for record in records:
        label, position = record.get("same_prompt_as", ["gated", record["position"]])
        source = by_key.get((label, position, record["example_id"]), record)
        assert (source["prediction"], source["gold_logprob"]) == (
            record["prediction"],
            record["gold_logprob"],
        )
        sources.add(label)
        placed = with_gold_at(examples[record["example_id"]], record["position"])
        ((expected, _),) = engine.score_continuations(
            prompt_of(placed), [candidates_of(placed)[1]], method=load_method(gated)
        )
        assert record["gold_logprob"] == pytest.approx(expected, abs=1e-4)
    assert len(records) == 18
    assert sources == ({"none", "invariant-reorder"} if order_recorded else {"none", "gated"})


def test_prompts_without_two_documents_are_left_as_they_are(engine):
    no_documents = [document_message("Name three colours.", [])]
    assert engine.rewritten([no_documents], method="invariant-reorder")[1][0] == no_documents
    one = _qa((1,))
    assert engine.score_continuations(one, [" Paris"], method="invariant-reorder") == (
        engine.score_continuations(one, [" Paris"], method="none")
    )
    with pytest.raises(MissingDocumentSpans):
        engine.generate("Where is Paris?", method="invariant-reorder", max_new_tokens=3)


def test_bad_settings_and_uses_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match="best must be 'first' or 'last'"):
        InvariantReorder(best="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"does not compose .* Engine.rewritten"):
        parse_method("invariant-reorder+mspoe")
    with pytest.raises(TypeError, match="invariant-reorder rewrites the prompt"):
        rescaled(tiny_chat_model()[0], InvariantReorder()).__enter__()
    for keep in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep is how many documents the model reads"):
            InvariantReorder(keep=keep)  # type: ignore[arg-type]
    for spec in ("invariant-reorder:0", "invariant-reorder:two"):
        with pytest.raises(ValueError, match="write e.g. 'invariant-reorder:3'"):
            parse_method(spec)
    with pytest.raises(ValueError, match="score must be one of 'question', 'attention', 'judge'"):
        InvariantReorder(score="retriever")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give them with score='attention'"):
        InvariantReorder(layers=[1, 2])
    with pytest.raises(ValueError, match="layer"):
        InvariantReorder(score="attention", layers=[-1])
    assert InvariantReorder(score="attention").ranking_layers(24) == list(range(12, 18))
    with pytest.raises(ValueError):
        InvariantReorder(score="attention", layers=[30]).ranking_layers(24)


@pytest.mark.slow
def test_the_embedded_model_answers_every_order_alike_and_right(embedded):
    model, tokenizer = embedded
    engine = Engine(model, tokenizer, method="none")
    answers = {
        engine.generate(_qa(order), method="invariant-reorder", max_new_tokens=12).text
        for order in ((0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1))
    }
    assert len(answers) == 1
    assert "paris" in answers.pop().lower()
