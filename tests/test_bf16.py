"""bf16 as a first-class dtype: gated attention, the head-mixed cache and gate gradients in bf16; dtype="auto"."""

from __future__ import annotations

import pytest
import torch
from test_gates import LOCAL, SINK, reference_logits, sink_local_mask

import rlkv
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, load, make_cache, resolve_dtype
from rlkv.inference.dtypes import cpu_has_bf16
from rlkv.testing import tiny_model

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)


def bf16_model(family: str):
    return tiny_model(family).to(torch.bfloat16)


def close_in_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within a few bf16 ulps of the logits' scale (8 mantissa bits: relative spacing 2**-8)."""
    scale = b.float().abs().max()
    return bool(((a.float() - b.float()).abs().max() <= 4 * 2**-8 * scale).item())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_gated_attention_alpha_one_and_zero_match_full_and_sink_local(family, left_padded_batch):
    ids, mask = left_padded_batch
    real = mask.bool()
    stock = bf16_model(family)(input_ids=ids, attention_mask=mask).logits
    gated = bf16_model(family)
    gates = rlkv.attach_gates(gated, sink=SINK, local=LOCAL, init=1.0)
    assert gates.alpha.dtype == torch.float32  # fp32 master gates in a bf16 model
    assert close_in_bf16(gated(input_ids=ids, attention_mask=mask).logits[real], stock[real])

    with torch.no_grad():
        gates.alpha.zero_()
    local = gated(input_ids=ids, attention_mask=mask).logits
    ref = reference_logits(bf16_model(family), ids, mask, sink_local_mask(mask, SINK, LOCAL))
    assert close_in_bf16(local[real], ref[real])
    assert not close_in_bf16(local[real], stock[real])  # and the two attentions really differ here


def test_bf16_head_mixed_cache_at_sparsity_zero_is_token_identical_to_plain_generate(left_padded_batch):
    ids, mask = left_padded_batch
    plain = bf16_model("qwen2")
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = bf16_model("qwen2")
    cache = make_cache(model, CompressionConfig(head_mask=None, policy="full"))
    got = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, **cache_kwargs(cache)
    )
    assert torch.equal(got, expected)


def test_bf16_gate_gradient_is_finite_and_matches_fp32_in_sign_and_size(left_padded_batch):
    ids, mask = left_padded_batch
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("qwen2").to(dtype)
        gates = rlkv.attach_gates(model, sink=SINK, local=LOCAL, init=0.5)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[dtype] = gates.alpha.grad.clone()
    g32, g16 = grads[torch.float32], grads[torch.bfloat16]
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()
    big = g32.abs() > 0.1 * g32.abs().max()  # sign is only meaningful where the gradient is not ~0
    assert big.any() and torch.equal(g16[big].sign(), g32[big].sign())
    ratio = g16.norm() / g32.norm()
    assert 0.8 <= ratio <= 1.25


def test_resolve_dtype_names_auto_and_errors():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    with pytest.raises(ValueError, match="auto, bfloat16"):
        resolve_dtype("int8")


def test_load_applies_the_dtype(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    rlkv.testing.tiny_tokenizer().save_pretrained(tmp_path / "m")
    model, _ = load(str(tmp_path / "m"), dtype="bfloat16")
    assert next(model.parameters()).dtype is torch.bfloat16
    model, _ = load("tiny:llama")  # test fixtures stay fp32 under "auto"
    assert next(model.parameters()).dtype is torch.float32


def test_bf16_asked_on_a_cpu_without_native_bf16_says_it_is_emulated(monkeypatch, caplog):
    import rlkv.inference.dtypes as dtypes

    monkeypatch.setattr(dtypes, "cpu_has_bf16", lambda: False)  # rlkv's own probe of /proc/cpuinfo
    with caplog.at_level("WARNING", logger="rlkv.inference.dtypes"):
        assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
        assert resolve_dtype("float32", "cpu") is torch.float32
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "emulated" in lines[0] and "float32" in lines[0], lines
