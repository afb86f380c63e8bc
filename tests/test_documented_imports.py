"""Every import the docs show works, and no module of the package outgrows 450 lines and no line
120 characters (issues 51, 77)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from rlkv.vllm_plugin import VLLM_ONLY_MODULES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
IMPORT = re.compile(r"^\s*from (rlkv(?:\.\w+)*) import \(?([\w, ]+)\)?\s*(?:#.*)?$")
DOTTED = re.compile(r"`(rlkv(?:\.\w+)+)")  # `rlkv.ablation.mask_nll(...)`, `rlkv.HeadMask`
MAX_MODULE_LINES = 450
MAX_LINE_CHARACTERS = 120
# modules that subclass vLLM's classes: they import where vLLM is installed (`make test-vllm` checks them)
NEEDS_VLLM = VLLM_ONLY_MODULES


def documented_imports() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for line in doc.read_text(encoding="utf-8").splitlines():
            match = IMPORT.match(line)
            if match:
                for name in match.group(2).split(","):
                    if name.strip():
                        found.add((match.group(1), name.strip().split(" as ")[0]))
    return sorted(found)


def documented_paths() -> list[str]:
    return sorted({m for doc in DOCS for m in DOTTED.findall(doc.read_text(encoding="utf-8"))})


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_the_docs_show_imports():
    assert ("rlkv.inference", "CompressionConfig") in documented_imports()
    assert "rlkv.HeadMask" in documented_paths()


@pytest.mark.parametrize("path", documented_paths())
def test_every_documented_dotted_path_resolves(path):
    if path.startswith(NEEDS_VLLM) and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (make test-vllm)")
    resolve(path)


@pytest.mark.parametrize(("module", "name"), documented_imports())
def test_every_documented_import_works(module, name):
    assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


@pytest.mark.parametrize(
    "name",
    [
        "HeadMask",
        "HeadMaskError",
        "ModelFingerprint",
        "rank_heads",
        "TIE_BREAK_BELOW_ZERO",
        "MASK_JSON",
        "MASK_TSV",
    ],
)
def test_head_mask_names_keep_their_import_path(name):
    """`rlkv/head_mask.py` became a package: every name it offered imports from `rlkv.head_mask` as before."""
    import rlkv.head_mask

    assert hasattr(rlkv.head_mask, name)


def test_no_module_over_450_lines_and_no_line_over_120_characters():
    texts = {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for path in (ROOT / "rlkv").rglob("*.py")
    }
    sizes = {p: len(text.splitlines()) for p, text in texts.items()}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}
    long_lines = [
        f"{p}:{i}"
        for p, text in texts.items()
        for i, line in enumerate(text.splitlines(), 1)
        if len(line) > MAX_LINE_CHARACTERS
    ]
    assert long_lines == []
