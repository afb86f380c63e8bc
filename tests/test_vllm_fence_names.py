"""Every vLLM name rlkv touches is listed in the plugin's fence (`rlkv/vllm_plugin/fence.py`), which checks each at
a head-mixed engine's start (issue 88, item 3): a new import from vLLM, or a new private member of vLLM's reached
from rlkv, fails here until it is listed. Reads rlkv's source only (no vLLM needed)."""

from __future__ import annotations

import ast
from pathlib import Path

from rlkv.vllm_plugin import fence

ROOT = Path(__file__).resolve().parent.parent / "rlkv"
# private names rlkv's vLLM modules reach outside vLLM: os._exit (the engine processes' parent-death hook), TRL's
# parameter iterator of its vLLM weight sync, argparse's type of a subparsers action (a type hint)
OTHER_PRIVATE = {"_exit", "_iter_named_params", "_SubParsersAction"}


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(ROOT.rglob("*.py"))}


def test_every_vllm_import_is_in_the_fence():
    listed = set(fence.VLLM_IMPORTS) | set(fence.VLLM_CPU_IMPORTS)
    imported = {
        f"{node.module}:{alias.name}"
        for tree in _trees().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm"
        for alias in node.names
    }
    assert imported - listed == set(), "list these in rlkv/vllm_plugin/fence.py VLLM_IMPORTS"
    assert listed - imported == set(), "the fence lists names rlkv no longer imports"


# the modules that hold vLLM objects (the plugin's room, rlkv's engines on vLLM, the serve command)
VLLM_MODULES = ("vllm_plugin/", "inference/vllm", "rollout/vllm", "eval/vllm", "cli/serve.py")


def test_every_private_member_rlkv_reaches_outside_its_own_code_is_in_the_fence():
    trees = {
        p: t for p, t in _trees().items() if any(m in p.relative_to(ROOT).as_posix() for m in VLLM_MODULES)
    }
    defined: set[str] = (
        set()
    )  # names rlkv defines anywhere (its own helpers and fields the vLLM modules reach)
    for tree in _trees().values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
    reached = {
        node.attr
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    }
    fenced = {path.rpartition(".")[2] for path in fence.VLLM_PRIVATE_MEMBERS}
    assert reached - defined - OTHER_PRIVATE - fenced == set(), "list them in fence.VLLM_PRIVATE_MEMBERS"
    # what the fence lists is still reached (by attribute, or by name where a dataclass is rebuilt)
    sources = "".join(path.read_text(encoding="utf-8") for path in trees)
    assert all(name in sources for name in fenced)
