"""The fenced code blocks of the Markdown docs, as a reader copies them, and what the docs test
(tests/e2e/test_docs_run.py) is told about each.

A block is whatever sits between an opening fence (three or more backticks or tildes, indented
as a list item may indent it) and its closing fence; the word after the opening fence is its
language. An HTML comment on the nearest non-blank line above the fence speaks to the docs
test, and a reader of the rendered page never sees it:

    <!-- docs-run: skip (needs a GPU) -->      not run; the reason is required
    <!-- docs-run: with tls-token -->          run against the named setup (see the test)
    <!-- docs-run: continues -->               run after the runnable block above it, as one

Anything else after `docs-run:` is an error naming the doc and line, so a typo never turns a
block off quietly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "DocsError", "LANGUAGES", "SHOWN", "find_blocks"]

#: Languages the docs test runs, by the runner that runs them: Python is executed, YAML is
#: loaded by the daemon's own parser (a config or a tenants file), shell is run by bash.
LANGUAGES = {"python": "python", "py": "python", "yaml": "yaml", "yml": "yaml",
             "sh": "shell", "bash": "shell", "shell": "shell", "console": "shell"}
#: Blocks a reader reads but never runs: output, diagrams, a command's synopsis, frame
#: layouts, pseudocode. Written ```text, so a block without a language is never mistaken
#: for one that a reader would copy and the docs test never runs.
SHOWN = "text"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-run:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>[^)]*\S[^)]*)\)$")
_WITH = re.compile(r"^with\s+(?P<setup>[a-z0-9-]+)$")


class DocsError(ValueError):
    """A doc the docs test cannot read as intended: a fence never closed, or a docs-run
    comment it does not understand. The message names the file and the line."""


@dataclass(frozen=True)
class Block:
    """One fenced block of one doc."""

    doc: str
    """The doc's path relative to the repository root (README.md, docs/engine.md)."""
    line: int
    """The 1-based line of the opening fence."""
    lang: str
    """The first word after the opening fence, lower case; "" when there is none."""
    text: str
    """The block's lines, the fence's indentation removed, each ending in a newline."""
    skip: str | None = None
    """Why the docs test does not run it (a docs-run: skip comment), else None."""
    setup: str = ""
    """The setup a docs-run: with comment names; "" for the default one."""
    continues: bool = False
    """It runs after the runnable block above it in the same doc, as one program."""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runner(self) -> str | None:
        """"python", "yaml" or "shell"; None for a block shown, not run (```text)."""
        return LANGUAGES.get(self.lang)


def find_blocks(path: Path, root: Path) -> list[Block]:
    """Every fenced block of the Markdown file at path, in order; DocsError for a fence never
    closed or a docs-run comment that is not one of the forms above."""
    doc = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = _closing(lines, i, opening.group("fence"))
        if end is None:
            raise DocsError(f"{doc}:{i + 1}: a code fence that is never closed")
        indent = len(opening.group("indent"))
        body = "".join(_dedent(line, indent) + "\n" for line in lines[i + 1:end])
        lang = opening.group("info").split(maxsplit=1)[0].lower() if opening.group("info") else ""
        blocks.append(_with_directive(Block(doc, i + 1, lang, body),
                                      _directive_above(lines, i, doc)))
        i = end + 1
    return blocks


def _closing(lines: list[str], start: int, fence: str) -> int | None:
    """The index of the line that closes the fence opened at start: the same character, at
    least as many of them, nothing else on the line."""
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            return j
    return None


def _dedent(line: str, indent: int) -> str:
    """line without the fence's indentation (a list item's), where it has that much."""
    head = len(line) - len(line.lstrip(" \t"))
    return line[min(head, indent):]


def _directive_above(lines: list[str], fence: int, doc: str) -> str | None:
    """The body of the docs-run comment on the nearest non-blank line above the fence."""
    for j in range(fence - 1, -1, -1):
        if lines[j].strip():
            found = _DIRECTIVE.match(lines[j])
            if found is not None:
                return found.group("body")
            start = _comment_start(lines, j)
            comment = "".join(lines[start:j + 1])
            if "<!--" in comment and "docs-run" in comment:
                raise DocsError(f"{doc}:{start + 1}: write the comment on one line, as "
                                "<!-- docs-run: skip (why) -->")
            return None
    return None


def _comment_start(lines: list[str], end: int) -> int:
    """The line where the HTML comment that closes on line end opens; end when it closes
    nowhere there (the line is prose, or the comment is on it alone)."""
    if "-->" not in lines[end]:
        return end
    for j in range(end, -1, -1):
        if "<!--" in lines[j]:
            return j
    return end


def _with_directive(block: Block, body: str | None) -> Block:
    if body is None:
        return block
    skip, setup = _SKIP.match(body), _WITH.match(body)
    if skip is not None:
        return Block(block.doc, block.line, block.lang, block.text,
                     skip=skip.group("reason").strip())
    if setup is not None:
        return Block(block.doc, block.line, block.lang, block.text, setup=setup.group("setup"))
    if body == "continues":
        return Block(block.doc, block.line, block.lang, block.text, continues=True)
    raise DocsError(f"{block.where}: docs-run: {body!r} is none of 'skip (why)', 'with SETUP' "
                    "or 'continues'")
