"""The ablation head mask on tiny models: zero scores inside sink + local, the one head that matters ranks first,
batched scores equal a brute-force per-head NLL, the artifact, the CLI."""

import json
import math

import pytest
import torch

from rlkv.ablation import ablation_mask, ablation_scores, greedy_solutions
from rlkv.cli import main as cli_main
from rlkv.gates import attach_gates, detach_gates
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model, tiny_tokenizer

PROBLEMS = [
    {"problem": "let x be 3 then x + 4 = 7", "source": "chain"},
    {"problem": "wait", "source": "chain"},
    {"problem": "1 + 2 = 3. 2 * 3 = 6. therefore the final answer is boxed", "source": "chain"},
]


def _solutions(model, max_new_tokens):
    return greedy_solutions(
        model, tiny_tokenizer(), PROBLEMS, max_new_tokens, template="plain", progress=False
    )


def _brute_force_nll(model, sequences):
    """Mean completion NLL (nats/token), one unpadded sequence at a time through the model's logits."""
    total, count = 0.0, 0
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
        positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
        total -= sum(float(logp[t, ids[0, t + 1]]) for t in positions)
        count += len(completion)
    return total / count


def _brute_force_delta(model, sequences, sink, local):
    """Each head's NLL increase, by `_brute_force_nll` with that head alone at sink + local."""

    gates = attach_gates(model, sink=sink, local=local)
    base = _brute_force_nll(model, sequences)
    delta = torch.zeros_like(gates.alpha)
    for layer, head in torch.cartesian_prod(*map(torch.arange, gates.alpha.shape)).tolist():
        with torch.no_grad():
            gates.alpha.fill_(1.0)[layer, head] = 0.0
        delta[layer, head] = _brute_force_nll(model, sequences) - base
    detach_gates(model)
    return delta


def test_sequences_inside_sink_plus_local_score_zero():
    model = tiny_model("llama")
    sequences = _solutions(model, 8)
    assert max(len(p) + len(c) for p, c in sequences) <= 64  # every query sees everything through local
    scores = ablation_scores(model, sequences, sink=16, local=64, batch_size=2, progress=False)
    assert scores.delta_nll.abs().max() < 1e-5 and scores.base_nll > 0
    assert scores.num_tokens == sum(len(c) for _, c in sequences)


def test_batched_scores_equal_a_brute_force_per_head_nll():
    model = tiny_model("qwen2")
    sequences = _solutions(model, 12)  # prompts of different lengths: padded batches
    scores = ablation_scores(model, sequences, sink=2, local=4, batch_size=2, progress=False)
    expected = _brute_force_delta(model, sequences, sink=2, local=4)
    assert scores.delta_nll.abs().max() > 1e-3  # compression matters here
    torch.testing.assert_close(scores.delta_nll, expected.float(), atol=2e-5, rtol=1e-4)


def test_the_one_head_that_carries_information_scores_highest_and_is_kept_full():
    model = tiny_model("llama")  # 2 layers x 2 KV heads, 2 query heads per KV head, head_dim 16
    target = (1, 0)
    with torch.no_grad():  # only the query heads of KV head `target` write to the residual stream
        for layer in model.model.layers:
            weight = layer.self_attn.o_proj.weight.view(64, 4, 16)  # [hidden, query head, dim]
            for query_head in range(4):
                if (layer.self_attn.layer_idx, query_head // 2) != target:
                    weight[:, query_head] = 0.0
    trainable = [p.requires_grad for p in model.parameters()]
    attention = model.config._attn_implementation
    mask = ablation_mask(
        model,
        tiny_tokenizer(),
        PROBLEMS,
        max_new_tokens=16,
        sink=1,
        local=2,
        template="plain",
        progress=False,
    )
    delta = torch.tensor(mask.metadata["delta_nll"])
    others = [(layer, head) for layer in range(2) for head in range(2) if (layer, head) != target]
    assert delta[target] > 1e-3 and all(abs(float(delta[h])) < 1e-6 for h in others)
    assert mask.scores[target] == 1.0 and mask.metadata["method"] == "ablation"
    assert (mask.train_sink, mask.train_local) == (1, 2)
    assert mask.full_heads(0.75)[target] and int(mask.full_heads(0.75).sum()) == 1
    # the model is left as it was
    assert not hasattr(model, "rlkv_gates") and model.config._attn_implementation == attention
    assert [p.requires_grad for p in model.parameters()] == trainable


def test_cli_writes_a_loadable_mask(tmp_path, capsys):
    out = tmp_path / "mask"
    argv = ["ablation-mask", "--model", "tiny:llama", "--problems", "chain", "--num", "2"]
    argv += ["--max-new-tokens", "6", "--sink", "2", "--local", "4", "--out", str(out), "--no-progress"]
    assert cli_main([*argv, "--base-model", "org/base-model"]) == 0
    assert "top heads L" in capsys.readouterr().out
    mask = HeadMask.from_pretrained(out, tiny_model("llama"))
    assert mask.metadata["method"] == "ablation" and mask.metadata["problem_set"] == "chain"
    assert mask.metadata["num_problems"] == 2 and len(mask.metadata["delta_nll"]) == 2
    assert float(mask.scores.min()) == 0.0 and float(mask.scores.max()) == pytest.approx(1.0)
    assert json.loads((out / "head_mask.json").read_text())["train_local"] == 4
    assert mask.metadata["base_model"] == "org/base-model"
    card = (out / "README.md").read_text()
    assert "\nbase_model: org/base-model\n" in card and "scored by `rlkv ablation-mask`" in card


def test_mask_nll_is_zero_uncompressed_mask_free_when_all_compressed_and_the_ablation_score_for_one_head():
    from rlkv.ablation import mask_nll

    model = tiny_model("qwen2")
    sequences = _solutions(model, 12)
    scores = ablation_scores(model, sequences, sink=2, local=4, batch_size=2, progress=False)
    order = torch.tensor([[1, 1], [0, 0], [0, 1], [1, 0]])  # (1, 1) compressed first
    masks = {"order": HeadMask.from_order(order, model), "random": HeadMask.random(model, seed=0)}
    base, inc = mask_nll(
        model, sequences, masks, [0.0, 0.25, 1.0], sink=2, local=4, batch_size=2, progress=False
    )
    assert base == pytest.approx(scores.base_nll)
    assert inc["order"][0.0] == 0.0 and inc["random"][0.0] == 0.0
    assert inc["order"][1.0] == pytest.approx(inc["random"][1.0]) and inc["order"][1.0] > 1e-3
    assert inc["order"][0.25] == pytest.approx(float(scores.delta_nll[1, 1]), abs=1e-6)
    assert not hasattr(model, "rlkv_gates")


def test_token_nlls_equal_a_brute_force_per_token_nll_and_their_mean_is_completion_nll():
    from rlkv.ablation import completion_nll, completion_token_nll

    model = tiny_model("qwen2")
    sequences = _solutions(model, 12)
    tokens = completion_token_nll(model, sequences, batch_size=3)
    assert [len(t) for t in tokens] == [len(c) for _, c in sequences]
    for (prompt, completion), got in zip(sequences, tokens, strict=True):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
        want = [-float(logp[t, ids[0, t + 1]]) for t in range(len(prompt) - 1, len(ids[0]) - 1)]
        assert got.tolist() == pytest.approx(want, abs=1e-4)
    assert completion_nll(model, sequences, 3) == pytest.approx(float(torch.cat(tokens).mean()), abs=1e-12)


def test_the_decisive_screen_scores_the_tokens_every_head_compressed_hurts_most():
    """Decisive tokens: those whose NLL rises by more than the threshold with every head compressed, one set for
    every mask. Below any rise, every token is decisive (the two screens agree); all heads compressed, the
    decisive tokens' mean rise is above the threshold; nothing compressed, both screens are 0."""
    from rlkv.ablation import completion_token_nll, gated_model, screen_masks

    model = tiny_model("qwen2")
    sequences = _solutions(model, 12)
    masks = {"random": HeadMask.random(model, seed=1)}
    settings = dict(sink=2, local=4, batch_size=2, progress=False)
    every = screen_masks(model, sequences, masks, [0.5], decisive=-1e9, **settings)
    assert every.num_decisive == every.num_tokens
    assert every.decisive_increase["random"][0.5] == pytest.approx(every.increase["random"][0.5], abs=1e-12)
    screen = screen_masks(model, sequences, masks, [0.0, 0.5, 1.0], decisive=0.5, **settings)
    with gated_model(model, 2, 4) as gates:  # the decisive set, measured apart
        full = torch.cat(completion_token_nll(model, sequences, 2))
        with torch.no_grad():
            gates.alpha.zero_()
        rise = torch.cat(completion_token_nll(model, sequences, 2)) - full
    assert screen.num_decisive == int((rise > 0.5).sum()) and 0 < screen.num_decisive < screen.num_tokens
    assert screen.decisive_increase["random"][1.0] == pytest.approx(float(rise[rise > 0.5].mean()), abs=1e-9)
    assert screen.decisive_increase["random"][1.0] > 0.5 > screen.increase["random"][1.0]
    assert screen.increase["random"][0.0] == 0.0 and screen.decisive_increase["random"][0.0] == 0.0
    assert not hasattr(model, "rlkv_gates")


def test_mask_nll_cli_prints_and_writes_the_table(tmp_path, capsys):
    mask_path = tmp_path / "mask.json"
    HeadMask.random(tiny_model("llama"), seed=5).save(mask_path)
    out = tmp_path / "nll.json"
    argv = ["mask-nll", "--model", "tiny:llama", "--problems", "chain", "--num", "2", "--max-new-tokens", "6"]
    argv += ["--sink", "1", "--local", "2", "--masks", f"mine={mask_path}", "--random", "2"]
    argv += ["--sparsities", "0,0.5", "--out", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "full KV:" in printed and "mine" in printed and "random-mask@1" in printed
    doc = json.loads(out.read_text())
    assert set(doc["increase"]) == {"mine", "random-mask@0", "random-mask@1"}
    assert doc["increase"]["mine"]["0.0"] == 0.0 and doc["num_problems"] == 2


def test_rank_correlation_is_spearmans_with_mean_ranks_for_ties():
    from rlkv.eval.tables import rank_correlation

    assert rank_correlation([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert rank_correlation([1, 1, 2], [1, 2, 3]) == pytest.approx(1.5 / 3**0.5)  # ranks 0.5, 0.5, 2
    assert math.isnan(rank_correlation([1, 2], [2, 1])) and math.isnan(rank_correlation([1, 1, 1], [1, 2, 3]))


def test_mask_nll_cli_screens_decisive_tokens_and_correlates_both_screens_with_pass_at_1(tmp_path, capsys):
    """--decisive adds the decisive-token screen; --pass-at-1 pairs (mask, sparsity) with eval cells and prints
    each screen's rank correlation with their pass@1 (cells of a made-up eval folder: 4 problems each)."""
    from rlkv.eval.tables import rank_correlation

    folder = tmp_path / "grid"
    folder.mkdir()
    solved = {"a": [1, 0, 0, 0], "b": [1, 1, 0, 0], "c": [1, 1, 1, 0]}
    rows = [
        {"key": f"{m}-{i}", "benchmark": "chain", "problem_id": str(i), "method": m, "sparsity": 0.5, "sample": 0,
         "correct": bool(ok)}
        for m, outcome in solved.items()
        for i, ok in enumerate(outcome)
    ]  # fmt: skip
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "screen.json"
    argv = ["mask-nll", "--model", "tiny:llama", "--problems", "chain", "--num", "2", "--max-new-tokens", "6"]
    argv += ["--sink", "1", "--local", "2", "--random", "3", "--sparsities", "0.5", "--decisive", "0.2"]
    argv += [f"--pass-at-1=random-mask@{k}@0.5={folder}:{m}@0.5" for k, m in enumerate("abc")]
    assert cli_main([*argv, "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["pass_at_1"] == {
        "random-mask@0@0.5": 0.25,
        "random-mask@1@0.5": 0.5,
        "random-mask@2@0.5": 0.75,
    }
    assert doc["decisive"]["threshold"] == 0.2 and 0 <= doc["decisive"]["num_tokens"]
    for screen, key in (("token-mean", "increase"), ("decisive-token", None)):
        values = doc[key] if key else doc["decisive"]["increase"]
        want = rank_correlation([values[f"random-mask@{k}"]["0.5"] for k in range(3)], [0.25, 0.5, 0.75])
        got = doc["rank_correlation"][screen]
        assert got["n"] == 3 and (
            got["rho"] == pytest.approx(want) or math.isnan(want) and math.isnan(got["rho"])
        )
        assert f"{screen} screen" in printed
    assert "decisive tokens (NLL rise > 0.2 nats" in printed
    bad = [*argv[:-3], "--pass-at-1", f"nobody@0.5={folder}:a@0.5"]
    assert cli_main(bad) == 2
    assert "--pass-at-1 'nobody@0.5=" in capsys.readouterr().err


def test_mask_nll_cli_refuses_nothing_to_compare(capsys):
    argv = ["mask-nll", "--model", "tiny:llama", "--problems", "chain", "--sparsities", "0.5"]
    assert cli_main(argv) == 2
    assert "--masks" in capsys.readouterr().err


def _eval_folder(tmp_path, stopped):
    """A tiny eval recipe (YAML) whose folder holds `full` rows of 4 chain problems, those of `stopped`
    (problem indices) marked as ended before the cap (a random tiny model never emits its EOS)."""
    import yaml

    from rlkv.eval import EvalConfig, read_results, run_eval

    doc = dict(
        model="tiny:qwen2",
        out=str(tmp_path / "eval"),
        benchmarks=["chain"],
        methods=["full"],
        sparsities=[0.5],
        num_problems=4,
        max_new_tokens=6,
        batch_size=2,
        sink=2,
        window=4,
        combo_sink=1,
        combo_window=1,
        progress=False,
    )
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    out = run_eval(EvalConfig.from_yaml(recipe), tokenizer=tiny_tokenizer())
    rows = read_results(out / "results.jsonl")
    order = sorted({r["problem_id"] for r in rows})
    for r in rows:
        if order.index(r["problem_id"]) in stopped:
            r["finish_reason"] = "stop"
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return recipe, {r["problem_id"]: r for r in rows}


def test_mask_nll_solutions_from_an_eval_folder_scores_its_rows_below_the_cap(tmp_path):
    from rlkv.eval import EvalConfig
    from rlkv.eval.runner import benchmark_prompts
    from rlkv.inference import encode_prompts, load

    recipe, rows = _eval_folder(tmp_path, stopped={0, 2, 3})
    out = tmp_path / "nll.json"
    argv = ["mask-nll", "--solutions-from", str(recipe), "--num", "2", "--random", "1"]
    assert cli_main([*argv, "--sparsities", "0,1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    # the first two rows below the cap in problem order, prompts as the eval encoded them
    model, tokenizer = load("tiny:qwen2")
    prompts = benchmark_prompts(EvalConfig.from_yaml(recipe), tokenizer)["chain"]
    kept = [(pid, messages) for pid, _, messages, _ in prompts if rows[pid]["finish_reason"] == "stop"][:2]
    expected = [
        (
            encode_prompts(tokenizer, [m])[0],
            tokenizer(rows[pid]["completion"], add_special_tokens=False)["input_ids"],
        )
        for pid, m in kept
    ]
    assert [len(p) for p, _ in expected] == [rows[pid]["num_prompt_tokens"] for pid, _ in kept]
    assert doc["num_sequences"] == 2 and doc["num_tokens"] == sum(len(c) for _, c in expected)
    assert doc["base_nll"] == pytest.approx(_brute_force_nll(model, expected), rel=1e-5)
    assert (doc["sink"], doc["local"]) == (2, 4)  # the window the eval compressed with
    assert doc["increase"]["random-mask@0"]["0.0"] == 0.0 and doc["increase"]["random-mask@0"]["1.0"] > 0
    assert cli_main([*argv, "--sparsities", "1", "--sink", "1", "--out", str(out), "--no-progress"]) == 0
    assert (json.loads(out.read_text())["sink"], json.loads(out.read_text())["local"]) == (1, 4)
    # --dtype overrides the recipe's (a CPU without bf16 screens in float32), and the table says which
    for dtype in ("bfloat16", "float32"):
        assert (
            cli_main([*argv, "--sparsities", "1", "--dtype", dtype, "--out", str(out), "--no-progress"]) == 0
        )
        assert json.loads(out.read_text())["dtype"] == dtype


def test_full_kv_solutions_read_texts_archived_out_of_the_rows(tmp_path):
    """A committed folder's `full` texts may live in completions.jsonl.gz (archive_completions --with-full):
    the solutions re-encoded from there equal those from the rows."""
    import gzip

    from rlkv.eval import EvalConfig, read_results
    from rlkv.eval.results import ARCHIVE_FILE
    from rlkv.eval.solutions import full_kv_solutions

    recipe, _ = _eval_folder(tmp_path, stopped={0, 2, 3})
    cfg, tokenizer = EvalConfig.from_yaml(recipe), tiny_tokenizer()
    before = full_kv_solutions(cfg, tokenizer, "chain")
    results = tmp_path / "eval" / "results.jsonl"
    rows = read_results(results)
    with gzip.open(tmp_path / "eval" / ARCHIVE_FILE, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"key": r["key"], "completion": r["completion"]}) + "\n" for r in rows)
    results.write_text("".join(json.dumps(r | {"completion": None}) + "\n" for r in rows))
    assert len(before) == 3 and full_kv_solutions(cfg, tokenizer, "chain") == before


@pytest.mark.parametrize(
    "extra, stopped, needle",
    [
        (["--problems", "chain"], {0}, "--problems: not used with --solutions-from"),
        (["--benchmark", "humaneval"], {0}, "'humaneval' is not one of the eval recipe's benchmarks"),
        ([], set(), "no full-KV row of chain that ended before the length cap"),
    ],
)
def test_mask_nll_solutions_from_refuses_what_it_cannot_use(tmp_path, capsys, extra, stopped, needle):
    recipe, _ = _eval_folder(tmp_path, stopped)
    argv = ["mask-nll", "--solutions-from", str(recipe), "--random", "1", "--sparsities", "0.5", *extra]
    assert cli_main(argv) == 2
    assert needle in capsys.readouterr().err


def test_mask_nll_needs_a_source_of_solutions(capsys):
    assert cli_main(["mask-nll", "--random", "1", "--sparsities", "0.5"]) == 2
    assert "--solutions-from EVAL_RECIPE" in capsys.readouterr().err


def test_refine_cut_lowers_the_joint_nll_of_a_bad_ranking_and_nests_its_cuts(tmp_path):
    """From the reverse of the ablation ranking (the heads that matter compressed first), the swap
    search lowers the NLL at both sparsities, never raises it, keeps the s=0.75 set inside the s=0.5 set
    (one ranking serves both), and the refined mask's `mask_nll` is what the search recorded."""
    from rlkv.ablation import mask_nll
    from rlkv.cut_search import refine_cut

    model = tiny_model("qwen2", num_hidden_layers=4)  # 8 KV heads
    sequences = _solutions(model, 12)
    scores = ablation_scores(model, sequences, sink=2, local=4, batch_size=2, progress=False)
    worst_first = torch.argsort(scores.delta_nll.flatten(), descending=True)  # compress the top heads first
    order = torch.stack([worst_first // 2, worst_first % 2], dim=1)
    bad = HeadMask.from_order(order, model, method="reversed ablation")
    scored, calls = {}, []
    search = dict(
        sink=2, local=4, swap_in=2, swap_out=2, rounds=4, batch_size=2, progress=False, scored=scored
    )
    refined, searches = refine_cut(
        model, sequences, bad, [0.75, 0.5], **search, on_score=lambda values: calls.append(len(values))
    )
    assert [c.sparsity for c in searches] == [0.5, 0.75]
    assert calls == list(range(1, len(scored) + 1)) and "base" in scored  # each NLL reported as measured
    # resumed from what was measured: nothing scored twice, the same result
    again, _ = refine_cut(
        model, sequences, bad, [0.5, 0.75], **search, on_score=lambda values: calls.append(-1)
    )
    assert -1 not in calls and torch.equal(again.scores, refined.scores)
    assert all(c.increase <= c.start_increase for c in searches)
    assert searches[0].increase < searches[0].start_increase - 1e-4 and searches[0].swaps
    full_half, full_quarter = refined.full_heads(0.5), refined.full_heads(0.75)
    assert bool((full_quarter <= full_half).all()) and int(full_quarter.sum()) == 2
    for c, full in zip(searches, (full_half, full_quarter), strict=True):
        assert sorted(full.flatten().nonzero().flatten().tolist()) == c.kept
    _, increases = mask_nll(
        model, sequences, {"refined": refined}, [0.5, 0.75], sink=2, local=4, batch_size=2, progress=False
    )
    assert increases["refined"][0.5] == pytest.approx(searches[0].increase, abs=1e-6)
    assert increases["refined"][0.75] == pytest.approx(searches[1].increase, abs=1e-6)
    assert not hasattr(model, "rlkv_gates")
    refined.save_pretrained(tmp_path / "refined")
    loaded = HeadMask.from_pretrained(tmp_path / "refined", model)
    assert loaded.metadata["method"] == "reversed ablation"
    assert [s["kept"] for s in loaded.metadata["cut_search"]["searches"]] == [c.kept for c in searches]


def test_refine_mask_cli_writes_the_refined_mask_and_prints_each_search(tmp_path, capsys):
    start = tmp_path / "ablation"
    argv = [
        "ablation-mask",
        "--model",
        "tiny:llama",
        "--problems",
        "chain",
        "--num",
        "2",
        "--max-new-tokens",
        "6",
    ]
    argv += ["--sink", "1", "--local", "2", "--no-progress"]
    assert cli_main([*argv, "--out", str(start)]) == 0
    out = tmp_path / "refined"
    refine = ["refine-mask", "--mask", str(start), *argv[1:], "--sparsities", "0.5", "--swaps", "1,2"]
    assert cli_main([*refine, "--out", str(out)]) == 0
    assert "cut at s=0.5: NLL increase +" in capsys.readouterr().out
    mask = HeadMask.from_pretrained(out, tiny_model("llama"))
    search = mask.metadata["cut_search"]
    assert search["refined_from"] == str(start) and search["problem_set"] == "chain"
    assert (
        sorted(mask.full_heads(0.5).flatten().nonzero().flatten().tolist()) == search["searches"][0]["kept"]
    )
    assert search["searches"][0]["increase"] <= search["searches"][0]["start_increase"]
    assert (
        mask.metadata["method"] == "ablation"
        and "refined by a swap search" in (out / "README.md").read_text()
    )
    with pytest.raises(SystemExit):
        cli_main([*refine[:-2], "--swaps", "4", "--out", str(tmp_path / "x")])
    assert "--swaps: '4': give IN,OUT" in capsys.readouterr().err
    assert cli_main([*refine[:-4], "--sparsities", "1.0", "--out", str(tmp_path / "y")]) == 2
    assert "--sparsities [1.0]" in capsys.readouterr().err
    assert not (tmp_path / "refined.partial.json").exists()  # removed once the mask is written
    stale = tmp_path / "z.partial.json"  # a stopped search with other settings is not resumed
    stale.write_text(json.dumps({"identity": {"mask": "other"}, "scored": {}}))
    assert cli_main([*refine, "--out", str(tmp_path / "z")]) == 2
    assert "a stopped search with other settings" in capsys.readouterr().err
