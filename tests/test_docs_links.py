"""Relative links between README.md and docs/ resolve: every `[text](path)`, `![alt](path)` and
`[ref]: path` names a file of the repository, every `#anchor` a heading of its page (GitHub's
anchors), and every `docs/NAME.md` mentioned in the text exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
DOC_MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.md\b")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def markdown_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, without punctuation or
    symbols, spaces turned into hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("*", "").lower()
    kept = (c for c in text if c in " -" or unicodedata.category(c)[0] in "LNM" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(root: Path) -> list[str]:
    """One message per broken relative link, anchor or docs/ mention in README.md and docs/."""
    problems = []
    anchor_cache: dict[Path, set[str]] = {}
    for page in markdown_files(root):
        where = page.relative_to(root)
        text = page.read_text()
        for number, line in prose_lines(text):
            for mention in DOC_MENTION.findall(LINK.sub("", line)):  # a link's own target is checked below
                if not (root / mention).is_file():
                    problems.append(f"{where}:{number}: {mention} does not exist")
            outside_code = INLINE_CODE.sub("", line)
            targets = LINK.findall(outside_code)
            reference = REFERENCE.match(outside_code)
            if reference:
                targets.append(reference.group(1))
            for target in targets:
                if EXTERNAL.match(target):
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = (page.parent / file_part).resolve() if file_part else page
                if file_part and not resolved.is_relative_to(root):
                    problems.append(f"{where}:{number}: {target} points outside the repository")
                    continue
                if not resolved.exists():
                    problems.append(f"{where}:{number}: {target}: {file_part} does not exist")
                    continue
                if anchor and resolved.suffix == ".md":
                    known = anchor_cache.setdefault(resolved, anchors(resolved)) if resolved.is_file() else set()
                    if anchor not in known:
                        problems.append(f"{where}:{number}: {target}: no heading with anchor #{anchor} "
                                        f"in {resolved.relative_to(root)}")
    return problems


def test_readme_and_docs_links_resolve() -> None:
    problems = broken_links(ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_to_the_docs_index() -> None:
    assert "(docs/README.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("heading, anchor", [
    ("Tool calls over HTTP: a conversation's KV between its turns", "tool-calls-over-http-a-conversations-kv-between-its-turns"),
    ("Ablation: starvation prevention × admission", "ablation-starvation-prevention--admission"),
    ("Scheduler overhead: `scripts/bench_scheduler_overhead.py`", "scheduler-overhead-scriptsbench_scheduler_overheadpy"),
    ("Profile `calibrated-cpu` (measured on vLLM)", "profile-calibrated-cpu-measured-on-vllm"),
    ("`WaitingQueue.push_back`", "waitingqueuepush_back"),
    ("Against INFERCEPT's published curve", "against-infercepts-published-curve"),
])
def test_slug_matches_githubs_anchors(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## Second part\n\nBack to the [README](../README.md), [here](#second-part), "
        "[gone](#nowhere), `[not a link](missing.md)`.\n\n```\n[in code](missing.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\nSee [the page](docs/page.md#second-part), [a missing one](docs/missing.md), "
        "[a bad anchor](docs/page.md#third-part), [out](../elsewhere.md), [web](https://example.org/x.md), "
        "and `docs/also-missing.md`.\n\n[ref]: docs/page.md#a-page\n")
    problems = broken_links(tmp_path)
    assert len(problems) == 5, problems
    assert any("docs/missing.md does not exist" in p for p in problems)
    assert any("#third-part" in p for p in problems)
    assert any("#nowhere" in p and p.startswith("docs/page.md") for p in problems)
    assert any("outside the repository" in p for p in problems)
    assert any("docs/also-missing.md does not exist" in p for p in problems)
