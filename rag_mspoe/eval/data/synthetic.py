"""Synthetic examples, reproducible from a seed.

- `generate_kv`: key-value retrieval as in the lost-in-the-middle paper (random UUID pairs), or
  with short word keys and number values that a small model can follow.
- `generate_invented_qa`: multi-document QA about invented entities (towns, rivers, companies,
  ships with made-up names and facts), so no model can answer from memory. Every distractor
  states one fact of the same kind of value as the answer (a year, a person, ...), so the values
  in the context are all plausible answers and forced choice among them is meaningful.
"""

from __future__ import annotations

import functools
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from rag_mspoe.eval.data.records import Document, KVExample, QAExample
from rag_mspoe.eval.scoring.metrics import normalize_answer

# Short, common, distinct words: keys a small model reads as single tokens or nearly.
KEY_WORDS = (
    "apple", "anchor", "badge", "basket", "beacon", "bell", "blanket", "bottle", "bridge", "brush",
    "bucket", "button", "cabin", "camera", "candle", "canoe", "carpet", "castle", "chair", "cherry",
    "circle", "cloud", "clover", "coin", "comet", "copper", "cotton", "crown", "desert", "diamond",
    "dolphin", "dragon", "drum", "eagle", "engine", "falcon", "feather", "fence", "field", "flag",
    "flute", "forest", "fountain", "garden", "ginger", "glacier", "goat", "guitar", "hammer", "harbor",
    "helmet", "honey", "island", "jacket", "jungle", "kettle", "kite", "ladder", "lantern", "lemon",
    "library", "lizard", "magnet", "maple", "marble", "meadow", "mirror", "monkey", "needle", "ocean",
    "orange", "otter", "paddle", "palace", "panda", "pencil", "pepper", "piano", "pillow", "planet",
    "pocket", "puzzle", "rabbit", "ribbon", "rocket", "saddle", "sailor", "shadow", "silver", "spider",
    "spoon", "square", "statue", "stone", "sugar", "tiger", "tomato", "tower", "tunnel", "turtle",
    "umbrella", "valley", "velvet", "violin", "wagon", "walnut", "window", "winter", "wolf", "zebra",
)  # fmt: skip

# Syllables of invented names ("Velmora", "Tarquinel"): pronounceable, rarely real words.
_SYLLABLES = (
    "bra", "cor", "del", "fen", "gar", "hal", "ith", "jor", "kel", "lun", "mor", "nar", "ost",
    "pel", "quin", "ros", "sal", "tor", "ulm", "vel", "wen", "yar", "zen", "dra", "mir", "tav",
)  # fmt: skip
_MATERIALS = ("copper", "tin", "cedar", "wool", "glass", "clay", "silk", "slate", "amber", "linen", "iron")
_GOODS = ("lanterns", "bowls", "rope", "nails", "rugs", "bells", "tiles", "barrels", "combs", "kettles")


@dataclass(frozen=True)
class _Attribute:
    """One kind of fact about one kind of entity: how it is asked, and how documents state it."""

    kind: str
    value_type: str  # what the answer is: year, count, person, place, goods
    question: str
    statements: tuple[str, ...]  # several wordings of the same fact


_ATTRIBUTES = (
    _Attribute("town", "year", "In what year was the town of {e} founded?", (
        "{e} was founded in {v}.",
        "Settlers founded {e} in {v}.",
        "The founding of {e} dates to {v}.",
    )),
    _Attribute("town", "count", "How many people live in the town of {e}?", (
        "{e} has a population of {v}.",
        "About {v} people live in {e}.",
        "The census counts {v} people in {e}.",
    )),
    _Attribute("town", "person", "Who was the first mayor of the town of {e}?", (
        "The first mayor of {e} was {v}.",
        "{v} served as the first mayor of {e}.",
        "{e} chose {v} as its first mayor.",
    )),
    _Attribute("town", "place", "Which town is twinned with the town of {e}?", (
        "{e} is twinned with {v}.",
        "Since long ago {e} and {v} have been twin towns.",
        "The twin town of {e} is {v}.",
    )),
    _Attribute("town", "goods", "What is the main export of the town of {e}?", (
        "The main export of {e} is {v}.",
        "{e} is best known for exporting {v}.",
        "Most trade out of {e} is in {v}.",
    )),
    _Attribute("river", "year", "In what year was the river {e} first mapped?", (
        "The river {e} was first mapped in {v}.",
        "Surveyors first mapped the {e} in {v}.",
        "The first map of the river {e} was drawn in {v}.",
    )),
    _Attribute("river", "count", "How long is the river {e}, in kilometres?", (
        "The river {e} is {v} kilometres long.",
        "The {e} runs for {v} kilometres.",
        "From source to mouth the {e} measures {v} kilometres.",
    )),
    _Attribute("river", "person", "Who first sailed the whole length of the river {e}?", (
        "{v} was the first to sail the whole river {e}.",
        "The whole {e} was first sailed by {v}.",
        "The first voyage down the entire {e} was made by {v}.",
    )),
    _Attribute("river", "place", "Where does the river {e} rise?", (
        "The river {e} rises near {v}.",
        "The source of the {e} lies at {v}.",
        "The {e} begins in the hills above {v}.",
    )),
    _Attribute("river", "goods", "What do barges mostly carry on the river {e}?", (
        "Barges on the river {e} mostly carry {v}.",
        "The main cargo on the {e} is {v}.",
        "Most boats on the {e} are loaded with {v}.",
    )),
    _Attribute("company", "year", "In what year was the company {e} founded?", (
        "The company {e} was founded in {v}.",
        "{e} opened for business in {v}.",
        "The company {e} dates from {v}.",
    )),
    _Attribute("company", "count", "How many people does the company {e} employ?", (
        "The company {e} employs {v} people.",
        "{e} has a staff of {v}.",
        "The payroll of {e} lists {v} workers.",
    )),
    _Attribute("company", "person", "Who is the chief executive of the company {e}?", (
        "The chief executive of {e} is {v}.",
        "{v} runs the company {e}.",
        "The company {e} is led by {v}.",
    )),
    _Attribute("company", "place", "Where does the company {e} have its headquarters?", (
        "The company {e} has its headquarters in {v}.",
        "{e} is based in {v}.",
        "The head office of {e} is in {v}.",
    )),
    _Attribute("company", "goods", "What does the company {e} make?", (
        "The company {e} makes {v}.",
        "{e} is known for its {v}.",
        "The main product of {e} is {v}.",
    )),
    _Attribute("ship", "year", "In what year was the ship {e} launched?", (
        "The ship {e} was launched in {v}.",
        "The {e} first went to sea in {v}.",
        "Shipwrights launched the {e} in {v}.",
    )),
    _Attribute("ship", "count", "How many tonnes can the ship {e} carry?", (
        "The ship {e} can carry {v} tonnes.",
        "The {e} holds up to {v} tonnes of cargo.",
        "Fully loaded, the {e} carries {v} tonnes.",
    )),
    _Attribute("ship", "person", "Who was the first captain of the ship {e}?", (
        "The first captain of the ship {e} was {v}.",
        "{v} was the first to command the {e}.",
        "The {e} sailed first under {v}.",
    )),
    _Attribute("ship", "place", "What is the home port of the ship {e}?", (
        "The home port of the ship {e} is {v}.",
        "The {e} is registered in {v}.",
        "The ship {e} sails out of {v}.",
    )),
    _Attribute("ship", "goods", "What cargo does the ship {e} usually carry?", (
        "The ship {e} usually carries {v}.",
        "The {e} is mostly loaded with {v}.",
        "The usual cargo of the {e} is {v}.",
    )),
)  # fmt: skip
_MAX_FILLERS = 4  # the other value types of an entity's kind
_MAX_TRIES = 200


def generate_kv(num_pairs: int, num_examples: int, seed: int, short_keys: bool = False) -> list[KVExample]:
    """Key-value retrieval examples; the asked-for pair is at a random index.

    short_keys=False: keys and values are random UUIDs, as in the paper. short_keys=True: keys are
    distinct common words and values distinct four-digit numbers (at most len(KEY_WORDS) pairs).
    """
    if num_pairs < 2:
        raise ValueError(f"num_pairs must be at least 2 (one to find, one to ignore), got {num_pairs}.")
    if short_keys and num_pairs > len(KEY_WORDS):
        raise ValueError(
            f"short_keys has {len(KEY_WORDS)} distinct words, fewer than num_pairs={num_pairs}; "
            "ask for fewer pairs or use UUID keys (short_keys=False)."
        )
    _check_count("num_examples", num_examples)
    rng = random.Random(seed)
    examples = []
    for number in range(num_examples):
        if short_keys:
            keys = rng.sample(KEY_WORDS, num_pairs)
            values = [str(v) for v in rng.sample(range(1000, 10000), num_pairs)]
        else:
            keys = _uuids(rng, num_pairs)
            values = _uuids(rng, num_pairs)
        pairs = tuple(zip(keys, values, strict=True))
        key, value = pairs[rng.randrange(num_pairs)]
        examples.append(KVExample(id=f"kv-{seed}-{number}", pairs=pairs, key=key, value=value))
    return examples


def generate_invented_qa(
    num_documents: int,
    num_examples: int,
    seed: int,
    distractor_similarity: float = 0.5,
    *,
    filler_sentences: int = 0,
) -> list[QAExample]:
    """Multi-document QA over invented facts; the gold document is at a random index.

    Each example asks one fact of one invented entity. The gold document states it; each of the
    other documents is about another invented entity and states one value of the same type (a
    candidate answer), with filler sentences of other types. The answer and the entity's name
    appear in the gold document only, and every candidate in exactly one document.

    distractor_similarity in [0, 1] is the chance, drawn separately for each distractor, that it
    (a) states the same attribute of the same kind of entity, (b) with the gold's wording when
    it does, and (c) names an entity that starts like the gold's. At 0 distractors state other
    attributes of other kinds of entity under unrelated names; at 1 they differ from the gold
    only in the name (similar) and the value.

    filler_sentences (0 to 4): facts of other value types added to every document, each about 12
    tokens. With none, SmolLM2-135M picks the gold among 10 candidates about half the time when
    it is in document 1 and a fifth of the time elsewhere; two fillers bring that down to a
    quarter and a tenth (20 examples per position), so harder settings suit larger models.
    """
    if num_documents < 1:
        raise ValueError(f"num_documents must be at least 1 (the gold document), got {num_documents}.")
    _check_count("num_examples", num_examples)
    if not 0.0 <= distractor_similarity <= 1.0:
        raise ValueError(f"distractor_similarity must be in [0, 1], got {distractor_similarity}.")
    if not 0 <= filler_sentences <= _MAX_FILLERS:
        raise ValueError(f"filler_sentences must be in [0, {_MAX_FILLERS}], got {filler_sentences}.")
    rng = random.Random(seed)
    return [
        _clean_example(
            rng, f"invented-{seed}-{number}", num_documents, distractor_similarity, filler_sentences
        )
        for number in range(num_examples)
    ]


def _check_count(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")


def _uuids(rng: random.Random, count: int) -> list[str]:
    found: dict[str, None] = {}  # ordered and unique
    while len(found) < count:
        found[str(uuid.UUID(int=rng.getrandbits(128), version=4))] = None
    return list(found)


class _Exhausted(Exception):
    """No unused name or value was found: the request needs more than the generator can invent."""


class _Names:
    """Names and values already used in one example, so that none contains another."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def fresh(self, make: Callable[[random.Random], str], rng: random.Random) -> str:
        for _ in range(_MAX_TRIES):
            candidate = make(rng)
            low = candidate.lower()
            if all(low not in other and other not in low for other in self.used):
                self.used.append(low)
                return candidate
        raise _Exhausted


def _invented_word(rng: random.Random, first: str | None = None) -> str:
    start = first or rng.choice(_SYLLABLES)
    rest = rng.sample([s for s in _SYLLABLES if s != start], rng.randint(1, 2))
    return (start + "".join(rest)).capitalize()


def _value(value_type: str, rng: random.Random) -> str:
    if value_type == "year":
        return str(rng.randint(1100, 1899))
    if value_type == "count":  # four digits above any year, so a count never equals a year
        return str(rng.randint(2000, 9999))
    if value_type == "person":
        return f"{_invented_word(rng)} {_invented_word(rng)}"
    if value_type == "place":
        return _invented_word(rng)
    return f"{rng.choice(_MATERIALS)} {rng.choice(_GOODS)}"


def _clean_example(
    rng: random.Random, example_id: str, num_documents: int, similarity: float, fillers: int
) -> QAExample:
    """Draw examples until one passes `_is_clean` (a draw rarely fails it)."""
    try:
        for _ in range(_MAX_TRIES):
            example = _invented_example(rng, example_id, num_documents, similarity, fillers)
            if _is_clean(example):
                return example
    except _Exhausted:
        pass
    raise ValueError(
        f"Could not invent {num_documents} documents with distinct names and values; ask for fewer documents."
    )


def _invented_example(
    rng: random.Random, example_id: str, num_documents: int, similarity: float, fillers: int
) -> QAExample:
    names = _Names()
    gold_attribute = rng.choice(_ATTRIBUTES)
    gold_name = names.fresh(_invented_word, rng)
    gold_wording = rng.randrange(len(gold_attribute.statements))
    gold_value = names.fresh(functools.partial(_value, gold_attribute.value_type), rng)
    documents = [
        _document(rng, names, gold_attribute, gold_name, gold_wording, gold_value, fillers, is_gold=True),
    ]
    candidates = [gold_value]
    first_syllable = gold_name.lower()[:3]
    for _ in range(num_documents - 1):
        if rng.random() < similarity:
            attribute = gold_attribute
            wording = gold_wording if rng.random() < similarity else rng.randrange(len(attribute.statements))
        else:
            attribute = rng.choice(
                [
                    a
                    for a in _ATTRIBUTES
                    if a.value_type == gold_attribute.value_type and a.kind != gold_attribute.kind
                ]
            )
            wording = rng.randrange(len(attribute.statements))
        similar = rng.random() < similarity
        name = names.fresh(functools.partial(_invented_word, first=first_syllable if similar else None), rng)
        value = names.fresh(functools.partial(_value, attribute.value_type), rng)
        documents.append(_document(rng, names, attribute, name, wording, value, fillers, is_gold=False))
        candidates.append(value)
    rng.shuffle(documents)
    return QAExample(
        id=example_id,
        question=gold_attribute.question.format(e=gold_name),
        answers=(gold_value,),
        documents=tuple(documents),
        candidates=tuple(sorted(candidates)),  # sorted: their order says nothing about the gold
    )


def _document(
    rng: random.Random,
    names: _Names,
    attribute: _Attribute,
    name: str,
    wording: int,
    value: str,
    fillers: int,
    *,
    is_gold: bool,
) -> Document:
    """The main fact in one of its wordings, among `fillers` facts of other value types."""
    sentences = [attribute.statements[wording].format(e=name, v=value)]
    others = [a for a in _ATTRIBUTES if a.kind == attribute.kind and a.value_type != attribute.value_type]
    for filler in rng.sample(others, fillers):
        filler_value = names.fresh(functools.partial(_value, filler.value_type), rng)
        sentences.append(rng.choice(filler.statements).format(e=name, v=filler_value))
    rng.shuffle(sentences)
    return Document(title=name, text=" ".join(sentences), is_gold=is_gold, has_answer=is_gold)


def _is_clean(example: QAExample) -> bool:
    """The gold entity and answer occur only in the gold document, each candidate in exactly one
    document, and no candidate contains another (so matching an answer is unambiguous)."""
    texts = [normalize_answer(f"{d.title} {d.text}") for d in example.documents]
    gold = next(i for i, d in enumerate(example.documents) if d.is_gold)
    entity = normalize_answer(example.documents[gold].title)
    if [i for i, text in enumerate(texts) if entity in text] != [gold]:
        return False
    answer = normalize_answer(example.answers[0])
    if [i for i, text in enumerate(texts) if answer in text] != [gold]:
        return False
    normalised = [normalize_answer(c) for c in example.candidates]
    return all(
        sum(candidate in text for text in texts) == 1 and sum(candidate in other for other in normalised) == 1
        for candidate in normalised
    )
