"""The observer hooks of rlkv.cache.hooks: installed once, removed exactly (scoped with `observing`)."""

from rlkv.cache import install_observers, observing, uninstall_observers


def hook_counts(model) -> tuple[int, int, int]:
    norm = model.get_decoder().norm
    return len(model._forward_pre_hooks), len(model._forward_hooks), len(norm._forward_hooks)


def test_install_is_idempotent_and_uninstall_removes_only_its_hooks(make_model):
    model = make_model("qwen2")
    other = model.register_forward_hook(lambda *args: None)  # someone else's hook stays
    before = hook_counts(model)
    install_observers(model)
    install_observers(model)
    assert hook_counts(model) == (before[0] + 1, before[1] + 1, before[2] + 1)
    assert model._rlkv_observes_hidden_states
    uninstall_observers(model)
    assert hook_counts(model) == before and not hasattr(model, "_rlkv_observer_hooks")
    uninstall_observers(model)  # nothing installed: a no-op
    assert hook_counts(model) == before
    other.remove()


def test_observing_is_scoped_and_keeps_hooks_that_were_there(make_model):
    model = make_model("qwen2")
    before = hook_counts(model)
    with observing(model):
        assert hook_counts(model) != before
    assert hook_counts(model) == before
    install_observers(model)
    installed = hook_counts(model)
    with observing(model):
        pass
    assert hook_counts(model) == installed  # installed before the block: still there after it
