"""What the plugin reads of vLLM beyond its plugin surface is checked, not assumed (issue 88, item 3 in part):
each per-step metadata field the compressed groups' builders read is declared by vLLM's
`CommonAttentionMetadata` (checked at a head-mixed engine's start), and a step whose metadata lacks one is
refused in one line naming vLLM's version and the field, never served in another form."""

import dataclasses
import logging
import os

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

import torch  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from rlkv.vllm_plugin import fence  # noqa: E402


def _step() -> CommonAttentionMetadata:
    """vLLM's metadata of a step of two requests: a 3-token prompt chunk and one decode token."""
    starts = torch.tensor([0, 3, 4], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=4,
        max_query_len=3,
        max_seq_len=9,
        block_table_tensor=torch.tensor([[1], [2]], dtype=torch.int32),
        slot_mapping=torch.tensor([32, 33, 34, 72]),
        positions=torch.tensor([0, 1, 2, 8]),
        is_prefilling=torch.tensor([True, False]),
        seq_lens_cpu_upper_bound=torch.tensor([3, 9], dtype=torch.int32),
    )


def test_every_field_read_is_declared_by_this_vllm():
    declared = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert set(fence.STEP_FIELDS) <= declared
    fence.check_step_fields()  # the tested version: no refusal


def test_the_step_inputs_are_vllms_host_flags_lengths_and_positions():
    prefilling, upper, positions = fence.step_inputs(_step())
    assert prefilling.tolist() == [True, False] and upper.tolist() == [3, 9]
    assert positions.tolist() == [0, 1, 2, 8]


@pytest.mark.parametrize("field", ["is_prefilling", "seq_lens_cpu_upper_bound", "positions"])
def test_a_step_without_a_field_is_refused_in_one_line(field):
    with pytest.raises(
        fence.VllmApiError, match=rf"vLLM \S+'s model runner passed no {field} to the attention"
    ) as e:
        fence.step_inputs(dataclasses.replace(_step(), **{field: None}))
    assert "\n" not in str(e.value) and "VLLM_USE_V2_MODEL_RUNNER=0" in str(e.value)


def test_another_vllm_version_is_named_in_one_warning(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    logger = logging.getLogger("vllm.rlkv")
    monkeypatch.setattr(logger, "disabled", False)
    with caplog.at_level(logging.WARNING, logger="vllm.rlkv"):
        fence.check_step_fields()
    assert any("vLLM 0.33.0 is not the version" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("field", sorted(fence.STEP_FIELDS))
def test_a_vllm_whose_metadata_lacks_a_field_is_refused_at_engine_start(field):
    """A copy of vLLM's metadata class without `field` (a vLLM that dropped or renamed it)."""
    kept = [(f.name, f.type, f) for f in dataclasses.fields(CommonAttentionMetadata) if f.name != field]
    changed = dataclasses.make_dataclass("CommonAttentionMetadata", kept)
    with pytest.raises(
        fence.VllmApiError, match=rf"CommonAttentionMetadata has no {field}: rlkv's compressed heads"
    ):
        fence.check_step_fields(changed)


@pytest.mark.parametrize("chosen", [None, "1"])
def test_rlkvs_engines_run_vllms_v1_model_runner_unless_the_user_chose(monkeypatch, chosen):
    """vLLM's model runner V2 (its default on CUDA with Triton; vLLM's CPU install cannot start it) passes no
    `is_prefilling` or `positions`: rlkv's engines ask for V1 where the user did not choose."""
    from rlkv.inference.vllm_engine import import_vllm

    if chosen is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", chosen)
    import_vllm()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == (chosen or "0")


def test_every_vllm_name_the_plugin_uses_resolves_in_this_vllm():
    fence.check_vllm_api()  # imports, private members, overridden methods' parameters, step fields


@pytest.mark.parametrize(
    "listed, says",
    [
        ("VLLM_IMPORTS", r"vLLM \S+ has no vllm\.v1\.core\.sched\.scheduler\.Gone, which rlkv's plugin uses"),
        ("VLLM_PRIVATE_MEMBERS", r"has no vllm\.v1\.core\.sched\.scheduler\.Gone, which rlkv's plugin uses"),
    ],
    ids=["import", "private-member"],
)
def test_a_vllm_without_a_name_the_plugin_uses_is_refused_in_one_line(monkeypatch, listed, says):
    """A vLLM that dropped or moved a name (here one listed beside the real ones)."""
    monkeypatch.setattr(fence, listed, (*getattr(fence, listed), "vllm.v1.core.sched.scheduler:Gone"))
    with pytest.raises(fence.VllmApiError, match=says) as e:
        fence.check_vllm_api()
    assert "\n" not in str(e.value)


def test_a_vllm_whose_manager_lost_a_parameter_rlkv_overrides_is_refused(monkeypatch):
    method = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.get_num_blocks_to_allocate"
    monkeypatch.setitem(fence.VLLM_PARAMETERS, method, (*fence.VLLM_PARAMETERS[method], "prefill_start"))
    with pytest.raises(fence.VllmApiError, match=r"get_num_blocks_to_allocate takes no prefill_start"):
        fence.check_vllm_api()
