"""The prompt-lookup loop: from any starting cache, its answer is plain greedy decoding's, token for
token, and it stops where generate would (length, end of sequence, a stopping criterion)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from tiny_models import tiny_model
from transformers.cache_utils import DynamicCache

from rag_mspoe.engine.prompt_lookup import decode_with_drafts, drafted_tokens, drafts_apply
from rag_mspoe.rope.hooks import cache_argument, returned_cache


def test_drafts_follow_the_latest_occurrence_of_the_longest_tail():
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert drafted_tokens(tokens, 3) == [8, 2, 5]  # "5 6" last seen at 4, then 8 2 5
    assert drafted_tokens(tokens, 1) == [8]
    assert drafted_tokens([1, 2, 3, 9, 2, 3, 4, 7, 3], 2) == [4, 7]  # no earlier "4 7 3" or "7 3": "3"
    assert drafted_tokens([1, 2, 3], 4) == []
    assert drafted_tokens(tokens, 0) == []


@pytest.fixture(scope="module")
def model():
    # Large random weights: peaked, repetitive greedy outputs, so many drafts are accepted.
    return tiny_model("llama", vocab_size=64, max_position_embeddings=512, initializer_range=0.3).float()


def greedy(model, ids, max_new_tokens, eos=None):
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        disable_compile=True,
    )
    return out[0, len(ids) :].tolist()


@contextmanager
def recorded_reads(model):
    """The tokens each forward of `model` reads while the block runs, in order."""
    reads: list[int] = []
    forward = model.forward

    def recorded(input_ids, **kwargs):
        reads.append(input_ids.shape[1])
        return forward(input_ids, **kwargs)

    model.forward = recorded
    try:
        yield reads
    finally:
        del model.forward


def drafted_from_the_prompt(model, ids, max_new_tokens):
    """(the answer drafted 10 tokens ahead from the prompt alone, the tokens each forward read)."""
    with recorded_reads(model) as reads, torch.inference_mode():
        answer = decode_with_drafts(
            model,
            ids,
            cache=None,
            max_new_tokens=max_new_tokens,
            draft_tokens=10,
            eos_ids=[],
            finished=lambda s: False,
        )
    return answer, reads


def prefilled(model, ids):
    with torch.inference_mode():
        return returned_cache(model(torch.tensor([ids]), use_cache=True, **cache_argument(DynamicCache())))


def prompts(count, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (length,), generator=generator).tolist() for _ in range(count)]


@pytest.mark.parametrize("kept", [0, 10, 29])
def test_drafted_answers_equal_greedy_from_any_kept_start(model, kept):
    steps = 0
    for ids in prompts(4, 30):
        expected = greedy(model, ids, 24)
        cache = prefilled(model, ids[:kept]) if kept else None
        forwards: list[int] = []

        def finished(sequence, forwards=forwards):
            forwards.append(sequence.shape[1])
            return False

        with torch.inference_mode():
            answer = decode_with_drafts(
                model,
                ids,
                cache=cache,
                max_new_tokens=24,
                draft_tokens=6,
                eos_ids=[],
                finished=finished,
            )
        assert answer == expected
        assert forwards[-1] == len(ids) + 24
        steps += len(forwards)
    assert steps < 4 * 24  # some drafts were taken, several tokens a forward


def test_an_end_of_sequence_token_or_a_criterion_ends_the_answer(model):
    ids = prompts(1, 30, seed=1)[0]
    plain = greedy(model, ids, 20)
    eos = plain[5]
    with torch.inference_mode():
        answer = decode_with_drafts(
            model, ids, cache=None, max_new_tokens=20, draft_tokens=6, eos_ids=[eos], finished=lambda s: False
        )
        assert answer == greedy(model, ids, 20, eos=eos)
        assert answer[-1] == eos and eos not in answer[:-1]
        stopped = decode_with_drafts(
            model,
            ids,
            cache=None,
            max_new_tokens=20,
            draft_tokens=6,
            eos_ids=[],
            finished=lambda sequence: sequence.shape[1] >= len(ids) + 3,
        )
    assert stopped[:3] == plain[:3] and len(stopped) < 20


def test_a_cache_holding_the_whole_prompt_is_refused(model):
    ids = prompts(1, 12)[0]
    with pytest.raises(ValueError, match="last one to read"):
        decode_with_drafts(
            model,
            ids,
            cache=prefilled(model, ids),
            max_new_tokens=4,
            draft_tokens=4,
            eos_ids=[],
            finished=any,
        )


def test_a_model_whose_config_changes_greedy_choices_is_not_drafted(model):
    assert drafts_apply(model)
    model.generation_config.repetition_penalty = 1.1
    try:
        assert not drafts_apply(model)
    finally:
        model.generation_config.repetition_penalty = 1.0


def test_the_prompt_is_read_alone_as_plain_decoding_reads_it(model):
    # int8-prompt reads a call of over 16 tokens in int8 and a shorter one exactly: drafted tokens
    # read behind the prompt would be read otherwise than greedy decoding reads them.
    ids = prompts(1, 30, seed=3)[0]
    ids = ids + ids[:12]  # its last tokens occurred before: there is a draft from the start
    assert drafted_tokens(ids, 10)
    answer, reads = drafted_from_the_prompt(model, ids, 8)
    assert answer == greedy(model, ids, 8)
    assert reads[0] == len(ids) and max(reads[1:]) <= 11
