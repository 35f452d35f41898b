"""Random-k's subsets of small tensors (``thinwire.compress.shared_subsets``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.compress import shared_subsets
from thinwire.compress.shared_subsets import SharedSubsets


def _parts(indices: torch.Tensor, sizes: list[int], ks: list[int]) -> list[torch.Tensor]:
    """Each tensor's kept positions, in its own numbering."""
    parts, start, offset = [], 0, 0
    for n, k in zip(sizes, ks, strict=True):
        parts.append(indices[start : start + k] - offset)
        start, offset = start + k, offset + n
    assert start == indices.numel()
    return parts


@settings(max_examples=60, deadline=None)
@given(
    tensors=st.lists(
        st.integers(1, 3000).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**64 - 1),
)
def test_each_tensor_keeps_k_distinct_sorted_positions_of_its_own(tensors, seed) -> None:
    sizes, ks = [n for n, _ in tensors], [k for _, k in tensors]
    seeds = [(seed + 7 * i) % 2**64 for i in range(len(sizes))]
    for n, k, part in zip(sizes, ks, _parts(SharedSubsets(sizes, ks).pick(seeds), sizes, ks)):
        assert part.numel() == k
        assert bool((part[1:] > part[:-1]).all())  # sorted, distinct
        assert int(part[0]) >= 0 and int(part[-1]) < n


def test_a_tensors_subset_is_its_own_alone_or_in_any_layout() -> None:
    alone = [SharedSubsets([n], [k]).pick([s]) for n, k, s in [(200, 20, 11), (90, 9, 5)]]
    for sizes, ks, seeds, order in [
        ([200, 90], [20, 9], [11, 5], [0, 1]),
        ([90, 50, 200], [9, 3, 20], [5, 3, 11], [1, None, 0]),
    ]:
        parts = _parts(SharedSubsets(sizes, ks).pick(seeds), sizes, ks)
        for part, which in zip(parts, order, strict=True):
            if which is not None:
                assert torch.equal(part, alone[which])


def test_too_few_draws_are_topped_up_to_the_same_subset(monkeypatch) -> None:
    """A tensor whose draws gave fewer than k distinct positions draws more; its first
    draws stay the same, so the subset is the one ample draws give."""
    sizes, ks, seeds = [100, 40, 7], [30, 39, 7], [1, 2, 3]
    ample = SharedSubsets(sizes, ks).pick(seeds)
    monkeypatch.setattr(shared_subsets, "draws_needed", lambda n, k: 0 if k >= n else 2)
    assert torch.equal(SharedSubsets(sizes, ks).pick(seeds), ample)


def test_every_entry_is_kept_k_of_n_of_the_time() -> None:
    """Uniform: over many seeds each of n entries is kept about k/n of the time (six
    binomial standard deviations), and pairs of entries as often as any other pair."""
    n, k, draws = 40, 8, 6000
    layout = SharedSubsets([n], [k])
    kept = torch.zeros(n)
    together = torch.zeros(n, n)
    for seed in range(draws):
        chosen = layout.pick([seed * 0x9E3779B1 + 17])
        kept[chosen] += 1
        mask = torch.zeros(n)
        mask[chosen] = 1
        together += mask[:, None] * mask[None, :]
    p = k / n
    assert bool(((kept / draws - p).abs() < 6 * (p * (1 - p) / draws) ** 0.5).all())
    pair = k * (k - 1) / (n * (n - 1))
    off = together[~torch.eye(n, dtype=torch.bool)] / draws
    assert bool(((off - pair).abs() < 6 * (pair * (1 - pair) / draws) ** 0.5).all())


def test_bad_sizes_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"0 < k <= n"):
        SharedSubsets([10, 5], [3, 6])
