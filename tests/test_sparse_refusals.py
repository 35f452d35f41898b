"""Sharded embeddings: bad tables and stalled peers give clear errors; a shard is drawn alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import thinwire
from sparse_cases import DIM, VOCAB, Bag, make_optimizer, step_ids
from thinwire.data_parallel.sparse import (
    AllGatherEmbedding,
    ShardedEmbedding,
    dense_embeddings,
    shard_embeddings,
)
from thinwire.data_parallel.sparse.embedding import initial_shard

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _parameter_server_over_a_sharded_table(rank: int, world: int) -> str:
    model = Bag(nn.Embedding(VOCAB, DIM))
    shard_embeddings(model)
    try:
        thinwire.ParameterServer(make_optimizer("sgd", model.parameters()), model).close()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_parameter_server_refuses_sharded_tables_with_what_to_do(pool2) -> None:
    """Its shards hold every parameter: each rank's table shard would be overwritten."""
    for message in pool2.run(_parameter_server_over_a_sharded_table):
        assert "embedding.weight" in message and "dense_embeddings" in message, message


def _different_tables(rank: int, world: int, layout: str, option: str) -> str:
    rows, width = VOCAB, DIM
    kwargs: dict[str, Any] = {"seed": 3}
    if rank == 1:
        if option == "num_embeddings":
            rows += 20
        elif option == "embedding_dim":
            width += 2
        elif option == "seed":
            kwargs["seed"] = 2**63 + 4  # torch takes seeds up to 2**64 - 1
        else:
            kwargs[option] = True
    build = ShardedEmbedding if layout == "sharded" else AllGatherEmbedding
    try:
        build(rows, width, **kwargs).close()
    except thinwire.RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("layout", "option"),
    [
        ("sharded", "num_embeddings"),
        ("sharded", "embedding_dim"),
        ("sharded", "sparse_grad"),
        ("allgather", "num_embeddings"),
        ("allgather", "embedding_dim"),
        ("allgather", "seed"),
    ],
)
def test_ranks_building_different_tables_are_refused(pool2, layout: str, option: str) -> None:
    """Sharded rows: a later lookup failed on one rank and timed out on the other; width:
    gloo aborted the process. All-gather rows or width: the same at the first backward;
    seed: the replicas differed for good, silently."""
    kind = "sharded tables" if layout == "sharded" else "all-gather tables"
    for message in pool2.run(_different_tables, layout, option):
        assert f"ranks build different {kind}" in message and option in message, message


def _table_survivor_or_casualty(rank: int, port: int, layout: str, results: Any) -> None:
    """Rank 1 stops answering after two steps; rank 0 must get a CommunicationError."""
    import os
    import time

    from thinwire.launch import init_local_group

    os.environ["OMP_NUM_THREADS"] = "1"
    init_local_group(rank, 2, port, timeout_s=4)
    build = ShardedEmbedding if layout == "sharded" else AllGatherEmbedding
    table = build(VOCAB, DIM, seed=3)
    for step in range(6):
        if rank == 1 and step == 2:
            time.sleep(30)  # alive but silent: only the timeout can tell
            os._exit(0)
        try:
            table(step_ids(rank, step)).sum().backward()
        except thinwire.CommunicationError as error:
            results.put(("error", step, str(error)))
            return
    results.put(("finished", 6, ""))


@pytest.mark.parametrize("layout", ["sharded", "allgather"])
def test_a_stalled_peer_gives_a_communication_error(layout: str, first_report: Any) -> None:
    """Before, the survivor got gloo's bare 'Timed out waiting ... for recv'."""
    kind, step, message = first_report(_table_survivor_or_casualty, layout)
    assert kind == "error" and step == 2, (kind, step, message)
    assert "peer rank has probably died" in message and "table" in message, message
    assert "timeout: 0:00:04" in message


def _shard_state_dicts(rank: int, world: int, path: str) -> str:
    table = ShardedEmbedding(VOCAB, DIM, seed=rank + 5)
    torch.save(table.state_dict(), f"{path}.{rank}")
    torch.distributed.barrier()
    own, other = ShardedEmbedding(VOCAB, DIM), ShardedEmbedding(VOCAB, DIM)
    own.load_state_dict(torch.load(f"{path}.{rank}"))  # its own rows: fine
    assert torch.equal(own.weight, table.weight)
    try:
        other.load_state_dict(torch.load(f"{path}.{(rank + 1) % world}"))
    except RuntimeError as error:
        return str(error)
    return "accepted another rank's rows"


def test_a_shard_state_dict_loads_on_its_own_rank_only(pool2, tmp_path: Path) -> None:
    for rank, message in enumerate(pool2.run(_shard_state_dicts, str(tmp_path / "shard"))):
        assert f"holds shard {1 - rank} of a table sharded over 2 ranks" in message
        assert "full_state_dict" in message


def _convert(rank: int, world: int, case: str) -> Any:
    torch.manual_seed(rank)  # every rank starts from another table: conversion takes rank 0's
    if case == "tied":
        embedding = nn.Embedding(10, DIM)
        output = nn.Linear(DIM, 10, bias=False)
        output.weight = embedding.weight
        model = nn.ModuleDict({"embedding": embedding, "output": output})
    elif case == "padding":
        model = nn.ModuleDict({"embedding": nn.Embedding(10, DIM, padding_idx=0)})
    elif case == "sparse":
        model = nn.ModuleDict({"embedding": nn.Embedding(10, DIM, sparse=True)})
    else:
        embedding = nn.Embedding(10, DIM).double().requires_grad_(False)
        model = nn.ModuleDict({"embedding": embedding, "head": nn.Linear(DIM, 2)})
        before = embedding.weight.detach().clone()
        names = shard_embeddings(model)
        table = model["embedding"]
        assert names == ["embedding"] and isinstance(table, ShardedEmbedding)
        assert model._ddp_params_and_buffers_to_ignore == ["embedding.weight"]
        assert table.weight.dtype == torch.float64 and not table.weight.requires_grad
        looked_up = table(torch.arange(10)).numpy()
        assert dense_embeddings(model) == ["embedding"]
        back = model["embedding"]
        assert isinstance(back, nn.Embedding) and not back.weight.requires_grad
        assert model._ddp_params_and_buffers_to_ignore == []
        return {"before": before.numpy(), "looked_up": looked_up, "back": back.weight.numpy()}
    try:
        shard_embeddings(model)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_conversion_keeps_the_table_and_refuses_ties_and_padding(pool2) -> None:
    results = pool2.run(_convert, "plain")
    assert not np.array_equal(results[0]["before"], results[1]["before"])
    for result in results:  # rank 0's table, its dtype, on every rank, and back again
        np.testing.assert_array_equal(result["looked_up"], results[0]["before"])
        np.testing.assert_array_equal(result["back"], results[0]["before"])
    for message in pool2.run(_convert, "sparse"):
        assert "sparse" in message and "sparse_grad=True" in message
    for message in pool2.run(_convert, "tied"):
        assert "shares its weight with output.weight" in message and "untie" in message
    for message in pool2.run(_convert, "padding"):
        assert "padding_idx" in message and "leave this embedding dense" in message


# -- a shard drawn without the whole table ---------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    dim=st.integers(1, 40),
    world=st.integers(1, 6),
    chunk_rows=st.sampled_from([16, 32, 48, 160]),
    seed=st.integers(0, 50),
)
def test_a_shard_drawn_in_pieces_is_the_whole_tables_rows(
    rows: int, dim: int, world: int, chunk_rows: int, seed: int
) -> None:
    full = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))
    for rank in range(world):
        shard = initial_shard(rows, dim, seed, rank, world, chunk_rows)
        assert torch.equal(shard, full[rank::world]), f"rank {rank} of {world}"


def test_no_piece_of_a_large_table_is_drawn_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 000 x 64 table (51 MB) for 8 ranks: no draw larger than one piece, and the
    shard alone is kept."""
    drawn: list[int] = []
    randn = torch.randn

    def counting(*size: Any, **kwargs: Any) -> torch.Tensor:
        drawn.append(size[0])
        return randn(*size, **kwargs)

    monkeypatch.setattr(torch, "randn", counting)
    shard = initial_shard(200_000, 64, seed=1, rank=3, world=8, chunk_rows=4096)
    assert shard.shape == (25_000, 64)
    assert max(drawn) <= 4096 + 1 and sum(drawn) == 200_000
    with pytest.raises(ValueError, match="multiple of 16"):
        initial_shard(10, 4, seed=0, rank=0, world=1, chunk_rows=100)
