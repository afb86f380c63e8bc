"""Architecture invariants (docs/design.md): no import cycles between rlkv modules, lazy imports
included, and every module imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import rlkv
from rlkv.vllm_plugin import VLLM_ONLY_MODULES

PACKAGE = Path(rlkv.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the rlkv modules it imports anywhere in its body (top level, in functions, TYPE_CHECKING)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] == "rlkv" else None
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_policies_do_not_import_the_cache():
    """Policies see the store through `rlkv.policies.base.PolicyStore` only."""
    graph = import_graph()
    offenders = [
        (m, d) for m in graph if m.startswith("rlkv.policies") for d in graph[m] if d.startswith("rlkv.cache")
    ]
    assert offenders == []


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """A parent process imports every module once (so the third-party libraries are loaded), drops
    every rlkv module from `sys.modules`, then forks one child per module: each child starts with no
    rlkv module loaded and imports just that one (a cycle or a missing import fails there)."""
    script = textwrap.dedent(
        """
        import importlib, os, sys
        names = sys.argv[1:]
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                pass  # reported by its child below
        for loaded in [m for m in sys.modules if m == "rlkv" or m.startswith("rlkv.")]:
            del sys.modules[loaded]
        failed = []
        for name in names:
            pid = os.fork()
            if pid == 0:
                try:
                    importlib.import_module(name)
                except BaseException as e:
                    print(f"{name}: {type(e).__name__}: {e}", flush=True)
                    os._exit(1)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if status:
                failed.append(name)
        print("FAILED", failed)
        sys.exit(1 if failed else 0)
        """
    )
    # the vLLM plugin's model classes and scheduler subclass vLLM's: they import where vLLM is installed (make test-vllm)
    needs_vllm = set() if importlib.util.find_spec("vllm") else set(VLLM_ONLY_MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", script, *sorted(set(_modules()) - needs_vllm)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PACKAGE.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
