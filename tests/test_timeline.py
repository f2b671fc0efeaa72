"""The one modeled timeline (cost.timeline): the list schedule the runtime reports and the stage search minimizes."""

from __future__ import annotations

import numpy as np
import pytest

from hetforge.cost.timeline import Task, list_schedule
from hetforge.placement.exact import exact_front
from hetforge.placement.stages import LayerTable, exhaustive_front, objectives, stage_tasks

MS = 1e-3


def test_list_schedule_overlaps_independent_devices_and_serializes_one_device():
    tasks = [
        Task("call", "cpu", "a", 2 * MS),
        Task("transfer", "cpu->gpu", "x", 1 * MS, deps=(0,), dst="gpu"),
        Task("call", "gpu", "b", 5 * MS, deps=(1,)),
        Task("call", "cpu", "c", 4 * MS, deps=(0,)),  # independent of b: overlaps it on the cpu lane
        Task("call", "cpu", "d", 1 * MS, deps=(2, 3)),
    ]
    tl = list_schedule(tasks)
    starts = {s.name: s.start_s for s in tl.spans}
    assert starts["b"] == pytest.approx(3 * MS) and starts["c"] == pytest.approx(2 * MS)
    assert starts["d"] == pytest.approx(8 * MS)  # waits for b (ends at 8) and c (ends at 6)
    assert tl.makespan_s == pytest.approx(9 * MS)
    assert tl.serial_s == pytest.approx(13 * MS)
    # loads: cpu runs a, c, d (7 ms); gpu runs b and receives x (6 ms)
    assert tl.load_s == pytest.approx({"cpu": 7 * MS, "gpu": 6 * MS})
    assert tl.bottleneck_s == pytest.approx(7 * MS)


def _two_layer_table(mode: str) -> LayerTable:
    t = np.array([[3.0, 10.0], [10.0, 4.0]]) * MS  # layer 0 fast on d0, layer 1 fast on d1
    xt = np.full((3, 2, 2), 0.5 * MS)
    for d in range(2):
        xt[:, d, d] = 0.0
    return LayerTable(["d0", "d1"], t, t * 2, np.full((2, 2), 0.5), np.ones(2), np.array([10.0, 10.0]), xt,
                      xt * 3, entry=0, exit=0, aux_time=(1 * MS, 2 * MS), aux_energy=0.0, latency_mode=mode)


def test_stage_bottleneck_is_the_load_of_the_device_hosting_embedding_layers_and_head():
    # plan d0[0] d1[1]: embedding 1 + layer0 3 on d0, transfer 0.5 + layer1 4 on d1, exit transfer 0.5 + head 2
    # back on d0. d0's load is 1 + 3 + 0.5 + 2 = 6.5 ms (a stage-wise max would say 4.5, d1's stage)
    f_b = objectives(_two_layer_table("bottleneck"), (0, 1))
    f_t = objectives(_two_layer_table("total"), (0, 1))
    assert f_b[1] == pytest.approx(6.5 * MS)
    assert f_t[1] == pytest.approx(11.0 * MS)
    tl = list_schedule(stage_tasks(_two_layer_table("bottleneck"), (0, 1)))
    assert [s.lane for s in tl.spans] == ["d0", "d0", "d0->d1", "d1", "d1->d0", "d0"]
    assert tl.makespan_s == pytest.approx(f_t[1]) and tl.bottleneck_s == pytest.approx(f_b[1])


@pytest.mark.parametrize("mode", ["bottleneck", "total"])
def test_exact_front_minimizes_the_timeline_objective(mode):
    table = _two_layer_table(mode)
    brute, _ = exhaustive_front(table)
    got = exact_front(table).archive
    assert set(got.items) == set(brute.items)
    for key, (f, _) in got.items.items():
        tl = list_schedule(stage_tasks(table, key))
        assert f[1] == pytest.approx(tl.makespan_s if mode == "total" else tl.bottleneck_s)
