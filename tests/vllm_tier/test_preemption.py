"""Preemption (vLLM V1 recomputes a preempted request: its prompt and outputs so far, replayed), abort and
resume in rlkv's groups (issue 88, item 2).

What a replay must give, by design: the replayed outputs are computed again as prompt (a compressed head
reads them in full, and the eviction group compresses prompt and outputs as one prompt), so after its
last preemption at k outputs a request continues as a cold request whose prompt is its prompt plus those k
outputs. A request never preempted gets the undisturbed run's tokens. Every block goes back to the pool.
Demo model (2 KV heads), fp32, greedy; a 48-block pool forces vLLM to preempt.
"""

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import demo_chain, engine, greedy, kv_groups  # noqa: E402

from rlkv.eval.methods import method_config  # noqa: E402
from rlkv.inference.vllm import compression_overrides, vllm_compression  # noqa: E402
from rlkv.vllm_plugin.split import CONFIG_KEY  # noqa: E402

NEW_TOKENS, REQUESTS = 300, 5
# 48 blocks of 32 tokens over every group: five ~350-token prompts + 300 new tokens need more, so vLLM
# preempts; a step's token budget holds a whole replay (no replay is chunked)
SMALL_POOL = {"num_gpu_blocks_override": 48, "max_model_len": 700, "max_num_batched_tokens": 2048}


@pytest.fixture(scope="module")
def demo():
    return demo_chain(REQUESTS)


def _overrides(model, mask, form: str) -> dict:
    if form.startswith("rlkv+rkv"):  # the eval's matched R-KV (buffer 0, the prompt evictable)
        return compression_overrides(
            model.config, method_config("rlkv+rkv", 0.5, model=model, masks={"rlkv": mask})
        )
    config = vllm_compression(mask, 0.5, sink=16, window=64, protect_prompt=form.startswith("protected"))
    overrides = compression_overrides(model.config, config)
    if form.endswith("torch"):  # rlkv's gather form instead of the ring
        overrides[CONFIG_KEY] = overrides[CONFIG_KEY] | {"kernel": "torch"}
    return overrides


def _run_preempted(llm, prompts: list[list[int]], abort: str | None = None):
    """Step `llm` over the prompts (EOS ignored); (tokens per finished request, per request the outputs it
    held at each of its preemptions, whether every block went back to the pool)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    _, pool = kv_groups(llm)
    free, core = pool.get_num_free_blocks(), llm.llm_engine
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    finished, cuts, step = {}, {f"r{i}": [] for i in range(len(prompts))}, 0
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if abort is not None and step == 30:
            core.abort_request([abort])
        for internal, request in scheduler.requests.items():  # a request preempted this step computed nothing
            rid = internal.split("-")[0]  # vLLM's internal id: the request's own, a suffix appended
            if request.num_preemptions > len(cuts[rid]):
                cuts[rid].append(request.num_output_tokens)
    return finished, cuts, pool.get_num_free_blocks() == free


@pytest.mark.parametrize("form", ["eval-form", "eval-form-torch", "protected", "rlkv+rkv"])
def test_a_preempted_request_continues_as_a_cold_request_over_its_outputs(demo, form):
    model, tokenizer, _, prompts, mask = demo
    ids = [tokenizer(p).input_ids for p in prompts]
    overrides = _overrides(model, mask, form)
    with engine(hf_overrides=overrides, **SMALL_POOL) as llm:
        served, cuts, all_freed = _run_preempted(llm, ids, abort=f"r{REQUESTS - 1}")
    assert all_freed  # every block of the finished, preempted and aborted requests
    assert sorted(served) == [f"r{i}" for i in range(REQUESTS - 1)]
    preempted = {rid: k[-1] for rid, k in cuts.items() if k and rid in served}
    assert preempted, "the small pool preempted no request that finished"
    assert len(preempted) < REQUESTS - 1, "every request preempted: no undisturbed one to compare"
    with engine(hf_overrides=overrides) as llm:
        undisturbed = greedy(llm, [{"prompt_token_ids": x} for x in ids[:-1]], NEW_TOKENS, ignore_eos=True)
        continued = {
            rid: greedy(
                llm,
                [{"prompt_token_ids": ids[int(rid[1:])] + served[rid][:k]}],
                NEW_TOKENS - k,
                ignore_eos=True,
            )[0]
            for rid, k in preempted.items()
        }
    for rid, tokens in served.items():
        if rid in preempted:
            k = preempted[rid]
            assert tokens[k:] == continued[rid], (rid, k)
        else:
            assert tokens == undisturbed[int(rid[1:])], rid


@pytest.mark.parametrize("form", ["eval-form", "protected", "protected-torch", "rlkv+rkv"])
def test_no_block_leaks_after_200_requests_with_preemption_aborts_and_prefix_hits(demo, form):
    """200 requests through a 48-block pool: prompts that share prefixes (hits where the form caches), every
    7th aborted mid-run, vLLM preempting; afterwards the pool holds every block again."""
    model, tokenizer, _, prompts, mask = demo
    ids = [tokenizer(p).input_ids for p in prompts]
    caching = form == "protected-torch"  # the rings and the eviction group cache nothing
    with engine(
        hf_overrides=_overrides(model, mask, form), enable_prefix_caching=caching, **SMALL_POOL
    ) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        _, pool = kv_groups(llm)
        free, core = pool.get_num_free_blocks(), llm.llm_engine
        for i in range(200):  # a prompt, or the same prompt cut shorter: a prefix of an earlier one
            prompt = ids[i % REQUESTS][: 350 - 13 * (i % 17)]
            params = vllm.SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 11), ignore_eos=True)
            core.add_request(f"q{i}", {"prompt_token_ids": prompt}, params)
        preempted, hits, step = False, 0, 0
        while core.has_unfinished_requests():
            for out in core.step():
                hits += bool(out.finished and out.num_cached_tokens)
            step += 1
            if step % 5 == 0:  # abort the running requests numbered 7k
                core.abort_request([f"q{i}" for i in range(0, 200, 7)])
            preempted = preempted or any(r.num_preemptions for r in scheduler.requests.values())
        assert pool.get_num_free_blocks() == free  # cached blocks nobody holds count as free, as for vLLM
    assert preempted
    assert (hits > 0) == caching


def test_beam_search_reads_every_beam_as_prompt_so_it_equals_stock_vllm(demo):
    """vLLM's beam search sends, each step, a request whose prompt is the beam: a compressed head reads a
    prompt in full in the eval form, so beam search compresses nothing there and gives stock vLLM's beams."""
    from vllm.sampling_params import BeamSearchParams

    model, tokenizer, _, prompts, mask = demo
    params = BeamSearchParams(beam_width=2, max_tokens=24, ignore_eos=True)
    requests = [{"prompt_token_ids": tokenizer(p).input_ids} for p in prompts[:2]]
    with engine(hf_overrides=_overrides(model, mask, "eval-form")) as llm:
        compressed = [[b.tokens for b in o.sequences] for o in llm.beam_search(requests, params)]
    with engine() as llm:
        stock = [[b.tokens for b in o.sequences] for o in llm.beam_search(requests, params)]
    assert compressed == stock
