"""A checkpoint saved before a compressor option existed resumes where this run leaves the
option at its default, and is refused where it does not (thinwire.comm.saved_options)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.saved_options import option_defaults, same_compressor
from thinwire.compress.dgc import DGC
from thinwire.compress.powersgd import PowerSGD
from thinwire.compress.topk import TopK


def _without(text: str, option: str) -> str:
    """``text`` (a repr) as a version without ``option`` wrote it."""
    name, _, body = text[:-1].partition("(")
    kept = [part for part in body.split(", ") if not part.startswith(f"{option}=")]
    assert len(kept) < len(body.split(", ")), (option, text)
    return f"{name}({', '.join(kept)})"


def test_an_option_added_since_matches_only_at_its_default() -> None:
    mine = DGC(density=0.01, partitioned=True)
    older = _without(repr(mine), "keep")
    assert same_compressor(older, repr(mine), option_defaults(mine))
    keeping = DGC(density=0.01, partitioned=True, keep=4)
    assert not same_compressor(older, repr(keeping), option_defaults(keeping))
    # the saved values still count: another density is another compressor
    other = DGC(density=0.02, partitioned=True)
    assert not same_compressor(older, repr(other), option_defaults(other))
    # an option the saved repr lists that this version does not know: refused
    assert not same_compressor(repr(keeping), older, option_defaults(mine))
    # another class with the same options: refused
    assert not same_compressor(repr(TopK()), repr(DGC()), option_defaults(DGC()))
    assert not same_compressor("not a repr", repr(mine), option_defaults(mine))


def test_values_with_commas_and_brackets_are_one_option_each() -> None:
    mine = "X(a=(1, 2), b='p, q', c=None, d=[3, (4, 5)])"
    defaults = {"c": "None"}
    assert same_compressor("X(a=(1, 2), b='p, q', d=[3, (4, 5)])", mine, defaults)
    assert not same_compressor("X(a=(1, 3), b='p, q', d=[3, (4, 5)])", mine, defaults)
    assert not same_compressor("X(a=(1, 2), b='p, r', d=[3, (4, 5)])", mine, defaults)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process (removed afterwards)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_the_engine_resumes_a_state_saved_before_an_option_existed(one_rank) -> None:
    from thinwire.comm.engine import GradientExchange, GradientItem

    saver = GradientExchange(DGC(density=0.01, warmup_steps=0))
    saver.exchange([GradientItem("w", torch.randn(64, 64))])
    state = saver.state_dict()
    state["owner"]["compressor"] = _without(state["owner"]["compressor"], "keep")
    GradientExchange(DGC(density=0.01, warmup_steps=0)).load_state_dict(state)  # resumes
    with pytest.raises(ValueError, match="same compressor options"):
        GradientExchange(DGC(density=0.02, warmup_steps=0)).load_state_dict(state)
    powersgd = GradientExchange(PowerSGD(rank=2))
    with pytest.raises(ValueError, match="saved with compressor DGC"):
        powersgd.load_state_dict(state)
