"""Every ```python block of README.md and docs/**/*.md runs here (issue 51): examples that cannot rot.

The blocks of one page run in order in one namespace, in a scratch working directory, on the tiny
models of `rlkv.testing` (or assets/demo-model) that the blocks themselves build. A block that needs
a real model, the Hub or a GPU starts with a marker line, `# doc-test: skip (needs a GPU)`, and is
reported as skipped with that reason; a later block of the page must then not rely on its names.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*$")
SKIP = re.compile(r"^#\s*doc-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    index: int  # 1-based among the page's python blocks
    line: int  # 1-based line of the opening fence
    source: str
    skip_reason: str | None


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown page (indented ones too, e.g. inside a list item)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent, lang = i, match.group("indent"), match.group("lang")
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if lang != "python":
            continue
        source = textwrap.dedent(
            "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in body)
        )
        first = source.strip().splitlines()[0] if source.strip() else ""
        skip = SKIP.match(first)
        blocks.append(
            Block(
                page=str(path.relative_to(ROOT)),
                index=len(blocks) + 1,
                line=start + 1,
                source=source,
                skip_reason=skip.group("reason") if skip else None,
            )
        )
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


@dataclass
class PageRun:
    """One page's namespace and scratch directory, and how far its blocks have run."""

    workdir: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__doc_example__"})
    done: int = 0  # index of the last block run (or skipped)
    failed: str | None = None


RUNS: dict[str, PageRun] = {}


def run_block(block: Block, state: PageRun) -> None:
    code = compile(block.source, f"{block.page}:{block.line}", "exec")
    cwd = Path.cwd()
    os.chdir(state.workdir)
    try:
        exec(code, state.namespace)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_doc_block_runs(block: Block, tmp_path_factory):
    state = RUNS.get(block.page)
    if state is None:
        state = RUNS[block.page] = PageRun(tmp_path_factory.mktemp("doc_example"))
    # the page's earlier blocks first, when this one was selected alone (pytest -k)
    for earlier in python_blocks(ROOT / block.page)[state.done : block.index - 1]:
        if earlier.skip_reason is None and state.failed is None:
            try:
                run_block(earlier, state)
            except Exception as exc:  # recorded: the later blocks of the page report it
                state.failed = f"{earlier.page}:{earlier.line} raised {exc!r}"
        state.done = earlier.index
    state.done = block.index
    if block.skip_reason is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.skip_reason}")
    if state.failed is not None:
        pytest.fail(f"an earlier block of the page failed: {state.failed}")
    try:
        run_block(block, state)
    except Exception as exc:
        state.failed = f"{block.page}:{block.line} raised {exc!r}"
        raise


def test_the_collector_finds_the_readme_examples():
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert len(readme) >= 4 and all(b.skip_reason is None for b in readme)


def test_skip_markers_state_a_reason():
    """A marker that does not parse would run the block; one that names no reason is refused."""
    for block in BLOCKS:
        first = block.source.strip().splitlines()[0] if block.source.strip() else ""
        if "doc-test" in first:
            assert block.skip_reason, f"{block.page}:{block.line}: write `# doc-test: skip (reason)`"


def test_readme_links_resolve():
    """mkdocs --strict checks the links of docs/; the README (not part of the site) is checked here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"^[a-z]+://", t)]
    assert local and [t for t in local if not (ROOT / t).exists()] == []
