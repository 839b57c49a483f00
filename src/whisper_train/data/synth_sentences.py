"""The sentences synthesised speech says: a vocabulary, its split, and templates that use it.

English sentences are grammatical templates (function words: articles, pronouns, modals,
prepositions) filled with content words from `resources/vocabulary.tsv`, about 3,400 common
English nouns, verbs, adjectives and adverbs. `split_vocabulary` splits the content words by
word family into a training part and a held-out part, so that held-out sentences hold words
training never saw. Spanish sentences (the second demo) come from a small built-in lexicon,
split the same way. Who says them is `espeak`'s; datasets of them are `synth`'s.
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from dataclasses import astuple, dataclass
from importlib import resources

HELD_OUT_WORDS_PERCENT = 20  # of the vocabulary's word families, never in training sentences


# -- English: vocabulary and sentences ---------------------------------------------------------


@dataclass(frozen=True)
class Vocabulary:
    """Content words by part of speech (sorted); a word may be in more than one list."""

    nouns: tuple[str, ...]  # that are not also adjectives
    verbs: tuple[str, ...]  # base forms: they follow a modal, `did not`, `please` ...
    adjectives: tuple[str, ...]
    adverbs: tuple[str, ...]

    def words(self) -> frozenset[str]:
        return frozenset((*self.nouns, *self.verbs, *self.adjectives, *self.adverbs))

    def only(self, keep) -> Vocabulary:
        """The words for which `keep(word)` is true, in every list."""
        return Vocabulary(*(tuple(w for w in ws if keep(w)) for ws in astuple(self)))


@functools.cache
def vocabulary() -> Vocabulary:
    """The built-in content words: about 3,400 common English nouns, verbs, adjectives and
    adverbs (`resources/vocabulary.tsv`, whose header says where they come from)."""
    text = resources.files("whisper_train").joinpath("resources/vocabulary.tsv").read_text()
    by_tag: dict[str, list[str]] = {tag: [] for tag in "nvar"}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            word, tags = line.split("\t")
            for tag in tags:
                by_tag[tag].append(word)
    # A word that is also an adjective (chemical, private) reads as one: not in the noun slot.
    by_tag["n"] = [word for word in by_tag["n"] if word not in set(by_tag["a"])]
    return Vocabulary(*(tuple(sorted(by_tag[tag])) for tag in "nvar"))


# Suffixes stripped, repeatedly, to find a word's family: careful, carefully and care land in
# one family, so a held-out word is never a suffix away from a training word.
_FAMILY_SUFFIXES = (
    "ization", "ation", "ition", "ness", "ment", "ship", "ably", "ibly", "ally", "ities", "ity",
    "ical", "ful", "less", "ous", "ive", "ist", "ism", "ers", "ies", "ing", "ion", "able",
    "ible", "ly", "er", "or", "es", "ed", "al", "ic", "en", "s", "e", "y",
)  # fmt: skip
_MIN_STEM = 3


def word_family(word: str) -> str:
    """A crude stem shared by a word's derived forms (`carefully` → `car`, as `care`)."""
    stripped = True
    while stripped:
        stripped = False
        for suffix in _FAMILY_SUFFIXES:
            if word.endswith(suffix) and len(word) - len(suffix) >= _MIN_STEM:
                word, stripped = word[: -len(suffix)], True
                break
    return word


def split_vocabulary(
    held_out_percent: int = HELD_OUT_WORDS_PERCENT,
) -> tuple[Vocabulary, Vocabulary]:
    """(training words, held-out words): whole word families by a fixed hash of the family, so
    the split is the same on every machine and Python, and no family is on both sides."""

    def held_out(word: str) -> bool:
        return zlib.crc32(word_family(word).encode()) % 100 < held_out_percent

    words = vocabulary()
    return words.only(lambda w: not held_out(w)), words.only(held_out)


# Function words: the templates' own, shared by every set. {S} subject, {O} object (a noun
# phrase), {N} noun, {V} verb, {A} adjective, {R} adverb, {M} modal, {P} preposition.
_TEMPLATES = (
    "{S} {M} {V} {O}.",
    "{S} {M} {V} {O} {P} {O}.",
    "{S} {M} {R} {V} {O}.",
    "{S} did not {V} {O} {P} {O}.",
    "Did {S} {V} {O}?",
    "Why would {S} {V} {O} {P} {O}?",
    "When {M} {S} {V} {O}?",
    "{NP} was {A} and {A}.",
    "{NP} is very {A} {P} {O}.",
    "There is {a} {A} {N} {P} {O}.",
    "Please {V} {O} {P} {O}.",
    "Do not {V} {O} {R}.",
    "Let us {V} {O} and {V} {O}.",
    "{S} {M} {V} {O} because {S} {M} {V} {O}.",
    "If {S} {M} {V} {O}, {S} {M} {V} {O}.",
    "{S} {M} not {V} {O} {P} {O} {R}.",
)
_PRONOUNS = ("I", "you", "we", "they", "he", "she")
_DETERMINERS = ("the", "the", "the", "a", "a", "this", "that", "my", "your", "our", "their",
                "his", "her", "every", "some")  # fmt: skip
_MODALS = ("will", "can", "could", "should", "would", "might", "must", "may")
_PREPOSITIONS = ("in", "on", "at", "with", "from", "into", "about", "under", "after", "before",
                 "behind", "near", "for", "over", "without", "through", "across", "like")  # fmt: skip
_ADJECTIVE_PROBABILITY = 0.35  # of an adjective before a noun phrase's noun
_PRONOUN_PROBABILITY = 0.4  # of a pronoun as subject rather than a noun phrase
# Words spelt with a vowel but said with a consonant (a university), and the reverse (an hour).
_A_NOT_AN = ("uni", "use", "usu", "uti", "eu", "one", "once")
_AN_NOT_A = ("hour", "honest", "honor", "heir")


def _article(word: str) -> str:
    vowel = word[0] in "aeiou" and not word.startswith(_A_NOT_AN)
    return "an" if vowel or word.startswith(_AN_NOT_A) else "a"


def make_sentence(words: Vocabulary, rng: random.Random) -> str:
    """One sentence from a random template, its content words drawn from `words` only."""

    def noun_phrase() -> str:
        noun = rng.choice(words.nouns)
        if rng.random() < _ADJECTIVE_PROBABILITY:
            noun = f"{rng.choice(words.adjectives)} {noun}"
        determiner = rng.choice(_DETERMINERS)
        return f"{_article(noun) if determiner == 'a' else determiner} {noun}"

    fillers = {
        "S": lambda: (
            rng.choice(_PRONOUNS) if rng.random() < _PRONOUN_PROBABILITY else noun_phrase()
        ),
        "O": noun_phrase,
        "NP": noun_phrase,
        "N": lambda: rng.choice(words.nouns),
        "V": lambda: rng.choice(words.verbs),
        "A": lambda: rng.choice(words.adjectives),
        "R": lambda: rng.choice(words.adverbs),
        "M": lambda: rng.choice(_MODALS),
        "P": lambda: rng.choice(_PREPOSITIONS),
    }
    # re.split alternates literal text and slot names; "{a}" is the article of what follows.
    parts = re.split(r"\{(\w+)\}", rng.choice(_TEMPLATES))
    filled = [
        part if index % 2 == 0 or part == "a" else fillers[part]()
        for index, part in enumerate(parts)
    ]
    for index in range(1, len(parts), 2):
        if parts[index] == "a":
            filled[index] = _article("".join(filled[index + 1 :]).lstrip())
    sentence = "".join(filled)
    return sentence[0].upper() + sentence[1:]


def make_sentences(words: Vocabulary, n: int, seed: int) -> list[str]:
    """`n` sentences from `words`, the same for the same seed (no repeats within the list)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    seen: set[str] = set()
    while len(sentences) < n:
        sentence = make_sentence(words, rng)
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
    return sentences


# Every word a template writes itself: what sentences of every set share.
FUNCTION_WORDS = frozenset(
    word
    for text in (*_TEMPLATES, *_PRONOUNS, *_DETERMINERS, *_MODALS, *_PREPOSITIONS, "an")
    for word in re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", text).lower())
)


def content_words(sentence: str) -> set[str]:
    """The words of `sentence` that are not the templates' function words (lower case)."""
    return set(re.findall(r"[a-z]+", sentence.lower())) - FUNCTION_WORDS


# -- Spanish (the second demo) -----------------------------------------------------------------
# Content words are split as the English ones are, by a fixed hash, so held-out sentences hold
# words training never heard. A small built-in lexicon (the articles agree with their nouns) in
# templates whose function words every set shares.


@dataclass(frozen=True)
class SpanishWords:
    """Content words of the Spanish templates: subjects, verbs (3rd person present), objects
    (with their article), places and times."""

    subjects: tuple[str, ...]
    verbs: tuple[str, ...]
    objects: tuple[str, ...]
    places: tuple[str, ...]
    times: tuple[str, ...]

    def only(self, keep) -> SpanishWords:
        return SpanishWords(*(tuple(w for w in ws if keep(w)) for ws in astuple(self)))


SPANISH_WORDS = SpanishWords(
    subjects=("mi hermano", "la profesora", "el médico", "nuestra vecina", "tu amigo", "la niña",
              "el cocinero", "mi abuela", "el conductor", "la alcaldesa", "el pintor",
              "la enfermera", "mi primo", "la panadera", "el cartero", "su hija"),
    verbs=("compra", "prepara", "busca", "lleva", "vende", "limpia", "encuentra", "pinta",
           "guarda", "necesita", "mira", "trae", "abre", "cierra", "pide", "quiere", "rompe",
           "esconde", "arregla", "olvida"),
    objects=("el pan", "la leche", "el libro", "la carta", "el coche", "la mesa",
             "el periódico", "la fruta", "el café", "la camisa", "el regalo", "la llave",
             "el vino", "la silla", "el queso", "la maleta", "el sombrero", "la ventana",
             "el pescado", "la bicicleta", "el cuaderno", "la manzana", "el teléfono",
             "la puerta", "el paraguas", "la cuchara", "el espejo", "la almohada"),
    places=("en el mercado", "en la cocina", "cerca de la estación", "en el jardín",
            "detrás de la casa", "en la oficina", "junto al río", "en la plaza",
            "dentro del armario", "en la biblioteca", "sobre la montaña", "en el hospital"),
    times=("por la mañana", "después de la cena", "todos los domingos", "antes de las ocho",
           "cada tarde", "esta noche", "durante el verano", "el lunes"),
)  # fmt: skip
_SPANISH_TEMPLATES = (
    "{S} {V} {O} {L}.",
    "{T}, {S} {V} {O}.",
    "¿{S} {V} {O} {L}?",
    "{S} no {V} {O} {T}.",
    "{S} {V} {O} y {O} {L}.",
    "{T}, {S} {V} {O} {L}.",
)


def split_spanish_words(held_out_percent: int = 25) -> tuple[SpanishWords, SpanishWords]:
    """(training words, held-out words) by a fixed hash of each word, as `split_vocabulary`."""

    def held_out(word: str) -> bool:
        return zlib.crc32(word.encode()) % 100 < held_out_percent

    return SPANISH_WORDS.only(lambda w: not held_out(w)), SPANISH_WORDS.only(held_out)


def make_spanish_sentences(words: SpanishWords, n: int, seed: int) -> list[str]:
    """`n` different Spanish sentences from `words`, the same for the same seed."""
    rng = random.Random(seed)
    slots = {"S": words.subjects, "V": words.verbs, "O": words.objects, "L": words.places,
             "T": words.times}  # fmt: skip
    sentences: list[str] = []
    seen: set[str] = set()
    while len(sentences) < n:
        template = rng.choice(_SPANISH_TEMPLATES)
        sentence = re.sub(r"\{(\w)\}", lambda m: rng.choice(slots[m.group(1)]), template)
        start = 2 if sentence.startswith("¿") else 1  # capitalise after an opening ¿
        sentence = sentence[: start - 1] + sentence[start - 1].upper() + sentence[start:]
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
    return sentences
