"""Deterministic plain-English text for building and testing models without any data set.

The stories follow a handful of templates in the style of TinyStories: a few hundred everyday words, short
sentences, dialogue in quotes and the odd number, so that a tokenizer trained on it looks like a real one and a
small model trained on it learns real structure. Paragraphs (one story each) are separated by blank lines.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "calibrate", "heldout")


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


NAMES = _words("Lily Tom Mia Ben Sara Max Anna Leo Zoe Sam Lucy Jack Emma Tim Ella Finn Rosa Ivan Nora Omar Ruby Kai")
GIRLS = frozenset(_words("Lily Mia Sara Anna Zoe Lucy Emma Ella Rosa Nora Ruby"))
ANIMALS = _words("cat dog bird rabbit fox bear frog duck owl horse turtle lion pig cow bee squirrel puppy kitten")
SIZES = _words("little big tiny small tall young old")
TRAITS = _words("happy sad brave shy kind curious silly grumpy friendly clever lazy gentle busy proud quiet funny")
COLORS = _words("red blue green yellow pink purple orange brown white black shiny")
PLACES = _words("park forest garden house farm school village beach river hill town lake field castle kitchen zoo")
THINGS = _words(
    "ball kite box hat book toy cake apple flower boat car drum shell stick rock key map cup sock bell leaf "
    "star blanket lamp basket"
)
FOODS = _words("apples cookies bread soup berries carrots cheese pie eggs honey grapes")
VERBS_PAST = _words("played jumped ran walked danced sang laughed climbed swam waited hid rested")
GERUNDS = _words("playing jumping running dancing singing swimming reading drawing baking")
FEELINGS = _words("happy sad scared excited tired angry surprised proud worried glad")
WEATHER = _words("sunny rainy windy cold warm snowy cloudy bright")
TIMES = ("One day", "One morning", "Later that day", "The next day", "One evening", "After lunch", "At night")
FAMILY = _words("mom dad sister brother friend teacher grandma grandpa neighbor")
REACTIONS = _words("nodded laughed smiled frowned")
LESSONS = (
    "sharing is good",
    "being kind makes friends",
    "it is good to be careful",
    "asking for help is brave",
    "patience brings rewards",
    "friends help each other",
    "trying again is important",
    "honesty is best",
)


def synth_corpus(seed: int, n_chars: int, split: str = "train") -> str:
    """Whole stories joined by blank lines, stopping once at least `n_chars` characters are written.

    The same arguments always give the same text, and each split draws from its own random stream, so text of
    the "heldout" split is never the text a model was trained or calibrated on.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    # A string seed is hashed with SHA-512, so the stream does not depend on PYTHONHASHSEED.
    rng = random.Random(f"{split}/{seed}")
    stories: list[str] = []
    total = 0
    while total < n_chars:
        story = _story(rng)
        stories.append(story)
        total += len(story) + 2
    return "\n\n".join(stories)


def paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


@dataclass(frozen=True)
class _Character:
    name: str
    kind: str
    size: str
    trait: str

    @property
    def he(self) -> str:
        return "she" if self.name in GIRLS else "he"

    @property
    def his(self) -> str:
        return "her" if self.name in GIRLS else "his"


def _character(rng: random.Random, avoid: str = "") -> _Character:
    name = rng.choice([n for n in NAMES if n != avoid])
    person = "girl" if name in GIRLS else "boy"
    kind = person if rng.random() < 0.4 else rng.choice(ANIMALS)
    return _Character(name, kind, rng.choice(SIZES), rng.choice(TRAITS))


def _story(rng: random.Random) -> str:
    hero = _character(rng)
    friend = _character(rng, avoid=hero.name)
    parts = [rng.choice(_OPENINGS)(rng, hero)]
    parts += [rng.choice(_EVENTS)(rng, hero, friend) for _ in range(rng.randint(2, 4))]
    parts.append(rng.choice(_ENDINGS)(rng, hero, friend))
    return " ".join(parts)


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(word: str) -> str:
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + ("es" if word[-1] in "sx" else "s")


def _cap(word: str) -> str:
    return word[0].upper() + word[1:]


def _opening_once(rng: random.Random, c: _Character) -> str:
    return (
        f"Once upon a time, there was {_a(c.size)} {c.trait} {c.kind} named {c.name}. "
        f"{_cap(c.he)} lived in {_a(rng.choice(PLACES))} near the {rng.choice(PLACES)}."
    )


def _opening_weather(rng: random.Random, c: _Character) -> str:
    return (
        f"It was a {rng.choice(WEATHER)} day. {c.name} the {c.kind} woke up and felt {rng.choice(FEELINGS)}. "
        f"{_cap(c.he)} wanted to go to the {rng.choice(PLACES)}."
    )


def _opening_love(rng: random.Random, c: _Character) -> str:
    return (
        f"{c.name} was {_a(c.trait)} {c.kind} who loved {rng.choice(FOODS)} and {rng.choice(GERUNDS)}. "
        f"Every day, {c.he} played with {c.his} {rng.choice(COLORS)} {rng.choice(THINGS)}."
    )


def _event_find(rng: random.Random, c: _Character, o: _Character) -> str:
    thing = rng.choice(THINGS)
    return (
        f"{rng.choice(TIMES)}, {c.name} found {_a(rng.choice(COLORS))} {thing} in the {rng.choice(PLACES)}. "
        f'"Look what I found!" {c.he} said to {o.name}. {o.name} smiled and said, "What a nice {thing}!"'
    )


def _event_lost(rng: random.Random, c: _Character, o: _Character) -> str:
    thing = rng.choice(THINGS)
    return (
        f"{rng.choice(TIMES)}, {c.name} lost {c.his} {thing}. {_cap(c.he)} felt {rng.choice(FEELINGS)} and looked "
        f"under the {rng.choice(THINGS)} and behind the {rng.choice(THINGS)}. {o.name} the {o.kind} came to help, "
        f"and together they found the {thing} near the {rng.choice(PLACES)}."
    )


def _event_share(rng: random.Random, c: _Character, o: _Character) -> str:
    have, give = rng.randint(2, 9), rng.randint(1, 5)
    give = min(give, have)
    return (
        f'{c.name} had {have} {rng.choice(FOODS)}. {o.name} asked, "Can I have some?" {c.name} gave {o.name} '
        f"{give} of them, and now {c.he} had {have - give} left. They ate together and {rng.choice(VERBS_PAST)}."
    )


def _event_play(rng: random.Random, c: _Character, o: _Character) -> str:
    return (
        f"{c.name} and {o.name} went to the {rng.choice(PLACES)}. They {rng.choice(VERBS_PAST)} and "
        f"{rng.choice(VERBS_PAST)} all day. The sky was {rng.choice(WEATHER)} and the {_plural(rng.choice(ANIMALS))} "
        f"were {rng.choice(TRAITS)}."
    )


def _event_problem(rng: random.Random, c: _Character, o: _Character) -> str:
    return (
        f"But then, {_a(rng.choice(SIZES))} {rng.choice(ANIMALS)} took {c.name}'s {rng.choice(THINGS)}. "
        f'"Stop!" shouted {c.name}. {_cap(c.his)} {rng.choice(FAMILY)} said, '
        f'"Do not be {rng.choice(FEELINGS)}. We can fix this."'
    )


def _event_ask(rng: random.Random, c: _Character, o: _Character) -> str:
    return (
        f'{c.name} asked {c.his} {rng.choice(FAMILY)}, "Why is the {rng.choice(THINGS)} so {rng.choice(COLORS)}?" '
        f'"Because it likes {rng.choice(WEATHER)} days," came the answer. {c.name} thought about it and '
        f"{rng.choice(REACTIONS)}."
    )


def _ending_lesson(rng: random.Random, c: _Character, o: _Character) -> str:
    return f"In the end, {c.name} learned that {rng.choice(LESSONS)}. {_cap(c.he)} was very {rng.choice(FEELINGS)}."


def _ending_home(rng: random.Random, c: _Character, o: _Character) -> str:
    return (
        f"When the sun went down, {c.name} went home to {c.his} {rng.choice(FAMILY)}. "
        f"{_cap(c.he)} ate some {rng.choice(FOODS)} and fell asleep with {c.his} {rng.choice(THINGS)}. The end."
    )


def _ending_friends(rng: random.Random, c: _Character, o: _Character) -> str:
    return (
        f"From that day on, {c.name} and {o.name} were best friends. They played in the {rng.choice(PLACES)} "
        f"every {rng.choice(WEATHER)} day."
    )


_OPENINGS: tuple[Callable[[random.Random, _Character], str], ...] = (_opening_once, _opening_weather, _opening_love)
_EVENTS: tuple[Callable[[random.Random, _Character, _Character], str], ...] = (
    _event_find,
    _event_lost,
    _event_share,
    _event_play,
    _event_problem,
    _event_ask,
)
_ENDINGS: tuple[Callable[[random.Random, _Character, _Character], str], ...] = (
    _ending_lesson,
    _ending_home,
    _ending_friends,
)
