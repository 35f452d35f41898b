"""The scatter round (an uneven all-to-all of several requests at once) on real gloo ranks:
every rank gets, per request and tensor, the rows each rank addressed to it, in source rank
order, whatever the dtypes, row shapes and counts (zeros included), sent all at once or
paced one partner at a time (one rank not pacing); a poisoned source
poisons every rank's round; messages stay whole words; bad counts are refused."""

from __future__ import annotations

import pytest
import torch

from thinwire.compress.base import Request

WORLD = 4


def _inputs(source: int) -> list[Request]:
    """What rank ``source`` scatters: two requests of mixed dtypes and row shapes, with
    counts that differ by source and destination (some zero)."""
    gen = torch.Generator().manual_seed(100 + source)
    first_counts = [(source + dest) % 3 for dest in range(WORLD)]  # 0, 1 or 2 rows
    second_counts = [5 * dest + source for dest in range(WORLD)]  # rank 0 to 0: none
    n, m = sum(first_counts), sum(second_counts)
    return [
        Request.scatter(
            first_counts,
            torch.randn(n, 3, generator=gen, dtype=torch.float64),
            torch.randint(-1000, 1000, (n,), generator=gen, dtype=torch.int32),
        ),
        Request.scatter(
            second_counts,
            torch.randint(0, 255, (m,), generator=gen, dtype=torch.uint8),
            torch.randn(m, 2, generator=gen),
        ),
    ]


def _expected(dest: int) -> list[list[torch.Tensor]]:
    """Per request and tensor, the rows every source sends ``dest``, in source order."""
    out: list[list[torch.Tensor]] = [[], []]
    for index in range(2):
        per_tensor = []
        for position in range(2):
            pieces = []
            for source in range(WORLD):
                request = _inputs(source)[index]
                counts = list(request.counts or ())
                begin = sum(counts[:dest])
                pieces.append(request.tensors[position][begin : begin + counts[dest]])
            per_tensor.append(torch.cat(pieces))
        out[index] = per_tensor
    return out


def _scatter_on_gloo(rank: int, world: int, poisoner: int, device_flag: bool, paced: bool) -> tuple:
    import torch.distributed as dist

    from thinwire.comm import paced as pacing
    from thinwire.comm.scatter import scatter_round

    def collective(fn, *args, **kwargs) -> None:
        fn(*args, **kwargs)

    poison: bool | torch.Tensor = rank == poisoner
    if device_flag:
        poison = torch.tensor(rank == poisoner)
    default = pacing.PACE_BYTES
    # paced: one partner at a time, except rank 0, which does not pace (the ranks agree)
    pacing.PACE_BYTES = (1 if rank else 0) if paced else default
    try:
        answers, poisoned, sent, received = scatter_round(
            _inputs(rank), poison, world, rank, collective
        )
    finally:
        pacing.PACE_BYTES = default
    dist.barrier()
    return answers, poisoned, sent, received


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("poisoner", [-1, 2], ids=["clean", "rank2-poisoned"])
@pytest.mark.parametrize("device_flag", [False, True], ids=["bool", "flag-tensor"])
@pytest.mark.parametrize("paced", [False, True], ids=["at-once", "paced"])
def test_every_rank_gets_the_rows_addressed_to_it_in_source_order(
    pool4, poisoner: int, device_flag: bool, paced: bool
) -> None:
    found = pool4.run(_scatter_on_gloo, poisoner, device_flag, paced)
    for dest, (answers, poisoned, sent, received) in enumerate(found):
        expected = _expected(dest)
        for got, want in zip(answers, expected, strict=True):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(g, w)
        assert isinstance(poisoned, torch.Tensor) == device_flag
        assert bool(poisoned) == (poisoner >= 0)
        # each message: 16 bytes of header, its rows, 8-15 status bytes, whole words;
        # plus the lengths' all-to-all (every rank's 4 lengths and budget to and from each other)
        for moved, direction in ((sent, "to"), (received, "from")):
            rows = 0
            for other in range(WORLD):
                if other == dest:
                    continue
                source, target = (dest, other) if direction == "to" else (other, dest)
                for request in _inputs(source):
                    count = (request.counts or ())[target]
                    rows += sum(count * t[0].numel() * t.element_size() for t in request.tensors)
            others = WORLD - 1
            assert rows + others * (16 + 8 + 40) <= moved <= rows + others * (16 + 15 + 40)


def _bad_counts(rank: int, world: int) -> str:
    from thinwire.comm.scatter import scatter_round

    request = Request.scatter([1, 1], torch.zeros(2), torch.zeros(2, dtype=torch.int32))
    try:
        scatter_round([request], False, world, rank, lambda fn, *a, **k: fn(*a, **k))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_counts_for_another_number_of_ranks_are_refused_before_anything_is_sent(pool4) -> None:
    for message in pool4.run(_bad_counts):
        assert "counts for 2 ranks" in message and "has 4" in message
