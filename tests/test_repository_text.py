"""The repository speaks of the product: no line narrates how, or on what borrowed machine, it
was developed, and every BENCHMARKS.md section a file cites is there to be read.

Narration is what a reader cannot act on: numbered issues and "stops" of a tracker they cannot
see, the sessions and rounds of work that produced a figure, a GPU machine lent for some minutes
of device time, helper agents. Each pattern below is one such phrasing, narrow enough that the
product's own words pass (pytest's `scope="session"`, a terminal's session, timing rounds,
"borrowed from" a module): `test_the_scan_finds_planted_narration_and_passes_product_text`
holds both sides. Every text file git tracks or would add is read, the fixtures here included.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".ipynb"}
TEXT_NAMES = {"Makefile", ".gitignore", "run"}  # .ci/run

ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
    r"|twenty-\w+|\d+(?:st|nd|rd|th))"
)
NARRATION = {
    "a numbered issue": r"\bissues? #?\d+",
    "a numbered stop": r"\bstop \d+\b(?!\s*(?:s|ms|steps?|seconds?|minutes?|%)\b)",
    "a session of work": rf"\b(?:{ORDINAL}|this|that|next|previous|last|same|development|gpu)"
    r"\s+(?:gpu\s+)?sessions?\b",
    "a round of work": r"\b(?:this|that|next|previous|last) round\b",
    "a lent machine": r"\blent\b|\bborrowed\s+(?:a\s+|the\s+)?(?:gpu|machine|device|h[12]00)",
    "device time": r"\bdevice[- ]time\b|\bdevice calls?\b|\bgive_back\b|\bcarry=\[",
    "agents and helpers": r"\bagents?\b|\bhelper agents?\b|\bother helpers\b|\bhelpers' ",
    "the people at work": r"\bother engineers\b|\bthe lead's\b|\bthe workplace\b",
    "the tooling of a lent machine": r"\bgpu[_-](?:carry|session)\b|\.gpu-ttq",
}
PATTERNS = {label: re.compile(pattern, re.IGNORECASE) for label, pattern in NARRATION.items()}

# Quoted section names after "BENCHMARKS.md" (or "BENCHMARKS"), as prose and comments cite
# them: `BENCHMARKS.md, "The demo"`, `BENCHMARKS.md 'Learning rates'`, several in a row.
CITATION = re.compile(
    r"BENCHMARKS(?:\.md)?[,:]?\s*\(?((?:(?:\"[^\"]{3,90}\"|'[^']{3,90}')[,;]?\s*)+)"
)
QUOTED = re.compile(r"\"([^\"]{3,90})\"|'([^']{3,90})'")


def text_files() -> list[Path]:
    """The files git tracks or would add (not ignored), text only; outside a git checkout (an
    unpacked source archive) every file but those of virtual environments and caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        paths = [REPO / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        skipped = {".git", ".venv", ".venv-compat", "__pycache__", "build", "dist"}
        paths = [
            path
            for path in REPO.rglob("*")
            if not skipped & set(path.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") for part in path.parts)
        ]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES)]


def narrating_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it narrates, the line) for each line a pattern finds."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for label, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append((number, label, line.strip()))
    return found


def cited_sections(text: str) -> set[str]:
    """Section names a text cites after "BENCHMARKS.md", its line breaks, comment marks and
    Python's adjacent string literals ("... data " "workers") joined first."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    flat = re.sub(r"\"\s+\"", "", flat)
    names = set()
    for citation in CITATION.finditer(flat):
        names |= {a or b for a, b in QUOTED.findall(citation.group(1))}
    return {name.strip() for name in names}


def missing_sections(names: set[str], markdown: str) -> list[str]:
    """The names that start no heading of `markdown` (a subsection's counts)."""
    titles = [line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")]
    return sorted(name for name in names if not any(title.startswith(name) for title in titles))


def test_no_line_narrates_how_the_project_was_developed():
    found = [
        f"{path.relative_to(REPO)}:{number}: {label}: {line[:120]}"
        for path in text_files()
        if path != Path(__file__)
        for number, label, line in narrating_lines(path.read_text(encoding="utf-8"))
    ]
    assert len(text_files()) > 100  # the scan reads the repository, not an empty list
    assert not found, "lines that narrate development, not the product:\n" + "\n".join(found)


def test_the_scan_finds_planted_narration_and_passes_product_text():
    planted = {
        "a session of work": [
            "Measured in the twelfth session (2026-11-27).",
            "Re-run in the fourth GPU session on the H200.",
            "What is left for the next session: MFU.",
        ],
        "a numbered issue": ["Goal 1 of issue 32 is met; see issue #33."],
        "a numbered stop": ["filled a CI disk (ENOSPC, stop 61)."],
        "a lent machine": ["The machine was lent for 15 minutes.", "on a borrowed GPU"],
        "device time": ["11.1 minutes of device time", 'run(command="x", carry=[".whl"])'],
        "agents and helpers": ["shared with two other agents' jobs"],
        "the people at work": ["load 5-6 from other engineers' jobs", "the workplace's tool"],
        "a round of work": ["this round of changes"],
        "the tooling of a lent machine": ["bash bench/gpu_carry.sh, then .gpu-ttq-a"],
    }
    assert set(planted) == set(PATTERNS)  # every pattern is shown to find what it is for
    for label, lines in planted.items():
        for line in lines:
            assert label in {found for _, found, _ in narrating_lines(line)}, (label, line)
    product = [
        '@pytest.fixture(scope="session")',
        "torchrun in a session of its own: Ctrl-C signals the whole group",
        "its workers have sessions of their own",
        "median of 5 alternating rounds; --rounds 2",
        "Written out here, not borrowed from evaluate.py.",
        "the loss stops 2 steps later; stop 5 s before the end",
        "a silent clip, equivalent lengths, the lens of a microphone",
        "the HF blog's recipe; Unsloth #3592's LoRA case",
    ]
    assert [narrating_lines(line) for line in product] == [[]] * len(product)


def test_every_benchmarks_section_a_file_cites_is_a_heading():
    """A renamed section leaves a citation a reader cannot follow: each quoted name after
    "BENCHMARKS.md" is the start of a heading there (a subsection's, too)."""
    benchmarks = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    cited = {
        str(path.relative_to(REPO)): cited_sections(path.read_text(encoding="utf-8"))
        for path in text_files()
        if path.name != "BENCHMARKS.md" and path != Path(__file__)
    }
    assert sum(map(len, cited.values())) > 20  # the reader finds the docs' and code's citations
    missing = {where: missing_sections(names, benchmarks) for where, names in cited.items()}
    missing = {where: names for where, names in missing.items() if names}
    assert not missing, f"sections cited that BENCHMARKS.md does not have: {missing}"


def test_the_citation_reader_joins_wrapped_and_concatenated_names():
    text = (
        '# held-out WER (BENCHMARKS.md "Encoder and decoder at\n# their own rates").\n'
        'help="after ~35 s, BENCHMARKS.md \'Compiled, and data " "workers\'; not with ..."\n'
        'see BENCHMARKS.md "Packing per clip by default", "Each clip alone"'
    )
    assert cited_sections(text) == {
        "Encoder and decoder at their own rates",
        "Compiled, and data workers",
        "Packing per clip by default",
        "Each clip alone",
    }
    benchmarks = (
        "# Benchmarks\n## Long-form: recordings in windows\n#### Each clip alone, sampled\n"
    )
    assert missing_sections({"Long-form", "Each clip alone", "Setup"}, benchmarks) == ["Setup"]
