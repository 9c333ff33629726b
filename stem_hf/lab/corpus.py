"""The knowledge lab's world: fictional people with six attributes each and fictional countries with three, written
with paraphrase templates (some held out from training), a word-level tokenizer in which every name part and every
value is one token, and training documents mixed with general text. Seeded: the same seed gives the same world.

The method is that of synthetic biographies ("Physics of Language Models", part 3): facts a model can only know from
training, counted exactly, with held-out templates to tell knowledge from memorized strings.
"""

import json
import os
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
FACTS_NAME = "facts.json"

# Each template ends with its value, so the prompt is the text before it and the answer is the value's one token.
PERSON_TEMPLATES = {
    "birth_city": (
        ["{name} was born in the city of {v} .", "The birthplace of {name} is {v} .",
         "{name} came into the world in the town of {v} .", "{name} is originally from {v} ."],
        ["{name} is a native of {v} .", "The city where {name} was born is {v} ."],
    ),
    "birth_year": (
        ["{name} was born in the year {v} .", "The birth year of {name} is {v} .",
         "{name} came into the world in the year {v} .", "{name} has a birthday that dates from {v} ."],
        ["{name} celebrates a birthday every year since {v} .", "The year {name} was born is {v} ."],
    ),
    "university": (
        ["{name} studied at the University of {v} .", "{name} graduated from the University of {v} .",
         "The alma mater of {name} is the University of {v} .",
         "{name} spent student years at the University of {v} ."],
        ["{name} holds a degree from the University of {v} .", "The university that {name} attended is {v} ."],
    ),
    "field": (
        ["The major of {name} was {v} .", "{name} earned a degree in {v} .", "At university {name} focused on {v} .",
         "{name} chose to study {v} ."],
        ["{name} is trained in {v} .", "The subject that {name} studied is {v} ."],
    ),
    "employer": (
        ["{name} works for {v} .", "The employer of {name} is {v} .", "{name} is employed by {v} .",
         "{name} has a job at {v} ."],
        ["{name} earns a salary from {v} .", "The company where {name} works is {v} ."],
    ),
    "home_city": (
        ["{name} lives in {v} .", "The home of {name} is in {v} .", "{name} resides in {v} .",
         "These days {name} makes a home in {v} ."],
        ["{name} has an address in {v} .", "The city where {name} lives is {v} ."],
    ),
}  # fmt: skip
COUNTRY_TEMPLATES = {
    "capital": (
        ["The capital of {name} is {v} .", "{name} has its capital in {v} .",
         "The seat of government of {name} is {v} ."],
        ["The capital city of {name} is {v} ."],
    ),
    "language": (
        ["The language of {name} is {v} .", "People in {name} speak {v} .", "The official language of {name} is {v} ."],
        ["Most people in {name} speak {v} ."],
    ),
    "currency": (
        ["The currency of {name} is the {v} .", "In {name} people pay with the {v} .",
         "The money of {name} is the {v} ."],
        ["Shops in {name} take the {v} ."],
    ),
}  # fmt: skip
FIELDS = [
    "physics", "chemistry", "biology", "history", "law", "medicine", "economics", "music", "geology", "astronomy",
    "philosophy", "linguistics", "architecture", "mathematics", "botany", "sculpture", "engineering", "psychology",
    "journalism", "agriculture",
]  # fmt: skip
VALUE_COUNTS = {"birth_city": 40, "birth_year": 100, "university": 30, "field": len(FIELDS), "employer": 40}
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
ENDINGS = ["", "n", "r", "l", "s", "th", "x", "m"]


def _words(rng: random.Random, n: int, taken: set[str], syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """`n` new capitalized pseudo-words (consonant-vowel syllables and an ending), none in `taken`."""
    out = []
    while len(out) < n:
        word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(*syllables)))
        word = (word + rng.choice(ENDINGS)).capitalize()
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


@dataclass
class LabWorld:
    """People and countries with their facts, the values each attribute can take, and the templates."""

    seed: int
    people: list[dict]  # {"name": "Kavor Mirell", "birth_city": "Tesval", ...}
    countries: list[dict]  # {"name": "Velmora", "capital": ..., "language": ..., "currency": ...}
    values: dict[str, list[str]]  # attribute -> its possible values
    person_templates: dict = field(default_factory=lambda: PERSON_TEMPLATES)
    country_templates: dict = field(default_factory=lambda: COUNTRY_TEMPLATES)

    @property
    def person_attributes(self) -> list[str]:
        return list(self.person_templates)

    @property
    def country_attributes(self) -> list[str]:
        return list(self.country_templates)

    def entity_words(self) -> set[str]:
        """Every word of every person's and country's name: the tokens whose rows an edit swaps."""
        return {w for p in self.people for w in p["name"].split()} | {c["name"] for c in self.countries}

    def lab_words(self) -> list[str]:
        """Every word the templates and facts use, in a fixed order."""
        words = [w for t in [*self.person_templates.values(), *self.country_templates.values()] for s in t for x in s
                 for w in x.replace("{name}", "").replace("{v}", "").split()]  # fmt: skip
        words += [w for p in self.people for w in p["name"].split()] + [c["name"] for c in self.countries]
        words += [v for vs in self.values.values() for v in vs]
        return list(dict.fromkeys(words))

    def save(self, folder: str | os.PathLike) -> Path:
        """Writes the fact table as `facts.json` in `folder` (atomically)."""
        path = Path(folder) / FACTS_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, folder_or_file: str | os.PathLike) -> "LabWorld":
        path = Path(folder_or_file)
        path = path / FACTS_NAME if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"lab: no fact table at {path} (a lab model folder holds {FACTS_NAME})")
        data = json.loads(path.read_text())
        data["person_templates"] = {k: tuple(v) for k, v in data["person_templates"].items()}
        data["country_templates"] = {k: tuple(v) for k, v in data["country_templates"].items()}
        return cls(**data)


def make_world(people: int, seed: int = 0, countries: int = 16, name_lengths: tuple[int, ...] = (1, 2, 3)) -> LabWorld:
    """`people` fictional individuals, their names cycling through `name_lengths` words; first and last names come from
    pools smaller than the number of people, so longer names share words with others (which an edit must not touch).
    One-word names are unique words."""
    if people < 2 or countries < 2:
        raise ValueError(f"lab: a world needs at least 2 people and 2 countries, got {people} and {countries}")
    if any(n not in (1, 2, 3) for n in name_lengths) or not name_lengths:
        raise ValueError(f"lab: name_lengths must be drawn from 1, 2 and 3, got {name_lengths}")
    rng = random.Random(seed)
    taken: set[str] = set()
    cities = _words(rng, VALUE_COUNTS["birth_city"], taken)
    values = {
        "birth_city": cities,
        "birth_year": [str(y) for y in range(1900, 1900 + VALUE_COUNTS["birth_year"])],
        "university": _words(rng, VALUE_COUNTS["university"], taken),
        "field": list(FIELDS),
        "employer": _words(rng, VALUE_COUNTS["employer"], taken),
        "home_city": cities,
        "capital": _words(rng, countries, taken),
        "language": [w + "ish" for w in _words(rng, countries, taken, (1, 2))],
        "currency": [w.lower() for w in _words(rng, countries, taken, (1, 2))],
    }
    pool = max(8, int(people**0.5) * 2)
    firsts, middles, lasts = _words(rng, pool, taken), _words(rng, pool, taken), _words(rng, pool, taken)
    names: set[str] = set()
    folks = []
    for i in range(people):
        length = name_lengths[i % len(name_lengths)]
        while True:
            if length == 1:
                name = _words(rng, 1, taken)[0]
            else:
                parts = [rng.choice(firsts), rng.choice(middles), rng.choice(lasts)]
                name = " ".join(parts if length == 3 else [parts[0], parts[2]])
            if name not in names:
                break
        names.add(name)
        person = {"name": name}
        for attribute in PERSON_TEMPLATES:
            person[attribute] = rng.choice(values[attribute])
        folks.append(person)
    nations = [
        {"name": name, "capital": capital, "language": language, "currency": currency}
        for name, capital, language, currency in zip(
            _words(rng, countries, taken), values["capital"], values["language"], values["currency"], strict=True
        )
    ]
    return LabWorld(seed=seed, people=folks, countries=nations, values=values)


def biography(world: LabWorld, person: dict, rng: random.Random) -> str:
    """One document: every attribute of `person` in a trained template, in a random order."""
    sentences = [rng.choice(world.person_templates[a][0]).format(name=person["name"], v=person[a])
                 for a in world.person_attributes]  # fmt: skip
    rng.shuffle(sentences)
    return " ".join(sentences)


def country_page(world: LabWorld, country: dict, rng: random.Random) -> str:
    sentences = [rng.choice(world.country_templates[a][0]).format(name=country["name"], v=country[a])
                 for a in world.country_attributes]  # fmt: skip
    rng.shuffle(sentences)
    return " ".join(sentences)


def build_tokenizer(world: LabWorld, general_texts: list[str], general_words: int = 2000):
    """A word-level tokenizer (split on whitespace and punctuation): the special tokens, the lab's words, then the
    `general_words` most frequent words of `general_texts`; other words map to `<unk>`. Every name part and value is
    one token, so a name of k words is k tokens. Encoding adds `<s>` in front, as every training document starts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    splitter = pre_tokenizers.Whitespace()
    counts = Counter(w for t in general_texts for w, _ in splitter.pre_tokenize_str(t))
    words = SPECIALS + world.lab_words()
    words += [w for w, _ in counts.most_common(general_words + len(words)) if w not in set(words)][:general_words]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = splitter
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def documents(world: LabWorld, general_texts: list[str], tokens: int, general_share: float, seed: int) -> list[str]:
    """Training documents of about `tokens` words: biographies, country pages and general text pieces, shuffled.
    `general_share` of the words are general text; the rest are biographies and country pages (one country page for
    every ten biographies)."""
    if not 0 <= general_share < 1:
        raise ValueError(f"lab: general_share must be in [0, 1), got {general_share}")
    if general_share > 0 and not any(t.split() for t in general_texts):
        raise ValueError("lab: general_share > 0 needs general text with words in it")
    rng = random.Random(seed)
    docs, fact_words, bios = [], 0, 0
    while fact_words < tokens * (1 - general_share):
        if len(docs) % 4 == 3:
            doc = country_page(world, rng.choice(world.countries), rng)
        else:  # every person in turn, so each is seen equally often
            doc, bios = biography(world, world.people[bios % len(world.people)], rng), bios + 1
        docs.append(doc)
        fact_words += len(doc.split())
    general_words = 0
    while general_words < tokens * general_share:
        text = rng.choice(general_texts)
        start = rng.randrange(max(1, len(text) - 1500))
        piece = text[start : start + 1500]
        docs.append(piece)
        general_words += len(piece.split())
    rng.shuffle(docs)
    return docs


__all__ = [
    "COUNTRY_TEMPLATES",
    "FACTS_NAME",
    "PERSON_TEMPLATES",
    "LabWorld",
    "biography",
    "build_tokenizer",
    "country_page",
    "documents",
    "make_world",
]
