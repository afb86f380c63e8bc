"""The host-flag fast paths of scoring (no empty slot, no padded row) keep exactly what the masked paths keep.

`rlkv.policies.helpers.scoring.window_start` (the observation window read from host counts; with
`observation_prefix`, the window as the last slots: scored on the slots before it and kept by count) and
`rlkv.policies.base._host_extra` (one kept count per (row, head), no rank tensor; with the forced set
at the ends of every (row, head), `select_top_scores` returns the kept slots themselves and the store
copies them by index) switch the fast paths on; with both returning None every compression builds
the general masks. Greedy decoding of
an unpadded batch must keep the same positions in every layer at every step, and generate the same tokens.
"""

import pytest
import torch

from rlkv.cache import CompressedStore, HeadMixedCache, register_attention
from rlkv.compat import cache_kwargs
from rlkv.policies import base, get_policy
from rlkv.policies.helpers import scoring
from rlkv.testing import tiny_model

LAYOUT = torch.tensor([[False, False], [True, False], [False, True]])  # 3 layers x 2 KV heads
POLICIES = [
    ("snapkv", dict(window=4, kernel=3, buffer=4)),
    ("rkv", dict(window=4, buffer=4)),
    ("knorm", dict(buffer=4)),
    ("h2o", {}),
    ("rpc", dict(interval=6, selector_window=3)),
]  # sink-recent and streaming select by position without scores (`compact_ends`)


def _decode(
    model, policy: str, kwargs: dict, budget, protect: bool
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Kept positions of every compressed store after each forward, and the greedy tokens."""
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    cache = HeadMixedCache(
        model.config,
        LAYOUT,
        get_policy(policy, **kwargs),
        sink=2,
        window=3,
        budget=budget,
        protect_prompt=protect,
    )
    kept, tokens = [], []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        for step in range(20):
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok)
            kept.append([layer.store.positions.clone() for layer in cache.layers if layer.store is not None])
            position = torch.full((2, 1), ids.shape[1] + step)
            out = model(input_ids=tok, **cache_kwargs(cache), use_cache=True, position_ids=position)
    return kept, torch.cat(tokens, dim=1)


@pytest.mark.parametrize(
    "budget,protect",
    [(10, False), (0.1, True), (3, False)],
    ids=["int-budget", "ratio-protected", "budget-under-window"],
)
@pytest.mark.parametrize("policy,kwargs", POLICIES, ids=[p for p, _ in POLICIES])
def test_fast_paths_keep_what_the_masked_paths_keep(policy, kwargs, budget, protect, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=3)
    model.set_attn_implementation(register_attention())
    taken = []
    fast_window, fast_extra = scoring.window_start, base._host_extra

    def counted(function):
        def wrapper(*args):
            result = function(*args)
            taken.append(result is not None)
            return result

        return wrapper

    monkeypatch.setattr(scoring, "window_start", counted(fast_window))
    monkeypatch.setattr(base, "_host_extra", counted(fast_extra))
    prefixes = []
    observation_prefix = scoring.observation_prefix

    def prefix_spy(store):
        prefixes.append(observation_prefix(store))
        return prefixes[-1]

    monkeypatch.setattr(scoring, "observation_prefix", prefix_spy)
    by_slots = []
    compact_slots = CompressedStore.compact_slots

    def slots_spy(store, slots):
        by_slots.append(slots.shape)
        compact_slots(store, slots)

    monkeypatch.setattr(CompressedStore, "compact_slots", slots_spy)
    fast_kept, fast_tokens = _decode(model, policy, kwargs, budget, protect)
    assert any(taken), "no fast path was taken: the test no longer covers it"
    if policy != "rpc":  # RPC selects per layer (its mask, not slots)
        assert by_slots, "no compaction by slot indices (`select_top_scores`): the test no longer covers it"
    if policy in ("snapkv", "rkv"):  # observation windows: scored on the slots before them, kept by count
        took_prefix = any(p is not None for p in prefixes)
        # a budget under the window may cut it: from then on the window is found by the masks
        assert took_prefix == (budget != 3), prefixes

    monkeypatch.setattr(scoring, "window_start", lambda store: None)
    monkeypatch.setattr(base, "_host_extra", lambda store, budget: None)
    slow_kept, slow_tokens = _decode(model, policy, kwargs, budget, protect)
    assert torch.equal(fast_tokens, slow_tokens)
    for step, (fast, slow) in enumerate(zip(fast_kept, slow_kept, strict=True)):
        for layer, (a, b) in enumerate(zip(fast, slow, strict=True)):
            assert torch.equal(a, b), (step, layer)
