"""Head sensitivity sweeps by learned-gate, ablation and random order, and the `ablation-mask` eval method."""

import pytest
import torch

from rlkv.eval import EvalConfig, method_config, read_results, run_eval
from rlkv.eval.methods import MethodError
from rlkv.eval.sensitivity import mask_from_order, sensitivity_config
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model, tiny_tokenizer

GATE_ORDER = [[0, 0], [0, 1], [1, 0], [1, 1]]  # compressed first
ABLATION_ORDER = [[1, 1], [1, 0], [0, 1], [0, 0]]


def test_sweep_runs_gate_ablation_and_random_order(tmp_path):
    model = tiny_model("qwen2")  # 2 layers x 2 KV heads
    paths = {}
    for name, order in (("gates", GATE_ORDER), ("ablation", ABLATION_ORDER)):
        mask_from_order(torch.tensor(order), model, method=name).save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    cfg = EvalConfig(
        model="tiny:qwen2",
        out=str(tmp_path / "eval"),
        head_mask=paths["gates"],
        ablation_mask=paths["ablation"],
        benchmarks=["chain"],
        methods=["full"],
        num_problems=2,
        max_new_tokens=6,
        batch_size=2,
        progress=False,
    )
    sweep = sensitivity_config(cfg, num_heads=4, steps=2)
    assert sweep.methods == ["full", "rlkv", "ablation-mask", "random-mask"]
    assert sweep.sparsities == [0.0, 0.5, 1.0]
    masks = {
        m: HeadMask.from_pretrained(paths[f], model)
        for m, f in (("rlkv", "gates"), ("ablation-mask", "ablation"))
    }
    for method, order in (("rlkv", GATE_ORDER), ("ablation-mask", ABLATION_ORDER)):
        full = method_config(method, 0.5, model=model, masks=masks).full_heads(model)
        compressed = sorted(map(tuple, (~full).nonzero().tolist()))
        assert compressed == sorted(map(tuple, order[:2])), method  # the first two heads of its order
    out = run_eval(sweep, model=model, tokenizer=tiny_tokenizer())
    rows = read_results(out / "results.jsonl")
    assert {(r["method"], r["sparsity"]) for r in rows if r["method"] != "full"} == {
        (m, s) for m in ("rlkv", "ablation-mask", "random-mask") for s in (0.0, 0.5, 1.0)
    }
    assert (out / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    assert sensitivity_config(EvalConfig(model="x", methods=["full"]), 4).methods == ["full", "random-mask"]


def test_ablation_mask_method_needs_its_mask():
    with pytest.raises(ValueError, match=r"EvalConfig.ablation_mask \(--ablation-mask\) is not set"):
        EvalConfig(model="tiny:qwen2", methods=["full", "ablation-mask+rkv"])
    with pytest.raises(MethodError, match="set ablation_mask"):
        method_config("ablation-mask", 0.5, model=tiny_model("qwen2"), masks={})
