"""The kvpress half of `benchmarks/kvpress/compare.py`, run inside `.venv-kvpress/` (kvpress pins transformers<5.3).

Imports only torch, transformers and kvpress (never rlkv, which needs transformers 5.23), so the
same file runs in both environments: `compare.py` imports its measurement helpers
(`tensor_storage_bytes`, `GenerationProbe`, `vm_hwm_bytes`) for the rlkv side, so both sides are
measured by the same code.

    .venv-kvpress/bin/python benchmarks/kvpress/worker.py --spec runs/compare-kvpress/spec.json --out kvpress.json

The spec (written by compare.py): model folder, prompts (token ids), answers, max_new_tokens,
a DuoAttention pattern folder (`full_attention_heads.tsv` + `config.json`) and the kvpress methods.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def tensor_storage_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages reachable from `obj` (attributes, lists, tuples, dicts).

    Does not descend into `torch.nn.Module`s (a policy or press may hold the model), so it counts
    what a KV cache object keeps alive: keys, values, positions, buffers. Views of one storage
    count once.
    """
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen_objects or isinstance(item, torch.nn.Module):
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.device.type == "meta":
                continue
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
        elif hasattr(item, "__slots__"):
            stack.extend(getattr(item, s) for s in item.__slots__ if hasattr(item, s))
    return sum(storages.values())


def vm_hwm_bytes() -> int:
    """Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_vm_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs). False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class GenerationProbe:
    """A forward hook on the causal LM: step timestamps and the cache's resident bytes after every forward.

    The cache walk's own time is measured and left out of the decode time.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.times: list[float] = []
        self.walk_seconds: list[float] = []
        self.kv_bytes: list[int] = []  # the cache's bytes after every forward
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        end = time.perf_counter()
        # transformers 5.24 renamed past_key_values to cache (arguments and outputs); kvpress pins < 5.3
        cache = kwargs.get("cache") or kwargs.get("past_key_values") or _output_cache(output)
        if cache is not None:
            self.kv_bytes.append(tensor_storage_bytes(cache))
        self.times.append(end)
        self.walk_seconds.append(time.perf_counter() - end)

    @property
    def peak_kv(self) -> int:
        return max(self.kv_bytes, default=0)

    @property
    def mean_kv(self) -> float:
        """The cache's bytes averaged over the forwards: what generation holds over time (a snapshot at
        its end depends on where it falls in a compression cycle)."""
        return sum(self.kv_bytes) / max(len(self.kv_bytes), 1)

    def step_seconds(self) -> list[float]:
        """Each decode step's seconds: from the end of one forward to the end of the next (the
        generation loop's own work included), less the cache walk after the first of the two."""
        return [b - a - walk for a, b, walk in zip(self.times, self.times[1:], self.walk_seconds)]

    def decode_seconds(self) -> tuple[int, float]:
        """(decode steps, seconds) from the end of the prefill forward to the end of the last step."""
        steps = self.step_seconds()
        return len(steps), sum(steps)

    def remove(self) -> None:
        self.handle.remove()


def _output_cache(output: Any) -> Any:
    """The cache a model or generate output carries: `cache` from transformers 5.24, `past_key_values` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (the chain task's answer), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = text.find("}", start)
    return None if end < 0 else text[start + len("\\boxed{") : end].strip()


def run_method(
    model,
    tokenizer,
    prompts: list[list[int]],
    answers: list[str],
    max_new_tokens: int,
    context,
    make_cache_kwargs=None,
) -> dict[str, Any]:
    """Greedy generation, one prompt at a time, under `context` (a press or a null context).

    `make_cache_kwargs()`, if given, returns the keyword argument that hands `generate` a fresh cache
    (the rlkv side: `rlkv.compat.cache_kwargs(make_cache(...))`, named for the installed transformers).

    Returns accuracy, mean resident KV after generation, mean peak KV during generation, KV averaged
    over each generation's forwards (mean over prompts), VmHWM
    (reset before the method; max over its prompts), decode tokens/s, every decode step's seconds
    (per prompt, `GenerationProbe.step_seconds`) and the generated token ids.
    """
    reset_ok = reset_vm_hwm()
    correct, resident, peaks, means, steps, seconds, outputs, step_seconds = 0, [], [], [], 0, 0.0, [], []
    with context:
        for ids, answer in zip(prompts, answers):
            input_ids = torch.tensor([ids])
            probe = GenerationProbe(model)
            kwargs = make_cache_kwargs() if make_cache_kwargs is not None else {}
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
            probe.remove()
            new = out.sequences[0, input_ids.shape[1] :].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            correct += boxed_answer(text) == str(answer)
            resident.append(tensor_storage_bytes(_output_cache(out)))
            peaks.append(probe.peak_kv)
            means.append(probe.mean_kv)
            n, s = probe.decode_seconds()
            steps, seconds = steps + n, seconds + s
            step_seconds.append([round(t, 7) for t in probe.step_seconds()])
            outputs.append(new)
    n = max(len(prompts), 1)
    return {
        "accuracy": 100.0 * correct / n,
        "resident_kv_bytes": sum(resident) / n,
        "peak_kv_bytes": sum(peaks) / n,
        "mean_kv_bytes": sum(means) / n,
        "vm_hwm_bytes": vm_hwm_bytes(),
        "vm_hwm_reset": reset_ok,
        "decode_tokens_per_s": steps / seconds if seconds > 0 else 0.0,
        "step_seconds": step_seconds,
        "outputs": outputs,
    }


def _duo_press(pattern_dir: str, head_compression_ratio: float):
    """kvpress `DuoAttentionPress` reading a local DuoAttention pattern folder.

    kvpress 0.5.5 only downloads patterns of six checkpoints from raw GitHub
    (`DuoAttentionPress.load_attention_pattern` asserts `name_or_path in PATTERNS_DICT`), so the
    subclass replaces that one static method with the same parsing of a local folder:
    `config.json` (sink_size, recent_size) + `full_attention_heads.tsv` (np.loadtxt, clip to [0, 1]).
    """
    import numpy as np
    from kvpress import DuoAttentionPress

    folder = Path(pattern_dir)
    config = json.loads((folder / "config.json").read_text())
    scores = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t"), 0, 1)

    class LocalPatternDuoAttentionPress(DuoAttentionPress):
        @staticmethod
        def load_attention_pattern(model):
            return config["sink_size"], config["recent_size"], scores

    return LocalPatternDuoAttentionPress(head_compression_ratio=head_compression_ratio)


def stock_duo_error(model) -> str:
    """What stock `DuoAttentionPress` says for a model outside its download list (the reason for the subclass)."""
    from kvpress import DuoAttentionPress

    try:
        DuoAttentionPress(head_compression_ratio=0.5).post_init_from_model(model)
    except Exception as e:  # noqa: BLE001 - reported verbatim
        return f"{type(e).__name__}: {e}"
    return ""


def make_press(method: dict[str, Any], pattern_dir: str):
    """The press of one method spec: {"kind": "duo", "sparsity"} or {"kind": "decoding", "scorer", ...}."""
    from kvpress import DecodingPress, KnormPress, SnapKVPress

    if method["kind"] == "duo":
        return _duo_press(pattern_dir, method["sparsity"])
    if method["kind"] == "decoding":
        scorer = {
            "snapkv": lambda: SnapKVPress(window_size=method["window"], kernel_size=method["kernel"]),
            "knorm": lambda: KnormPress(),
        }[method["scorer"]]()
        return DecodingPress(
            base_press=scorer,
            compression_interval=method["interval"],
            target_size=method["budget"],
            hidden_states_buffer_size=method["interval"],
        )
    raise ValueError(f"unknown kvpress method kind {method['kind']!r}")


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    result: dict[str, Any] = {
        "versions": {
            "kvpress": getattr(kvpress, "__version__", "") or _dist_version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "stock_duo_error": stock_duo_error(model),
        "methods": {},
    }
    prompts, answers = spec["prompt_ids"], spec["answers"]
    # warm-up (allocator, kernels), so the first method's VmHWM is not the load
    run_method(model, tokenizer, prompts[:1], answers[:1], spec["max_new_tokens"], _NullContext())
    for method in spec["methods"]:
        name = method["name"]
        press = None if method["kind"] == "full" else make_press(method, spec["duo_pattern"])
        context = _NullContext() if press is None else press(model)
        started = time.perf_counter()
        try:
            row = run_method(model, tokenizer, prompts, answers, spec["max_new_tokens"], context)
        except Exception as e:  # noqa: BLE001 - one failing press must not hide the others
            row = {"error": f"{type(e).__name__}: {e}"}
        row["seconds"] = time.perf_counter() - started
        if press is not None and getattr(press, "streaming_mask", None) is not None:
            row["streaming_heads"] = press.streaming_mask.int().tolist()
        result["methods"][name] = row
        print(f"kvpress {name}: {row.get('accuracy', row.get('error'))}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(result))
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
