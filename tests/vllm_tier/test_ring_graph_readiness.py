"""The ring's metadata is CUDA-graph-ready (issue 87, item 3), checked on the CPU.

Two properties a captured decode graph needs from a metadata builder, asserted on the ring builder of a real
in-process engine (eval and protected layouts), over the steps of staggered requests (decode-only steps and
steps mixing a prompt with generated tokens); the second also on the eviction group's builder on vLLM's kernel,
whose one host read left is each request's first block (its schedule is host ints):

- no host read of a device tensor: each recorded step is replayed through the builder with vLLM's device fields
  (query starts, lengths, block table, slot mapping, positions) and the builder's own buffers on torch's `meta`
  device, whose tensors hold no data: a read of one on the host (`.tolist()`, `.item()`, `bool()`, a copy to
  the host) or an op mixing it with a host tensor raises, as a read would sync and a mix would fail on a GPU;
- fixed addresses: every tensor the kernel reads (lengths, block table, write slots) is a view of a persistent
  buffer, vLLM's or the builder's, at the same address in every decode-only step of one batch size.
"""

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm_engines import demo_chain, engine, model_runner  # noqa: E402

from rlkv.inference.vllm import compression_overrides, vllm_compression  # noqa: E402

DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions")
HOST_FIELDS = ("query_start_loc_cpu", "is_prefilling", "seq_lens_cpu_upper_bound")


@pytest.fixture(scope="module")
def demo():
    return demo_chain(6)


def _builders(llm, kind: str) -> list:
    builders = [
        b
        for groups in model_runner(llm).attn_groups
        for group in groups
        for b in group.metadata_builders
        if type(b).__name__ == kind
    ]
    assert builders, f"no {kind} in this engine"
    return builders


def _record(builder, steps: list) -> None:
    """Record each step the builder reads: its metadata (host fields copied: vLLM reuses their buffers) and
    the addresses of what it hands the kernel."""
    read_metadata = builder.read_metadata

    def recording(m, *rest):
        if rest:  # the eviction builder: the kernel's metadata, no ring
            read = read_metadata(m, *rest)
            ring = prompt = read.slot_mapping if rest[0].decode_tokens is not None else None
        else:
            read, ring, prompt = read_metadata(m)
        host = {name: getattr(m, name).clone() for name in HOST_FIELDS}
        steps.append(
            {
                "metadata": dataclasses.replace(m, **host),
                "decode_only": (prompt is None or rest)
                and not bool(host["is_prefilling"][: m.num_reqs].any()),
                "reqs": m.num_reqs,
                "kernel_reads": {
                    "seq_lens": read.seq_lens,
                    "block_table": read.block_table_tensor,
                    "slot_mapping": read.slot_mapping,
                    **({"ring_slots": ring} if ring is not None else {}),
                },
                "addresses": {
                    "seq_lens": read.seq_lens.data_ptr(),
                    "block_table": read.block_table_tensor.data_ptr(),
                    "slot_mapping": read.slot_mapping.data_ptr(),
                },
                "vllm_storages": {
                    getattr(m, name).untyped_storage().data_ptr()
                    for name in ("seq_lens", "block_table_tensor", "slot_mapping")
                },
            }
        )
        return read if rest else (read, ring, prompt)

    builder.read_metadata = recording  # this engine's builder object only


def _staggered_steps(llm, prompts) -> None:
    """Requests arriving one per few steps, so that steps mix a prompt with generated tokens, then decode-only
    steps of a fixed batch."""
    import vllm

    core = llm.llm_engine
    params = vllm.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
        for _ in range(3):
            core.step()
    while core.has_unfinished_requests():
        core.step()


def _on_meta(builder):
    """A copy of the builder whose own tensors (its persistent buffers too) live on the `meta` device."""

    def moved(holder):
        copied = copy.copy(holder)
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                setattr(copied, name, value.to("meta"))
        return copied

    probe = moved(builder)
    probe.__dict__.pop("read_metadata", None)  # the recording wrapper reads through the real builder
    probe.persistent = moved(builder.persistent)
    probe.ring_slots = probe.persistent.write_slots
    return probe


@pytest.mark.parametrize("protect_prompt", [False, True], ids=["eval-form", "protected"])
def test_the_ring_builder_reads_no_device_tensor_and_hands_the_kernel_fixed_addresses(demo, protect_prompt):
    model, _, _, prompts, mask = demo
    config = vllm_compression(mask, 0.5, sink=16, window=64, protect_prompt=protect_prompt)
    overrides = compression_overrides(model.config, config)
    steps: list = []
    with engine(hf_overrides=overrides, max_num_seqs=8) as llm:
        builders = _builders(llm, "CpuRingBuilder")
        _record(builders[0], steps)
        _staggered_steps(llm, prompts)
        persistent = builders[0].persistent.storages()
        probe = _on_meta(builders[0])
        for step in steps:  # the meta replay: a host read of a device tensor raises
            m = step["metadata"]
            meta = dataclasses.replace(m, **{name: getattr(m, name).to("meta") for name in DEVICE_FIELDS})
            read, ring, _ = probe.read_metadata(meta)
            assert {read.seq_lens.device.type, read.block_table_tensor.device.type, ring.device.type} == {
                "meta"
            }
    _check_addresses(steps, persistent, len(prompts))


def _check_addresses(steps: list, persistent: set[int], batch: int) -> None:
    mixed = [s for s in steps if not s["decode_only"]]
    decode = [s for s in steps if s["decode_only"] and s["reqs"] == batch]
    assert mixed and len(decode) >= 10, (len(mixed), len(decode))
    for step in steps:  # every tensor the kernel reads is a view of a persistent buffer
        for name, tensor in step["kernel_reads"].items():
            storage = tensor.untyped_storage().data_ptr()
            assert storage in persistent | step["vllm_storages"], name
    for name in decode[0]["addresses"]:  # ... at one address in every decode step of the batch
        assert len({s["addresses"][name] for s in decode}) == 1, name


def test_the_eviction_builder_on_vllms_kernel_hands_it_fixed_addresses(demo):
    """The eviction group on vLLM's kernel (rlkv+rkv at s=0.5, R-KV's serving buffer): the read table, lengths and
    write slots of its steps lie in persistent buffers, at one address over a batch's decode steps."""
    from rlkv.eval.methods import method_config

    model, _, _, prompts, mask = demo
    config = method_config(
        "rlkv+rkv", 0.5, model=model, masks={"rlkv": mask}, policy_kwargs={"rkv": {"buffer": 8}}
    )
    steps: list = []
    with engine(hf_overrides=compression_overrides(model.config, config), max_num_seqs=8) as llm:
        builder = _builders(llm, "CpuEvictionBuilder")[0]
        _record(builder, steps)
        _staggered_steps(llm, prompts)
        persistent = builder.persistent.storages()
        assert builder.compactions > 0  # compactions ran among the recorded steps
    _check_addresses(steps, persistent, len(prompts))
