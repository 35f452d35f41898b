"""Sparse embeddings: tables sharded by rows over the data-parallel ranks, looked up and
updated with all-to-all messages that carry only the rows a batch uses."""

from thinwire.sparse.embedding import ShardedEmbedding, SparseTraffic, shard_embeddings

__all__ = ["ShardedEmbedding", "SparseTraffic", "shard_embeddings"]
