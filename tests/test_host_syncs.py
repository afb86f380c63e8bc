"""No host sync in a decode step: what would make a GPU's host wait is counted on CPU.

`HostSyncCounter` counts the tensor operations that block the host on CUDA (a value read back,
a data-dependent output size, a device-to-host copy). After the prompt forward, every decode step
(model forward, cache update, policy decision and compaction) must count 0 for full heads, streaming
and every registered budgeted policy, in the steady state and on compression steps, with
equal-length and left-padded rows, with and without full heads.
"""

from __future__ import annotations

import pytest
import torch
from policy_matrix import POLICY_MATRIX

from rlkv.compat import cache_kwargs
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig, generate, make_cache
from rlkv.policies import available
from rlkv.testing import HostSyncCounter

PROMPTS = [
    "let x be 3 then x + 4 = 7",
    "1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is boxed",
]
STEPS = 24


def test_counter_counts_host_reads_and_nothing_else():
    t = torch.arange(6.0)
    reads = [
        lambda: t[0].item(),
        lambda: bool(t.any()),
        lambda: int(t[1]),
        lambda: t.tolist(),
        lambda: t.nonzero(),
        lambda: torch.equal(t, t),
        lambda: t[t > 2],
        lambda: torch.repeat_interleave(t.long(), t.long()),
    ]
    for read in reads:
        with torch.inference_mode(), HostSyncCounter() as syncs:
            read()
        assert syncs.count == 1, syncs.ops
    with HostSyncCounter() as syncs:
        keep = t > 2
        torch.nonzero_static(keep, size=3)
        torch.sort(t, stable=True)
        torch.where(keep, t, -1.0).index_select(0, torch.tensor([0, 2])) @ torch.ones(2)
    assert syncs.count == 0, syncs.ops
    assert torch.Tensor.tolist is not None and torch.Tensor.item.__name__ == "item"  # unpatched again


def _config(model, name: str, tokenizer, full_heads: bool) -> CompressionConfig:
    entry = POLICY_MATRIX[name]
    mask = {"head_mask": HeadMask.random(model, seed=3), "sparsity": 0.5} if full_heads else {}
    # the matrix's evicting settings (RPC's with a short sink and window), so that compression
    # steps happen among the counted steps
    settings = {"sink": 2, "window": 2} if name == "rpc" else entry.evicting or {}
    return CompressionConfig(policy=name, policy_kwargs=entry.kwargs(tokenizer), **settings, **mask)


def _decode_syncs(model, tokenizer, cache, padded: bool, steps: int = STEPS) -> list[int]:
    """Host syncs of each decode step after the prompt forward, driven as `generate` drives the model."""
    enc = tokenizer(PROMPTS if padded else PROMPTS[1:] * 2, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    counts = []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        token = out.logits[:, -1].argmax(-1)
        for _ in range(steps):
            with HostSyncCounter() as syncs:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                positions = positions[:, -1:] + 1
                out = model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=positions,
                    **cache_kwargs(cache),
                )
                token = out.logits[:, -1].argmax(-1)
            counts.append(syncs.count)
    return counts


def _evictions(cache) -> int:
    return sum(layer.store.evicted_host[0] for layer in cache.layers if layer.store is not None)


@pytest.mark.parametrize("padded", [False, True], ids=["equal-rows", "left-padded"])
@pytest.mark.parametrize("full_heads", [False, True], ids=["all-compressed", "with-full-heads"])
# the package's policies, not the `test_*` ones other test modules register when pytest imports them first
@pytest.mark.parametrize("name", sorted(n for n in available() if not n.startswith("test_")))
def test_decode_step_makes_no_host_sync(name, full_heads, padded, make_model, tokenizer):
    model = make_model("llama")
    cache = make_cache(model, _config(model, name, tokenizer, full_heads))
    with torch.inference_mode():
        # the prompt forward is allowed its reads; then count each step's
        counts = _decode_syncs(model, tokenizer, cache, padded)
    if name == "skipkv":
        # the per-sentence sums grow by a bounded read: at most once per `capacity - read` tokens
        assert max(counts) <= 1 and sum(counts) <= 2, counts
    else:
        assert counts == [0] * STEPS
    if POLICY_MATRIX[name].evicting is not None:
        assert _evictions(cache) > 0, "vacuous: no compression step among the counted steps"


def test_sparsity_zero_decode_makes_no_host_sync(make_model, tokenizer):
    model = make_model("qwen2")
    cache = make_cache(model, CompressionConfig(head_mask=HeadMask.random(model), sparsity=0.0))
    assert all(layer.store is None for layer in cache.layers)
    assert _decode_syncs(model, tokenizer, cache, padded=True) == [0] * STEPS


def _stock_decode_syncs(model, tokenizer) -> list[int]:
    """Host syncs of each decode step of `model` with transformers' own cache (a left-padded batch)."""
    from transformers import DynamicCache

    return _decode_syncs(model, tokenizer, DynamicCache(config=model.config), padded=True, steps=6)


def _next_logits(model, enc) -> torch.Tensor:
    """Logits of one decode step after the prompt (the single-token path), [B, V]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(**enc, **cache_kwargs(cache))
        mask = torch.cat([enc["attention_mask"], enc["attention_mask"].new_ones(len(PROMPTS), 1)], dim=1)
        token = out.logits[:, -1:].argmax(-1)
        return model(input_ids=token, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1]


def test_gated_decode_adds_no_host_sync_and_follows_gate_changes(make_model, tokenizer):
    """The gated single-token path decides which layers are stock attention from a host flag read
    only when the gates change (issue 40), and its mask function never asks the host whether the
    batch is padded: its decode steps make no host sync after the one read at the first step (the
    stock model reads the padding mask once per forward), and an in-place change of the gates is
    seen at the next step."""
    from rlkv.gates import attach_gates

    stock = _stock_decode_syncs(make_model("llama"), tokenizer)
    model = make_model("llama")
    gates = attach_gates(model, sink=2, local=4)
    with torch.no_grad():
        gates.alpha[0] = 0.3  # layer 0 mixed, layer 1 stock
    counts = _stock_decode_syncs(model, tokenizer)
    assert counts == [1] + [0] * (len(counts) - 1)  # the read after the change, then none
    assert min(stock) >= 1  # transformers' padding-mask read
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        gates.alpha.fill_(1.0)
    reference = _next_logits(make_model("llama"), enc)
    torch.testing.assert_close(_next_logits(model, enc), reference)  # every layer stock
    with torch.no_grad():
        gates.alpha[0, 0] = 0.0  # in place: layer 0 is sink + local for this head from now on
    assert not torch.allclose(_next_logits(model, enc), reference)


@pytest.mark.parametrize("policy", ["streaming", "rkv"])
def test_generate_loop_reads_finished_rows_every_few_steps(policy, make_model, tokenizer):
    """`rlkv.inference.generate`'s whole loop (forward, cache, policy, stopping, row-end stats) reads
    the device once per ROW_END_READ_EVERY steps: 16 more tokens cost 1 more read, not 16 or more."""
    from rlkv.inference.row_ends import ROW_END_READ_EVERY

    model = make_model("llama")
    config = _config(model, policy, tokenizer, full_heads=True)
    syncs = {}
    for tokens in (16, 32):
        with HostSyncCounter() as counter:
            out = generate(model, tokenizer, PROMPTS, tokens, compression=config, progress=False)
        assert max(o.num_generated_tokens for o in out) == tokens  # a row ran to the limit
        syncs[tokens] = counter.count
    assert syncs[32] - syncs[16] == 16 // ROW_END_READ_EVERY == 1


def test_compressed_rollouts_read_finished_rows_every_few_steps(make_model, tokenizer):
    """`rlkv.rollout.generate_rollouts` (the RL rollout memory saver) decodes as `generate` does:
    16 more sampled tokens cost 1 more host read, not 16 or more."""
    from transformers import GenerationConfig

    from rlkv.inference.row_ends import ROW_END_READ_EVERY
    from rlkv.rollout.compressed import CompressedRolloutConfig
    from rlkv.rollout.generation import generate_rollouts

    model = make_model("llama")
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    compression = CompressedRolloutConfig(head_mask=HeadMask.random(model), sparsity=0.5, sink=2, window=4)
    syncs = {}
    for tokens in (16, 32):
        config = GenerationConfig(
            max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id
        )
        torch.manual_seed(0)
        with HostSyncCounter() as counter:
            batch = generate_rollouts(
                model,
                enc["input_ids"],
                enc["attention_mask"],
                config,
                compression,
                temperature=1.0,
                eos_token_ids=[tokenizer.eos_token_id],
            )
        assert [len(ids) for ids in batch.completion_ids] == [tokens] * len(PROMPTS)
        syncs[tokens] = counter.count
    assert syncs[32] - syncs[16] == 16 // ROW_END_READ_EVERY == 1, syncs


@pytest.mark.parametrize("race", [True, False], ids=["race", "multinomial"])
def test_gate_trainer_rollouts_read_finished_rows_every_few_steps(race, make_model, tokenizer):
    """`GateGRPOTrainer`'s rollouts (TRL's own `generate` call, under `rollout_generation`) read which
    rows ended once per ROW_END_READ_EVERY steps; plain transformers reads at every step."""
    from transformers import GenerationConfig

    from rlkv.gates import attach_gates
    from rlkv.inference.row_ends import ROW_END_READ_EVERY
    from rlkv.trainers.sampling import rollout_generation

    model = make_model("llama")
    gates = attach_gates(model, sink=2, local=4)
    with torch.no_grad():
        gates.alpha[0] = 0.3  # a mixed layer: the shared-scores decode path
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    syncs, plain = {}, {}
    for tokens in (16, 32):
        config = GenerationConfig(
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=0.7,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.no_grad():
            with rollout_generation(model, config, [tokenizer.eos_token_id], race=race) as used:
                model.generate(**enc, generation_config=used)  # the gate read after the change
                with HostSyncCounter() as counter:
                    out = model.generate(**enc, generation_config=used)
            assert out.shape[1] == width + tokens
            syncs[tokens] = counter.count
            with HostSyncCounter() as counter:
                model.generate(**enc, generation_config=config)
            plain[tokens] = counter.count
    assert syncs[32] - syncs[16] == 16 // ROW_END_READ_EVERY == 1, syncs
    assert plain[32] - plain[16] >= 16, plain  # what the trainer's rollouts did before


def test_host_stop_check_acts_only_inside_its_context(make_model, tokenizer):
    """transformers' decode loop, patched once: inside `host_stop_check` it stops when the host says
    so (or at the length limit), outside it stops at EOS as it always did."""
    from rlkv.compat import host_stop_check

    model = make_model("llama")
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    width = enc["input_ids"].shape[1]
    with torch.no_grad():
        eos = int(model(**enc).logits[0, -1].argmax())  # the first greedy token ends the row
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    with host_stop_check(width + 8, lambda: False) as installed:  # the host never sees the row end
        inside = model.generate(**enc, **kwargs)
    outside = model.generate(**enc, **kwargs)
    assert installed
    assert inside.shape[1] == width + 8  # padding after the EOS, up to the limit
    assert outside.shape[1] == width + 1
