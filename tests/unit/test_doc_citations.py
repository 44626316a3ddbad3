"""Comments cite documents that are in the repository, by sections that exist.

The project's design document and its notes on other systems live in `docs/` (docs/design.md, docs/references.md),
and code comments cite them as `docs/<name>.md §N` (or `§N.M`). This test reads every comment and docstring of the
Python files, and the whole text of the other files, under operator/, tests/, charts/, images/, examples/ and the
top-level README.md, Makefile and pyproject.toml, and fails on:
- a document of docs/ named without its `docs/` path (a bare or differently-rooted name cannot be followed);
- a citation of the team's notes outside the repository (its notes on the seed systems, its shared folder);
- a citation of an issue tracker ("issue" or "must-show" and a number): a tracker is not in the repository, and
  its numbers say nothing to a reader; the text says the why itself, or cites docs/design.md;
- a section sign whose number is not a numbered heading of the cited document, or that follows no cited
  document (a bare `§N` refers to the last `docs/<name>.md` named before it in the same docstring, in the file's
  comments, or in the same text file).
docs/*.md are read too: a bare section there refers to the document itself.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SCANNED_DIRS = ("operator", "tests", "charts", "images", "examples")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml")
SKIP_PARTS = {".venv", ".venv-vllm", "__pycache__", ".git", ".pytest_cache", ".hypothesis"}
TEXT_SUFFIXES = {"", ".md", ".txt", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".ini", ".tpl", ".j2", ".json"}

HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
# A document of docs/ named with whatever prefix it has (captured so that only `docs/` passes).
DOC_NAME = re.compile(r"(?P<prefix>[\w./-]*?)(?P<name>\b(?:design|references)\.md)\b")
SECTION = re.compile(r"§\s?(?P<number>\d+(?:\.\d+)*)")
CHAINED = re.compile(r"[\s`,;-]*(?:(?:and|or)[\s`]*)?")
"""What may stand between a document's name (or a section of it) and the next section of the same citation."""
OUTSIDE = re.compile(r"seed-systems|shared/reference|/work/shared|\bseed pitfall\b|\bseed \d+\.\d+", re.IGNORECASE)
TRACKER = re.compile(r"\b(?:issues?|must[- ]shows?)\b[\s,#]*\d+", re.IGNORECASE)
"""An issue tracker's numbers: "issue", "issues" or "must-show" followed by a number (test_planted_bad_citations_fail)."""


@cache
def headings(doc: str) -> frozenset[str]:
    """Section numbers of docs/<doc>: its numbered headings (`## 4.`, `### 4.1 ...`)."""
    path = DOCS / doc
    return frozenset(HEADING.findall(path.read_text())) if path.is_file() else frozenset()


def problems(text: str, own_doc: str | None = None) -> list[str]:
    """What is wrong with the citations in one block of comment or docstring text. `own_doc`: the docs/ file the
    text is from; there a bare document name is a relative link, and a section sign refers to the document itself
    unless it directly follows another document's name, or a section that does."""
    out: list[str] = []
    for m in OUTSIDE.finditer(text):
        out.append(f"cites a document outside the repository: {m.group(0)!r}")
    for m in TRACKER.finditer(text):
        out.append(f"cites an issue tracker, which is not in the repository: {m.group(0)!r} (say the why itself, "
                   "or cite docs/design.md §N)")
    events = [(m.start(), "doc", m) for m in DOC_NAME.finditer(text)]
    events += [(m.start(), "section", m) for m in SECTION.finditer(text)]
    current, chain_end = own_doc, -1  # the document sections refer to; where its last citation ended
    for start, kind, m in sorted(events, key=lambda e: e[0]):
        if kind == "doc":
            name, prefix = m.group("name"), m.group("prefix")
            if prefix == "docs/" or (own_doc is not None and prefix == ""):
                current, chain_end = name, m.end()
            else:
                out.append(f"names {prefix + name!r} without the docs/ path: cite docs/{name}")
                current = None
            continue
        if own_doc is not None and not CHAINED.fullmatch(text[chain_end:start]):
            current = own_doc
        number = m.group("number")
        chain_end = m.end()
        if current is None:
            out.append(f"§{number} follows no cited document (cite docs/<name>.md §{number})")
        elif not (DOCS / current).is_file():
            out.append(f"docs/{current} does not exist (cited with §{number})")
        elif number not in headings(current):
            out.append(f"docs/{current} has no section {number}")
    return out


def python_blocks(source: str) -> list[str]:
    """The docstrings (and attribute docstrings: any bare string statement) of a module, one block each, and all
    its comments as one block, in order."""
    blocks = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    blocks.append("\n".join(t.string for t in tokens if t.type == tokenize.COMMENT))
    return blocks


def scanned_files() -> list[Path]:
    files = [ROOT / f for f in SCANNED_FILES if (ROOT / f).is_file()]
    for d in SCANNED_DIRS:
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and not SKIP_PARTS & set(p.parts)
                  and (p.suffix == ".py" or p.suffix in TEXT_SUFFIXES)]
    return files


def file_problems(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    blocks = python_blocks(text) if path.suffix == ".py" else [text]
    own = path.name if path.parent == DOCS else None
    return [p for block in blocks for p in problems(block, own)]


def test_every_comment_cites_a_section_that_exists():
    found = {str(p.relative_to(ROOT)): file_problems(p) for p in scanned_files() + sorted(DOCS.glob("*.md"))}
    bad = {k: v for k, v in found.items() if v}
    assert not bad, bad


def test_the_design_document_is_numbered():
    # The sections code cites most: the API, start order, completion and teardown, the wire format, the trainer
    # API, lag, Fast-LLM, the module map; and the pitfalls and vLLM facts of the references.
    assert {str(n) for n in range(1, 11)} | {"2.4", "4.1", "4.4", "5.4", "5.6"} <= headings("design.md")
    assert {f"6.{n}" for n in range(1, 16)} | {"7", "8"} <= headings("references.md")


def test_good_citations_pass():
    assert problems("see docs/design.md §4.1 and, for the stall rule, §4.3") == []
    assert problems("the pitfalls of docs/references.md §6: never count samples (§6.1, §6.10)") == []
    assert problems("README may link docs/design.md without a section") == []
    assert problems("a section of its own document: §5.6", own_doc="design.md") == []
    # In a docs/ file, a section right after another document's name is that document's; later ones are its own.
    text = "facts are in `docs/references.md §7` and §6.15; the module map is §10"
    assert problems(text, own_doc="design.md") == []
    assert problems("see `docs/references.md §42`", own_doc="design.md") == ["docs/references.md has no section 42"]


def test_planted_bad_citations_fail():
    # Each synthetic comment below carries one bad citation; the check must name it.
    bad = {
        "(design.md s4)": "without the docs/ path",
        "the brief, /work/shared/design.md section 5": "outside the repository",
        "(seed-systems 6.15: zeroing inside forward_backward)": "outside the repository",
        "verified (shared/reference/vllm-cpu-weight-sync.md)": "outside the repository",
        "generation keeps going (seed pitfall 6.4)": "outside the repository",
        "the counters can stall (seed 6.8)": "outside the repository",
        "see docs/design.md §42": "has no section 42",
        "see docs/design.md §4.9": "has no section 4.9",
        "see docs/references.md §6.16": "has no section 6.16",
        "never by counting samples (§6.1)": "follows no cited document",
        "see docs/nonexistent.md §1": "follows no cited document",  # not a docs/ document this check knows
        "spec.trainer.lora (issue 22, LoRA): validation": "cites an issue tracker",
        "Issue 9, must-show 3: tiny random models": "cites an issue tracker",
        "through the operator (must-show 1)": "cites an issue tracker",
        "a dead watch connection (kopf issues 585, 957)": "cites an issue tracker",
        "see issue #12": "cites an issue tracker",
    }
    for text, expected in bad.items():
        found = problems(text)
        assert any(expected in p for p in found), (text, found)


def test_planted_bad_citation_in_a_python_comment_fails():
    source = 'def f():\n    """docs/design.md §6: fine."""\n    return 1  # teardown order (design.md s4)\n'
    found = [p for block in python_blocks(source) for p in problems(block)]
    assert found == ["names 'design.md' without the docs/ path: cite docs/design.md"], found
    # A string that is code, not a comment or docstring, is not a citation.
    assert [p for block in python_blocks('x = "(design.md s4)"\n') for p in problems(block)] == []


def module_map_gaps(design: str, modules: list[Path]) -> list[str]:
    """Shipped modules that docs/design.md §10 (the module map) does not name."""
    section = design.split("## 10. Module map", 1)[1].split("\n## ", 1)[0]
    return [str(m) for m in modules if f"`{m.name}`" not in section and f"`{m.parent.name}/`" not in section]


def test_the_module_map_names_every_shipped_module():
    package = ROOT / "operator" / "rlkube"
    modules = sorted(p.relative_to(package) for p in package.rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 50
    assert module_map_gaps((DOCS / "design.md").read_text(), modules) == []
    # A module the map does not name is reported.
    assert module_map_gaps("## 10. Module map\n- `a.py`: one.\n", [Path("x/a.py"), Path("x/b.py")]) == ["x/b.py"]
