"""The emulated cheap cluster: hosts in network namespaces joined by slow, delayed links."""

from thinwire.cluster.emulated import (
    ClusterError,
    EmulatedCluster,
    Host,
    check_can_emulate,
    list_namespaces,
    remove_leftovers,
)
from thinwire.cluster.units import parse_duration, parse_rate

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "Host",
    "check_can_emulate",
    "list_namespaces",
    "parse_duration",
    "parse_rate",
    "remove_leftovers",
]
