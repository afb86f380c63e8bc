"""Head split helpers: the slice path equals the gather path bitwise, for every layout of 4 KV heads."""

import itertools

import pytest
import torch

from rlkv.cache.head_index import head_indices, merge_heads, pick_heads


@pytest.mark.parametrize("layout", list(itertools.product([False, True], repeat=4))[1:-1])
@pytest.mark.parametrize("groups", [1, 3])
def test_pick_and_merge_equal_the_gather_path(layout, groups):
    full = torch.tensor(layout)
    t = torch.randn(2, 4 * groups, 5, 8)
    full_idx, full_slice = head_indices(full, groups)
    comp_idx, comp_slice = head_indices(~full, groups)
    kv = torch.nonzero(full, as_tuple=True)[0]
    assert full_idx.tolist() == [h * groups + g for h in kv.tolist() for g in range(groups)]
    contiguous = kv.tolist() == list(range(kv[0], kv[-1] + 1))
    assert (full_slice is not None) == contiguous
    a, b = pick_heads(t, full_idx, full_slice), pick_heads(t, comp_idx, comp_slice)
    assert torch.equal(a, t.index_select(1, full_idx)) and torch.equal(b, t.index_select(1, comp_idx))
    if full_slice is not None:
        assert a.data_ptr() == t[:, full_slice].data_ptr()  # a view, no copy
    out = merge_heads(a.transpose(1, 2), b.transpose(1, 2), full_idx, full_slice, comp_idx, comp_slice)
    assert torch.equal(out, t.transpose(1, 2))


def test_every_head_is_the_tensor_itself():
    t = torch.randn(1, 4, 3, 2)
    idx, sl = head_indices(torch.ones(4, dtype=torch.bool))
    assert pick_heads(t, idx, sl) is t
