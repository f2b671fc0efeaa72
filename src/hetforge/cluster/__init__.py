"""Beyond one device: place and run a model across several edge nodes on Ray, the network in the cost model.

* :mod:`.spec` — cluster profiles (YAML, pydantic-validated): nodes (each an SoC profile) and the network
  links between them (bandwidth, latency, energy per byte, each with its source or a labelled estimate).
* :mod:`.placement` — contiguous decoder-layer stages over nodes (the exact front of
  :mod:`hetforge.placement.exact` over a node-level layer table whose transfers are network links), memory
  per node enforced, every cut explained; inside each node the ``stages`` strategy places over its devices.
* :mod:`.timeline` — the modeled timeline of one token: node stages and network transfers as spans.
* :mod:`.split` — cut a captured prefill/decode graph into per-stage graph modules at layer boundaries.
* :mod:`.ray_runtime` — node actors on a Ray cluster (one per node, holding its stages' weights and its
  slice of the KV cache), generation through them, re-planning when a node dies.

See docs/arch/cluster.md.
"""
