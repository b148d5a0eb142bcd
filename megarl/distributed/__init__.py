"""Topology, device selection and process launch. See `topology.Topology`."""

from megarl.distributed.topology import Groups, ParallelConfig, Topology, TopologyError

__all__ = ["Groups", "ParallelConfig", "Topology", "TopologyError"]
