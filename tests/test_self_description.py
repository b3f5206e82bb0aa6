"""The repository speaks of the project, never of how, in which order or by whom the work was done.

Every text file of README.md, docs/, acco_ds/, tests/, benchmarks/ (results included: .md, .json) and
examples/ is searched for phrases that narrate the work ("not re-run", "was fixed in", "today's suite
times", ...). A hit fails the test with its file:line; write instead what the project does, with dated
figures. Technical terms that look alike stay: ACCO's rounds ("the previous round's gradients"). The
patterns are checked on samples first, so the test can fail.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("README.md", "docs", "acco_ds", "tests", "benchmarks", "examples")
SUFFIXES = {".md", ".py", ".json", ".sh", ".txt", ".yml", ".yaml", ".cfg", ".toml"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", "site"}

# Case-insensitive. Each names a way of narrating the work rather than describing the project.
NARRATING = [
    r"\bnot re-?run\b",
    r"\bre-?ran\b",
    r"\bround of work\b",
    r"\bprevious round of (work|the work|changes)\b",
    r"\bwas fixed in\b",
    r"\bfixed (in|since|after) (this|that|the) (run|change)\b",
    r"\bnow fixed\b",
    r"\b(it|this|that|they|we|what|which) used to\b",
    r"\bused to (be|do|send|take|make|recommend|run|give|fail|hang)\b",
    r"\btoday('s)?\b",
    r"\bfirst try\b",
    r"\b(were|was) not repeated\b",
    r"\b(before|since|after) this change\b",
    r"\bbuilt since\b",
    r"\bwe (chose|weighed|decided|tried|found|fixed|implemented)\b",
    r"\bnot (run|measured|tested) yet\b",
    r"\bhas not yet (run|been run|been measured|been tested)\b",
    r"\bat the previous stop\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in NARRATING), re.I)


def narrating(line: str) -> list:
    """The narrating phrases of ``line``."""
    return [m.group(0) for m in PATTERN.finditer(line)]


def searched_files():
    me = Path(__file__).resolve()
    for name in SEARCHED:
        top = ROOT / name
        if top.is_file():
            yield top
            continue
        for path in sorted(top.rglob("*")):
            if (path.is_file() and path.suffix in SUFFIXES and path.resolve() != me
                    and not SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts)):
                yield path


def across(line: str, following: str) -> list:
    """The narrating phrases that start on ``line`` and end on ``following`` (wrapped text, a comment)."""
    left = line.rstrip()
    right = re.sub(r"^\s*(#+|//|\*|>|\"\"\"|\")?\s*", "", following)
    joined = f"{left} {right}"
    return [m.group(0) for m in PATTERN.finditer(joined) if m.start() < len(left) < m.end() - 1]


def hits() -> list:
    found = []
    for path in searched_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            following = lines[number] if number < len(lines) else ""
            for phrase in narrating(line) + across(line, following):
                found.append(f"{path.relative_to(ROOT)}:{number}: {phrase!r}")
    return found


def test_the_patterns_catch_narration_and_spare_the_technical_terms():
    for line in ("Measured before the collectives changed; not re-run.", "we re-ran it with H = 4",
                 "The deadlock was fixed in peers.py.", "It used to hang.", "today's suite times",
                 "the alternative we weighed"):
        assert narrating(line), line
    for line in ("the gradients accumulated in the previous round are reduce-scattered",
                 "the estimate round and the real round", "load with the setting used to save it",
                 "shm files left by earlier runs"):
        assert not narrating(line), line
    # a phrase wrapped over two lines, or over two lines of a comment
    assert across("It was fixed", "in peers.py.") == ["was fixed in"]
    assert across("# Measured before; not", "# re-run.") == ["not re-run"]
    assert across("the gradients of the previous", "round are reduce-scattered") == []


def test_the_search_covers_the_repository():
    files = {p.relative_to(ROOT).as_posix() for p in searched_files()}
    assert "README.md" in files and "docs/testing.md" in files
    assert any(f.startswith("benchmarks/results/") and f.endswith(".json") for f in files)
    assert any(f.startswith("acco_ds/") for f in files) and any(f.startswith("examples/") for f in files)
    assert "tests/test_self_description.py" not in files


def test_no_text_narrates_the_work():
    found = hits()
    assert not found, "state what the project does (with dated figures) instead of how the work went:\n" + \
        "\n".join(found)
