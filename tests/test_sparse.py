"""Sharded embeddings: lookups and training equal one ``nn.Embedding`` on the global
batch (also converted in a DDP model, prefetched, and for the all-gather baseline),
duplicates and absent ids are handled, tables move between world sizes, and what cannot be
sharded is refused with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.comm.collectives import group_timeout
from thinwire.data_parallel.sparse import (
    AllGatherEmbedding,
    ShardedEmbedding,
    allgather_embeddings,
    dense_embeddings,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    shard_embeddings,
)
from thinwire.data_parallel.sparse.embedding import initial_shard

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

VOCAB, DIM, CLASSES = 37, 4, 3
STEPS, BATCH, LENGTH = 5, 3, 6


def _ids(worker: int, step: int) -> torch.Tensor:
    """Ids from a small range (many duplicates, many absent ids), rank- and step-specific."""
    generator = torch.Generator().manual_seed(100 * step + worker)
    return torch.randint(0, VOCAB // 2, (BATCH, LENGTH), generator=generator) * 2


def _labels(worker: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7000 + 100 * step + worker)
    return torch.randint(0, CLASSES, (BATCH,), generator=generator)


class Bag(nn.Module):
    """Mean of the embeddings of a sequence, then a linear classifier."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = embedding
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SparseAdam(params, lr=0.05)


def train_sharded(rank: int, world: int, kind: str) -> dict[str, np.ndarray]:
    """Sharded table + data-parallel head, ``STEPS`` steps on this rank's batches."""
    table = ShardedEmbedding(VOCAB, DIM, seed=3, sparse_grad=kind == "sparse-adam")
    model = Bag(table)
    head = thinwire.DistributedOptimizer(_optimizer("sgd", model.head.parameters()), model.head)
    rows = _optimizer(kind, [table.weight])
    outputs = []
    for step in range(STEPS):
        out = model(_ids(rank, step))
        outputs.append(out.detach().numpy().copy())
        loss = nn.functional.cross_entropy(out, _labels(rank, step))
        head.zero_grad()
        rows.zero_grad()
        loss.backward()
        head.step()
        rows.step()
    return {
        "table": table.full_weight().numpy(),
        "head": torch.cat([p.detach().reshape(-1) for p in model.head.parameters()]).numpy(),
        "outputs": np.stack(outputs),
    }


def train_reference(world: int, kind: str) -> dict[str, np.ndarray]:
    """One process, one ``nn.Embedding``, the global batch (all ranks' batches)."""
    full = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3))
    embedding = nn.Embedding(VOCAB, DIM, sparse=kind == "sparse-adam")
    with torch.no_grad():
        embedding.weight.copy_(full)
    model = Bag(embedding)
    head = _optimizer("sgd", model.head.parameters())
    rows = _optimizer(kind, [embedding.weight])
    outputs = []
    for step in range(STEPS):
        ids = torch.cat([_ids(r, step) for r in range(world)])
        labels = torch.cat([_labels(r, step) for r in range(world)])
        out = model(ids)
        outputs.append(out.detach().numpy().copy())
        head.zero_grad()
        rows.zero_grad()
        nn.functional.cross_entropy(out, labels).backward()
        head.step()
        rows.step()
    return {
        "table": embedding.weight.detach().numpy(),
        "head": torch.cat([p.detach().reshape(-1) for p in model.head.parameters()]).numpy(),
        "outputs": np.stack(outputs),
    }


@pytest.mark.parametrize("kind", ["sgd", "adam", "sparse-adam"])
def test_training_equals_one_embedding_on_the_global_batch(pool, kind: str) -> None:
    results = pool.run(train_sharded, kind)
    world = len(results)
    expected = train_reference(world, kind)
    for rank, result in enumerate(results):
        np.testing.assert_allclose(result["table"], expected["table"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["head"], expected["head"], rtol=1e-5, atol=1e-6)
        # each rank's outputs are its slice of the global batch's outputs, at every step
        mine = expected["outputs"][:, rank * BATCH : (rank + 1) * BATCH]
        np.testing.assert_allclose(result["outputs"], mine, rtol=1e-5, atol=1e-6)
    start = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)).numpy()
    touched = sorted(
        {int(i) for r in range(world) for s in range(STEPS) for i in _ids(r, s).unique()}
    )
    absent = sorted(set(range(VOCAB)) - set(touched))
    assert absent, "the test must leave some rows out"
    moved = np.abs(expected["table"] - start).max(axis=1)
    assert (moved[touched] > 1e-3).all()
    if kind == "sparse-adam":  # rows nobody ever looked up stay exactly as they were
        assert (moved[absent] == 0).all()


def train_converted(
    rank: int, world: int, layout: str, front: str = "ddp"
) -> dict[str, np.ndarray]:
    """A model with an ``nn.Embedding`` converted to ``layout``, then wrapped whole in DDP
    (which must leave the table alone), trained with one SGD optimizer; ``front``: plain
    DDP, DDP with thinwire's hook, or thinwire's optimizer wrapper without DDP (both must
    leave the table alone too)."""
    embedding = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))
    model = Bag(embedding)
    if layout == "allgather":
        assert allgather_embeddings(model) == ["embedding"]
    else:
        assert shard_embeddings(model, overlap=layout != "sharded-no-overlap") == ["embedding"]
    if front.startswith("optimizer"):
        ddp: nn.Module = model
        given: Any = model.named_parameters() if front == "optimizer-pairs" else model
        optimizer = thinwire.DistributedOptimizer(_optimizer("sgd", model.parameters()), given)
    else:
        ddp = DistributedDataParallel(model)
        assert ddp.parameters_to_ignore == {"embedding.weight"}
        optimizer = _optimizer("sgd", ddp.parameters())
        if front == "register":
            thinwire.register(ddp, "none")
    outputs = []
    for step in range(STEPS):
        out = ddp(_ids(rank, step))
        if layout == "sharded-prefetch" and step + 1 < STEPS:
            model.embedding.prefetch(_ids(rank, step + 1))
        outputs.append(out.detach().numpy().copy())
        optimizer.zero_grad()
        nn.functional.cross_entropy(out, _labels(rank, step)).backward()
        optimizer.step()
    kind = type(model.embedding).__name__
    assert dense_embeddings(model) == ["embedding"]
    return {
        "kind": kind,
        "table": model.embedding.weight.detach().numpy(),
        "head": torch.cat([p.detach().reshape(-1) for p in model.head.parameters()]).numpy(),
        "outputs": np.stack(outputs),
    }


@pytest.mark.parametrize(
    ("layout", "front"),
    [
        ("sharded", "ddp"),
        ("sharded-prefetch", "ddp"),
        ("sharded-no-overlap", "ddp"),
        ("allgather", "ddp"),
        ("sharded", "register"),
        ("sharded", "optimizer"),
        ("allgather", "optimizer"),
        ("sharded", "optimizer-pairs"),
    ],
)
def test_converted_tables_under_ddp_train_as_one_embedding(pool, layout: str, front: str) -> None:
    """Under thinwire's hook and optimizer wrapper too: the wrapper's setup check refused
    the ranks' different shards (37 rows over 2 or 4 ranks), and where the shards had
    the same shape the optimizer wrapper overwrote every rank's with rank 0's."""
    results = pool.run(train_converted, layout, front)
    expected = train_reference(len(results), "sgd")
    for rank, result in enumerate(results):
        assert result["kind"] == (
            "AllGatherEmbedding" if layout == "allgather" else "ShardedEmbedding"
        )
        np.testing.assert_allclose(result["table"], expected["table"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["head"], expected["head"], rtol=1e-5, atol=1e-6)
        mine = expected["outputs"][:, rank * BATCH : (rank + 1) * BATCH]
        np.testing.assert_allclose(result["outputs"], mine, rtol=1e-5, atol=1e-6)


def _parameter_server_over_a_sharded_table(rank: int, world: int) -> str:
    model = Bag(nn.Embedding(VOCAB, DIM))
    shard_embeddings(model)
    try:
        thinwire.ParameterServer(_optimizer("sgd", model.parameters()), model).close()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_parameter_server_refuses_sharded_tables_with_what_to_do(pool2) -> None:
    """Its shards hold every parameter: each rank's table shard would be overwritten."""
    for message in pool2.run(_parameter_server_over_a_sharded_table):
        assert "embedding.weight" in message and "dense_embeddings" in message, message


def _misuse_prefetch(rank: int, world: int) -> list[str]:
    table = ShardedEmbedding(VOCAB, DIM, seed=3)
    messages = []
    table.prefetch(torch.tensor([1, 2, 3]))
    try:
        table.prefetch(torch.tensor([1, 2, 3]))
    except RuntimeError as error:
        messages.append(str(error))
    try:  # every rank passes other ids: every rank refuses, none waits for the others
        table(torch.tensor([4, 5]))
    except RuntimeError as error:
        messages.append(str(error))
    after = table(torch.tensor([6])).detach()  # the table still works afterwards
    messages.append(str(torch.equal(after, table.full_weight()[6:7])))
    # the table's own groups give up when the user's timeout says, not gloo's 30 minutes
    timeouts = {str(group_timeout(g)) for g in (None, table._lookup_group, table._prefetch_group)}
    messages.append(" ".join(sorted(timeouts)))
    return messages


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
            table(_ids(rank, step)).sum().backward()
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


def test_prefetch_misuse_is_refused_with_a_reason(pool2) -> None:
    for pending, mismatch, works, timeouts in pool2.run(_misuse_prefetch):
        assert timeouts == "0:01:00"  # the pools' 60 s
        assert "already waiting for its forward" in pending
        assert "other ids than the last prefetch" in mismatch
        assert works == "True"


def _one_rank_misuses_prefetch(rank: int, world: int) -> list[str]:
    table = ShardedEmbedding(VOCAB, DIM, seed=3)
    table.prefetch(torch.tensor([1, 2, 3]))
    messages = []
    try:  # only rank 0 passes other ids: it raises, and the others learn of it at once
        table(torch.tensor([4, 5]) if rank == 0 else torch.tensor([1, 2, 3]))
        messages.append("no error")
    except RuntimeError as error:
        messages.append(f"{type(error).__name__}: {error}")
    after = table(torch.tensor([6])).detach()  # every rank still makes the same calls
    messages.append(str(torch.equal(after, table.full_weight()[6:7])))
    return messages


def test_one_rank_misusing_prefetch_makes_every_rank_raise_not_wait(pool) -> None:
    results = pool.run(_one_rank_misuses_prefetch)
    assert "other ids than the last prefetch" in results[0][0]
    for message, works in results[1:]:
        assert message.startswith("RankMismatchError") and "rank(s) [0]" in message
        assert works == "True"
    assert results[0][1] == "True"


def _gathered_traffic(rank: int, world: int, dtype: torch.dtype) -> dict[str, Any]:
    table = AllGatherEmbedding(VOCAB, DIM, seed=3).to(dtype)
    ids = torch.tensor([[5, 5, 5, 0], [36, 5, 0, 0]]) if rank == 0 else torch.tensor([[rank]])
    table(ids).sum().backward()
    return {"ids": table.traffic.ids, "grads": table.traffic.grads, "grad": table.weight.grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_gather_sends_each_distinct_row_once_and_sums_every_ranks(
    pool, dtype: torch.dtype
) -> None:
    results = pool.run(_gathered_traffic, dtype)
    world = len(results)
    size = torch.finfo(dtype).bits // 8
    assert results[0]["ids"] == (3 + 1) * 8 and results[0]["grads"] == 3 * DIM * size
    expected = torch.zeros(VOCAB, DIM, dtype=dtype)
    for row, uses in ((5, 4), (0, 3), (36, 1)):  # rank 0's sum of ones per use
        expected[row] += uses / world
    for r in range(1, world):
        expected[r] += 1 / world
    for result in results:
        torch.testing.assert_close(result["grad"], expected)


def _lookups(rank: int, world: int) -> dict[str, Any]:
    table = ShardedEmbedding(VOCAB, DIM, seed=3)
    ids = torch.tensor([[5, 5, 5, 0], [36, 5, 0, 0]]) if rank == 0 else torch.tensor([[rank]])
    out = table(ids)
    sent = table.traffic
    empty = table(torch.zeros(0, dtype=torch.int64))
    return {
        "out": out.detach().numpy(),
        "shape": tuple(out.shape),
        "empty": tuple(empty.shape),
        "id_bytes": sent.ids,
        "row_bytes": sent.rows,
    }


def test_duplicates_are_sent_once_and_absent_or_empty_batches_work(pool) -> None:
    full = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3))
    results = pool.run(_lookups)
    world = len(results)
    np.testing.assert_array_equal(
        results[0]["out"], full[torch.tensor([[5, 5, 5, 0], [36, 5, 0, 0]])].numpy()
    )
    assert results[0]["shape"] == (2, 4, DIM)
    # rank 0 looked up 8 ids but only 3 distinct ones travel (+ the counts)
    assert results[0]["id_bytes"] == (3 + world) * 8
    # and each rank serves rows to the others: every row it sent is a D-vector of floats
    assert sum(r["row_bytes"] for r in results) == (3 + world - 1) * DIM * 4
    for rank, result in enumerate(results[1:], start=1):
        np.testing.assert_array_equal(result["out"], full[torch.tensor([[rank]])].numpy())
        assert result["empty"] == (0, DIM)


def _save(rank: int, world: int, path: str) -> None:
    table = ShardedEmbedding(VOCAB, DIM, seed=11)
    with torch.no_grad():
        table.weight.mul_(rank + 2)  # a table no seed reproduces
    full = table.full_weight()
    if rank == 0:
        torch.save({"table": full}, path)


def _load(rank: int, world: int, path: str) -> np.ndarray:
    table = ShardedEmbedding(VOCAB, DIM, seed=0)
    table.load_full_weight(torch.load(path)["table"])
    return table(torch.arange(VOCAB)).detach().numpy()


def test_a_table_saved_on_two_ranks_loads_on_four(pool2, pool4, tmp_path: Path) -> None:
    path = str(tmp_path / "table.pt")
    pool2.run(_save, path)
    saved = torch.load(path)["table"]
    for r in range(2):  # row i came from rank i % 2, scaled by its factor
        expected = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(11))[r::2]
        torch.testing.assert_close(saved[r::2], expected * (r + 2))
    for lookup in pool4.run(_load, path):
        np.testing.assert_array_equal(lookup, saved.numpy())


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


def _sharded_model() -> nn.Module:
    embedding = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))
    model = Bag(embedding)
    shard_embeddings(model)
    return model


def _train_steps(rank: int, model: nn.Module, optimizer: Any, steps: range) -> None:
    ddp = DistributedDataParallel(model)
    for step in steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(_ids(rank, step)), _labels(rank, step)).backward()
        optimizer.step()


def _save_checkpoint(rank: int, world: int, kind: str, path: str) -> None:
    model = _sharded_model()
    optimizer = _optimizer(kind, model.parameters())
    _train_steps(rank, model, optimizer, range(3))
    state = {
        "model": full_state_dict(model),
        "optimizer": full_optimizer_state_dict(optimizer, model),
    }
    if rank == 0:
        torch.save(state, path)


def _resume(
    rank: int, world: int, kind: str, path: str, with_optimizer: bool
) -> dict[str, np.ndarray]:
    model = _sharded_model()
    optimizer = _optimizer(kind, model.parameters())
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    if with_optimizer:
        load_full_optimizer_state_dict(optimizer, model, saved["optimizer"])
    _train_steps(rank, model, optimizer, range(3, STEPS))
    return {"table": model.embedding.full_weight().numpy()}


def _reference_across_world_sizes(kind: str, worlds: list[int]) -> np.ndarray:
    """One process: step ``s`` trains on the global batch of ``worlds[s]`` ranks."""
    embedding = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))
    model = Bag(embedding)
    optimizer = _optimizer(kind, model.parameters())
    for step, world in enumerate(worlds):
        ids = torch.cat([_ids(r, step) for r in range(world)])
        labels = torch.cat([_labels(r, step) for r in range(world)])
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(ids), labels).backward()
        optimizer.step()
    return embedding.weight.detach().numpy()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_training_saved_on_two_ranks_resumes_on_four_with_its_optimizer_state(
    pool2, pool4, tmp_path: Path, kind: str
) -> None:
    path = str(tmp_path / "checkpoint.pt")
    pool2.run(_save_checkpoint, kind, path)
    saved = torch.load(path)
    assert tuple(saved["model"]["embedding.weight"].shape) == (VOCAB, DIM)
    per_row = [v for v in saved["optimizer"]["state"][0].values() if v.dim() == 2]
    assert per_row and all(tuple(v.shape) == (VOCAB, DIM) for v in per_row)
    expected = _reference_across_world_sizes(kind, [2] * 3 + [4] * (STEPS - 3))
    for result in pool4.run(_resume, kind, path, True):
        np.testing.assert_allclose(result["table"], expected, rtol=1e-5, atol=1e-6)
    # the optimizer's state matters: resuming without it ends elsewhere
    for result in pool4.run(_resume, kind, path, False):
        assert not np.allclose(result["table"], expected, atol=1e-4)


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
