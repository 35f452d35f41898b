"""Sharded embeddings: lookups, training, checkpoints equal one nn.Embedding on the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from sparse_cases import BATCH, CLASSES, DIM, STEPS, VOCAB, Bag, make_optimizer, step_ids
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

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _labels(worker: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7000 + 100 * step + worker)
    return torch.randint(0, CLASSES, (BATCH,), generator=generator)


def train_sharded(rank: int, world: int, kind: str) -> dict[str, np.ndarray]:
    """Sharded table + data-parallel head, ``STEPS`` steps on this rank's batches."""
    table = ShardedEmbedding(VOCAB, DIM, seed=3, sparse_grad=kind == "sparse-adam")
    model = Bag(table)
    head = thinwire.DistributedOptimizer(make_optimizer("sgd", model.head.parameters()), model.head)
    rows = make_optimizer(kind, [table.weight])
    outputs = []
    for step in range(STEPS):
        out = model(step_ids(rank, step))
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
    head = make_optimizer("sgd", model.head.parameters())
    rows = make_optimizer(kind, [embedding.weight])
    outputs = []
    for step in range(STEPS):
        ids = torch.cat([step_ids(r, step) for r in range(world)])
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
        {int(i) for r in range(world) for s in range(STEPS) for i in step_ids(r, s).unique()}
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
        optimizer = thinwire.DistributedOptimizer(make_optimizer("sgd", model.parameters()), given)
    else:
        ddp = DistributedDataParallel(model)
        assert ddp.parameters_to_ignore == {"embedding.weight"}
        optimizer = make_optimizer("sgd", ddp.parameters())
        if front == "register":
            thinwire.register(ddp, "none")
    outputs = []
    for step in range(STEPS):
        out = ddp(step_ids(rank, step))
        if layout == "sharded-prefetch" and step + 1 < STEPS:
            model.embedding.prefetch(step_ids(rank, step + 1))
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
        nn.functional.cross_entropy(ddp(step_ids(rank, step)), _labels(rank, step)).backward()
        optimizer.step()


def _save_checkpoint(rank: int, world: int, kind: str, path: str) -> None:
    model = _sharded_model()
    optimizer = make_optimizer(kind, model.parameters())
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
    optimizer = make_optimizer(kind, model.parameters())
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
    optimizer = make_optimizer(kind, model.parameters())
    for step, world in enumerate(worlds):
        ids = torch.cat([step_ids(r, step) for r in range(world)])
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
