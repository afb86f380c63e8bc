"""Every registered policy passes the shared properties (tests/policy_properties.py), and every
registered policy has a matrix row (tests/policy_matrix.py) and a row in the policy table of
docs/guides/policies.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from policy_matrix import POLICY_MATRIX
from policy_properties import assert_no_eviction_is_identity, assert_rows_independent

from rlkv.policies import available, get_policy, get_policy_class

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)

ROOT = Path(__file__).resolve().parents[1]
POLICY_GUIDE = ROOT / "docs" / "guides" / "policies.md"
END_OF_POLICY_TABLE = "<!-- policy rows"


def guide_policy_names() -> list[str]:
    """Names in the first column of the policy guide's table (the rows above its end marker)."""
    text = POLICY_GUIDE.read_text()
    table = text[: text.index(END_OF_POLICY_TABLE)].rsplit("| name | paper |", 1)[1]
    return re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)


def shipped_policies() -> list[str]:
    """Every policy `rlkv.policies.available()` lists from the package itself (test modules register
    their own helper policies too)."""
    return [name for name in available() if get_policy_class(name).__module__.startswith("rlkv.")]


def test_every_registered_policy_is_in_the_matrix():
    assert sorted(POLICY_MATRIX) == shipped_policies()


def test_every_registered_policy_is_in_the_policy_guide_table():
    assert sorted(guide_policy_names()) == shipped_policies()


def check_property(check, name, make_model, tokenizer, batch, new_tokens, cache_kwargs) -> None:
    """Run a shared property of tests/policy_properties.py for the policy `name` on a tiny Qwen2."""
    ids, mask = batch
    make_policy = lambda: get_policy(name, **POLICY_MATRIX[name].kwargs(tokenizer))  # noqa: E731
    check(make_model("qwen2"), make_policy, ids, mask, new_tokens, **cache_kwargs)


@pytest.mark.parametrize("name", sorted(POLICY_MATRIX))
def test_budget_above_sequence_is_plain_generation(name, make_model, tokenizer, left_padded_batch):
    entry = POLICY_MATRIX[name]
    check_property(
        assert_no_eviction_is_identity,
        name,
        make_model,
        tokenizer,
        left_padded_batch,
        entry.identity_tokens,
        entry.identity,
    )


@pytest.mark.parametrize("name", sorted(n for n, e in POLICY_MATRIX.items() if e.evicting is not None))
def test_batch_rows_are_compressed_as_alone(name, make_model, tokenizer, left_padded_batch):
    entry = POLICY_MATRIX[name]
    check_property(
        assert_rows_independent,
        name,
        make_model,
        tokenizer,
        left_padded_batch,
        entry.evicting_tokens,
        entry.evicting,
    )


def test_contributing_shows_the_shipped_example_policy():
    """CONTRIBUTING.md's worked example is rlkv/policies/knorm.py verbatim (< 50 lines), which the
    matrix above runs like every other policy."""
    import rlkv.policies.knorm as example

    listing = (ROOT / "CONTRIBUTING.md").read_text().split("```python\n")[1].split("```")[0]
    assert listing == Path(example.__file__).read_text()
    assert len(listing.splitlines()) < 50
    assert "knorm" in POLICY_MATRIX and "knorm" in guide_policy_names()
