"""Train RLKV head gates with GRPO: `rlkv train --config recipes/<name>.yaml [--field value ...]`, or under
accelerate `accelerate launch train_gates.py --config ...` (train_gates.py is a shim over `main` here).

Every field of `ScriptArguments` (data, prompt, rewards), `rlkv.trainers.GateGRPOConfig` (TRL's
GRPOConfig plus RLKV's l1_beta, reward_threshold, adaptive_penalty, gate_*, target_sparsity) and
TRL's `ModelConfig` (model_name_or_path, dtype, ...) can be set in the YAML or on the command line
(`dtype: auto` means bf16 on CPUs with AVX512/AMX-BF16 and on CUDA, fp32 otherwise; the gates stay fp32)
(the command line wins). Writes checkpoints with the gates and `head_mask.json` / `head_mask.tsv`
into `output_dir` at every save and at the end.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ScriptArguments:
    """What to train on and how it is scored."""

    dataset_name: str = field(
        default="",
        metadata={
            "help": "Problem set for rlkv.data.load_problems: a name (gsm8k, deepscaler, chain, reasoning_gym:<task>, "
            "...), a .jsonl/.json/.parquet file or a save_to_disk folder (e.g. a curriculum) in the problem schema."
        },
    )
    dataset_split: str | None = field(
        default=None, metadata={"help": "Split (each named set has a default)."}
    )
    dataset_num: int | None = field(
        default=None, metadata={"help": "Use this many problems (seeded sample)."}
    )
    dataset_data_files: str | None = field(
        default=None, metadata={"help": "Local file in the hub layout for a named set (offline machines)."}
    )
    prompt_template: str = field(
        default="auto",
        metadata={"help": "rlkv.data prompt template: math (RLKV paper), code, plain, or auto (by source)."},
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message."})
    open_think: bool = field(
        default=False, metadata={"help": "End the prompt inside an opened <think> block."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir that holds a run: its checkpoint-* folders and head mask are "
            "deleted first. Without it (and without resume_from_checkpoint) such an output_dir is refused."
        },
    )
    rewards: list[str] = field(
        default_factory=lambda: ["verify"],
        metadata={
            "help": "Reward functions: verify (the verifier registered for each row's source), math (boxed answer "
            "vs `answer` with math-verify), or import paths module:function."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.rewards, str):  # `rewards: verify` in a recipe: one reward, not its letters
            self.rewards = [self.rewards]
        if not self.rewards or not all(isinstance(r, str) and r for r in self.rewards):
            raise ValueError(
                f"rewards={self.rewards!r} is invalid: use a list of reward names, e.g. [verify]"
            )


def check_model_geometry(model_name_or_path: str, **load_kwargs) -> None:
    """Fail fast (before loading weights) when the model config lacks what per-KV-head gates need."""
    from transformers import AutoConfig

    from rlkv.geometry import attention_geometry, text_config

    config = AutoConfig.from_pretrained(model_name_or_path, **load_kwargs)
    text = text_config(config)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if getattr(text, a, None) is None]
    if missing:
        raise ValueError(
            f"model {model_name_or_path!r} ({config.model_type}) has no {', '.join(missing)} in its config: rlkv "
            "gates need a decoder with per-layer (grouped-query) attention such as Llama, Qwen2, Qwen3, Mistral"
        )
    geometry = attention_geometry(text)
    heads, kv = geometry.num_attention_heads, geometry.num_key_value_heads
    if heads % kv:
        raise ValueError(
            f"model {model_name_or_path!r}: num_attention_heads={heads} not divisible by kv heads={kv}"
        )


def check_curriculum_model(dataset_name: str, model_name_or_path: str, **load_kwargs) -> None:
    """Refuse a curriculum (a folder with run.json, or its dataset/ subfolder) whose completions another
    kind of model generated: distilling or training on them would teach this model another's solutions."""
    import json

    from transformers import AutoConfig

    folder = Path(dataset_name)
    run = next((p / "run.json" for p in (folder, folder.parent) if (p / "run.json").is_file()), None)
    if run is None or not folder.is_dir():
        return
    generator = json.loads(run.read_text(encoding="utf-8")).get("generator", {})
    model_type = AutoConfig.from_pretrained(model_name_or_path, **load_kwargs).model_type
    if generator.get("model_type") not in (None, model_type):
        raise ValueError(
            f"dataset_name {dataset_name!r} is a curriculum generated by {generator.get('model')!r} "
            f"({generator['model_type']}), not by this {model_type} model {model_name_or_path!r}: build one "
            f"with `rlkv data curriculum --model {model_name_or_path} ...` and train on it"
        )


_RUN_FILES = ("head_mask.json", "head_mask.tsv", "gates.safetensors")
DISTILL_STAGE_DIR = "distill"  # objective 'distill+grpo': the distillation stage's own run folder


def _checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N folders of `output_dir`, by step."""
    from rlkv.trainers.checkpoints import checkpoint_step  # torch-heavy: only when a run dir is checked

    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def is_complete_checkpoint(checkpoint: Path) -> bool:
    """Whether a checkpoint folder's trainer_state.json (transformers writes it last) holds a whole state.

    transformers writes that file in place, not atomically: a kill mid-write leaves it empty or torn, and
    resuming from it would fail in transformers' JSON reader.
    """
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "global_step" in state


def _unknown_fields_advice(message: str, parser: Any) -> str | None:
    """For TRL's "Unknown arguments from config file: ['--x', ...]": each unknown recipe field with the
    closest known field names (TRL's own advice is to edit its dataclasses); None for other errors."""
    import difflib
    import re

    if "Unknown arguments" not in message:
        return None
    names = re.findall(r"'--([\w.-]+)'", message)
    known = sorted({a.dest for a in parser._actions if a.dest != "help"})
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    return (
        f"unknown field{'s' if len(parts) > 1 else ''} {', '.join(parts)}: fix the spelling or remove "
        "the line (train_gates.py --help lists every field)"
    )


def resolve_output_dir(
    output_dir: str, resume_from_checkpoint: str | None, overwrite: bool, main_process: bool
):
    """The checkpoint to resume from (None: a fresh run), after checking `output_dir` against the request.

    `resume_from_checkpoint`: a checkpoint folder (must be complete: `is_complete_checkpoint`) or
    "true" (the latest complete checkpoint of output_dir). A fresh run into an output_dir that holds
    a run is refused unless `overwrite` (the old run's checkpoints and head mask are deleted, on the
    main process). Raises `UserInputError` naming the way out.
    """
    from rlkv.errors import UserInputError

    out = Path(output_dir)
    if main_process:
        from rlkv._io import remove_stale_temps

        remove_stale_temps(out)  # temp files of checkpoint writes a kill cut short
    complete = [p for p in _checkpoints(out) if is_complete_checkpoint(p)] if out.is_dir() else []
    latest = f"the last complete one is {complete[-1]}" if complete else f"{out} has no complete checkpoint"
    if resume_from_checkpoint is not None and resume_from_checkpoint.strip().lower() == "true":
        if not complete:
            raise UserInputError(
                f"resume_from_checkpoint=true: {latest} (nothing to resume); start over in it with "
                "--overwrite_output_dir true instead of --resume_from_checkpoint, or choose another output_dir"
            )
        return str(complete[-1])
    if resume_from_checkpoint:
        if not is_complete_checkpoint(Path(resume_from_checkpoint)):
            raise UserInputError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} is not a complete checkpoint (its "
                f"trainer_state.json is missing, or was cut short by a kill); {latest}"
            )
        return resume_from_checkpoint
    holds_run = out.is_dir() and (_checkpoints(out) or any((out / f).exists() for f in _RUN_FILES))
    if holds_run and not overwrite and not complete:
        raise UserInputError(
            f"output_dir {str(out)!r} holds only incomplete checkpoints (cut short by a kill) or a run's "
            "files: nothing to resume; start over in it with --overwrite_output_dir true, or choose another output_dir"
        )
    if holds_run and not overwrite:
        raise UserInputError(
            f"output_dir {str(out)!r} already holds a training run; continue it with --resume_from_checkpoint true, "
            "start over in it with --overwrite_output_dir true, or choose another output_dir"
        )
    if holds_run and main_process:
        for checkpoint in _checkpoints(out):
            shutil.rmtree(checkpoint)
        for name in _RUN_FILES:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / DISTILL_STAGE_DIR, ignore_errors=True)
    return None


def build_train_dataset(
    script_args: ScriptArguments, tokenizer, chat_template_kwargs: dict | None, seed: int
):
    """The problems with a `prompt` column (chat-templated string) added; ProblemDataError if unusable or empty."""
    from rlkv.data import ProblemDataError, build_prompt, load_problems
    from rlkv.verifiers.verify import check_verifiers

    if not script_args.dataset_name:
        raise ProblemDataError("dataset_name is empty: set it in the recipe or with --dataset_name")
    ds = load_problems(
        script_args.dataset_name,
        split=script_args.dataset_split,
        num=script_args.dataset_num,
        seed=seed,
        data_files=script_args.dataset_data_files,
    )
    if len(ds) == 0:
        raise ProblemDataError(
            f"dataset {script_args.dataset_name!r} has no problems after loading/filtering"
        )
    if "verify" in script_args.rewards:
        check_verifiers(ds.unique("source"), f"dataset {script_args.dataset_name!r}")

    def add_prompt(example: dict) -> dict:
        prompt = build_prompt(
            example,
            tokenizer,
            script_args.prompt_template,
            system_prompt=script_args.system_prompt,
            open_think=script_args.open_think,
            chat_template_kwargs=chat_template_kwargs,
        )
        return {"prompt": prompt}

    return ds.map(add_prompt, desc="prompts")


def _remove_if_empty(folders: list[Path]) -> None:
    """rmdir each folder in turn (innermost first) while it is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty: the run wrote into it
            return


@dataclass
class Recipe:
    """A parsed, checked recipe and what it loads before the model: the parts every stage is built from."""

    parser: Any
    script_args: ScriptArguments
    training_args: Any  # GateGRPOConfig
    model_args: Any  # trl.ModelConfig
    tokenizer: Any
    train_dataset: Any


def parse_recipe(
    argv: list[str] | None = None, prog: str | None = None, held: contextlib.ExitStack | None = None
) -> Recipe:
    """Parse and validate the recipe, load the tokenizer and the prompts (exit status 2 with a
    `PROG: error:` line when something is bad). `prog` names the command in messages. With `held`,
    the main process locks output_dir (`rlkv._io.FolderLock`, released when `held` closes) before
    checking or clearing it, so a second run into the same folder refuses naming the first."""
    import torch
    from transformers import AutoTokenizer
    from trl import ModelConfig, TrlParser

    from rlkv.data import ProblemDataError
    from rlkv.errors import OneLineErrors
    from rlkv.inference import resolve_dtype
    from rlkv.trainers import GateGRPOConfig, get_reward

    class RecipeParser(OneLineErrors, TrlParser):
        """TrlParser whose errors are one line, not buried under the usage text of every TRL field."""

    parser = RecipeParser((ScriptArguments, GateGRPOConfig, ModelConfig), **({"prog": prog} if prog else {}))
    try:
        script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    except ValueError as e:  # unknown recipe fields and invalid values
        parser.error(f"bad recipe: {_unknown_fields_advice(str(e), parser) or e}")
    if not model_args.model_name_or_path:
        parser.error("bad recipe: model_name_or_path is not set")
    if held is not None and training_args.process_index == 0:
        from rlkv._io import FolderLock
        from rlkv.errors import UserInputError

        out = Path(training_args.output_dir)
        made = [folder for folder in (out, *out.parents) if not folder.exists()]  # innermost first
        out.mkdir(parents=True, exist_ok=True)
        # made for the lock, removed again if nothing was written (a refused recipe); runs after the
        # lock's exit (LIFO), which unlinks the lock file
        held.callback(_remove_if_empty, made)
        held.enter_context(FolderLock(out, prog or "train_gates.py", UserInputError))
    training_args.resume_from_checkpoint = resolve_output_dir(
        training_args.output_dir,
        training_args.resume_from_checkpoint,
        script_args.overwrite_output_dir,
        main_process=training_args.process_index == 0,
    )
    load_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
    }
    try:
        check_model_geometry(model_args.model_name_or_path, **load_kwargs)
        check_curriculum_model(script_args.dataset_name, model_args.model_name_or_path, **load_kwargs)
        if training_args.objective != "distill":
            [get_reward(name) for name in script_args.rewards]  # a bad reward name fails before any training
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, padding_side="left", **load_kwargs
        )
        train_dataset = build_train_dataset(
            script_args, tokenizer, training_args.chat_template_kwargs, seed=training_args.seed
        )
    except (ValueError, OSError, ProblemDataError) as e:
        parser.error(f"bad recipe: {e}")
    device = "cpu" if training_args.use_cpu or not torch.cuda.is_available() else "cuda"
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "revision": model_args.model_revision,
        **({"dtype": resolve_dtype(model_args.dtype, device)} if model_args.dtype else {}),
    }
    return Recipe(parser, script_args, training_args, model_args, tokenizer, train_dataset)


def grpo_trainer(recipe: Recipe, model: Any = None):
    """The `GateGRPOTrainer` of `recipe`, on `model` (a model carrying the gates of an earlier stage) or
    on the recipe's model path."""
    from rlkv.gates import UnsupportedModelError
    from rlkv.trainers import GateGRPOTrainer, get_reward

    try:
        return GateGRPOTrainer(
            model=model if model is not None else recipe.model_args.model_name_or_path,
            reward_funcs=[get_reward(name) for name in recipe.script_args.rewards],
            args=recipe.training_args,
            train_dataset=recipe.train_dataset,
            processing_class=recipe.tokenizer,
        )
    except UnsupportedModelError as e:
        recipe.parser.error(f"bad recipe: {e}")


def distill_trainer(recipe: Recipe):
    """The `GateDistillTrainer` of `recipe`: objective 'distill' trains into output_dir for max_steps;
    the first stage of 'distill+grpo' into output_dir/distill for distill_steps (started over each time)."""
    import copy

    from rlkv.gates import UnsupportedModelError
    from rlkv.trainers.distill import GateDistillTrainer, distill_sequences

    base = recipe.training_args
    args = copy.copy(base)
    if base.distill_learning_rate is not None:
        args.learning_rate = base.distill_learning_rate
    if base.objective == "distill+grpo":
        args.output_dir = str(Path(base.output_dir) / DISTILL_STAGE_DIR)
        args.max_steps = base.distill_steps
        args.resume_from_checkpoint = None
        shutil.rmtree(args.output_dir, ignore_errors=True)
    try:
        sequences = distill_sequences(recipe.train_dataset, recipe.tokenizer, base.distill_max_length)
        return GateDistillTrainer(
            model=recipe.model_args.model_name_or_path,
            args=args,
            train_dataset=sequences,
            processing_class=recipe.tokenizer,
        )
    except (ValueError, UnsupportedModelError) as e:
        recipe.parser.error(f"bad recipe: {e}")


def build_trainer(argv: list[str] | None = None, prog: str | None = None):
    """Parse and validate the recipe (exit status 2 with a `PROG: error:` line when it is bad); the ready
    trainer of its first stage: GateGRPOTrainer (objective 'grpo'), GateDistillTrainer ('distill',
    'distill+grpo'). `prog` names the command in messages (default: the script's file name)."""
    recipe = parse_recipe(argv, prog)
    return grpo_trainer(recipe) if recipe.training_args.objective == "grpo" else distill_trainer(recipe)


def train(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Train the gates of the recipe's model by its objective, then save the final gates and head mask into
    output_dir. 'distill+grpo' distils into output_dir/distill first, unless GRPO resumes a checkpoint."""
    with contextlib.ExitStack() as held:
        _train(parse_recipe(argv, prog, held))


def _train(recipe: Recipe) -> None:
    import torch

    args = recipe.training_args
    model = None
    if args.objective == "distill" or (args.objective == "distill+grpo" and not args.resume_from_checkpoint):
        stage = distill_trainer(recipe)
        stage.train(
            resume_from_checkpoint=args.resume_from_checkpoint if args.objective == "distill" else None
        )
        stage.save_model(stage.args.output_dir)
        model = stage.accelerator.unwrap_model(stage.model)
        args.gate_init_from = None  # GRPO continues from the distilled gates
    if args.objective != "distill":
        trainer = grpo_trainer(recipe, model)
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model(args.output_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None, prog: str = "train_gates.py") -> int:
    """`train(argv)`; exit status 2 with one `PROG: error: ...` line for a bad recipe or input."""
    from rlkv.errors import run_reporting_user_errors

    return run_reporting_user_errors(prog, lambda: train(argv, prog))
