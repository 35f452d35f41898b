"""Sparse embeddings: tables sharded by rows over the data-parallel ranks, looked up and
updated with all-to-all messages that carry only the rows a batch uses, and the sparse
all-gather baseline they are measured against."""

from thinwire.data_parallel.sparse.allgather import AllGatherEmbedding
from thinwire.data_parallel.sparse.checkpoint import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
)
from thinwire.data_parallel.sparse.convert import (
    allgather_embeddings,
    dense_embeddings,
    shard_embeddings,
    sparse_table_parameters,
)
from thinwire.data_parallel.sparse.embedding import ShardedEmbedding, SparseTraffic

__all__ = [
    "AllGatherEmbedding",
    "ShardedEmbedding",
    "SparseTraffic",
    "allgather_embeddings",
    "dense_embeddings",
    "full_optimizer_state_dict",
    "full_state_dict",
    "load_full_optimizer_state_dict",
    "shard_embeddings",
    "sparse_table_parameters",
]
