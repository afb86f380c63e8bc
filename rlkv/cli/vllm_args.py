"""Reading the vLLM flags `rlkv serve` passes through: a user's `--hf-overrides` and the few flags rlkv checks.

vLLM keeps the last `--hf-overrides` it is given and appends dotted ones (`--hf-overrides.KEY VALUE`) after
every other flag, so a user's overrides passed beside rlkv's would replace the head split without a word.
`take_hf_overrides` removes every form of the flag (`--hf-overrides JSON`, `--hf-overrides=JSON`, the
dotted forms, `_` for `-`) from the pass-through flags and returns their merged mapping, parsed as vLLM
parses it, so `rlkv serve` can merge it into rlkv's own and pass one flag.
"""

from __future__ import annotations

import json
from typing import Any

from rlkv.errors import UserInputError

_HF_OVERRIDES = "--hf-overrides"


def _canonical(flag: str) -> str:
    """`--hf_overrides.a_b` -> `--hf-overrides.a_b`: vLLM accepts `_` for `-` in a flag's name only."""
    name, dot, rest = flag.partition(".")
    return name.replace("_", "-") + dot + rest


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # vLLM keeps a dotted flag's non-JSON value as a string


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def take_hf_overrides(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(the merged `--hf-overrides` mapping of `args`, `args` without those flags)."""
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        flag = _canonical(flag) if flag.startswith("--") else flag
        if flag != _HF_OVERRIDES and not flag.startswith(_HF_OVERRIDES + "."):
            rest.append(arg)
            i += 1
            continue
        if eq:
            text, i = inline, i + 1
        elif i + 1 < len(args):
            text, i = args[i + 1], i + 2
        else:
            raise UserInputError(
                f"{flag} needs a value, e.g. {_HF_OVERRIDES} '{{\"max_position_embeddings\": 4096}}'"
            )
        if flag == _HF_OVERRIDES:
            value = _value(text)
            if not isinstance(value, dict):
                raise UserInputError(
                    f"{_HF_OVERRIDES} {text!r}: must be a JSON object, e.g. '{{\"max_position_embeddings\": 4096}}'"
                )
        else:
            keys = flag[len(_HF_OVERRIDES) + 1 :].removesuffix("+").split(".")
            value = _value(json.dumps(text.split(",")) if flag.endswith("+") else text)
            for key in reversed(keys):
                value = {key: value}
        _merge(overrides, value)
    return overrides, rest


def option(args: list[str], *names: str) -> str | None:
    """The last value given to any of `names` (`--x V`, `--x=V`, `-x V`; `_` for `-` in long names), else None."""
    wanted = {_canonical(n) if n.startswith("--") else n for n in names}
    found = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        flag = _canonical(flag) if flag.startswith("--") else flag
        if flag in wanted:
            found = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def switch(args: list[str], name: str) -> bool | None:
    """The last of vLLM's boolean flag `--NAME` (True) / `--no-NAME` (False) in `args` (`_` for `-`; also
    `--NAME=true` / `--NAME=false`, which vLLM's parser accepts), else None."""
    found = None
    for arg in args:
        flag, eq, value = arg.partition("=")
        flag = _canonical(flag) if flag.startswith("--") else flag
        if flag == f"--{name}":
            if not eq or value.lower() in _TRUE:
                found = True
            elif value.lower() in _FALSE:
                found = False
            else:
                raise UserInputError(f"--{name}={value}: give true or false (or --{name} / --no-{name})")
        elif flag == f"--no-{name}":
            found = False
    return found
