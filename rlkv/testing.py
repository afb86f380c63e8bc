"""Tiny random models and an offline tokenizer, for tests, demos and smoke runs (no network).

`tiny_model(family)` builds a randomly initialised causal LM of a real architecture
(Llama, Qwen2, Qwen3, Mistral) with grouped-query attention; `tiny_tokenizer()` trains a
small byte-level BPE tokenizer from an in-memory corpus and gives it a ChatML chat template.
`HostSyncCounter` counts, on any device, the tensor operations that would make the host wait for
a GPU (tests/test_host_syncs.py: none in a decode step).
"""

from __future__ import annotations

import collections
import functools
import string
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from rlkv.compat import torch_dispatch_mode

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus() -> list[str]:
    words = (
        "solve the following math problem efficiently and clearly think step by step before answering "
        "therefore final answer is boxed i hope it is correct let x y z be numbers if then so we have "
        "wait alternatively again compute sum product total each apples cost how many more than"
    ).split()
    lines = [" ".join(words[i : i + 9]) for i in range(0, len(words), 3)]
    lines += [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a in range(30) for b in range(0, 30, 7)]
    lines += ["\\boxed{" + str(n) + "} $\\frac{1}{2}$ (x) [y] {z}\n\n" for n in range(50)]
    lines.append(string.printable)
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline on a small built-in corpus (ChatML template, left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(family: str = "llama", **overrides):
    """Config of a tiny GQA model (2 layers, 4 query heads, 2 KV heads, head_dim 16) of `family`."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {FAMILIES}")
    tok = tiny_tokenizer()
    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    config.name_or_path = f"rlkv-tiny-{family}"
    return config


def tiny_model(
    family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (fp32, eval mode) of the given family."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    # Larger-than-default init so attention patterns are peaked and tests discriminate between methods.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.3)
    model.name_or_path = config.name_or_path
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()


# Host reads: aten ops that make the host wait for the device on CUDA (a value read back, or an
# output whose size depends on the data). On CPU they are free, so a test counts them to prove a
# decode step would not stall a GPU.
_SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), int(t), float(t), bool(t), `if t:`
        "aten::equal",
        "aten::is_nonzero",
        "aten::nonzero",  # nonzero_static is not here: its size is given
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::histc",
        "aten::bincount",
    }
)
# Python-level reads, patched while counting: under `torch.inference_mode` a CPU `.item()` never
# reaches the dispatcher, so the aten op alone would miss it.
_HOST_READ_METHODS = ("item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__")


class HostSyncCounter(torch_dispatch_mode()):
    """Counts the tensor operations that would block the host on the device on CUDA, on any device.

    Counted: reading a value back (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.numpy()`), ops
    whose output size depends on the data (`nonzero`, boolean-mask indexing, `masked_select`,
    `unique`, `repeat_interleave` without `output_size`), `torch.equal`, and device-to-host copies.
    Use as a context manager: `with HostSyncCounter() as syncs: ...; syncs.count`; `syncs.ops`
    names what was counted (op name -> count). Not thread-safe (it patches `Tensor.tolist` & co.
    while active).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}
        self._reading = 0  # > 0 inside a patched read: its own aten ops are that one read

    @property
    def count(self) -> int:
        """Host syncs counted so far."""
        return sum(self.ops.values())

    def __enter__(self) -> HostSyncCounter:
        for name in _HOST_READ_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def _counting(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._reading:
                self.ops[f"Tensor.{name}"] += 1
            self._reading += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._reading -= 1

        return read

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if not self._reading and (name in _SYNC_OPS or _is_sync(name, args, kwargs)):
            self.ops[name] += 1
        return func(*args, **kwargs)


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """The ops that sync only for some arguments: boolean-mask indexing, repeat_interleave without
    `output_size`, a copy from a device to the host."""
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
    if name == "aten::repeat_interleave":
        repeats = args[1] if len(args) > 1 else args[0]  # .Tensor(repeats) / .self_Tensor / .self_int
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("aten::_to_copy", "aten::copy_"):
        if name == "aten::copy_":
            dst, src = args[0], args[1]
            return src.device.type != "cpu" and dst.device.type == "cpu"
        device = kwargs.get("device")
        return args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    return False


def graph_counting_compile(backend: str | None = None) -> tuple[Any, list]:
    """(CompileConfig, graphs) for a test of transformers' compiled decode on any device: fullgraph,
    static shapes, and a backend that records each graph dynamo captures (run eagerly, so the
    compiled tokens equal the eager ones exactly) in `graphs`; `backend` names a torch backend
    instead (nothing recorded). Pair with `torch._dynamo.config.patch(error_on_recompile=True)`."""
    from transformers import CompileConfig

    graphs: list = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend or record, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only by default
    return config, graphs
