"""Gated mixed attention (RLKV): equality to stock attention, to a plain sink+local reference, and gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import rlkv
from rlkv.compat import cache_kwargs
from rlkv.gates import UnsupportedModelError
from rlkv.gates.attention import mixed_attention_forward, mixed_attention_shared_scores
from rlkv.testing import tiny_model

SINK, LOCAL = 2, 4

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)


def sink_local_mask(attention_mask: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """Plain dense reference: BoolTensor[B, 1, T, T], True where query i may attend key j."""
    bsz, t = attention_mask.shape
    valid = attention_mask.bool()
    first = (~valid).long().cumprod(1).sum(1)  # leading pads per row
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    causal = j <= i
    rows = []
    for b in range(bsz):
        is_sink = (j - first[b] >= 0) & (j - first[b] < sink)
        allowed = causal & (is_sink | (i - j < local)) & valid[b][None, :]
        rows.append(allowed)
    return torch.stack(rows)[:, None]


def reference_logits(model, input_ids, attention_mask, mask4d):
    """The stock eager model run with an explicit 4D mask (padded query rows attend to themselves only)."""
    eye = torch.eye(mask4d.shape[-1], dtype=torch.bool)[None, None]
    full_rows = mask4d | (~mask4d.any(-1, keepdim=True) & eye)
    additive = torch.zeros(full_rows.shape).masked_fill(~full_rows, torch.finfo(torch.float32).min)
    model.set_attn_implementation("eager")
    return model(input_ids=input_ids, attention_mask=additive).logits


def causal_mask(attention_mask):
    t = attention_mask.shape[1]
    return (
        torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None] & attention_mask.bool()[:, None, None, :]
    )


@pytest.mark.parametrize("stock", ["sdpa", "eager"])
def test_alpha_one_equals_stock_model(family, stock, left_padded_batch):
    ids, mask = left_padded_batch
    ref = tiny_model(family, attn_implementation=stock)(input_ids=ids, attention_mask=mask).logits
    model = tiny_model(family)
    rlkv.attach_gates(model, sink=SINK, local=LOCAL, init=1.0)
    out = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (out - ref)[real].abs().max() <= 1e-5


def test_alpha_zero_equals_plain_sink_local_reference(family, left_padded_batch):
    ids, mask = left_padded_batch
    ref = reference_logits(tiny_model(family), ids, mask, sink_local_mask(mask, SINK, LOCAL))
    model = tiny_model(family)
    rlkv.attach_gates(model, sink=SINK, local=LOCAL, init=0.0)
    out = model(input_ids=ids, attention_mask=mask).logits
    assert (out - ref)[mask.bool()].abs().max() <= 1e-5
    # and sink+local really differs from full attention on these lengths
    full = tiny_model(family)(input_ids=ids, attention_mask=mask).logits
    assert (full - out)[mask.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("grad", [True, False], ids=["sdpa-branches", "shared-scores"])
@pytest.mark.parametrize("q_len", [1, 3, 13])
def test_random_alpha_is_per_group_mix_of_references(q_len, grad):
    torch.manual_seed(0)
    model = tiny_model("llama")
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)
    gates.alpha.data = torch.rand_like(gates.alpha)
    attn = model.model.layers[1].self_attn
    bsz, n_kv, groups, dim, kv_len = 2, 2, 2, 16, 13
    q = torch.randn(bsz, n_kv * groups, q_len, dim)
    k, v = torch.randn(bsz, n_kv, kv_len, dim), torch.randn(bsz, n_kv, kv_len, dim)
    pad = torch.ones(bsz, kv_len, dtype=torch.long)
    pad[1, :3] = 0
    full_mask = causal_mask(pad)[:, :, -q_len:]
    local_mask = sink_local_mask(pad, SINK, LOCAL)[:, :, -q_len:]
    if grad:
        out, _ = mixed_attention_forward(attn, q, k, v, full_mask, scaling=dim**-0.5)
    else:  # the decode path's function, on any number of queries
        with torch.no_grad():
            out = mixed_attention_shared_scores(q, k, v, gates.alpha[1], SINK, LOCAL, dim**-0.5, full_mask)

    def plain(mask):
        kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = (q @ kr.transpose(-1, -2)) * dim**-0.5
        s = s.masked_fill(~mask, float("-inf"))
        return (torch.softmax(s, -1) @ vr).transpose(1, 2)

    a = gates.alpha[1].repeat_interleave(groups)[None, None, :, None]
    expected = a * plain(full_mask) + (1 - a) * plain(local_mask)
    real_rows = full_mask.any(-1).squeeze(1)  # [B, Q]: padded query rows are undefined in both
    assert (out - expected)[real_rows].abs().max() <= 1e-5


def test_shared_scores_path_without_mask_reads_it_as_transformers_sdpa_does():
    """No 4D mask (no padding): the no-grad path applies causality and the band itself, reading "no
    mask" as transformers' SDPA call does: several queries are causal from the first column (SDPA's
    `is_causal`, how a static cache is prefilled), a single query sees every key."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)
    gates.alpha.data = torch.rand_like(gates.alpha)
    attn = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16)
    causal = causal_mask(torch.ones(1, 11, dtype=torch.long))  # [1, 1, 11, 11]
    alpha = gates.alpha[0].detach()
    implicit = mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, None)
    top_left = mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, causal[:, :, :5])
    assert (implicit - top_left).abs().max() <= 1e-6
    stock = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.25, enable_gqa=True
    )
    full = mixed_attention_shared_scores(q, k, v, torch.ones(2), SINK, LOCAL, 0.25, None)
    assert (full - stock.transpose(1, 2)).abs().max() <= 1e-5  # alpha = 1 is the stock reading
    last = mixed_attention_shared_scores(q[:, :, -1:], k, v, alpha, SINK, LOCAL, 0.25, causal[:, :, -1:])
    with torch.no_grad():  # and a decode step through the attention function takes this path
        step, _ = mixed_attention_forward(attn, q[:, :, -1:], k, v, None, scaling=0.25)
    assert (step - last).abs().max() <= 1e-6


def test_cached_generation_equals_teacher_forcing(family, left_padded_batch):
    ids, mask = left_padded_batch
    model = tiny_model(family)
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)
    torch.manual_seed(1)
    gates.alpha.data = torch.rand_like(gates.alpha)
    new = 12
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype)], 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp_min(0)
    # with gradients on the gates the forward takes the two-branch SDPA path; generate takes the shared-scores one
    logits = model(input_ids=seq, attention_mask=full_mask, position_ids=position_ids).logits.detach()
    tf = logits[:, ids.shape[1] - 1 : -1]
    cached = torch.stack(out.logits, 1)
    assert (tf - cached).abs().max() <= 1e-4
    assert torch.equal(tf.argmax(-1), seq[:, ids.shape[1] :])


def test_gradient_reaches_only_gates(left_padded_batch):
    ids, mask = left_padded_batch
    model = tiny_model("qwen2")
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL, init=0.7)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert gates.alpha.grad is not None and gates.alpha.grad.abs().sum() > 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["rlkv_gates.alpha"]
    assert all(p.grad is None for n, p in model.named_parameters() if n != "rlkv_gates.alpha")


def test_hard_forward_runs_the_deployed_layout_with_the_gradient_at_that_layout(left_padded_batch):
    """`hard_keep`: the loss is exactly that of the top-k gates at 1 and the rest at 0 (ties by
    below_zero, as the exported mask ranks them), and each gate's gradient is the soft forward's
    gradient at that 0/1 layout (straight-through), for heads inside and outside the cut alike."""
    ids, mask = left_padded_batch
    model = tiny_model("qwen2")  # 2 layers x 2 KV heads
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)
    gates.alpha.data = torch.tensor([[0.2, 0.6], [0.6, 0.1]])
    gates.below_zero.copy_(torch.tensor([[0.0, -1.0], [0.0, 0.0]]))  # the tie at 0.6: 1.0 ranks first
    gates.hard_keep = 1
    model.train()
    hard_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    hard_loss.backward()
    hard_grad = gates.alpha.grad.clone()
    assert (hard_grad != 0).all()

    layout = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    gates.hard_keep, gates.alpha.grad = None, None
    gates.alpha.data = layout.clone()
    soft_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    soft_loss.backward()
    assert torch.equal(hard_loss, soft_loss)  # same kernels, same shapes, same gate values
    assert torch.allclose(hard_grad, gates.alpha.grad, rtol=1e-6, atol=1e-9)


def test_hard_forward_rollouts_decode_with_the_deployed_layout(left_padded_batch):
    """GRPO's rollouts under `hard_keep` come from the deployed 0/1 layout: `generate` gives exactly the
    tokens and logits of the soft gates set to that layout (the same kernels on the same shapes)."""
    ids, mask = left_padded_batch
    model = tiny_model("qwen2")
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)

    def rollout():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return out.sequences, torch.stack(out.logits, 1)

    gates.alpha.data = torch.tensor([[0.3, 0.9], [0.6, 0.2]])
    gates.hard_keep = 2
    hard = rollout()
    gates.hard_keep = None
    gates.alpha.data = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    soft = rollout()
    assert torch.equal(hard[0], soft[0]) and torch.equal(hard[1], soft[1])


def test_clamp_and_detach_restore_stock_model(left_padded_batch):
    ids, mask = left_padded_batch
    model = tiny_model("llama")
    ref = model(input_ids=ids, attention_mask=mask).logits
    gates = rlkv.attach_gates(model, init=0.5)
    gates.alpha.data = torch.tensor([[1.7, -0.3], [0.5, 2.0]])
    gates.clamp_()
    assert gates.alpha.min() >= 0 and gates.alpha.max() <= 1
    rlkv.detach_gates(model)
    assert model.config._attn_implementation == "sdpa" and not hasattr(model, "rlkv_gates")
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, ref)


def test_unsupported_architecture_is_rejected_at_attach():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="layer_idx"):
        rlkv.attach_gates(gpt2)


def test_bad_gate_settings_are_rejected():
    with pytest.raises(ValueError, match="init"):
        rlkv.attach_gates(tiny_model("llama"), init=1.5)
    with pytest.raises(ValueError, match="local"):
        rlkv.attach_gates(tiny_model("llama"), local=0)


def test_frozen_head_never_copies_its_weight_per_row(left_padded_batch):
    """After attach_gates freezes the head, a `logits_to_keep` forward (the sliced, non-contiguous
    last hidden state) must run the head as one matmul, not a bmm over a per-row copy of the weight."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = left_padded_batch
    model = tiny_model("qwen2")
    ref = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    rlkv.attach_gates(model, init=1.0)
    vocab = model.config.vocab_size
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    expanded = [e for e in prof.events() if e.name == "aten::bmm" and any(vocab in s for s in e.input_shapes)]
    assert expanded == []
    torch.testing.assert_close(out, ref)
    rlkv.detach_gates(model)
    assert not model.get_output_embeddings()._forward_pre_hooks


def test_decode_band_masks_are_built_once_per_forward_and_never_reused_stale(monkeypatch, left_padded_batch):
    """A decode step builds the sink+local band from the mask once, for all layers (transformers passes
    each layer the same mask tensor); a new mask of the same shape, or the same one changed in place,
    is read again, never served from the last step."""
    from rlkv.gates import attention

    ids, mask = left_padded_batch
    model = tiny_model("llama")
    gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL)
    gates.alpha.data = torch.rand_like(gates.alpha) * 0.9  # every layer mixed
    builds = []
    real = attention.key_validity
    monkeypatch.setattr(attention, "key_validity", lambda *a: builds.append(1) or real(*a))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        builds.clear()
        step_mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
        model(input_ids=ids[:, -1:], attention_mask=step_mask, **cache_kwargs(out.past_key_values))
    assert len(builds) == 1 < model.config.num_hidden_layers

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    alpha = torch.tensor([0.3, 0.6])
    padded = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    padded[0, ..., :3] = False

    def fresh(m):
        attention._last_band[0] = None
        return mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, m)

    first = mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, padded)
    assert torch.equal(first, fresh(padded))
    other = torch.ones_like(padded)  # same shape, another tensor
    assert torch.equal(mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, other), fresh(other))
    assert not torch.equal(fresh(other), first)
    mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, padded)
    padded[1, ..., :5] = False  # changed in place
    assert torch.equal(
        mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, padded), fresh(padded)
    )
    with torch.inference_mode():  # an inference tensor keeps no version counter: never reused
        inference = padded.clone()
        mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, inference)
        inference[0] = True
        got = mixed_attention_shared_scores(q, k, v, alpha, SINK, LOCAL, 0.25, inference)
        assert torch.equal(got, fresh(inference))
