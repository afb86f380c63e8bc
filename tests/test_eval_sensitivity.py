"""Head sensitivity sweeps by learned-gate, ablation and random order, and the `ablation-mask` eval method."""

import pytest
import torch

from rlkv.cli import main
from rlkv.eval import EvalConfig, method_config, read_results, run_sensitivity
from rlkv.eval.methods import MethodError
from rlkv.eval.sensitivity import sensitivity_configs, sensitivity_curves
from rlkv.eval.tables import accuracy_table
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model, tiny_tokenizer

GATE_ORDER = [[0, 0], [0, 1], [1, 0], [1, 1]]  # compressed first
ABLATION_ORDER = [[1, 1], [1, 0], [0, 1], [0, 0]]


def test_sweep_runs_gate_ablation_and_random_order(tmp_path):
    model = tiny_model("qwen2")  # 2 layers x 2 KV heads
    paths = {}
    for name, order in (("gates", GATE_ORDER), ("ablation", ABLATION_ORDER)):
        HeadMask.from_order(torch.tensor(order), model, method=name).save_pretrained(tmp_path / name)
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
    sweep, every_head = sensitivity_configs(cfg, num_heads=4, steps=4)
    assert sweep.methods == ["full", "rlkv", "ablation-mask", "random-mask"]
    # s=0 is full KV and s=1 the same cache for every order: neither is run per order
    assert sweep.sparsities == [0.25, 0.5, 0.75]
    assert (every_head.methods, every_head.sparsities, every_head.out) == (["random-mask"], [1.0], sweep.out)
    masks = {
        m: HeadMask.from_pretrained(paths[f], model)
        for m, f in (("rlkv", "gates"), ("ablation-mask", "ablation"))
    }
    for method, order in (("rlkv", GATE_ORDER), ("ablation-mask", ABLATION_ORDER)):
        full = method_config(method, 0.5, model=model, masks=masks).full_heads(model)
        compressed = sorted(map(tuple, (~full).nonzero().tolist()))
        assert compressed == sorted(map(tuple, order[:2])), method  # the first two heads of its order
    out = run_sensitivity(cfg, model=model, tokenizer=tiny_tokenizer(), steps=4)
    rows = read_results(out / "results.jsonl")
    assert {(r["method"], r["sparsity"]) for r in rows if r["method"] != "full"} == {
        (m, s) for m in ("rlkv", "ablation-mask", "random-mask") for s in (0.25, 0.5, 0.75)
    } | {("random-mask", 1.0)}
    assert (out / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    # `rlkv eval --report-only --sensitivity` regenerates the sweep's report in place, whole, from its rows
    report = (out / "report.md").read_text()
    (out / "report.md").unlink()
    assert main(["eval", "--report-only", "--sensitivity", "--out", cfg.out]) == 0
    assert (out / "report.md").read_text() == report and "s=0.25" in report and "s=1 |" in report
    assert not (tmp_path / "eval" / "report.md").exists()
    curves = sensitivity_curves(rows)
    acc = accuracy_table(rows)
    for method in ("rlkv", "ablation-mask", "random-mask"):  # every order's curve spans 0 .. 1
        assert curves[method][0.0] == acc["full"][0.0] and curves[method][1.0] == acc["random-mask"][1.0]
        assert [s for s in curves[method]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert sensitivity_configs(EvalConfig(model="x", methods=["full"]), 4)[0].methods == [
        "full",
        "random-mask",
    ]
    with pytest.raises(ValueError, match="give >= 2 steps"):
        sensitivity_configs(cfg, num_heads=4, steps=1)


def test_ablation_mask_method_needs_its_mask():
    with pytest.raises(ValueError, match=r"EvalConfig.ablation_mask \(--ablation-mask\) is not set"):
        EvalConfig(model="tiny:qwen2", methods=["full", "ablation-mask+rkv"])
    with pytest.raises(MethodError, match="set ablation_mask"):
        method_config("ablation-mask", 0.5, model=tiny_model("qwen2"), masks={})
