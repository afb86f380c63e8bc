"""The head split handed to vLLM, as plain data: built from a mask, checked against the model, exported.

No vLLM here (the vLLM tier, tests/vllm_tier/, runs the engine): these are the checks a user meets before
an engine starts.
"""

import json

import pytest
import torch

from rlkv import HeadMask
from rlkv.inference import CompressionConfig, CompressionConfigError
from rlkv.inference.vllm import (
    export_vllm_folder,
    head_split,
    matched_compression,
    vllm_compression,
    vllm_overrides,
)
from rlkv.vllm_plugin.split import CONFIG_KEY, EvictionRule, HeadSplit, HeadSplitError

DEMO = "assets/demo-model"


def test_overrides_name_the_head_mixed_architecture_and_carry_the_mask_cut(make_model):
    model = make_model("qwen2")
    mask = HeadMask.random(model, seed=3)
    overrides = vllm_overrides(model.config, mask, 0.5, window=32)
    assert overrides["architectures"] == ["RlkvQwen2ForCausalLM"]
    split = overrides[CONFIG_KEY]
    full = mask.full_heads(0.5)
    assert split == {
        "format": 1,
        "full_kv_heads": [row.nonzero().flatten().tolist() for row in full],
        "sink": 16,  # the eval's form by default: sink 16, the prompt read whole
        "window": 32,
        "prompt": "full",
    }
    # the plugin reads back exactly this split, checked against the model's geometry
    config = model.config.to_dict() | overrides
    read = HeadSplit.from_config(config)
    assert read.full_kv_heads == tuple(tuple(row.nonzero().flatten().tolist()) for row in full)
    assert (read.sink, read.window, read.full_prompt, read.is_sliding_window) == (16, 32, True, False)
    # the window-only form is vLLM's own sliding window of window + 1 tokens; a split of format 1 without
    # "prompt" (written before the sink form existed) reads as that form
    windowed = vllm_overrides(model.config, mask, 0.5, window=32, sink=0, window_prefill=True)[CONFIG_KEY]
    assert windowed["prompt"] == "window"
    del windowed["prompt"]
    old = HeadSplit.from_config(model.config.to_dict() | {CONFIG_KEY: windowed})
    assert old.is_sliding_window and old.vllm_sliding_window == 33


def test_unit_is_the_gcd_of_the_part_sizes():
    assert HeadSplit(((0, 1), (0, 1, 2, 3), ()), window=8).unit(4) == 2
    assert HeadSplit(((0,), (1, 2)), window=8).unit(4) == 1
    assert HeadSplit(((0, 1, 2, 3),), window=8).unit(4) == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"full_kv_heads": [[0]]}, r"full_kv_heads has 1 layers, the model 4"),
        (
            {"full_kv_heads": [[0], [2], [], [1]]},
            r"full_kv_heads\[1\]=\[2\]: must list distinct KV heads in \[0, 2\)",
        ),
        ({"full_kv_heads": [[0, 0], [], [], []]}, r"full_kv_heads\[0\]=\[0, 0\]"),
        ({"prompt": "all"}, r"prompt='all': must be 'full' \(prompt read whole\), 'protected'"),
        ({"sink": -1}, r"sink=-1: must be an integer >= 0"),
        ({"window": -1}, r"window=-1: must be an integer >= 0"),
        ({"format": 2}, r"format=2: this rlkv reads format 1"),
        (
            {"prompt": "full", "policy": {"name": "rpc", "budget": 8}},
            r"policy.name='rpc': vLLM's eviction group runs",
        ),
        ({"prompt": "full", "policy": {"name": "rkv", "budget": 1.5}}, r"policy.budget=1.5: an integer >= 0"),
        ({"prompt": "full", "policy": {"name": "rkv", "budget": True}}, r"policy.budget=True"),
        ({"prompt": "full", "policy": {"name": "rkv", "budget": 8, "kwargs": [1]}}, r"policy.kwargs=\[1\]"),
        ({"prompt": "full", "policy": "rkv"}, r"policy must be a mapping"),
        ({"policy": {"name": "rkv", "budget": 8}}, r"prompt='window' with a policy"),
        ({"kernel": "flash"}, r"kernel='flash': must be 'stock' \(the platform's attention kernel"),
    ],
)
def test_a_split_that_does_not_fit_is_refused_in_one_line(change, message):
    config = json.loads(open(f"{DEMO}/config.json").read())
    config[CONFIG_KEY] = {
        "format": 1,
        "full_kv_heads": [[0], [1], [], [0, 1]],
        "sink": 0,
        "window": 8,
    } | change
    with pytest.raises(HeadSplitError, match=message):
        HeadSplit.from_config(config)


def test_the_kernel_round_trips_and_only_the_full_prompt_forms_run_as_rings():
    """`kernel` is absent from the plain data when stock (splits written before it read the same); the rings
    (`rlkv.vllm_plugin.ring`) serve the prompt-read-in-full forms (kept or not) without a policy, on the stock
    kernel."""
    base = HeadSplit(((0,), (1,)), window=8, sink=4, full_prompt=True)
    assert "kernel" not in base.to_config() and base.uses_ring
    torch_form = HeadSplit(((0,), (1,)), window=8, sink=4, full_prompt=True, kernel="torch")
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, CONFIG_KEY: torch_form.to_config()}
    assert HeadSplit.from_config(config) == torch_form and not torch_form.uses_ring
    assert not HeadSplit(((0,), (1,)), window=8, sink=4).uses_ring  # the windowed prompt
    assert HeadSplit(((0,), (1,)), window=8, sink=4, full_prompt=True, protect_prompt=True).uses_ring
    assert not HeadSplit(
        ((0,), (1,)), window=8, sink=4, full_prompt=True, policy=EvictionRule("rkv", 64)
    ).uses_ring


def test_no_split_and_unsupported_architectures_are_named(make_model):
    with pytest.raises(HeadSplitError, match="config has no rlkv_head_split"):
        HeadSplit.from_config({"num_hidden_layers": 2, "num_attention_heads": 2})
    model = make_model("llama")
    config = model.config
    config.architectures = ["MistralForCausalLM"]
    with pytest.raises(
        CompressionConfigError, match=r"architectures=\['MistralForCausalLM'\]: rlkv's vLLM plugin serves"
    ):
        vllm_overrides(config, HeadMask.random(model), 0.5)


def test_streaming_and_eviction_forms_have_a_split_and_others_are_refused(make_model):
    model = make_model("llama")
    mask = HeadMask.random(model)
    protected = head_split(model, CompressionConfig(head_mask=mask, sparsity=0.5, sink=16, window=64))
    assert protected.protect_prompt and protected.to_config()["prompt"] == "protected"  # generate's default
    with pytest.raises(CompressionConfigError, match="protect_prompt=True with window_prefill=True"):
        CompressionConfig(head_mask=mask, sparsity=0.5, window_prefill=True, protect_prompt=True)
    with pytest.raises(CompressionConfigError, match="policy='rpc'"):  # reasoning cycles: not on vLLM
        head_split(model, CompressionConfig(head_mask=mask, sparsity=0.5, policy="rpc", protect_prompt=False))
    rkv = CompressionConfig(
        head_mask=mask,
        sparsity=0.5,
        policy="rkv",
        budget=80,
        policy_kwargs={"buffer": 0},
        protect_prompt=False,
    )
    evicting = head_split(model, rkv)
    assert evicting.to_config()["policy"] == {"name": "rkv", "budget": 80, "kwargs": {"buffer": 0}}
    assert (
        HeadSplit.from_config({**model.config.to_dict(), "rlkv_head_split": evicting.to_config()}) == evicting
    )
    with pytest.raises(CompressionConfigError, match="window_prefill=True"):
        head_split(model, CompressionConfig(head_mask=mask, sparsity=0.5, policy="rkv", window_prefill=True))
    eval_form = head_split(model, vllm_compression(mask, 0.5))
    assert (eval_form.sink, eval_form.window, eval_form.full_prompt) == (16, 64, True)
    every_head = head_split(model, matched_compression(None, 0.5, window=4))
    assert all(heads == () for heads in every_head.full_kv_heads)


def test_export_writes_a_folder_vllm_serves_without_overrides(tmp_path):
    from safetensors.torch import load_file

    from rlkv.inference import load

    model, _ = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    out = export_vllm_folder(DEMO, tmp_path / "served", mask, 0.75, window=16)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["RlkvLlamaForCausalLM"]
    assert config[CONFIG_KEY]["window"] == 16
    assert sum(len(h) for h in config[CONFIG_KEY]["full_kv_heads"]) == 2  # 8 KV heads at s=0.75
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert (out / "tokenizer.json").is_file()
    assert not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama", {"attention_bias": True}), ("qwen2", {}), ("qwen3", {})],
)
def test_weights_permuted_to_the_served_head_order_compute_the_same_model(make_model, family, overrides):
    """The plugin loads each split layer's heads full-first (`HeadOrder`): q/k/v rows (and biases) and o_proj
    columns move by whole KV heads, so the model is the same function (fp32, o_proj sums in another order)."""
    from rlkv.vllm_plugin.head_order import HeadOrder

    geometry = dict(num_attention_heads=8, num_key_value_heads=4, **overrides)
    model = make_model(family, seed=1, **geometry)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # zero at init: random, so a bias left in the stock order shows
                p.normal_(0.0, 0.5)
    split = HeadSplit(((1, 3), (2,)), window=8)  # non-contiguous full heads in layer 0, one in layer 1
    orders = {layer: split.served_order(layer, 4) for layer in range(2)}
    assert orders == {0: (1, 3, 0, 2), 1: (2, 0, 1, 3)}
    head_order = HeadOrder(orders, groups=2, head_size=16)
    permuted = dict(head_order.weights(model.state_dict().items()))
    served = make_model(family, seed=2, **geometry)
    served.load_state_dict(permuted)
    moved = [n for n, w in model.state_dict().items() if not torch.equal(w, permuted[n])]
    # q, k, v weights (and biases: Qwen2's, Llama's with attention_bias) and o_proj's weight; not o_proj's bias
    assert len(moved) == 2 * {"llama": 7, "qwen2": 7, "qwen3": 4}[family]
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


# tensor parallelism (issue 78): every rank holds its share of a layer's full and compressed heads


def test_served_order_gives_each_rank_its_full_heads_first():
    split = HeadSplit(full_kv_heads=((0, 3), (), (0, 1, 2, 3), (1, 2)), window=8, sink=4)
    # vLLM gives rank r the served positions [2r, 2r + 2): its full head, then its compressed one
    assert split.served_order(0, 4, shards=2) == (0, 1, 3, 2)
    assert split.served_order(1, 4, shards=2) == (0, 1, 2, 3)
    assert split.served_order(3, 4, shards=2) == (1, 0, 2, 3)
    assert split.served_order(0, 4) == (0, 3, 1, 2)  # one rank: all full heads, then all compressed
    assert split.unit(4, shards=2) == 1 and split.unit(4) == 2
    split.check_shards(4, 2)


def test_a_split_that_cannot_be_shared_among_the_ranks_is_refused_naming_the_layer():
    split = HeadSplit(full_kv_heads=((0, 3), (2,), (), ()), window=8, sink=4)
    with pytest.raises(HeadSplitError, match=r"layer 1 has 1 full KV heads, not a multiple of 2"):
        split.check_shards(4, 2)
    with pytest.raises(HeadSplitError, match=r"4 KV heads per layer do not divide"):
        split.check_shards(4, 3)


def test_overrides_for_two_ranks_cut_the_mask_balanced(make_model):
    model = make_model("llama", num_key_value_heads=4, num_attention_heads=8, head_dim=32, hidden_size=128)
    mask = HeadMask.random(model, seed=3)
    for sparsity in (0.25, 0.5, 0.75):
        overrides = vllm_overrides(model.config, mask, sparsity, tensor_parallel_size=2)
        split = HeadSplit.from_config(model.config.to_dict() | overrides)
        assert all(len(full) % 2 == 0 for full in split.full_kv_heads), split.full_kv_heads
        split.check_shards(4, 2)
    with pytest.raises(CompressionConfigError, match=r"tensor_parallel_size=3: the model's 4 KV heads"):
        vllm_overrides(model.config, mask, 0.5, tensor_parallel_size=3)


def test_rollout_config_for_vllm_is_vllms_form_plus_the_rollout_fields(make_model):
    """`CompressedRolloutConfig.for_vllm` takes vLLM's form from `vllm_compression` (no `config_class=`: the
    inference room knows nothing of rollouts) and adds the rollout fields."""
    from rlkv.rollout import CompressedRolloutConfig

    model = make_model("llama")
    mask = HeadMask.random(model)
    config = CompressedRolloutConfig.for_vllm(
        mask, 0.5, 32, policy="rkv", budget=96, static_cache=False, vllm_kwargs={"dtype": "float32"}
    )
    assert isinstance(config, CompressedRolloutConfig)
    assert (config.sink, config.window, config.window_prefill, config.protect_prompt) == (
        16,
        32,
        False,
        False,
    )
    assert (config.policy, config.budget, config.static_cache) == ("rkv", 96, False)
    assert config.vllm_kwargs == {"dtype": "float32"} and config.importance_sampling_correction
    same_form = vllm_compression(mask, 0.5, window=32, policy="rkv", budget=96)
    assert config.compression == same_form and head_split(model, config.compression) == head_split(
        model, same_form
    )
    with pytest.raises(CompressionConfigError, match="vllm_kwargs sets"):
        CompressedRolloutConfig.for_vllm(mask, 0.5, vllm_kwargs={"hf_overrides": {}})
    with pytest.raises(CompressionConfigError, match="protect_prompt=True with window_prefill=True"):
        CompressedRolloutConfig.for_vllm(mask, 0.5, window_prefill=True, protect_prompt=True)
