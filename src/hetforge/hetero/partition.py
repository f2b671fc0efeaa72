"""The partition types, re-exported from where they live now (:mod:`hetforge.backends.partition`, below the
backends that compile them). The FX-graph partitioner that was here served only the tests: ``tests/fx_partition.py``.
"""

from hetforge.backends.partition import Partition, PartitionedGraph, fetch_attr

__all__ = ["Partition", "PartitionedGraph", "fetch_attr"]
