"""Model hooks that feed a head-mixed cache's policy what it observes besides attention.

The dynamic cache's policy gets token ids before the forward and final hidden states after it. The
static cache (rlkv/cache/static/cache.py) gets them through its eager host bookkeeping: the pre-hook runs
it in a direct forward (`generate` runs it from the step hook), and the norm hook only copies the
last hidden state into the cache's fixed buffer, the one op it adds to a compiled step.

`install_observers(model)` adds a forward pre-hook and hook on the model and a forward hook on its
decoder's final norm; `uninstall_observers(model)` removes exactly those hooks (and nothing else
registered on the model). `observing(model)` is the scoped form. See docs/design.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlkv.cache.layer import PolicyCache
from rlkv.cache.static import StaticHeadMixedCache
from rlkv.compat import forward_cache


def install_observers(model: torch.nn.Module) -> None:
    """Forward hooks feeding token ids and final-norm hidden states to the policy of the head-mixed cache
    (dynamic or static) a forward uses (only policies that declare `observe_tokens` /
    `observe_hidden_states`). Idempotent.

    The hooks sit on the model (pre/post) and on its decoder's final norm; a forward without a
    head-mixed cache passes through untouched.
    """
    if getattr(model, "_rlkv_observer_hooks", None):
        return
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    norm = getattr(decoder, "norm", None)
    active: dict[str, PolicyCache] = {}

    def before_forward(module, args, kwargs):
        active.clear()
        cache = forward_cache(kwargs)
        if not isinstance(cache, PolicyCache):
            return
        active["cache"] = cache
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(cache, StaticHeadMixedCache):
            if not torch.compiler.is_compiling() and not cache.begun:  # a direct forward
                q_len = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
                cache.before_forward(q_len, ids)
            return
        if cache.policy.observe_tokens and ids is not None:
            start = cache.get_seq_length()
            cache.policy.on_tokens(ids, torch.arange(start, start + ids.shape[1], device=ids.device))

    def after_norm(module, args, output):
        cache = active.get("cache")
        if isinstance(cache, StaticHeadMixedCache):
            if cache.policy.observe_hidden_states:
                cache.stash_hidden(output)
        elif cache is not None and cache.policy.observe_hidden_states:
            end = cache.get_seq_length()  # every layer has stored this forward's tokens by now
            cache.policy.on_hidden_states(
                output, torch.arange(end - output.shape[1], end, device=output.device)
            )

    def after_forward(module, args, kwargs, output):
        active.clear()

    handles = [
        model.register_forward_pre_hook(before_forward, with_kwargs=True),
        model.register_forward_hook(after_forward, with_kwargs=True),
    ]
    if norm is not None:
        handles.append(norm.register_forward_hook(after_norm))
    model._rlkv_observer_hooks = handles
    model._rlkv_observes_hidden_states = norm is not None


def uninstall_observers(model: torch.nn.Module) -> None:
    """Remove the hooks `install_observers` added to `model` (no-op when there are none)."""
    for handle in getattr(model, "_rlkv_observer_hooks", None) or []:
        handle.remove()
    for name in ("_rlkv_observer_hooks", "_rlkv_observes_hidden_states"):
        if hasattr(model, name):
            delattr(model, name)


@contextlib.contextmanager
def observing(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Context: the observer hooks installed for its duration; hooks that were there before stay."""
    had = bool(getattr(model, "_rlkv_observer_hooks", None))
    install_observers(model)
    try:
        yield model
    finally:
        if not had:
            uninstall_observers(model)
