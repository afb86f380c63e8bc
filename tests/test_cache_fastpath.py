"""Fast paths: cache storage that grows in chunks instead of one copy per step; R-KV's blocked redundancy.

Properties: decoding past 128 tokens writes new tokens into spare capacity (the history's storage
stays in place), the spare capacity is at most 1/128 of the stored tokens and is counted in
`resident_bytes()`, and the outputs equal a plain `DynamicCache` run exactly as before. The
redundancy computed in blocks (symmetric, newest-first) equals the dense K x K matrix.
"""

import torch
from transformers import DynamicCache

from rlkv import HeadMask
from rlkv.cache import GROWTH_DIVISOR, append_along_tokens
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies.rkv import key_redundancy


def test_append_along_tokens_grows_by_a_bounded_fraction_and_keeps_content():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, n, 4, generator=gen) for n in (300, 1, 1, 5, 1)]
    storage = current = None
    reallocations = 0
    for chunk in chunks:
        before = None if storage is None else storage.data_ptr()
        storage = append_along_tokens(storage, current, chunk)
        used = chunk.shape[2] + (0 if current is None else current.shape[2])
        current = storage[:, :, :used]
        reallocations += storage.data_ptr() != before
        # capacity = used + used // 128 at the last growth: never more than 1/128 spare
        assert used <= storage.shape[2] <= used + used // GROWTH_DIVISOR + chunk.shape[2]
        assert (
            storage.shape[2] * GROWTH_DIVISOR <= used * (GROWTH_DIVISOR + 1) + chunk.shape[2] * GROWTH_DIVISOR
        )
    assert torch.equal(current, torch.cat(chunks, dim=2))
    assert reallocations == 2  # the first chunk, then the 5-token chunk outgrew the 2 spare slots
    # below 128 tokens nothing is spare
    small = append_along_tokens(None, None, torch.zeros(1, 1, 127, 2))
    assert small.shape[2] == 127


def test_long_decode_writes_in_place_counts_capacity_and_matches_dynamic_cache(make_model):
    model, reference = make_model("llama"), make_model("llama")
    mask = HeadMask.random(model, seed=3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    spare = 200 // GROWTH_DIVISOR  # tokens that fit in the capacity left by the prefill

    # one full + one streaming head per layer: the full head's history is never copied while it fits
    mixed = make_cache(
        model, CompressionConfig(head_mask=mask, sparsity=0.5, min_full_per_layer=1, sink=4, window=16)
    )
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=mixed)
        pointers = [layer.keys.data_ptr() for layer in mixed.layers]
        for _ in range(spare):
            model(input_ids=prompt[:, :1], past_key_values=mixed)
    for layer, pointer in zip(mixed.layers, pointers, strict=True):
        assert layer.full_idx.numel() == 1
        assert layer.keys.data_ptr() == pointer  # no copy of the history
        assert layer.keys.shape[2] == layer.logical_length == 200 + spare
        assert layer.keys.untyped_storage().nbytes() == (200 + spare) * 16 * 4  # B=1, 1 head, D=16, fp32

    # sparsity 0: same logits as a DynamicCache; the capacity is counted
    everything = make_cache(model, CompressionConfig(head_mask=mask, sparsity=0.0))
    ref_cache = DynamicCache(config=reference.config)
    tokens = prompt
    with torch.no_grad():
        for _ in range(spare + 4):  # prefill, then decode past the first growth
            length = everything.get_seq_length()
            logits = model(input_ids=tokens[:, length:], past_key_values=everything).logits[:, -1]
            ref_logits = reference(input_ids=tokens[:, length:], past_key_values=ref_cache).logits[:, -1]
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
            tokens = torch.cat([tokens, ref_logits.argmax(-1, keepdim=True)], dim=1)
    used = sum(layer.keys.numel() + layer.values.numel() for layer in everything.layers) * 4
    stored = sum(
        layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        for layer in everything.layers
    )
    assert used < stored <= used * (1 + 1 / GROWTH_DIVISOR)  # spare capacity is real and bounded
    indices = sum(t.numel() * 8 for layer in everything.layers for t in layer.tensors()[2:])
    assert everything.resident_bytes() == stored + indices + everything.full_heads.numel()


def _dense_redundancy(keys, valid, threshold, exempt):
    """R-KV redundancy from the full K x K similarity matrix (plain reference, float64)."""
    normed = torch.nn.functional.normalize(keys.double(), dim=-1) * valid[..., None]
    sim = normed @ normed.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    slots = keys.shape[2]
    recency = torch.arange(1, slots + 1, dtype=torch.float64)
    rank, index = ((sim > threshold) * recency).topk(exempt, dim=-1)
    sim.scatter_(-1, index, torch.where(rank > 0, 0.0, sim.gather(-1, index)))
    mean = (sim.sum(dim=2) / valid.sum(-1, keepdim=True)).masked_fill(~valid, float("-inf"))
    return torch.softmax(mean, dim=-1)


def test_blocked_redundancy_equals_the_dense_matrix():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 300, 16, generator=gen)
    keys[:, :, 40:120] = keys[:, :, 40:41] + 0.4 * torch.randn(2, 3, 80, 16, generator=gen)  # a cluster
    keys[:, :, 200:210] = keys[:, :, 250:251] + 0.8 * torch.randn(2, 3, 10, 16, generator=gen)
    valid = torch.ones(2, 3, 300, dtype=torch.bool)
    valid[1, 2, :37] = False  # empty slots
    for exempt in (1, 2):
        want = _dense_redundancy(keys, valid, 0.5, exempt)
        for chunk in (7, 64, 256, 1000):
            got = key_redundancy(keys, valid, threshold=0.5, recent_exempt=exempt, chunk=chunk)
            torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=1e-5)
