"""A language Whisper lacks, taught under its own token (--new-language) or under its
neighbour's, on OpenAI's multilingual base: target WER, language detection on the new
language and on four others, and the others' WER as a guard.

    PYTHONPATH=src .venv/bin/python bench/new_language.py [--steps 60] [--work /tmp/newlang]

The new language is Esperanto (`eo`): Whisper has no token for it, espeak-ng speaks it (one
voice, `eo`, with the variants every espeak voice takes), its spelling is regular and Latin
(with ĉ ĝ ĥ ĵ ŝ ŭ, which base's byte-level BPE writes), and it has a clear neighbour among
Whisper's languages, Spanish, whose token the status quo trains under. Sentences come from a
small built-in lexicon in templates; content words and voices are split between training and
held-out by a fixed hash and by variant, as the demo's are, so the held-out WER is on words
and speakers no step saw. The built-in lexicon has ~80 content words: a model learns those
words, not Esperanto's spelling, and its held-out WER is bound by the ~20 it never saw.
`--lexicon dictionary` draws sentences from ~2,150 common roots of literumilo's Esperanto
dictionary (`pip install literumilo`; a quarter of the roots held out), so that training meets
the language's spelling rules and held-out WER measures how a model spells words it never saw.

Three models, each measured on the same held-out clips: base as it is (Esperanto decoded
under <|es|>), base trained N steps with --language es on the Esperanto clips (the
neighbour's token), and base trained N steps with --new-language eo --new-language-init es
(its own token; `--init LANG` starts it from another language's), both with the same data, seed and settings: --mode freeze-encoder (its
cached encoder makes a step affordable on a CPU; the encoder is then the same in all three,
so every clip is encoded once here), a fifth of the training clips in the other four
languages with their own labels (rehearsal, so that the decoder is not taught that every clip
is Esperanto; `--rehearsal N`: N clips a language), learning rate 1e-4. `--mode full` trains
every weight at the mode's default rates instead (per-clip packing; each model's own encoder
then encodes the held-out clips). Decoding is greedy, no fallback; the target's WER and CER
are printed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
import zlib
from pathlib import Path

import soundfile as sf
import torch
from transformers.modeling_outputs import BaseModelOutput

from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.config import RunConfig
from whisper_train.data.espeak import HELD_OUT_VARIANTS, TRAIN_VARIANTS, synthesize
from whisper_train.data.synth_sentences import (
    make_sentences,
    make_spanish_sentences,
    split_spanish_words,
    split_vocabulary,
)
from whisper_train.evaluation.scoring import score
from whisper_train.models import load_model
from whisper_train.training.train import train
from whisper_train.transcription.decoding import DecodingOptions, generate_decoded

ESPERANTO = {
    "S": ("mia frato", "la instruistino", "la kuracisto", "nia najbarino", "via amiko",
          "la knabino", "la kuiristo", "mia avino", "la ŝoforo", "la urbestro", "la pentristo",
          "la flegistino", "mia kuzo", "la bakistino", "la leterportisto", "ŝia filino"),
    "V": ("aĉetas", "preparas", "serĉas", "portas", "vendas", "purigas", "trovas", "pentras",
          "konservas", "bezonas", "rigardas", "alportas", "malfermas", "fermas", "petas",
          "volas", "rompas", "kaŝas", "riparas", "forgesas"),
    "O": ("la panon", "la lakton", "la libron", "la leteron", "la aŭton", "la tablon",
          "la gazeton", "la frukton", "la kafon", "la ĉemizon", "la donacon", "la ŝlosilon",
          "la vinon", "la seĝon", "la fromaĝon", "la valizon", "la ĉapelon", "la fenestron",
          "la fiŝon", "la biciklon", "la kajeron", "la pomon", "la telefonon", "la pordon",
          "la ombrelon", "la kuleron", "la spegulon", "la kusenon"),
    "L": ("en la bazaro", "en la kuirejo", "apud la stacidomo", "en la ĝardeno",
          "malantaŭ la domo", "en la oficejo", "apud la rivero", "sur la placo",
          "en la ŝranko", "en la biblioteko", "sur la monto", "en la hospitalo"),
    "T": ("matene", "post la vespermanĝo", "ĉiun dimanĉon", "antaŭ la oka", "ĉiun vesperon",
          "ĉi-nokte", "dum la somero", "lundon"),
}  # fmt: skip
TEMPLATES = (
    "{S} {V} {O} {L}.",
    "{T} {S} {V} {O}.",
    "Ĉu {S} {V} {O} {L}?",
    "{S} ne {V} {O} {T}.",
    "{S} {V} {O} kaj {O} {L}.",
    "{T} {S} {V} {O} {L}.",
)
# German and French: fixed sentences (no generator of their own here), for detection and the
# guard; the training share takes the first ones, the held-out set the rest.
GERMAN = (
    "Mein Bruder kauft das Brot auf dem Markt.", "Die Lehrerin liest ein Buch in der Küche.",
    "Am Morgen trinkt der Arzt einen Kaffee.", "Unsere Nachbarin sucht den Schlüssel.",
    "Das Mädchen öffnet das Fenster im Garten.", "Der Koch bringt den Käse in das Büro.",
    "Meine Großmutter malt ein Bild am Fluss.", "Der Fahrer vergisst den Regenschirm.",
    "Jeden Sonntag repariert er das Fahrrad.", "Die Krankenschwester schließt die Tür.",
    "Der Maler braucht einen neuen Stuhl.", "Nach dem Abendessen schreibt sie einen Brief.",
    "Im Sommer verkauft die Bäckerin Äpfel.", "Der Briefträger versteckt die Tasche.",
    "Mein Cousin sieht den Hut im Schrank.", "Die Bürgermeisterin will den Wein.",
    "Heute Abend bringt ihre Tochter den Fisch.", "Vor acht Uhr räumt er den Tisch auf.",
    "Der Arzt findet das Telefon im Krankenhaus.", "Am Montag kauft mein Bruder Milch.",
    "Die Lehrerin vergisst das Heft in der Bibliothek.", "Der Koch öffnet den Koffer.",
    "Unsere Nachbarin malt den Spiegel auf dem Platz.", "Das Mädchen sucht den Löffel.",
)  # fmt: skip
FRENCH = (
    "Mon frère achète le pain au marché.", "La professeure lit un livre dans la cuisine.",
    "Le matin, le médecin boit un café.", "Notre voisine cherche la clé.",
    "La petite fille ouvre la fenêtre du jardin.", "Le cuisinier apporte le fromage au bureau.",
    "Ma grand-mère peint un tableau près de la rivière.", "Le chauffeur oublie le parapluie.",
    "Chaque dimanche, il répare le vélo.", "L'infirmière ferme la porte.",
    "Le peintre a besoin d'une nouvelle chaise.", "Après le dîner, elle écrit une lettre.",
    "En été, la boulangère vend des pommes.", "Le facteur cache la valise.",
    "Mon cousin regarde le chapeau dans l'armoire.", "La maire veut le vin.",
    "Ce soir, sa fille apporte le poisson.", "Avant huit heures, il range la table.",
    "Le médecin trouve le téléphone à l'hôpital.", "Lundi, mon frère achète du lait.",
    "La professeure oublie le cahier à la bibliothèque.", "Le cuisinier ouvre la valise.",
    "Notre voisine peint le miroir sur la place.", "La petite fille cherche la cuillère.",
)  # fmt: skip
OTHERS = ("en", "es", "de", "fr")
# Each language's espeak voice; a variant (+m1, +f3, ...) makes a speaker.
VOICE = {"eo": "eo", "en": "en-us", "es": "es", "de": "de", "fr": "fr"}
SPEAKING_VARIANTS = tuple(v for v in TRAIN_VARIANTS if re.fullmatch(r"[mf]\d", v))


def esperanto_sentences(held_out: bool, n: int, seed: int) -> list[str]:
    """`n` different Esperanto sentences, their content words from one side of a fixed hash
    split (a quarter held out), as the demo splits English and Spanish words."""

    def side(word: str) -> bool:
        return (zlib.crc32(word.encode()) % 100 < 25) == held_out

    slots = {key: [w for w in words if side(w)] for key, words in ESPERANTO.items()}
    rng, seen, sentences = random.Random(seed), set(), []
    while len(sentences) < n:
        text = re.sub(r"\{(\w)\}", lambda m: rng.choice(slots[m.group(1)]), rng.choice(TEMPLATES))
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            sentences.append(text)
    return sentences


# literumilo's dictionary writes ĉ ĝ ĥ ĵ ŝ ŭ in the x-system (cx, gx, ...).
X_SYSTEM = {"cx": "ĉ", "gx": "ĝ", "hx": "ĥ", "jx": "ĵ", "sx": "ŝ", "ux": "ŭ"}
PRONOUNS = ("mi", "vi", "li", "ŝi", "ni", "ili")
DICTIONARY_TEMPLATES = (
    "{S} {V} {O}.",
    "{S} {V} {O} {P}.",
    "Ĉu {S} {V} {O}?",
    "{S} ne {V} {O}.",
    "{P} {S} {V} {O}.",
)


def dictionary_roots() -> dict[str, list[str]]:
    """Common Esperanto roots from literumilo's dictionary (`pip install literumilo`; free to
    use, by Klivo Lendon): nouns, transitive verbs and adjectives of its commonest three
    rarity classes (0-2), simple roots only (no compounds), in their own letters."""
    try:
        from importlib.resources import files

        table = (files("literumilo") / "data" / "vortaro.tsv").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise SystemExit(
            "--lexicon dictionary reads literumilo's: pip install literumilo"
        ) from None
    roots: dict[str, list[str]] = {"N": [], "V": [], "A": []}
    for line in table.splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 9:
            continue
        root, kind, transitive, rarity, flag = fields[0], fields[1], fields[3], fields[7], fields[8]
        if flag != "R" or not re.fullmatch(r"[a-z]+", root) or int(rarity) > 2:
            continue
        for pair, letter in X_SYSTEM.items():
            root = root.replace(pair, letter)
        if kind == "SUBST":
            roots["N"].append(root)
        elif kind == "VERBO" and transitive == "T":
            roots["V"].append(root)
        elif kind == "ADJ":
            roots["A"].append(root)
    return roots


def dictionary_sentences(held_out: bool, n: int, seed: int) -> list[str]:
    """`n` different Esperanto sentences over some 2,000 dictionary roots (a quarter held out
    by a fixed hash of the root, as `esperanto_sentences` splits its words): with this many
    roots, training sees Esperanto's spelling rules and not a few dozen words, so held-out
    WER measures how well a model spells words it never saw in the new language."""
    roots = {
        kind: [r for r in found if (zlib.crc32(r.encode()) % 100 < 25) == held_out]
        for kind, found in dictionary_roots().items()
    }
    rng, seen, result = random.Random(seed), set(), []

    def noun(case: str) -> str:
        ending = rng.choice(("o", "oj")) + case
        if rng.random() < 0.5:
            adjective = rng.choice(roots["A"]) + ending.replace("o", "a", 1)
            return f"la {adjective} {rng.choice(roots['N'])}{ending}"
        return f"la {rng.choice(roots['N'])}{ending}"

    while len(result) < n:
        slots = {
            "S": rng.choice(PRONOUNS) if rng.random() < 0.3 else noun(""),
            "V": rng.choice(roots["V"]) + rng.choice(("as", "is", "os")),
            "O": noun("n"),
            "P": f"{rng.choice(('en', 'apud', 'kun', 'sub', 'por'))} {noun('')}",
        }
        text = rng.choice(DICTIONARY_TEMPLATES).format_map(slots)
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            result.append(text)
    return result


def sentences(
    language: str, held_out: bool, n: int, seed: int, lexicon: str = "builtin"
) -> list[str]:
    if language == "eo":
        if lexicon == "dictionary":
            return dictionary_sentences(held_out, n, seed)
        return esperanto_sentences(held_out, n, seed)
    if language == "en":
        train_words, held_words = split_vocabulary()
        return make_sentences(held_words if held_out else train_words, n, seed)
    if language == "es":
        train_words, held_words = split_spanish_words()
        return make_spanish_sentences(held_words if held_out else train_words, n, seed)
    fixed = {"de": GERMAN, "fr": FRENCH}[language]
    half = len(fixed) // 2
    pool = fixed[half:] if held_out else fixed[:half]
    return [pool[i % len(pool)] for i in range(n)]


def synthesise(
    folder: Path, language: str, held_out: bool, n: int, seed: int, lexicon: str = "builtin"
) -> list[dict]:
    """`n` clips of `language` (held-out: other words and voices) → rows with absolute paths."""
    folder.mkdir(parents=True, exist_ok=True)
    variants = HELD_OUT_VARIANTS if held_out else SPEAKING_VARIANTS
    rng = random.Random(seed)
    rows = []
    for index, text in enumerate(sentences(language, held_out, n, seed, lexicon)):
        path = folder / f"{language}-{'held' if held_out else 'train'}-{index:03d}.wav"
        # Drawn for every clip, kept or not: clip i's voice does not depend on which are kept
        # (a larger set keeps the smaller one's clips and adds the voices a fresh run draws).
        voice, speed = f"{VOICE[language]}+{rng.choice(variants)}", rng.randint(135, 175)
        if not path.exists():
            sf.write(path, synthesize(text, voice=voice, speed_wpm=speed), SAMPLE_RATE)
        rows.append({"audio": str(path), "text": text, "language": language})
    return rows


def write_manifest(path: Path, rows: list[dict], *, esperanto_as: str) -> Path:
    lines = [
        json.dumps(
            {**row, "language": esperanto_as if row["language"] == "eo" else row["language"]}
        )
        for row in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@torch.no_grad()
def encode(model, processor, rows: list[dict], batch: int = 8) -> torch.Tensor:
    """Each clip's encoder output (base's: the frozen encoder every model here shares)."""
    hidden = []
    for first in range(0, len(rows), batch):
        audio = [load_audio(row["audio"]) for row in rows[first : first + batch]]
        features = processor.feature_extractor(
            audio, sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features
        hidden.append(model.get_encoder()(features).last_hidden_state)
    return torch.cat(hidden)


def measure(model, processor, hidden: torch.Tensor, rows: list[dict], language: str | None):
    """(WER %, CER %, detected codes) of `rows`, decoded in `language` (None: each row's own)."""
    texts, detected = [], []
    options = DecodingOptions(temperatures=(0.0,), logprob_threshold=None)
    for first in range(0, len(rows), 8):
        part = rows[first : first + 8]
        inputs = {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden[first : first + 8])}
        languages = [language or row["language"] for row in part]
        decoded = generate_decoded(
            model, inputs, processor.tokenizer, max_length=80, options=options, languages=languages
        )
        texts += [item.text for item in decoded]
        detected += [item.detected_language for item in decoded]
    scores = score([row["text"] for row in rows], texts, normalizer="basic")
    return 100 * scores.wer, 100 * scores.cer, detected


def share(detected: list[str], code: str) -> float:
    return 100 * sum(found == code for found in detected) / len(detected)


def train_arm(
    work: Path,
    name: str,
    manifest: Path,
    steps: int,
    new_language: bool,
    init: str = "es",
    seed: int = 0,
    mode: str = "freeze-encoder",
) -> Path:
    out = work / name
    if (out / "final" / "model.safetensors").exists():
        return out
    config = RunConfig()
    settings = {
        "model": "base",
        "data": str(manifest),
        "output_dir": str(out),
        "overwrite": True,
        "mode": mode,
        "max_steps": steps,
        "batch_size": 8,
        "seed": seed,
        "only_train": True,
        "language": "eo" if new_language else "es",
        # As the first measurements trained (before --nonspeech auto mixed noise in): the
        # arms differ by the token alone.
        "nonspeech": "none",
    }
    if mode == "freeze-encoder":  # the first measurements' rate; others: the mode's default
        settings.update(learning_rate=1e-4, encoder_cache_dir=str(work / "encoder-cache"))
    if new_language:
        settings.update(new_language="eo", new_language_init=init)
    config.update(settings)
    started = time.perf_counter()
    train(config.validate())
    print(f"{name}: {steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--work", default="/tmp/newlang-bench")
    parser.add_argument("--train-clips", type=int, default=96, help="Esperanto clips to train on")
    parser.add_argument("--held-out", type=int, default=32, help="held-out clips of Esperanto")
    parser.add_argument("--others", type=int, default=16, help="held-out clips a language")
    parser.add_argument(
        "--rehearsal",
        type=int,
        default=None,
        help="training clips in each other language (default: --train-clips / 16)",
    )
    parser.add_argument(
        "--init", default="es", help="the language whose token the new one starts from"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the runs' seed; other sentences and voices drawn"
    )
    parser.add_argument(
        "--lexicon",
        choices=("builtin", "dictionary"),
        default="builtin",
        help="Esperanto's words: the built-in ~80 (the first measurements) or ~2,000 roots "
        "of literumilo's dictionary (pip install literumilo)",
    )
    parser.add_argument(
        "--mode",
        choices=("freeze-encoder", "full"),
        default="freeze-encoder",
        help="freeze-encoder (learning rate 1e-4, the encoder cached) or full fine-tuning at "
        "its default rate (the encoder learns the new language's sounds too; per-clip packing)",
    )
    args = parser.parse_args()
    draw = 100 * args.seed  # seed 0: the sentences and voices of the first measurements
    rehearsal = args.train_clips // 16 if args.rehearsal is None else args.rehearsal
    init = args.init
    work = Path(args.work)
    clips = work / "clips"
    train_rows = synthesise(clips, "eo", False, args.train_clips, draw + 1, args.lexicon)
    for index, language in enumerate(OTHERS):  # rehearsal: by default a fifth of the clips
        train_rows += synthesise(clips, language, False, rehearsal, seed=draw + 10 + index)
    held = {"eo": synthesise(clips, "eo", True, args.held_out, draw + 2, args.lexicon)}
    for index, language in enumerate(OTHERS):
        held[language] = synthesise(clips, language, True, args.others, seed=draw + 20 + index)
    neighbour_data = write_manifest(work / "train-es.jsonl", train_rows, esperanto_as="es")
    own_data = write_manifest(work / "train-eo.jsonl", train_rows, esperanto_as="eo")

    base, processor = load_model("base")
    started = time.perf_counter()
    base_hidden = {language: encode(base, processor, rows) for language, rows in held.items()}
    print(f"encoded {sum(len(r) for r in held.values())} held-out clips in "
          f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    arms = {"neighbour (es)": ("neighbour", neighbour_data, False)}
    arms["own token (eo)"] = (f"own-token-{init}", own_data, True)
    if args.mode != "freeze-encoder":  # folders of the first measurements' mode keep their names
        arms = {name: (f"{folder}-{args.mode}", *rest) for name, (folder, *rest) in arms.items()}
    models = {"base": (base, processor)}
    for name, (folder, manifest, new_language) in arms.items():
        trained = train_arm(
            work, folder, manifest, args.steps, new_language, init, args.seed, args.mode
        )
        models[name] = load_model(str(trained))
    rows = []
    for name, (model, model_processor) in models.items():
        own = "own token" in name
        # A frozen encoder is base's: its outputs serve every model; a trained one encodes anew.
        hidden = base_hidden
        if args.mode != "freeze-encoder" and name != "base":
            hidden = {language: encode(model, processor, rows) for language, rows in held.items()}
        target_wer, target_cer, detected = measure(
            model, model_processor, hidden["eo"], held["eo"], "eo" if own else "es"
        )
        row = {"model": name, "eo WER": target_wer, "eo CER": target_cer}
        row["eo detected as eo"] = share(detected, "eo")
        row["eo detected as es"] = share(detected, "es")
        for language in OTHERS:
            wer, _, found = measure(model, model_processor, hidden[language], held[language], None)
            row[f"{language} WER"], row[f"{language} detected"] = wer, share(found, language)
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = list(rows[0])
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [row["model"]] + [f"{row[c]:.1f}" for c in columns[1:]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
