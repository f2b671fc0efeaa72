"""β_read, the one read-bandwidth definition (hetforge.hardware.bandwidth): its pool, its statistic, its use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.cost import estimate
from hetforge.hardware import load_file, save_spec
from hetforge.hardware.bandwidth import FACTOR, pool_size, pooled_time, read_bandwidth
from hetforge.hardware.calibrate import Measured, host_spec
from hetforge.kernels.native import llc_bytes
from hetforge.ops.registry import OpCall, TensorMeta


def test_read_bandwidth_pool_exceeds_the_last_level_cache_it_read():
    r = read_bandwidth(passes=1)
    assert r.llc_bytes == llc_bytes() > 0
    assert r.buffers >= 2 and r.buffers * r.buffer_bytes >= FACTOR * r.llc_bytes
    assert r.bytes_per_s > 1e6 and r.threads == torch.get_num_threads() and r.passes == 1
    for word in (f"{r.buffers} distinct", "last-level cache", "1 passes", "best read", f"{r.threads} thread"):
        assert word in r.method, word


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 1000), min_size=3, max_size=3), min_size=1, max_size=6),
       st.integers(1, 4))
def test_pooled_time_is_the_mean_over_buffers_of_each_buffers_best(per_pass, count):
    """Call ``i`` of pass ``p`` reads buffer ``i mod count`` and takes ``times[p][i]`` ticks of a fake clock."""
    count = min(count, 3)
    passes = len(per_pass)
    ticks = iter([0] * count + [t for row in per_pass for t in row[:count]])  # the warm-up pass is not timed
    now = [0.0]
    calls = []

    def clock() -> float:
        return now[0]

    def fn() -> None:
        calls.append(1)
        now[0] += next(ticks)

    got = pooled_time(fn, count, passes, clock)
    want = sum(min(row[i] for row in per_pass) for i in range(count)) / count
    assert got == pytest.approx(want)
    assert len(calls) == count * (passes + 1)


def test_bad_inputs_are_refused_with_the_value():
    with pytest.raises(ValueError, match="count and passes"):
        pooled_time(lambda: None, 0, 3)
    with pytest.raises(ValueError, match="buffer_bytes"):
        pool_size(0)
    with pytest.raises(ValueError, match="passes"):
        read_bandwidth(passes=0)


def test_cost_model_prices_a_memory_bound_one_row_product_at_the_read_bandwidth(tmp_path):
    """The host profile's bandwidth is β_read (with its method in the source), and a one-row product's time in
    the cost model is its bytes at that bandwidth plus the dispatch (no fitted factors here)."""
    r = read_bandwidth(passes=1)
    m = Measured(gemm={"fp32": {64: 1e11}}, bw_copy=1.0e9, bw_triad=2.0e9, dispatch_s=5e-6, efficiency={},
                 samples={}, seconds=0.0, threads=torch.get_num_threads(), bw_read=r.bytes_per_s, read=r)
    path = save_spec(host_spec(m, quick=True), tmp_path / "host.json")
    cpu = load_file(path).device("cpu")
    assert cpu.mem_bandwidth == pytest.approx(r.bytes_per_s)
    assert r.method in cpu.sources["mem_bandwidth"]["source"]
    x, w = TensorMeta((1, 1, 3072), torch.float32), TensorMeta((768, 3072), torch.float32)
    c = estimate(OpCall("aten.linear.default", (x, w), {}, (TensorMeta((1, 1, 768), torch.float32),)), cpu)
    assert c.bound == "memory"
    assert c.time_s == pytest.approx(c.bytes / r.bytes_per_s + cpu.dispatch_s, rel=1e-6)
    assert c.bytes >= 768 * 3072 * 4


def test_native_activation_is_costed_per_output_element_from_the_profile(tmp_path):
    """A native ``linear_act`` pays ``overhead_s['native:<op>:act:<act>']`` per output element on top of its
    product; ``none`` and a profile without the key pay nothing more."""
    import dataclasses

    from hetforge.cost import estimate_parts
    from hetforge.hardware import load_soc

    host = load_soc("host").device("cpu")
    cpu = dataclasses.replace(host, overhead_s={k: v for k, v in host.overhead_s.items() if ":act:" not in k})
    x, w = TensorMeta((1, 1, 768), torch.float32), TensorMeta((3072, 768), torch.float32)
    out = (TensorMeta((1, 1, 3072), torch.float32),)

    def cost(dev, act: str) -> float:
        call = OpCall("hetforge.linear_act.default", (x, w, None, act, False), {}, out)
        return estimate_parts(call, dev, native=True)[0][1].time_s

    key = "native:hetforge.linear_act.default:act:gelu_tanh"
    with_term = dataclasses.replace(cpu, overhead_s={**cpu.overhead_s, key: 1e-8})
    assert cost(with_term, "gelu_tanh") - cost(cpu, "gelu_tanh") == pytest.approx(3072 * 1e-8, rel=1e-6)
    assert cost(with_term, "none") == pytest.approx(cost(cpu, "none"))


def test_read_probe_keeps_each_buffers_best_over_its_passes_and_reset_forgets_them():
    """The probe's statistic is β_read's (pool bytes ÷ Σ per-buffer best), on a fake clock: pass 1 reads every
    buffer in 3 ticks, pass 2 in 1 tick; after reset only the new pass counts."""
    from hetforge.hardware.bandwidth import ReadProbe

    now, step = [0.0], [3.0]

    def clock() -> float:
        now[0] += step[0]  # each read of the clock advances it: a timed read spans one step
        return now[0]

    probe = ReadProbe(buffer_bytes=1 << 20, factor=1, clock=clock)
    with pytest.raises(ValueError, match="at least one read_pass"):
        probe.result()
    probe.read_pass()
    assert probe.result().bytes_per_s == pytest.approx(probe.n * 4 / 3.0)
    step[0] = 1.0
    probe.read_pass()
    assert probe.passes == 2 and probe.result().bytes_per_s == pytest.approx(probe.n * 4 / 1.0)
    probe.reset()
    step[0] = 2.0
    probe.read_pass()
    assert probe.passes == 1 and probe.result().bytes_per_s == pytest.approx(probe.n * 4 / 2.0)


def test_pooled_time_runs_before_pass_once_per_timed_pass_outside_the_timing():
    seen, now = [], [0.0]

    def clock() -> float:
        return now[0]

    def fn() -> None:
        now[0] += 1.0

    def before() -> None:
        seen.append(now[0])
        now[0] += 100.0  # untimed: must not reach the result

    assert pooled_time(fn, 2, 3, clock, before_pass=before) == pytest.approx(1.0)
    assert len(seen) == 3


def test_a_dram_stream_benchmark_is_reported_at_calibrations_bandwidth(monkeypatch):
    """calibrate._time_bench scales a pooled stream's time by β_window / β: a benchmark timed while the host
    read at half calibration's bandwidth is reported at half its measured time."""
    import hetforge.hardware.calibrate as cal
    from hetforge.hardware import bandwidth as bwmod

    class HalfProbe:
        def reset(self):
            pass

        def read_pass(self):
            pass

        def result(self):
            return bwmod.ReadBandwidth(bytes_per_s=5e9, buffers=2, buffer_bytes=1, llc_bytes=1, passes=1,
                                       threads=1, kernel="fake")

    monkeypatch.setattr(cal, "pooled_time", lambda fn, count, passes, clock, before_pass=None: 8e-3)
    monkeypatch.setattr(cal, "_pools", [(4, cal.STREAM_COPY_BYTES)])
    monkeypatch.setattr(cal, "_probe", [HalfProbe()])
    monkeypatch.setattr(cal, "_beta", [10e9])
    assert cal._time_bench(lambda: None, True, True, 0.01) == pytest.approx(4e-3)
    monkeypatch.setattr(cal, "_probe", [None])
    assert cal._time_bench(lambda: None, True, True, 0.01) == pytest.approx(8e-3)
