"""Reading option values: YAML with YAML 1.2's booleans, flag and YAML text made the field's
declared type (`coerce`), named evaluation sets (NAME[:LANG][:long]=PATH), and the one-line errors that
name a flag (`require_positive`, `one_of`, `on_off`), and the value types of the commands'
own options (`whole_number`, `number_above`), whose errors say what the flag takes."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import fields
from typing import Any

import yaml

from whisper_train.data.labels import language_code
from whisper_train.errors import UserError


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false (True, TRUE, ...).

    YAML 1.1, PyYAML's default, also reads yes/no/on/off as booleans, which turns `language: no`
    (Norwegian) into False and `packing: on` into True; options whose values are such words
    (on/off, language codes) then cannot be written plainly. A boolean option still takes
    yes/no/on/off, as text (`coerce`). Everything else (numbers, null) reads as before.
    Written files (`to_yaml`, PyYAML's dumper) quote every YAML 1.1 boolean word, so a 1.1
    reader reads them the same."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A configuration file's values, read with YAML 1.2's booleans (`_Yaml12Loader`)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader: builds only plain values


# NAME:long=PATH (or NAME:LANG:long=PATH): a set of long recordings, each decoded whole in
# sequential 30 s windows and scored over its whole reference (evaluation.longform).
LONG_FORM = "long"
# NAME:nonspeech=PATH: clips where nobody speaks (silence, noise, music, tones; transcripts
# ignored; PATH `builtin` synthesises a set), scored by the text a model invents on them
# (evaluation.nonspeech).
NONSPEECH = "nonspeech"
SET_KINDS = (LONG_FORM, NONSPEECH)


def _parse_sets(
    entries: list[str], flag: str, added: tuple[str, ...] = ()
) -> dict[str, tuple[str, str | None, str | None]]:
    """{name: (path, language, kind)} of NAME[:LANG][:KIND]=PATH entries, in order; kind is
    one of SET_KINDS, or None for clips with transcripts. `added`: languages the model adds to
    Whisper's (train's --new-language), accepted as LANG."""
    sets: dict[str, tuple[str, str | None, str | None]] = {}
    for entry in entries:
        label, sep, path = entry.partition("=")
        name, *tags = label.split(":")
        kinds = [tag for tag in tags if tag in SET_KINDS]
        tags = [tag for tag in tags if tag not in SET_KINDS]
        if not sep:  # a bare PATH
            name, tags, kinds, path = "eval", [], [], entry
        elif (
            not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)
            or not path
            or len(tags) > 1
            or len(kinds) > 1
        ):
            raise UserError(
                f"{flag} {entry}: expected NAME=PATH (or NAME:LANG=PATH, NAME:{LONG_FORM}=PATH "
                f"for long recordings, NAME:{NONSPEECH}=PATH for clips where nobody speaks) "
                "with NAME of letters, digits, '-', '_' or '.', or a bare PATH"
            )
        if name in sets:
            raise UserError(f"{flag} {entry}: the name {name} is used twice")
        language = tags[0] if tags else ""
        if language:
            try:
                language = language_code(language, added)
            except UserError as exc:
                raise UserError(f"{flag} {entry}: {exc}") from None
        sets[name] = (path, language or None, kinds[0] if kinds else None)
    return sets


def named_sets(
    entries: list[str], flag: str, added: tuple[str, ...] = ()
) -> dict[str, tuple[str, str | None]]:
    """["target:es=t/", "general=g/"] → {"target": ("t/", "es"), "general": ("g/", None)}, in
    order: NAME=PATH, or NAME:LANG=PATH to state the set's language (a code or name Whisper
    knows); a bare PATH is named "eval". The one reading of NAME[:LANG]=PATH for `train
    --eval-data` and `evaluate --data`. The language sits on the name's side of `=`, so paths
    (and hub ids such as `name:config:split`) are never split. A `:long` tag
    (`long_form_sets`) may sit beside the language."""
    return {
        name: (path, language)
        for name, (path, language, _) in _parse_sets(entries, flag, added).items()
    }


def long_form_sets(entries: list[str], flag: str, added: tuple[str, ...] = ()) -> set[str]:
    """The names of the sets tagged NAME[:LANG]:long=PATH: long recordings, decoded whole."""
    sets = _parse_sets(entries, flag, added)
    return {name for name, (_, _, kind) in sets.items() if kind == LONG_FORM}


def nonspeech_sets(entries: list[str], flag: str, added: tuple[str, ...] = ()) -> set[str]:
    """The names of the sets tagged NAME:nonspeech=PATH: clips where nobody speaks."""
    sets = _parse_sets(entries, flag, added)
    return {name for name, (_, _, kind) in sets.items() if kind == NONSPEECH}


def named_paths(entries: list[str], flag: str, added: tuple[str, ...] = ()) -> dict[str, str]:
    """{name: path} of `named_sets`."""
    return {name: path for name, (path, _) in named_sets(entries, flag, added).items()}


def require_positive(flag: str, value: int, *, alternative: str | None = None) -> None:
    """Reject a count below 1 with a one-line error that names the flag and the remedy.

    `--batch-size 0: must be at least 1`; an `alternative` such as "use --no-check" adds
    `(or use --no-check)`.
    """
    if value < 1:
        remedy = f" (or {alternative})" if alternative else ""
        raise UserError(f"{flag} {value}: must be at least 1{remedy}")


def one_of(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{flag} {value}: expected one of {', '.join(allowed)}")


def on_off(flag: str, value: Any, *others: str) -> str:
    """'on' / 'off' from a flag's text; true/yes/1 and false/no/0 too (the YAML file's
    `true` reaches here as the text "true", `coerce`). `others`: further words the flag
    takes, named in the error."""
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return "on"
    if text in ("off", "false", "no", "0"):
        return "off"
    if text in others:
        return text
    raise UserError(f"{flag} {value}: expected {', '.join(('on', *others))} or off")


_TRUE_WORDS = ("true", "yes", "y", "on", "1")
_FALSE_WORDS = ("false", "no", "n", "off", "0")


def coerce(group: Any, name: str, value: Any, source: str) -> Any:
    """YAML and flags give strings, numbers, lists; make them the field's declared type."""
    if value is None:
        return None
    annotation = str({f.name: f.type for f in fields(group)}[name])
    try:
        if annotation.startswith("list"):
            if isinstance(value, dict):  # YAML `eval_data: {name: path}`
                return [f"{k}={v}" for k, v in value.items()]
            if isinstance(value, str):
                return [part.strip() for part in value.split(",") if part.strip()]
            return [str(v) for v in value]
        if annotation.startswith("bool"):
            # YAML's true/false, or a yes/no word as text (YAML 1.2 keeps yes/no/on/off text).
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{_where(source)}{flag} {value}: expected true or false (or yes/no, on/off)"
            )
        if annotation.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if annotation.startswith("float"):
            return float(value)
        if isinstance(value, (list, tuple)):  # YAML `temperatures: [0, 0.2]`
            return ",".join(str(v) for v in value)
        if isinstance(value, bool):  # YAML's true/false where text is expected: as written
            return str(value).lower()
        return str(value)
    except (TypeError, ValueError):
        flag = "--" + name.replace("_", "-")
        kind = "a whole number" if annotation.startswith("int") else "a number"
        raise UserError(
            f"{_where(source)}{flag} {value!r}: expected {kind}, such as {_EXAMPLES[kind]}"
        ) from None


def _where(source: str) -> str:
    """A YAML file's name before the flag its key stands for; nothing for a typed flag."""
    return "" if source == "flag" else f"{source}: "


def whole_number(minimum: int):
    """argparse's `type` for a count: `argument --train-utterances: expected a whole number
    of at least 1, not '-5'` rather than `n_utterances must be at least 1` from deep inside."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number of at least {minimum}, such as {max(minimum, 8)}, "
                f"not {text!r}"
            )
        return value

    parse.__name__ = "whole number"  # argparse's fallback wording names the type by this
    return parse


def number_above(minimum: float, example: str, *, or_equal: bool = False):
    """argparse's `type` for a finite number above `minimum` (`--learning-rate`, `--epochs`),
    or `minimum` itself too where `or_equal` (`pseudo-label --max-wer 0`)."""
    bound = f"of at least {minimum:g}" if or_equal else f"above {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not or_equal):
            raise argparse.ArgumentTypeError(
                f"expected a number {bound}, such as {example}, not {text!r}"
            )
        return value

    parse.__name__ = "number"
    return parse


# What an expected value looks like, in the user's words rather than a Python type's.
_EXAMPLES = {"a whole number": "8", "a number": "1e-5 or 0.1"}
