"""Write atlas.jsonl beside this script: a larger set of general-knowledge questions.

Questions written for tokentrail, released under the project's MIT licence: the facts are
common knowledge; the wording, the selection, the accepted alternatives and the
distractors are ours. Families: the country whose capital a city is (the reverse of
facts.jsonl's capitals), the continent of countries knowledge.jsonl leaves out, a
country's main language, currency and nationality, an element's symbol (elements
facts.jsonl leaves out), the element a symbol (facts.jsonl's elements) or an atomic number
stands for, the capitals of US states and of Canadian and Australian states, provinces
and territories, who painted or composed a work, who discovered or invented something,
an animal's class, how many (sides, days, players, ...), the comparative and the
superlative of adjectives, the past participle of irregular verbs, the female equivalent
of a word, the country of a landmark or a city, the river through a city, space, colours
and SI units. About a fifth of each family's questions (space, colours and units
excepted) are asked as a two- or four-way choice instead, the other options being other
answers of the same family. No accepted free-text answer appears as whole words in its
question and no question repeats one of facts.jsonl or knowledge.jsonl (both asserted
below). Run `python make_atlas.py` to rebuild the file byte for byte (one seed,
`random.Random(3232)`).
"""

from __future__ import annotations

import functools
import random
import sys
from collections import Counter
from itertools import zip_longest
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # make_sets.py and make_knowledge.py sit beside this script
    sys.path.insert(0, str(HERE))

import make_knowledge  # noqa: E402
import make_sets  # noqa: E402
from atlas_facts import (  # noqa: E402
    ATOMIC,
    CLASSES,
    COLOUR,
    COMPARE,
    COMPOSED,
    ELEMENT_ALSO,
    FEMININE,
    HOW_MANY,
    PAINTED,
    PARTICIPLE,
    SCULPTED,
    SPACE,
    SYMBOLS,
    UNIT,
    WHO,
)
from atlas_places import (  # noqa: E402
    AUSTRALIA,
    CANADA,
    CITY,
    CURRENCY,
    LANDMARK,
    LANGUAGE,
    MORE_CAPITALS,
    MORE_CONTINENTS,
    NATIONALITY,
    NOT_REVERSED,
    PLURAL_PLACES,
    RIVER,
    US_STATES,
    countries,
    country,
)
from make_knowledge import CONTINENT_ALSO, CONTINENTS, words  # noqa: E402
from make_sets import CAPITALS, ELEMENTS, SYSTEM, write  # noqa: E402

SEED = 3232
#: The share of a family's questions asked as a choice (families with choices).
CHOICE_SHARE = 0.2


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def spelled(n: int) -> list[str]:
    """n (below 10,000) in words, with and without 'and': 144 -> 'one hundred and
    forty-four', 'one hundred forty-four'."""
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")]
    big, unit = (100, "hundred") if n < 1000 else (1000, "thousand")
    head, rest = f"{_ONES[n // big]} {unit}", n % big
    if not rest:
        return [head]
    if rest < 100:
        return [f"{head} and {spelled(rest)[0]}", f"{head} {spelled(rest)[0]}"]
    return [f"{head} {s}" for s in spelled(rest)]


def number(n: int) -> list[str]:
    return [str(n), *([f"{n:,}"] if n >= 1000 else []), *spelled(n)]


def earlier_questions() -> set[str]:
    """The questions of facts.jsonl and knowledge.jsonl (no question here repeats one)."""
    items = [*make_sets.facts(random.Random(make_sets.SEED)),
             *make_knowledge.knowledge(random.Random(make_knowledge.SEED))]
    return {words(it["messages"][-1]["content"]) for it in items}


def atlas(rng: random.Random) -> list[dict]:
    items: list[dict] = []

    add = functools.partial(make_knowledge.add_item, items)

    def family(name: str, entries: list[tuple[str, list[str]]], choices: bool = True) -> None:
        """Add a family's questions; with `choices`, a share of them (drawn) as a two- or
        four-way choice among its first answer and other entries' first answers."""
        labels = list({words(a[0]): a[0] for _, a in entries}.values())
        picked = set(rng.sample(range(len(entries)), round(len(entries) * CHOICE_SHARE))
                     if choices else [])
        ways = 4
        for i, (question, answers) in enumerate(entries):
            if i not in picked:
                add(name, question, answers)
                continue
            banned = {words(a) for a in answers}
            pool = [x for x in labels
                    if words(x) not in banned and f" {words(x)} " not in f" {words(question)} "]
            options = [*rng.sample(pool, ways - 1), answers[0]]
            rng.shuffle(options)
            add(f"{name}_choice", f"{question} Options: " + ", ".join(options) + ".",
                [answers[0]], options)
            ways = 6 - ways  # alternately four-way and two-way

    capitals = {c: city for c, city in CAPITALS.items() if c not in NOT_REVERSED}
    assert not set(capitals) & set(MORE_CAPITALS)
    family("capital_of", [(f"{city} is the capital of which country?", country(c))
                          for c, city in (capitals | MORE_CAPITALS).items()])

    known = {c for names in CONTINENTS.values() for c in names.split("; ")}
    continent_entries = []
    for continent, names in MORE_CONTINENTS.items():
        for c in names.split("; "):
            assert c not in known, c
            continent_entries.append((f"On which continent is {c}?",
                                      [continent, *CONTINENT_ALSO.get(continent, [])]))
    family("continent", continent_entries)

    family("language", [(f"What is the main language spoken in {c}?", a)
                        for c, a in LANGUAGE.items()])
    family("currency", [(f"What is the currency of {c}?", a) for c, a in CURRENCY.items()])
    family("nationality", [(f"What nationality is a person from {c}?", a)
                           for c, a in NATIONALITY.items()])

    assert not set(SYMBOLS) & set(ELEMENTS)
    family("symbol", [(f"What is the chemical symbol of {e}?", [s]) for e, s in SYMBOLS.items()])
    family("element", [(f"Which chemical element has the symbol {s}?",
                        [e, *ELEMENT_ALSO.get(e, [])]) for e, s in ELEMENTS.items()])
    family("atomic_number", [(f"Which chemical element has the atomic number {n}?",
                              [e, *ELEMENT_ALSO.get(e, [])]) for n, e in ATOMIC.items()])

    family("state_capital",
           [(f"What is the capital of the US state of {s}?", a) for s, a in US_STATES.items()]
           + [(f"What is the capital of the Canadian {p}?", a) for p, a in CANADA.items()]
           + [(f"What is the capital of the Australian {p}?", a) for p, a in AUSTRALIA.items()])

    def titled(verb: str, work: str) -> str:  # a bare title is quoted, a phrase is not
        return f"Who {verb} {work}?" if work[0] in "'t" else f"Who {verb} '{work}'?"

    family("painter", [(titled("painted", w), a) for w, a in PAINTED.items()]
           + [(titled("sculpted", w), a) for w, a in SCULPTED.items()])
    family("composer", [(titled("composed", w), a) for w, a in COMPOSED.items()])
    family("discoverer", list(WHO.items()))

    family("animal_class", [(f"To which class of animals does the {animal} belong?", list(c))
                            for c, animals in CLASSES.items() for animal in animals.split("; ")])
    family("how_many", [(q, number(n)) for q, n in HOW_MANY.items()])

    family("comparative", [(f"What is the comparative form of '{w}'?", c)
                           for w, (c, _) in COMPARE.items()])
    family("superlative", [(f"What is the superlative form of '{w}'?", s)
                           for w, (_, s) in COMPARE.items()])
    family("participle", [(f"What is the past participle of '{v}'?", a)
                          for v, a in PARTICIPLE.items()])
    family("feminine", [(f"What is the female equivalent of '{w}'?", a)
                        for w, a in FEMININE.items()])

    family("landmark", [(f"In which country {'are' if p in PLURAL_PLACES else 'is'} {p}?",
                         countries(a)) for p, a in LANDMARK.items()])
    family("city_country", [(f"In which country is the city of {c}?", countries(a))
                            for c, a in CITY.items()])
    family("river", [(f"Which river flows through {c}?", a) for c, a in RIVER.items()])

    family("space", list(SPACE.items()), choices=False)
    family("colour", list(COLOUR.items()), choices=False)
    family("unit", list(UNIT.items()), choices=False)

    questions = [words(it["messages"][-1]["content"]) for it in items]
    assert len(set(questions)) == len(questions), "a question repeats"
    assert not set(questions) & earlier_questions(), "a question repeats another set's"
    return deal(items, rng)


def deal(items: list[dict], rng: random.Random) -> list[dict]:
    """`items` shuffled, then dealt so that alternate lines (`--half 1|2`) split every
    family (a choice family apart from its free-text one) evenly: each family's items go
    to the halves in turn, a family with an odd count giving its extra one to the half that
    has had fewer such extras; the halves are then interleaved."""
    rng.shuffle(items)
    family = [it["id"].rsplit("-", 1)[0] for it in items]
    counts, seen, start, flip = Counter(family), Counter(), {}, 0
    halves: tuple[list[dict], list[dict]] = ([], [])
    for it, f in zip(items, family, strict=True):
        if f not in start:
            start[f], flip = flip, flip ^ (counts[f] % 2)
        halves[(start[f] + seen[f]) % 2].append(it)
        seen[f] += 1
    first, second = sorted(halves, key=len, reverse=True)
    assert len(first) - len(second) <= 1
    return [it for pair in zip_longest(first, second) for it in pair if it is not None]


if __name__ == "__main__":
    items = atlas(random.Random(SEED))
    assert items[0]["messages"][0]["content"] == SYSTEM
    write("atlas.jsonl", items)
    make_knowledge.print_families(items)
