"""A sharded parameter server on ``torch.distributed`` point-to-point messages (sync and
async), through any thinwire compressor."""

from thinwire.data_parallel.parameter_server.client import ParameterServer

__all__ = ["ParameterServer"]
