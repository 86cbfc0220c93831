"""Every citation of docs/architecture.md names something the document still has.

Code, tests, benchmarks and the other docs cite the design as `docs/architecture.md §Heading`
(a bare `§Heading` later in the same paragraph, comment or docstring cites the same document)
and its failure classes as `LESSONS #N`. A heading renamed or a class dropped would leave those
pointers dangling; this reads them all from the source text (no import, no process) and checks
each against the document's headings and the numbered classes under §Failure classes.

A citation may run into prose (`§Deadlines and §Clocks describe how they combine`): it then
names the longest heading it starts with, followed by one of `PROSE`. `§Streaming path 6` cites
numbered item 6 of §Streaming path (a list item or a table row); `§Threads "Engine process"`
cites both headings. A citation is read within one line: one wrapped after `§Streaming` is
reported dangling, so keep a citation on one line.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SOURCE_DIRS = ("pdserve", "tests", "benchmarks", "docs")
SOURCE_FILES = ("README.md",)

HEADING = re.compile(r"^#+\s+(.+?)\s*$")
# A numbered item: a list item `6. ...` or a table row `| 17 | ...`.
ITEM = re.compile(r"^(?:(\d+)\.\s|\|\s*(\d+)\s*\|)")
# Any markdown file named in the text: the document a following bare § belongs to.
DOC_NAME = re.compile(r"([\w./-]*?)(\w+)\.md\b")
SECTION = re.compile(r"§([A-Z][A-Za-z0-9'-]*(?: [A-Za-z0-9'-]+){0,4})(?:,?\s+\"([A-Z][^\"\n]*)\")?")
# `LESSONS #4, #8, #9`, also wrapped onto a comment's next line.
LESSONS = re.compile(r"LESSONS #(\d+)((?:,?\s+(?:#\s+)?#\d+)*)")
# Words that may follow a cited heading in a sentence without being part of it.
PROSE = frozenset({"and", "or", "describe", "describes", "lists", "says", "explains"})


@dataclass(frozen=True)
class Doc:
    headings: frozenset[str]
    items: dict[str, frozenset[str]]  # heading -> the numbers of its numbered items

    @classmethod
    def parse(cls, text: str) -> Doc:
        headings: set[str] = set()
        items: dict[str, set[str]] = {}
        current = None
        fenced = False
        for line in text.splitlines():
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            if (h := HEADING.match(line)) is not None:
                current = h.group(1)
                headings.add(current)
                items.setdefault(current, set())
            elif current is not None and (i := ITEM.match(line)) is not None:
                items[current].add(i.group(1) or i.group(2))
        return cls(frozenset(headings), {h: frozenset(n) for h, n in items.items()})

    def resolve(self, cited: str) -> str | None:
        """The heading `cited` names, or None if the document has none that fits."""
        if cited in self.headings:
            return cited
        words = cited.split()
        if len(words) > 1 and words[-1].isdigit():
            head = " ".join(words[:-1])
            return head if words[-1] in self.items.get(head, ()) else None
        for n in range(len(words) - 1, 0, -1):
            head = " ".join(words[:n])
            if head in self.headings and words[n] in PROSE:
                return head
        return None


@dataclass(frozen=True)
class Citation:
    where: str  # path:line
    cited: str  # the text after §, as the pattern read it


def section_citations(text: str, where: str = "") -> list[Citation]:
    """The architecture.md sections `text` cites: a § after a mention of docs/architecture.md,
    in the same block of non-blank lines, with no other document named between them."""
    out: list[Citation] = []
    lines = text.splitlines()
    start = 0
    while start < len(lines):
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and lines[end].strip():
            end += 1
        block = "\n".join(lines[start:end])
        events = [(m.start(), "doc", m) for m in DOC_NAME.finditer(block)]
        events += [(m.start(), "section", m) for m in SECTION.finditer(block)]
        document = None
        for pos, kind, m in sorted(events, key=lambda e: e[0]):
            if kind == "doc":
                document = m.group(2)
                continue
            if document != "architecture":
                continue
            line = f"{where}:{start + 1 + block.count(chr(10), 0, pos)}"
            out.append(Citation(line, m.group(1)))
            if m.group(2):
                out.append(Citation(line, m.group(2)))
        start = end
    return out


def lessons_citations(text: str, where: str = "") -> list[tuple[str, int]]:
    """Every `LESSONS #N` (and `#M` listed after it) in `text`, with where it is."""
    out = []
    for m in LESSONS.finditer(text):
        line = f"{where}:{text.count(chr(10), 0, m.start()) + 1}"
        for n in [m.group(1), *re.findall(r"#(\d+)", m.group(2))]:
            out.append((line, int(n)))
    return out


def own_citations(text: str, where: str) -> list[Citation]:
    """Every § in the document itself: all of them are its own headings."""
    out = []
    for m in SECTION.finditer(text):
        line = f"{where}:{text.count(chr(10), 0, m.start()) + 1}"
        out += [Citation(line, cited) for cited in m.groups() if cited]
    return out


def dangling(doc: Doc, citations: list[Citation]) -> list[str]:
    """The citations that name no heading (or no numbered item) of `doc`."""
    return [f"{c.where}: §{c.cited}" for c in citations if doc.resolve(c.cited) is None]


def missing_classes(doc: Doc, citations: list[tuple[str, int]]) -> list[str]:
    """The `LESSONS #N` citations whose N is no numbered item under §Failure classes."""
    classes = failure_classes(doc)
    return [f"{where}: LESSONS #{n}" for where, n in citations if n not in classes]


def sources() -> list[Path]:
    paths = [ROOT / f for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        paths += (ROOT / d).rglob("*.py")
        paths += (ROOT / d).rglob("*.md")
    return sorted(p for p in paths if p.is_file() and p != DOC and Path(__file__) != p)


@functools.cache
def read_sources() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sources()]


def failure_classes(doc: Doc) -> frozenset[int]:
    return frozenset(int(n) for n in doc.items.get("Failure classes", ()))


# -- the parser, on made-up text ----------------------------------------------------------------

FAKE_DOC = Doc.parse(
    "# Title\n\n## Loop\n\n1. wait\n2. drain\n\n### Engine process\n\n```\n# not a heading\n```\n\n"
    "## Failure classes\n\n1. **one**\n3. **three**\n"
)


def test_the_parser_reads_headings_and_numbered_items():
    assert FAKE_DOC.headings == {"Title", "Loop", "Engine process", "Failure classes"}
    assert FAKE_DOC.items["Loop"] == {"1", "2"}
    assert failure_classes(FAKE_DOC) == {1, 3}


def test_a_made_up_heading_is_dangling():
    text = "# docs/architecture.md §No such heading, and §Loop."
    cites = section_citations(text, "x.py")
    assert [c.cited for c in cites] == ["No such heading", "Loop"]
    assert dangling(FAKE_DOC, cites) == ["x.py:1: §No such heading"]
    # The same made-up citation against the real document.
    real = Doc.parse(DOC.read_text(encoding="utf-8"))
    assert dangling(real, cites) == ["x.py:1: §No such heading"]


def test_a_numbered_item_must_exist_under_its_heading():
    cites = section_citations("(docs/architecture.md §Loop 2; §Loop 7)")
    assert dangling(FAKE_DOC, cites) == [":1: §Loop 7"]


def test_a_heading_gone_is_not_saved_by_a_shorter_one():
    # "Engine" is no heading here, and "process" is no prose word: still dangling.
    doc = Doc.parse("## Engine\n")
    assert doc.resolve("Engine process") is None
    assert doc.resolve("Engine and") == "Engine"


def test_a_bare_section_belongs_to_the_last_document_named_in_its_block():
    text = (
        '"""Wall-clock (docs/architecture.md\n§Loop), see docs/reliability.md §Clocks.\n\n'
        '§Elsewhere, a new block."""\n# docs/architecture.md §Threads "Engine process"\n'
    )
    assert [(c.where, c.cited) for c in section_citations(text, "f.py")] == [
        ("f.py:2", "Loop"),
        ("f.py:5", "Threads"),
        ("f.py:5", "Engine process"),
    ]


def test_lessons_citations_read_every_number_and_a_missing_class_is_reported():
    text = "x\n# deadlines (LESSONS #1, #3,\n# #2) and LESSONS #99"
    cites = lessons_citations(text, "r.py")
    assert cites == [("r.py:2", 1), ("r.py:2", 3), ("r.py:2", 2), ("r.py:3", 99)]
    assert missing_classes(FAKE_DOC, cites) == ["r.py:2: LESSONS #2", "r.py:3: LESSONS #99"]


# -- the repository -----------------------------------------------------------------------------


def test_every_cited_section_of_architecture_md_exists():
    doc = Doc.parse(DOC.read_text(encoding="utf-8"))
    cites = [c for path, text in read_sources() for c in section_citations(text, path)]
    assert len(cites) >= 20, "the citations were not found: is the pattern still right?"
    assert dangling(doc, cites) == []


def test_architecture_md_cites_only_its_own_headings():
    text = DOC.read_text(encoding="utf-8")
    assert dangling(Doc.parse(text), own_citations(text, DOC.name)) == []


def test_every_cited_failure_class_exists():
    text = DOC.read_text(encoding="utf-8")
    doc = Doc.parse(text)
    assert failure_classes(doc) >= set(range(1, 20)), "§Failure classes lost its numbered rows"
    cites = [c for path, source in read_sources() for c in lessons_citations(source, path)]
    cites += lessons_citations(text, DOC.name)
    assert len(cites) >= 20, "the citations were not found: is the pattern still right?"
    assert missing_classes(doc, cites) == []
