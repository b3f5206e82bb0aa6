"""Where a learner's partitions land in the syncer's parts (``decoupled/layout.py``): every element of the model
goes to the one place the syncer's cut gives it, from a learner of any size, and comes back; padding is zero.
Checked against parts cut straight from the whole model, for random group sizes, learner and syncer sizes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds.runtime.outer.decoupled.layout import Parts, Relayout, moves, part_width


def cut(model: torch.Tensor, parts: Parts) -> list:
    """Each part of ``parts`` read straight from the whole model (groups end to end), zero padded."""
    out, start = [], 0
    groups = []
    for n in parts.sizes:
        groups.append(model[start:start + n])
        start += n
    for p in range(parts.count):
        pieces = []
        for g, w in zip(groups, parts.widths):
            piece = torch.zeros(w, dtype=model.dtype)
            got = g[p * w:(p + 1) * w]
            piece[:got.numel()] = got
            pieces.append(piece)
        out.append(torch.cat(pieces))
    return out


def test_the_width_is_deepspeeds_zero1_partition():
    """A group padded to a multiple of 2 x ranks (DeepSpeed's ``nccl_start_alignment_factor`` 2), split evenly."""
    assert [part_width(n, 2) for n in (1, 4, 5, 8, 9)] == [2, 2, 4, 4, 6]
    assert part_width(10, 3) == 4 and part_width(0, 3) == 0


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4), k=st.integers(1, 4), s=st.integers(1, 5))
def test_every_element_moves_to_its_place_in_the_syncers_cut(sizes, k, s):
    model = torch.arange(1, sum(sizes) + 1, dtype=torch.float64)
    mine, syncer = Parts.syncer(sizes, k), Parts.syncer(sizes, s)
    src, want = cut(model, mine), cut(model, syncer)
    got = [torch.zeros(syncer.numel, dtype=model.dtype) for _ in range(s)]
    for p, so, i, do, n in moves(mine, syncer):
        assert torch.count_nonzero(got[i][do:do + n]) == 0, "an element was written twice"
        got[i][do:do + n] = src[p][so:so + n]
    for i in range(s):
        assert torch.equal(got[i], want[i]), (sizes, k, s, i)
    back = [torch.zeros(mine.numel, dtype=model.dtype) for _ in range(k)]
    for p, so, i, do, n in moves(mine, syncer):
        back[p][so:so + n] = got[i][do:do + n]
    for p in range(k):
        assert torch.equal(back[p], src[p])


@pytest.mark.parametrize("s", [1, 2, 3])
def test_a_learner_of_one_rank_holds_every_part_and_gets_its_model_back(s):
    sizes = (7, 12, 1)
    model = torch.randn(sum(sizes))
    mine = Parts.syncer(sizes, 1)
    flat = cut(model, mine)[0]
    r = Relayout(mine, Parts.syncer(sizes, s), 0)
    assert r.owned == list(range(s)) and r.same == (s == 1)
    slices = r.to_syncer(flat)
    assert all(torch.equal(a, b) for a, b in zip(slices, cut(model, Parts.syncer(sizes, s))))
    assert torch.equal(r.from_syncer(slices), flat)


def test_two_models_with_other_groups_are_not_mapped():
    with pytest.raises(ValueError, match=r"groups of \[4, 4\] elements cannot be laid out as groups of \[8\]"):
        moves(Parts.syncer([4, 4], 2), Parts.syncer([8], 2))
