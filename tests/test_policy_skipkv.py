"""SkipKV: sentence tracking and ranges across evictions, sentence penalty vs a plain reference,
adaptive steering, steering-vector computation (API and CLI), and the policy properties."""

import copy
import json

import pytest
import torch
from policy_properties import (
    assert_combined_mode,
    assert_no_eviction_is_identity,
    kept_positions,
)
from transformers import AutoTokenizer

from rlkv.cache import HeadMixedCache, install_observers, register_attention, storage_bytes
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies.helpers.steering import SteeringError, SteeringVector, compute_steering_vector
from rlkv.policies.rkv import RKVPolicy
from rlkv.policies.skipkv import DELIMITERS, SkipKVPolicy, delimiter_token_mask

TRACE = (
    "let x be 3.\nthen x + 4 = 7.\nWait, check again.\nlet x be 3.\nthen x + 4 = 7.\n\n"
    "so the answer is 7.\nAlternatively 2 * 3 = 6.\nthen x + 4 = 7.\nlet x be 3.\n"
)
CACHE = dict(budget=30, sink=2, window=4)
TAU = 0.6  # the tiny random model's sentence embeddings are less alike than a real model's


@pytest.fixture
def qwen2(make_model):
    return make_model("qwen2")


def delimiter_ids(tokenizer):
    return {i for i in range(len(tokenizer)) if tokenizer.decode([i]) in DELIMITERS}


def test_delimiter_tokens(tokenizer):
    assert delimiter_ids(tokenizer)  # "\n" and "\n\n" in the tiny vocabulary
    extended = copy.deepcopy(tokenizer)
    extended.add_tokens([" \n", "\n\n\n", ".\n", ")\n\n", ":\n", "\n    ", "x\n"])
    mask = delimiter_token_mask(extended)
    marked = {extended.decode([i]) for i in range(len(extended)) if mask[i]}
    assert {" \n", "\n\n\n", ".\n", ")\n\n", "\n", "\n\n"} <= marked
    assert not marked & {":\n", "\n    ", "x\n", "."}


def reference_sentences(token_ids, delimiters):
    """Sentence index of every token: a non-delimiter token right after a delimiter opens the next sentence."""
    ids, current = [], 0
    for t, token in enumerate(token_ids):
        if t > 0 and token_ids[t - 1] in delimiters and token not in delimiters:
            current += 1
        ids.append(current)
    return ids


@torch.no_grad()
def teacher_force(model, cache, prompt_ids, prompt_mask, continuation, prefill_chunks=1):
    """Prefill the left-padded prompts (in `prefill_chunks` forwards), then feed `continuation` [B, T]
    one token per forward (like decoding)."""
    mask = prompt_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    bounds = torch.linspace(0, mask.shape[1], prefill_chunks + 1).long().tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        model(
            input_ids=prompt_ids[:, lo:hi],
            attention_mask=mask[:, :hi],
            position_ids=positions[:, lo:hi],
            **cache_kwargs(cache),
        )
    for t in range(continuation.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(
            input_ids=continuation[:, t : t + 1],
            attention_mask=mask,
            position_ids=mask.sum(-1, keepdim=True) - 1,
            **cache_kwargs(cache),
        )


class RecordingSkipKV(SkipKVPolicy):
    """SkipKV that snapshots what a compression decided, and the hidden states it was fed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events, self.hidden = [], {}

    def on_hidden_states(self, hidden_states, positions):
        super().on_hidden_states(hidden_states, positions)
        for q, p in enumerate(positions.tolist()):
            self.hidden[p] = hidden_states[:, q].detach().double().clone()

    def select(self, store):
        event = {
            "positions": store.positions.clone(),
            "rkv": RKVPolicy.scores(self, store).clone(),
            "scores": self.scores(store).clone(),
            "evictable": store.evictable().clone(),
            "forced": store.forced_keep().clone(),
            "num_generated": self.num_generated,
            "hidden": dict(self.hidden),
        }
        event["keep"] = super().select(store).clone()
        self.events.append(event)
        return event["keep"]


def forced_run(model, tokenizer, prompts, policy, prefill_chunks=1, **cache_kwargs):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    continuation = torch.tensor([tokenizer(TRACE)["input_ids"]] * len(prompts))
    model.set_attn_implementation(register_attention())
    install_observers(model)
    cache = HeadMixedCache(model.config, None, policy, **cache_kwargs)
    teacher_force(model, cache, enc["input_ids"], enc["attention_mask"], continuation, prefill_chunks)
    return cache, enc, continuation[0].tolist()


def reference_penalty(event, prompt_width, sentence_of, num_finished, tau):
    """max over later finished sentences j of cos(mean hidden_i, mean hidden_j) when above tau, per row."""
    batch = next(iter(event["hidden"].values())).shape[0]
    penalties = []
    for b in range(batch):
        means = []
        for s in range(num_finished):
            rows = [event["hidden"][prompt_width + t][b] for t, sid in enumerate(sentence_of) if sid == s]
            means.append(torch.stack(rows).mean(0))
        pen = []
        for i in range(num_finished):
            sims = [
                float(means[i] @ means[j] / (means[i].norm() * means[j].norm()))
                for j in range(i + 1, num_finished)
            ]
            over = [s for s in sims if s > tau]
            pen.append(max(over) if over else 0.0)
        penalties.append(pen)
    return penalties


def test_sentence_penalty_and_scores_match_reference(qwen2, tokenizer):
    policy = RecordingSkipKV(tokenizer=tokenizer, tau=TAU, buffer=8)
    cache, enc, trace = forced_run(
        qwen2, tokenizer, ["solve the following math problem", "wait"], policy, **CACHE
    )
    width = enc["input_ids"].shape[1]
    sentence_of = reference_sentences(trace, delimiter_ids(tokenizer))
    assert policy.sentence_of[:, : len(trace)].tolist() == [sentence_of, sentence_of]
    penalised = 0
    for ev in policy.events:
        fed = ev["num_generated"]
        # finished: sentences followed by the start of another one among the fed tokens
        num_finished = sentence_of[fed - 1] if fed else 0
        if num_finished < 2:
            continue
        pen = reference_penalty(ev, width, sentence_of[:fed], num_finished, TAU)
        batch, heads, slots = ev["positions"].shape
        want = ev["rkv"].double().clone()
        for b in range(batch):
            for h in range(heads):
                for k in range(slots):
                    gen = int(ev["positions"][b, h, k]) - width
                    if ev["positions"][b, h, k] >= 0 and gen >= 0 and sentence_of[gen] < num_finished:
                        want[b, h, k] -= pen[b][sentence_of[gen]]
                        penalised += pen[b][sentence_of[gen]] > 0
        torch.testing.assert_close(ev["scores"].double(), want, atol=1e-6, rtol=0)
        # whole redundant sentences go first: no penalised candidate kept while an unpenalised one goes
        candidate = ev["evictable"] & ~ev["forced"]
        hit = (ev["scores"] < ev["rkv"] - 1e-6) & candidate
        clean = ~hit & candidate
        assert not bool(((hit & ev["keep"]).any(-1) & (clean & ~ev["keep"]).any(-1)).any())
    assert penalised > 0, "the check is vacuous: no sentence was redundant"


def test_sentence_ranges_track_surviving_tokens_across_evictions(qwen2, tokenizer):
    policy = RecordingSkipKV(tokenizer=tokenizer, tau=TAU, buffer=8)
    cache, enc, trace = forced_run(
        qwen2, tokenizer, ["solve the following math problem", "wait"], policy, **CACHE
    )
    width = enc["input_ids"].shape[1]
    sentence_of = reference_sentences(trace, delimiter_ids(tokenizer))
    assert len(policy.events) >= 3 * qwen2.config.num_hidden_layers  # several evictions per layer
    for layer in cache.layers:
        store = layer.store
        begin, end = policy.sentence_cache_ranges(store)
        assert begin.shape[-1] == sentence_of[-1] + 1
        batch, heads, slots = store.positions.shape
        for b in range(batch):
            for h in range(heads):
                pos = store.positions[b, h].tolist()
                for s in range(begin.shape[-1]):
                    surviving = [
                        k for k in range(slots) if pos[k] >= width and sentence_of[pos[k] - width] == s
                    ]
                    if not surviving:
                        assert begin[b, h, s] == end[b, h, s] == -1
                        continue
                    lo, hi = int(begin[b, h, s]), int(end[b, h, s])
                    assert (lo, hi) == (min(surviving), max(surviving))
                    inside = [k for k in range(lo, hi + 1) if pos[k] >= 0]
                    assert inside == surviving  # the range holds exactly that sentence's surviving tokens
        assert int(store.evicted.sum()) > 0


def test_resident_bytes_count_the_sentence_bookkeeping(qwen2, tokenizer):
    """The policy's per-row sentence state is memory the cache holds: resident_bytes includes it."""
    policy = SkipKVPolicy(tokenizer=tokenizer, tau=TAU, buffer=8)
    cache, enc, trace = forced_run(
        qwen2, tokenizer, ["solve the following math problem", "wait"], policy, **CACHE
    )
    batch, generated = enc["input_ids"].shape[0], len(trace)
    state = policy.state_tensors()
    state_bytes = storage_bytes(state)  # views share storage: count each once, as the cache does
    cache_only = storage_bytes([cache.full_heads, *(t for layer in cache.layers for t in layer.tensors())])
    assert cache.resident_bytes() == cache_only + state_bytes
    assert state_bytes >= 2 * 8 * batch * generated  # sentence id + token id (int64) per generated token
    hidden = qwen2.config.hidden_size
    assert policy.sentence_sum.shape[::2] == (batch, hidden)  # a float sum per sentence, counted too
    policy.reset()
    assert policy.state_tensors() == []


def test_chunked_prefill_is_all_prompt(qwen2, tokenizer):
    prompts = ["solve the following math problem efficiently", "wait"]
    whole = SkipKVPolicy(tokenizer=tokenizer, tau=TAU, buffer=8)
    whole_cache, enc, trace = forced_run(qwen2, tokenizer, prompts, whole, **CACHE)
    chunked = SkipKVPolicy(tokenizer=tokenizer, tau=TAU, buffer=8)
    chunked_cache, _, _ = forced_run(qwen2, tokenizer, prompts, chunked, prefill_chunks=3, **CACHE)
    assert chunked.prompt_length == whole.prompt_length == enc["input_ids"].shape[1]
    assert chunked.sentence_of[:, : len(trace)].tolist() == whole.sentence_of[:, : len(trace)].tolist()
    torch.testing.assert_close(chunked.sentence_penalty(), whole.sentence_penalty(), atol=1e-5, rtol=1e-5)
    for row in range(len(prompts)):
        assert kept_positions(chunked_cache, row) == kept_positions(whole_cache, row)


def test_batch_rows_independent_with_sentences(qwen2, tokenizer):
    prompts = [
        "let x be 3 then x + 4 = 7",
        "solve the following math problem",
        "1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is boxed",
        "wait",
    ]
    batch_policy = SkipKVPolicy(tokenizer=tokenizer, tau=TAU, buffer=8)
    batch_cache, _, _ = forced_run(qwen2, tokenizer, prompts, batch_policy, **CACHE)
    for row, prompt in enumerate(prompts):
        alone_policy = SkipKVPolicy(tokenizer=tokenizer, tau=TAU, buffer=8)
        alone_cache, _, _ = forced_run(qwen2, tokenizer, [prompt], alone_policy, **CACHE)
        assert kept_positions(batch_cache, row) == kept_positions(alone_cache, 0)
        torch.testing.assert_close(batch_policy.sentence_penalty()[row], alone_policy.sentence_penalty()[0])
        assert alone_cache.stats()[0]["evictions"] > 0


def test_budget_above_sequence_is_plain_generation(family, make_model, tokenizer, left_padded_batch):
    ids, mask = left_padded_batch
    assert_no_eviction_is_identity(
        make_model(family), lambda: SkipKVPolicy(tokenizer=tokenizer, buffer=4), ids, mask, 20, budget=10_000
    )


def test_combined_mode_with_head_mask(qwen2, tokenizer, left_padded_batch):
    ids, mask = left_padded_batch
    policy = SkipKVPolicy(tokenizer=tokenizer, buffer=8)
    assert_combined_mode(qwen2, policy, ids, mask, 50, budget=24, sink=2, window=6)


def steering_file(tmp_path, model, layer=1, seed=0):
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return SteeringVector(vector=vector, layer=layer, model="tiny").save(tmp_path / "steer.json")


def test_adaptive_steering_adds_alpha_t_v_at_delimiters(qwen2, tokenizer, tmp_path):
    path = steering_file(tmp_path, qwen2)
    vector = SteeringVector.load(path).vector
    alpha0, gamma = 1.25, 0.5
    config = CompressionConfig(
        policy="skipkv",
        policy_kwargs={
            "tokenizer": tokenizer,
            "steering": str(path),
            "steering_alpha0": alpha0,
            "steering_gamma": gamma,
        },
        budget=10_000,
    )
    cache = make_cache(qwen2, config)
    layer = qwen2.model.layers[1]
    before, after = [], []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: before.append(o.clone()), prepend=True),
        layer.register_forward_hook(lambda m, a, o: after.append(o.clone())),
    ]
    enc = tokenizer(["solve the following math problem"], return_tensors="pt")
    trace = tokenizer(TRACE)["input_ids"]
    try:
        teacher_force(qwen2, cache, enc["input_ids"], enc["attention_mask"], torch.tensor([trace]))
    finally:
        for hook in hooks:
            hook.remove()
    delimiters = delimiter_ids(tokenizer)
    sentence_of = reference_sentences(trace, delimiters)
    texts = [
        tokenizer.decode([t for t, s in zip(trace, sentence_of) if s == i])
        for i in range(sentence_of[-1] + 1)
    ]
    non_exec = [any(k in text for k in ("Wait", "Alternatively", "again")) for text in texts]
    assert sum(non_exec) == 2
    torch.testing.assert_close(after[0], before[0])  # the prompt is not steered
    steered = 0
    for t, token in enumerate(trace):
        finished = sentence_of[t]  # sentences 0 .. sentence_of[t] - 1 are finished when token t enters
        alpha = alpha0 + gamma * sum(non_exec[:finished])
        expected = alpha * vector if token in delimiters else torch.zeros_like(vector)
        torch.testing.assert_close(after[t + 1] - before[t + 1], expected[None, None], atol=1e-5, rtol=1e-5)
        steered += token in delimiters and alpha > alpha0
    assert steered > 0
    assert cache.policy.non_execution.tolist() == [sum(non_exec[: sentence_of[-1]])]


def test_steering_changes_generation_only_when_configured(qwen2, tokenizer, tmp_path, left_padded_batch):
    ids, mask = left_padded_batch
    path = steering_file(tmp_path, qwen2, layer=0)
    plain = make_cache(
        qwen2, CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": tokenizer}, budget=4096)
    )
    out_plain = qwen2.generate(
        input_ids=ids, attention_mask=mask, **cache_kwargs(plain), max_new_tokens=8, do_sample=False
    )
    # the steering hook stays on the model; a cache whose policy has no steering is not affected
    make_cache(
        qwen2, CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": tokenizer, "steering": path})
    )
    again = make_cache(
        qwen2, CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": tokenizer}, budget=4096)
    )
    out_again = qwen2.generate(
        input_ids=ids, attention_mask=mask, **cache_kwargs(again), max_new_tokens=8, do_sample=False
    )
    assert out_plain.tolist() == out_again.tolist()


def reference_steering_vector(model, tokenizer, texts, layer):
    """mean over execution sentences minus mean over non-execution ones of their mean layer output
    (hidden_states[layer + 1]: the decoder layer's output, for any layer but the last, which HF normalises)."""
    delimiters = delimiter_ids(tokenizer)
    groups = {True: [], False: []}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[layer + 1][
                0
            ]
        sentence_of = reference_sentences(ids, delimiters)
        for s in range(sentence_of[-1] + 1):
            tokens = [i for i, sid in enumerate(sentence_of) if sid == s]
            text_s = tokenizer.decode([ids[i] for i in tokens])
            groups[any(k in text_s for k in ("Wait", "Alternatively", "again"))].append(
                hidden[tokens].mean(0)
            )
    return (
        torch.stack(groups[False]).mean(0) - torch.stack(groups[True]).mean(0),
        len(groups[False]),
        len(groups[True]),
    )


def test_compute_steering_vector_matches_reference(qwen2, tokenizer):
    texts = [TRACE, "Wait, 1 + 2 = 3.\n\n2 * 3 = 6.\n"]
    got = compute_steering_vector(qwen2, tokenizer, texts, layer=0)
    want, num_exec, num_non = reference_steering_vector(qwen2, tokenizer, texts, layer=0)
    torch.testing.assert_close(got.vector, want, atol=1e-5, rtol=1e-5)
    assert (got.layer, got.num_execution, got.num_non_execution) == (0, num_exec, num_non)
    with pytest.raises(SteeringError, match="non-execution"):
        compute_steering_vector(qwen2, tokenizer, ["1 + 2 = 3.\n"], layer=0)


def test_steering_cli_writes_the_vector(qwen2, tokenizer, tmp_path):
    from rlkv.cli import main

    qwen2.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "traces.jsonl"
    data.write_text(
        "\n".join(json.dumps({"response": t}) for t in (TRACE, "Wait, 2 * 3 = 6.\nso 6.\n")) + "\n"
    )
    out = tmp_path / "vec.json"
    args = ["steering", "compute", "--model", str(tmp_path / "model"), "--data", str(data)]
    assert main([*args, "--field", "response", "--layer", "0", "--out", str(out), "--dtype", "float32"]) == 0
    saved = SteeringVector.load(out)
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "model")  # what the command tokenises with
    want, _, _ = reference_steering_vector(qwen2, reloaded, [TRACE, "Wait, 2 * 3 = 6.\nso 6.\n"], layer=0)
    torch.testing.assert_close(saved.vector, want, atol=1e-5, rtol=1e-5)
    assert main([*args, "--layer", "1", "--out", str(out)]) == 2  # no "text" field: a clear error, exit 2


def test_steering_file_validation(qwen2, tmp_path, make_model):
    path = steering_file(tmp_path, qwen2)
    bad = tmp_path / "bad.json"
    payload = json.loads(path.read_text())
    for field, value, message in (
        ("vector", [1.0, float("nan")], "non-finite"),
        ("layer", -1, "layer"),
        ("format", "other", "not an rlkv steering vector"),
    ):
        bad.write_text(json.dumps({**payload, field: value}))
        with pytest.raises(SteeringError, match=message):
            SteeringVector.load(bad)
    wide = make_model("qwen2", hidden_size=32, head_dim=8)
    with pytest.raises(SteeringError, match="hidden_size"):
        SteeringVector.load(path).check_compatible(wide)
    with pytest.raises(SteeringError, match="does not exist"):
        SteeringVector(vector=torch.zeros(64), layer=5).check_compatible(qwen2)


def test_policy_needs_a_tokenizer_and_checks_kwargs(tokenizer):
    with pytest.raises(ValueError, match="tokenizer"):
        SkipKVPolicy()
    policy = SkipKVPolicy(tokenizer=tokenizer, tau=0.97, lam=0.05)
    assert (policy.tau, policy.lam, policy.buffer, policy.observe_queries) == (0.97, 0.05, 128, 8)
    assert (policy.observe_tokens, policy.observe_hidden_states) == (True, True)
    with pytest.raises(ValueError, match="tau"):
        SkipKVPolicy(tokenizer=tokenizer, tau=0.0)
