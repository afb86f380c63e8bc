"""A serving install carries no training stack (issue 77): the base dependencies name no TRL, PEFT, accelerate,
datasets or math-verify (the `train` / `eval` extras do), and serving's code paths load none of them."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TRAINING_STACK = ("trl", "peft", "accelerate", "datasets", "math-verify")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_base_dependencies_name_no_training_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _names(project["dependencies"])
    assert base.isdisjoint(TRAINING_STACK), base & set(TRAINING_STACK)
    extras = project["optional-dependencies"]
    assert {"trl", "peft", "accelerate", "rlkv"} <= _names(extras["train"])
    assert any(r.startswith("rlkv[eval") for r in extras["train"])
    assert {"datasets", "math-verify"} <= _names(extras["eval"])
    # make test / make demo install the dev extra: the training stack with it
    assert any(r.startswith("rlkv[train") for r in extras["dev"])


def _run(code: str, tmp_path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_plugin_imports_no_other_room_and_no_training_stack(tmp_path):
    """What every vLLM process runs first: `import rlkv.vllm_plugin` loads the plugin package alone."""
    out = _run(
        """
        import sys
        import rlkv.vllm_plugin
        print(sorted(m for m in sys.modules if m.startswith("rlkv")))
        print(sorted(m for m in ("trl", "peft", "datasets", "math_verify", "transformers") if m in sys.modules))
        """,
        tmp_path,
    )
    rlkv_modules, loaded = (eval(line) for line in out.splitlines()[-2:])
    assert [m for m in rlkv_modules if m != "rlkv" and not m.startswith("rlkv.vllm_plugin")] == []
    assert loaded == []


def test_generating_with_a_head_mask_loads_no_training_stack(tmp_path):
    """`rlkv generate` with a head mask (the transformers serving path) and the vLLM split of the same mask
    run without importing TRL, PEFT, datasets or math-verify."""
    out = _run(
        """
        import sys
        from rlkv.cli import main
        from rlkv.head_mask import HeadMask
        from rlkv.inference import load
        from rlkv.inference.vllm import vllm_overrides

        model, _ = load("tiny:llama")
        HeadMask.random(model, seed=0).save_pretrained("mask")
        assert vllm_overrides(model.config, "mask", 0.5)["rlkv_head_split"]["full_kv_heads"]
        code = main(["generate", "--model", "tiny:llama", "--head-mask", "mask", "--sparsity", "0.5",
                     "--window", "8", "--prompt", "hello", "--max-new-tokens", "4"])
        assert code in (0, None), code
        print(sorted(m for m in ("trl", "peft", "datasets", "math_verify") if m in sys.modules))
        """,
        tmp_path,
    )
    assert out.splitlines()[-1] == "[]"
