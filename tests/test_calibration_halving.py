"""`calibrate search`: successive halving over a search space as resumable sweeps, on a tiny model."""

from __future__ import annotations

import json

import pytest
from eval_run_helpers import tiny_chat_model

from rag_mspoe.eval.data.loaders import save_jsonl
from rag_mspoe.eval.data.synthetic import generate_invented_qa
from rag_mspoe.eval.runs.results import read_records
from rag_mspoe.eval.settings_search.halving import BASELINE, HalvingSearch, HalvingSettings, standings
from rag_mspoe.eval.settings_search.spaces import SPACES, space_candidates
from rag_mspoe.methods import Pine
from rag_mspoe.methods.method_config import MethodConfig
from rag_mspoe.rope.uniform import Uniform


def _record(method, position, example, logprob, tokens=2):
    return {
        "method": method,
        "position": position,
        "example_id": example,
        "gold_logprob": logprob,
        "gold_tokens": tokens,
    }


def test_fitness_is_the_mean_gain_plus_the_gain_where_the_model_does_worst():
    records = [
        # The unmodified model: -1.0 per token at position 0, -3.0 (its worst) at position 1.
        *(_record(BASELINE, p, e, lp) for e in "ab" for p, lp in ((0, -2.0), (1, -6.0))),
        *(_record("middle", p, e, lp) for e in "ab" for p, lp in ((0, -2.0), (1, -4.0))),  # +1 at worst
        *(_record("start", p, e, lp) for e in "ab" for p, lp in ((0, 0.0), (1, -6.0))),  # +1 at best
        _record("partial", 0, "a", 0.0),  # not scored at every position: left out
    ]
    table = standings(records, ["start", "middle", "partial"], (0, 1), worst_weight=1.0)
    assert [s.label for s in table] == ["middle", "start"]
    assert table[0].gain == {0: 0.0, 1: 1.0} and table[0].fitness == pytest.approx(1.5)
    assert table[1].fitness == pytest.approx(0.5) and table[0].questions == 2


def test_every_space_gives_valid_distinct_configs():
    for name in SPACES:
        candidates = space_candidates(name, 24)
        assert 4 <= len(candidates) <= 30, name
        dumped = [json.dumps(c.to_dict(), sort_keys=True) for c in candidates.values()]
        assert len(set(dumped)) == len(dumped)
        for config in candidates.values():
            assert MethodConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="Unknown search space"):
        space_candidates("nope", 24)


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


def test_a_search_runs_its_rungs_resumes_and_refuses_other_settings(tiny, tmp_path):
    data = tmp_path / "questions.jsonl"
    save_jsonl(data, generate_invented_qa(4, 6, seed=3))
    settings = HalvingSettings(
        data=str(data), space="custom", num_documents=4, positions=(0, 3), rungs=(2, 3), keep=2
    )
    candidates = {
        "pi-2": Uniform(factor=2.0),
        "pi-4": Uniform(factor=4.0),
        "pi-1.1": Uniform(factor=1.1),
        "pine": Pine(),
    }
    search = HalvingSearch(tmp_path / "out", settings, candidates)
    load = dict(model=tiny[0], tokenizer=tiny[1], progress=False)
    assert search.run(budget_hours=1e-9, **load) == []  # the budget ends after one batch: none
    assert search.run(budget_hours=1e-9, **load) == []  # and the next: the first candidate
    ranking = (tmp_path / "out" / "ranking.md").read_text()
    assert "## Rung 1, stopped before its end" in ranking and "| pi-2 | 2 |" in ranking
    tables = HalvingSearch(tmp_path / "out", settings, candidates).run(**load)  # resumes
    assert [len(t) for t in tables] == [4, 2]
    rung_2 = read_records(tmp_path / "out" / "rung-2" / "results.jsonl")
    kept = {s.label for s in tables[0][:2]}
    assert {r["method"] for r in rung_2} == kept | {BASELINE}
    assert {r["example_id"] for r in rung_2}.isdisjoint(
        {r["example_id"] for r in read_records(tmp_path / "out" / "rung-1" / "results.jsonl")}
    )
    assert tables[1][0].questions == 5  # both rungs count
    best = tables[1][0]
    saved = tmp_path / "out" / "rag_mspoe_method.json"
    assert saved.is_file() == (best.fitness > 0)
    assert "## Rung 2\n" in (tmp_path / "out" / "ranking.md").read_text()
    with pytest.raises(ValueError, match="other settings"):
        HalvingSearch(tmp_path / "out", HalvingSettings(**{**settings.__dict__, "keep": 1}), candidates)
    with pytest.raises(ValueError, match="baseline of every rung"):
        HalvingSearch(tmp_path / "other", settings, {"none": Uniform(factor=2.0)})


def test_a_search_folder_resumes_where_it_moves_with_its_data(tmp_path):
    """Its data path is kept relative to it (a clone elsewhere resumes); other data is refused."""
    data = tmp_path / "repo" / "data" / "questions.jsonl"
    data.parent.mkdir(parents=True)
    save_jsonl(data, generate_invented_qa(4, 6, seed=3))
    settings = HalvingSettings(
        data=str(data), space="custom", num_documents=4, positions=(0, 3), rungs=(2,), keep=1
    )
    candidates = {"pi-2": Uniform(factor=2.0)}
    HalvingSearch(tmp_path / "repo" / "runs" / "search", settings, candidates)
    saved = json.loads((tmp_path / "repo" / "runs" / "search" / "search.json").read_text())
    assert saved["data"] == "../../data/questions.jsonl"
    (tmp_path / "repo").rename(tmp_path / "clone")
    moved = HalvingSettings(
        **{**settings.__dict__, "data": str(tmp_path / "clone" / "data" / "questions.jsonl")}
    )
    HalvingSearch(tmp_path / "clone" / "runs" / "search", moved, candidates)  # resumes
    other = tmp_path / "other.jsonl"
    save_jsonl(other, generate_invented_qa(4, 6, seed=4))
    with pytest.raises(ValueError, match="is not the data the search in .* started on"):
        HalvingSearch(
            tmp_path / "clone" / "runs" / "search",
            HalvingSettings(**{**settings.__dict__, "data": str(other)}),
            candidates,
        )
