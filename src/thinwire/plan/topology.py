"""Where the ranks are and what joins them: a :class:`Topology` of link levels.

Ranks live on hosts. Ranks on one host talk over the host's fast link (loopback, PCIe,
NVLink: ``intra``); hosts talk over the network (``inter``), the cheap link thinwire is for.
A collective's group crosses the network if its ranks are on more than one host, and then
runs at the network's speed: a ring ordered by host sends each step's chunk through every
host's network link at once, so the slowest hop, the network, sets the pace (the links
inside a host are idle most of the ring). When several groups cross the network at once
(the data-parallel groups of several tensor shards, say), they share each host's link:
``sharing`` divides its bandwidth.

    topology = Topology(hosts=2, ranks_per_host=4, inter=Link(100e6, 1e-3),
                        intra=Link(10e9, 5e-6))                # as measured on your hosts
    topology.time("allreduce", 40e6, ranks=[0, 4])             # a dp group across hosts
    topology.time("allreduce", 8e6, ranks=[0, 1, 2, 3])        # a tp group inside a host

The data-parallel step of :mod:`thinwire.plan.cost` is the topology of one rank per host
(:meth:`Topology.flat`), whose every group crosses the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thinwire.plan.network import Link, collective_time, wire_bytes


@dataclass(frozen=True)
class Topology:
    """``hosts`` hosts of ``ranks_per_host`` ranks each (rank r on host r // ranks_per_host,
    as torchrun numbers them), joined by ``inter``; ranks of a host joined by ``intra``."""

    hosts: int
    ranks_per_host: int
    inter: Link
    intra: Link

    def __post_init__(self) -> None:
        for name in ("hosts", "ranks_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a topology's {name} must be an integer >= 1, got {value!r}")

    @classmethod
    def flat(cls, world_size: int, link: Link) -> Topology:
        """One rank per host, every pair joined by ``link``: the data-parallel model's."""
        return cls(hosts=world_size, ranks_per_host=1, inter=link, intra=link)

    @property
    def world_size(self) -> int:
        """All ranks of all hosts."""
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host rank ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this topology of {self.world_size} ranks")
        return rank // self.ranks_per_host

    def spans_hosts(self, ranks: Sequence[int]) -> bool:
        """Whether a group of ``ranks`` crosses the network."""
        return len({self.host_of(r) for r in ranks}) > 1

    def link_of(self, ranks: Sequence[int], sharing: int = 1) -> Link:
        """The link a collective of ``ranks`` runs at: the network if the group spans
        hosts (its bandwidth divided among ``sharing`` groups crossing it at once), else
        the hosts' own link."""
        if isinstance(sharing, bool) or not isinstance(sharing, int) or sharing < 1:
            raise ValueError(f"sharing must be an integer >= 1, got {sharing!r}")
        if not self.spans_hosts(ranks):
            return self.intra
        return self.inter.with_bandwidth(self.inter.bandwidth_bps / sharing)

    def time(self, kind: str, nbytes: float, ranks: Sequence[int], sharing: int = 1) -> float:
        """Seconds of one collective of ``kind`` (``network.KINDS``) with ``nbytes`` per
        rank over the group ``ranks``."""
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"a group needs distinct ranks, got {ranks}")
        return collective_time(kind, nbytes, len(ranks), self.link_of(ranks, sharing))

    def network_bytes(self, kind: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Bytes one rank of the group sends over the network for one collective (0 for a
        group inside one host)."""
        ranks = list(ranks)
        return wire_bytes(kind, nbytes, len(ranks)) if self.spans_hosts(ranks) else 0.0
