"""The modeled timeline of one token through the cluster: node stages and network hops as spans.

Stages run one after another (one token of one request depends on the previous stage's activations); each
hop between nodes is a transfer span on its ``src->dst`` lane, costed like any on-chip transfer
(:func:`hetforge.cost.transfer.transfer_cost` over the cluster link). The result is a
:class:`hetforge.hetero.timeline.Timeline`, the same object a single-SoC run reports, so traces and summaries
read alike. Every duration is **modeled**.
"""

from __future__ import annotations

from hetforge.cluster.placement import ClusterPlan
from hetforge.hetero.timeline import Span, Timeline


def token_timeline(plan: ClusterPlan) -> Timeline:
    """List-schedule one token: stage, hop, stage, ... (a stage starts when its input has arrived)."""
    spans: list[Span] = []
    t = 0.0
    hops = {h.before: h for h in plan.hops}
    for st in plan.stages:
        key = "head" if st.head and st.layers[0] == st.layers[1] else f"layer.{st.layers[0]}"
        h = hops.get(key)
        if h is not None and st.index > 0:
            spans.append(Span("transfer", f"{h.src}->{h.dst}", f"activations before {h.before} ({h.nbytes:.0f} B)",
                              t, h.modeled_s, h.modeled_j, {"nbytes": h.nbytes, "mode": "network"}))
            t += h.modeled_s
        spans.append(Span("call", st.node, st.label, t, st.modeled_s, st.modeled_j,
                          {"stage": st.index, "devices": st.devices, "layers": list(st.layers)}))
        t += st.modeled_s
    energy = sum(s.energy_j for s in spans)
    return Timeline(spans, t, energy, max(0, len(plan.stages) - 1), 0.0, sum(s.dur_s for s in spans))
