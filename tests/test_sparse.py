"""Sharded embeddings: lookups and training equal one ``nn.Embedding`` on the global
batch, duplicates and absent ids are handled, tables move between world sizes, and what
cannot be sharded is refused with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import thinwire
from thinwire.sparse import ShardedEmbedding, shard_embeddings

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
    if kind == "sparse-adam":  # lazy: rows nobody looked up stay exactly as they were
        assert (moved[absent] == 0).all()


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


def _convert(rank: int, world: int, case: str) -> str:
    torch.manual_seed(0)
    if case == "tied":
        embedding = nn.Embedding(10, DIM)
        output = nn.Linear(DIM, 10, bias=False)
        output.weight = embedding.weight
        model = nn.ModuleDict({"embedding": embedding, "output": output})
    elif case == "padding":
        model = nn.ModuleDict({"embedding": nn.Embedding(10, DIM, padding_idx=0)})
    else:
        model = nn.ModuleDict({"embedding": nn.Embedding(10, DIM), "head": nn.Linear(DIM, 2)})
        before = model["embedding"].weight.detach().clone()
        names = shard_embeddings(model)
        table = model["embedding"]
        assert names == ["embedding"] and isinstance(table, ShardedEmbedding)
        assert torch.equal(table(torch.arange(10)), before)
        return "converted"
    try:
        shard_embeddings(model)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_conversion_keeps_the_table_and_refuses_ties_and_padding(pool2) -> None:
    assert pool2.run(_convert, "plain") == ["converted", "converted"]
    for message in pool2.run(_convert, "tied"):
        assert "shares its weight with output.weight" in message and "untie" in message
    for message in pool2.run(_convert, "padding"):
        assert "padding_idx" in message and "leave this embedding dense" in message
