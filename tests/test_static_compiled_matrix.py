"""The compiled static decode against eager and the dynamic cache, over every static form and the shapes
that move indices: prompts shorter and longer than sink + window, several compactions, batch 1 and
left-padded batch 2, int and ratio budgets, protected and unprotected prompts. An index out of range
anywhere in the static cache fails here on CPU (the recording backend replays the graph eagerly, with
torch's bounds checks), not later as a device assert. Plus a decode forward compiled by hand."""

import pytest
import torch

from rlkv.cache.static.budget import StaticCacheError
from rlkv.compat import cache_kwargs
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig, make_cache
from rlkv.testing import graph_counting_compile, tiny_model, tiny_tokenizer

SINK, WINDOW, STEPS = 4, 8, 40

POLICIES = {
    "streaming": {},
    "rkv": dict(policy_kwargs=dict(buffer=4)),
    "snapkv": dict(policy_kwargs=dict(buffer=3)),
    "knorm": dict(policy_kwargs=dict(buffer=2)),
    "sink-recent": {},
    "h2o": {},
    "random": {},
    "rpc": dict(policy_kwargs=dict(interval=6, selector_window=2, kernel=3)),
    "skipkv": dict(policy_kwargs=dict(buffer=4, tau=0.6)),
}

# (prompt lengths per row, budget, protect_prompt): rows shorter than sink + window = 12 and left-padded
# with a ratio budget; one row longer with an int budget; two long rows, padded, unprotected (issue 68)
SHAPES = {
    "short-padded-ratio": ([10, 6], 0.3, False),
    "long-alone-int": ([16], 14, True),
    "long-padded-int": ([16, 13], 24, False),
}


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.randint(3, 300, (len(lengths), width), generator=torch.Generator().manual_seed(sum(lengths)))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
        ids[row, : width - n] = 0
    return ids, mask


def _config(model, policy: str, budget, protect: bool) -> CompressionConfig:
    kwargs = {k: dict(v) for k, v in POLICIES[policy].items()}
    if policy == "skipkv":
        kwargs["policy_kwargs"]["tokenizer"] = tiny_tokenizer()
    if policy != "streaming":
        kwargs["budget"] = budget
    return CompressionConfig(
        head_mask=HeadMask.random(model, seed=0),
        sparsity=0.5,
        sink=SINK,
        window=WINDOW,
        policy=policy,
        protect_prompt=protect,
        **kwargs,
    )


def _generate(model, batch, cache, **kwargs) -> torch.Tensor:
    ids, mask = batch
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        do_sample=False,
        **cache_kwargs(cache),
        **kwargs,
    )


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_static_decode_gives_the_eager_and_dynamic_tokens(policy, shape):
    lengths, budget, protect = SHAPES[shape]
    model = tiny_model("llama")
    config = _config(model, policy, budget, protect)
    batch = _batch(lengths)
    dynamic = _generate(model, batch, make_cache(model, config))
    cache = make_cache(model, config, static=True, max_cache_len=max(lengths) + STEPS)
    eager = _generate(model, batch, cache, disable_compile=True)
    assert torch.equal(eager, dynamic)
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _generate(model, batch, cache, compile_config=compile_config)
    assert torch.equal(compiled, eager)
    assert len(graphs) == 1
    if cache.form.kind == "budget" and policy != "rpc":
        assert (
            max(layer.compacted_at for layer in cache.layers) > max(lengths) + SINK + WINDOW
        )  # compacted late
    torch.compiler.reset()


def _direct_decode(model, cache, batch, fwd, bookkeeping: bool) -> torch.Tensor:
    """Prefill eagerly, then STEPS decode forwards through `fwd`, with the 4D mask generate builds."""
    ids, mask = batch
    total = cache.max_cache_len
    real = torch.cat([mask, torch.ones(ids.shape[0], total - ids.shape[1])], 1).bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(STEPS):
            tokens.append(token)
            column = ids.shape[1] + step
            step_mask = real[:, None, None, :] & (torch.arange(total) <= column)
            if bookkeeping:
                cache.before_forward(1, token)
            out = fwd(
                input_ids=token,
                attention_mask=step_mask,
                position_ids=positions[:, -1:] + 1 + step,
                **cache_kwargs(cache),
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, 1)


def test_a_hand_compiled_decode_step_needs_the_bookkeeping_and_then_matches_eager():
    """Issue 68's reproduction: static H2O, budget 24, sink 4, window 8, max_cache_len 96, batch 2, a
    16-token prefill, the decode forward under torch.compile(fullgraph=True, dynamic=False). Without the
    host bookkeeping the region never compacts (step 25 wrote past its 41 slots): now one clear error
    before any write; with `cache.before_forward(1, token)` 40 steps give the eager tokens."""
    model = tiny_model("llama")
    config = _config(model, "h2o", 24, True)
    batch = (torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0)), torch.ones(2, 16))
    cache = make_cache(model, config, batch_size=2, static=True, max_cache_len=96)
    eager = _direct_decode(model, cache, batch, model.forward, bookkeeping=False)
    cache.reset()
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    compiled_forward = torch.compile(
        model.forward, backend=compile_config.backend, fullgraph=True, dynamic=False
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _direct_decode(model, cache, batch, compiled_forward, bookkeeping=True)
    assert torch.equal(got, eager) and len(graphs) == 1
    cache.reset()
    torch.compiler.reset()
    with pytest.raises(Exception, match="before_forward") as caught:
        _direct_decode(model, cache, batch, compiled_forward, bookkeeping=False)
    assert isinstance(caught.value, StaticCacheError) or "StaticCacheError" in str(caught.value)
    torch.compiler.reset()
