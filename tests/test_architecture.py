"""Architecture invariants (docs/design.md): the rooms' import rules (the "may import" table), no import
cycles between rlkv modules or between rooms, lazy imports included, and every module imports alone in a
fresh interpreter."""

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


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the rlkv modules it imports anywhere in its body (top level, in functions, TYPE_CHECKING)."""
    mods = _modules(package)

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


# docs/design.md's "may import" table, as data: room -> the rooms its modules may import (besides their own
# room). A room is a subpackage of rlkv (`rlkv.cache`), a top-level module (`rlkv.ablation`), or "leaf"
# for the modules that import nothing of rlkv but each other.
LEAF_MODULES = {
    "rlkv.errors",
    "rlkv._io",
    "rlkv.geometry",
    "rlkv.compat",
    "rlkv.cpu_memory",
    "rlkv.attention_masks",
    "rlkv.ranking",
    "rlkv.testing",
    "rlkv.deprecation",
}
ANYTHING = "anything"
MAY_IMPORT: dict[str, set[str]] = {
    "rlkv": set(),  # its names load lazily (PEP 562), through no import statement
    "leaf": set(),
    "policies": {"leaf"},
    "cache": {"policies", "leaf"},
    "gates": {"leaf"},
    "head_mask": {"leaf"},
    "vllm_plugin": {"leaf"},
    "sandbox": {"leaf"},
    "verifiers": {"sandbox", "leaf"},
    "inference": {"cache", "policies", "head_mask", "vllm_plugin", "leaf"},
    "rollout": {"inference", "cache", "vllm_plugin", "leaf"},
    "data": {"inference", "rollout", "verifiers", "leaf"},
    "trainers": {"gates", "rollout", "data", "verifiers", "head_mask", "inference", "leaf"},
    "eval": {"inference", "data", "verifiers", "head_mask", "trainers", "policies", "leaf"},
    "ablation": {"gates", "head_mask", "data", "inference", "leaf"},
    "cut_search": {"ablation", "head_mask", "data", "leaf"},
    "cli": {ANYTHING},
}
# single modules allowed more than their room: the eviction group's backend makes rlkv's own decisions
# (the policies and the static cache's budget rule) inside vLLM
MODULE_EXCEPTIONS = {
    "rlkv.vllm_plugin.eviction": {"policies", "cache"},
    "rlkv.vllm_plugin.eviction_backend": {"policies", "cache"},
    "rlkv.vllm_plugin.eviction_compaction": {"cache"},
    "rlkv.vllm_plugin.observed": {"cache"},
}


def room_of(module: str) -> str:
    """The room of an rlkv module: "leaf", "rlkv" (the package itself), or its subpackage / top-level module."""
    if module in LEAF_MODULES:
        return "leaf"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlkv"


def rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import of `graph` that the table forbids, one line each naming the import and the rule."""
    breaks = []
    for module, targets in sorted(graph.items()):
        room = room_of(module)
        if room not in MAY_IMPORT:
            breaks.append(f"{module}: room {room!r} is not in the 'may import' table (docs/design.md)")
            continue
        allowed = MAY_IMPORT[room] | MODULE_EXCEPTIONS.get(module, set())
        for target in sorted(targets):
            other = room_of(target)
            if other != room and other not in allowed and ANYTHING not in allowed:
                rule = ", ".join(sorted(allowed)) or "nothing of rlkv"
                breaks.append(f"{module} imports {target}: {room} may import {rule} (docs/design.md)")
    return breaks


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = {room_of(m): set() for m in graph}
    for module, targets in graph.items():
        rooms[room_of(module)] |= {room_of(t) for t in targets} - {room_of(module)}
    return rooms


def test_the_rule_check_names_a_planted_bad_import(tmp_path):
    """A package with one forbidden import (the cache reaching up into eval) fails with that import and the rule."""
    for name, body in {
        "__init__.py": "",
        "cache/__init__.py": "",
        "cache/store.py": "from rlkv.policies.base import Policy\nfrom rlkv.eval.runner import run\n",
        "policies/__init__.py": "",
        "policies/base.py": "from rlkv import errors\n",
        "eval/__init__.py": "",
        "eval/runner.py": "from rlkv.inference import api\n",
        "inference/__init__.py": "",
        "inference/api.py": "from rlkv.cache import store\n",
        "errors.py": "",
    }.items():
        (tmp_path / "rlkv" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rlkv" / name).write_text(body)
    graph = import_graph(tmp_path / "rlkv")
    assert rule_breaks(graph) == [
        "rlkv.cache.store imports rlkv.eval.runner: cache may import leaf, policies (docs/design.md)"
    ]
    assert import_cycles(room_graph(graph)) == [["cache", "eval", "inference"]]


def test_every_import_follows_the_rooms_rules():
    assert rule_breaks(import_graph()) == []


def test_no_package_cycles():
    assert import_cycles(room_graph(import_graph())) == []


def test_the_rules_are_the_design_tables():
    """Every room of the rules has its row in docs/design.md's table, and every leaf module is named there."""
    table = (PACKAGE.parent / "docs" / "design.md").read_text().split("| room | holds | may import |")[1]
    table = table.split("\n\n")[0]
    for room in set(MAY_IMPORT) - {"rlkv", "leaf"}:
        path = f"`rlkv/{room}/`" if (PACKAGE / room).is_dir() else f"`rlkv/{room}.py`"
        assert path in table, f"{path} has no row in docs/design.md's 'may import' table"
    for module in LEAF_MODULES:
        assert f"`rlkv/{module.split('.')[1]}.py`" in table, f"leaf module {module} not in the table"
    rooms = {room_of(m) for m in _modules()}
    assert rooms <= set(MAY_IMPORT), f"rooms without a rule: {sorted(rooms - set(MAY_IMPORT))}"


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
    # the vLLM plugin's model classes and scheduler subclass vLLM's: they import where vLLM is installed
    # (make test-vllm)
    needs_vllm = set() if importlib.util.find_spec("vllm") else set(VLLM_ONLY_MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", script, *sorted(set(_modules()) - needs_vllm)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PACKAGE.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
