"""train_gates.py end to end on a tiny model: a run from a YAML recipe, bad recipes, a 2-process gloo run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlkv.data.chain_task import chain_problems
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def load_script():
    if "train_gates" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_gates", REPO / "train_gates.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_gates"] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["train_gates"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    tiny_model("qwen2").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chain.jsonl"
    rows = [
        {"problem": p.problem, "answer": p.answer, "source": "chain"} for p in chain_problems("train", num=8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_recipe(tmp_path: Path, **fields) -> Path:
    recipe = {
        "prompt_template": "plain",
        "rewards": ["verify"],
        "output_dir": str(tmp_path / "run"),
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "gate_sink": 4,
        "gate_local": 16,
        "save_steps": 1,
        "seed": 0,
        "disable_tqdm": True,
        **fields,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_recipe_run_writes_checkpoints_and_a_valid_head_mask(tmp_path, tiny_model_dir, problems_file):
    recipe = write_recipe(tmp_path, model_name_or_path=str(tiny_model_dir), dataset_name=str(problems_file))
    # a command-line override wins over the YAML
    load_script().main(["--config", str(recipe), "--l1_beta", "0.02", "--target_sparsity", "0.25"])
    out = tmp_path / "run"
    mask = HeadMask.load(out / "head_mask.json")
    mask.check_compatible(tiny_model("qwen2"))
    assert mask.metadata["l1_beta"] == 0.02 and mask.metadata["target_sparsity"] == 0.25
    assert mask.metadata["global_step"] == 2
    assert (out / "checkpoint-1" / "head_mask.json").is_file() and (
        out / "checkpoint-2" / "gates.safetensors"
    ).is_file()
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logged = state["log_history"][0]
    for key in (
        "reward",
        "rlkv/r_bar",
        "rlkv/beta_prime",
        "rlkv/l1_penalty",
        "gates/mean",
        "gates/above_0.5",
    ):
        assert key in logged, key
    assert logged["gates/mask_sparsity"] == 0.25


def run_bad(tmp_path, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_recipe_field_fails_at_start_naming_it(tmp_path, capsys, tiny_model_dir, problems_file):
    recipe = write_recipe(
        tmp_path, model_name_or_path=str(tiny_model_dir), dataset_name=str(problems_file), l1_betta=0.1
    )
    err = run_bad(tmp_path, capsys, "--config", str(recipe))
    assert "bad recipe" in err and "l1_betta" in err
    assert not (tmp_path / "run").exists()


def test_invalid_rlkv_value_fails_at_start(tmp_path, capsys, tiny_model_dir, problems_file):
    recipe = write_recipe(tmp_path, model_name_or_path=str(tiny_model_dir), dataset_name=str(problems_file))
    err = run_bad(tmp_path, capsys, "--config", str(recipe), "--target_sparsity", "1.5")
    assert "target_sparsity=1.5" in err


def test_model_without_gqa_attention_fails_at_start(tmp_path, capsys, problems_file):
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=len(tiny_tokenizer()))
    ).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    recipe = write_recipe(tmp_path, model_name_or_path=str(model_dir), dataset_name=str(problems_file))
    err = run_bad(tmp_path, capsys, "--config", str(recipe))
    assert "bad recipe" in err and "num_key_value_groups" in err


def test_empty_dataset_fails_at_start(tmp_path, capsys, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    recipe = write_recipe(tmp_path, model_name_or_path=str(tiny_model_dir), dataset_name=str(empty))
    err = run_bad(tmp_path, capsys, "--config", str(recipe))
    assert "bad recipe" in err and "empty" in err


LAUNCHER = """
import sys, torch, importlib.util
spec = importlib.util.spec_from_file_location("train_gates", sys.argv[1])
script = sys.modules["train_gates"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
trainer = script.build_trainer(sys.argv[2:])
trainer.train()
trainer.save_model()
rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
torch.save({"alpha": trainer.gates.alpha.detach().clone(), "world": world, "backend": torch.distributed.get_backend()},
           f"{trainer.args.output_dir}/alpha_rank{rank}.pt")
torch.distributed.destroy_process_group()
"""

REWARD_MODULE = """
def token_reward(prompts, completions, completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 3 == 0) / max(1, len(ids)) for ids in completion_ids]
"""


@pytest.mark.skipif(
    shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None, reason="no accelerate"
)
def test_two_gloo_processes_train_identical_gates(tmp_path, tiny_model_dir, problems_file):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU = 2 gloo ranks; each rank samples its own
    completions, DDP averages the gate gradients, so both ranks must end with the same gates."""
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "ddp_reward.py").write_text(REWARD_MODULE)
    recipe = write_recipe(
        tmp_path,
        model_name_or_path=str(tiny_model_dir),
        dataset_name=str(problems_file),
        rewards=["ddp_reward:token_reward"],
        per_device_train_batch_size=2,
        save_strategy="no",
        l1_beta=0.05,
        reward_threshold=0.0,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(REPO / "recipes/accelerate/multi_process_cpu.yaml"),
    ]
    with socket.socket() as sock:  # a free port: other test runs may launch at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd += ["--main_process_port", str(port), str(tmp_path / "launcher.py"), str(REPO / "train_gates.py")]
    cmd += ["--config", str(recipe)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / "run" / f"alpha_rank{r}.pt") for r in (0, 1)]
    assert all(r["world"] == 2 and r["backend"] == "gloo" for r in ranks)
    assert torch.equal(ranks[0]["alpha"], ranks[1]["alpha"])
    assert not torch.equal(ranks[0]["alpha"], torch.ones_like(ranks[0]["alpha"])), "gates did not train"
    assert torch.equal(HeadMask.load(tmp_path / "run" / "head_mask.json").scores, ranks[0]["alpha"])


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_parse_into_valid_configs(recipe):
    """Every recipe's fields exist and hold valid values (the paper recipes keep Table 3's numbers)."""
    from trl import ModelConfig, TrlParser

    from rlkv.trainers import GateGRPOConfig

    parser = TrlParser((load_script().ScriptArguments, GateGRPOConfig, ModelConfig))
    script_args, args, model_args = parser.parse_args_and_config(["--config", str(REPO / "recipes" / recipe)])
    assert model_args.model_name_or_path and script_args.dataset_name
    assert args.beta == 0.0 and args.num_generations == 4 and args.epsilon == 0.4 and not args.use_vllm
    paper = {
        "r1-distill-llama-8b.yaml": (1e-3, 0.5, 1.0),
        "r1-distill-qwen-7b.yaml": (1e-3, 0.55, 1.0),
        "qwen3-4b-thinking.yaml": (2.5e-3, 0.5, 0.95),
    }
    if recipe in paper:
        assert (args.l1_beta, args.reward_threshold, args.top_p) == paper[recipe]
        assert (
            args.max_completion_length == 7168 and args.num_train_epochs == 2 and args.learning_rate == 1e-2
        )
        assert args.per_device_train_batch_size * 8 * args.gradient_accumulation_steps == 32 * 4
        assert args.weight_decay == 0.017 and args.lr_scheduler_type == "constant" and args.temperature == 1.0
