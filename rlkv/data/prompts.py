"""Prompt templates applied through the tokenizer's chat template.

`build_prompt(example_or_text, tokenizer, template=...)` formats the problem with a named
template ("math": the RLKV paper's prompt, "code", "plain": the problem as-is, "auto": chosen
by the example's source) and wraps it as one user turn of the model's chat template, ending
with the assistant header so generation starts the answer. For thinking models, `open_think`
starts the `<think>` block (templates that already do it are left alone) and
`chat_template_kwargs` reaches the template (e.g. `{"enable_thinking": False}` for Qwen3).
"""

from __future__ import annotations

from typing import Any

from rlkv.rollout.engines import strip_added_bos
from rlkv.verifiers.verify import CODE_SOURCES

MATH_PROMPT = (
    "Solve the following math problem efficiently and clearly. The last line of your response should be "
    "of the following format: 'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I hope it is correct' "
    "(without quotes) where ANSWER is just the final number or expression that solves the problem. "
    "Think step by step before answering.\n\n{problem}"
)
CODE_PROMPT = (
    "Solve the following programming problem in Python. Think step by step, then give your complete "
    "solution (the full function definition with any imports it needs) in a single ```python code block "
    "at the end of your response.\n\n{problem}"
)
PLAIN_PROMPT = "{problem}"

PROMPT_TEMPLATES: dict[str, str] = {"math": MATH_PROMPT, "code": CODE_PROMPT, "plain": PLAIN_PROMPT}
PLAIN_SOURCES = ("chain",)
THINK_OPEN = "<think>\n"


def register_template(name: str, template: str) -> None:
    """Add a prompt template: a format string with a `{problem}` field (literal braces doubled)."""
    if "{problem}" not in template:
        raise ValueError(f"template {name!r} must contain the field '{{problem}}'")
    PROMPT_TEMPLATES[name] = template


def template_for(example: dict[str, Any]) -> str:
    """The template "auto" picks for an example: code for code sources, plain for the chain task, else math."""
    source = example.get("source", "")
    if source in CODE_SOURCES:
        return "code"
    if source in PLAIN_SOURCES:
        return "plain"
    return "math"


def format_problem(example_or_text: dict[str, Any] | str, template: str = "math") -> str:
    """The user message: the problem text (a string or an example's `problem`) inside the named template."""
    example = {"problem": example_or_text} if isinstance(example_or_text, str) else example_or_text
    if template == "auto":
        template = template_for(example)
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"template={template!r}: choose one of {sorted(PROMPT_TEMPLATES)} or 'auto'")
    return PROMPT_TEMPLATES[template].format(problem=example["problem"])


def build_prompt(
    example_or_text: dict[str, Any] | str,
    tokenizer: Any,
    template: str = "math",
    *,
    system_prompt: str | None = None,
    open_think: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The full prompt string: the formatted problem as a user turn of `tokenizer`'s chat template,
    assistant header added.

    The string is meant to be encoded with special tokens (`tokenizer(prompt)`, TRL, vLLM): a BOS the
    tokenizer adds itself is not repeated in it (see `strip_added_bos`).

    open_think: end the prompt inside an opened `<think>` block (no-op when the template already opens it).
    chat_template_kwargs: extra variables for the chat template (e.g. `enable_thinking`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "use an instruct/chat model or set tokenizer.chat_template"
        )
    messages = [{"role": "user", "content": format_problem(example_or_text, template)}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    if open_think and not prompt.rstrip().endswith("<think>"):
        prompt += THINK_OPEN
    return strip_added_bos(prompt, tokenizer)
