"""The native decode kernels' own thread pool (kernels/native.c): calls are split into chunks that whoever runs
claims, so a helper thread that never shows up (descheduled by a busy neighbour) stalls nobody, and results do
not depend on the thread count. Speed under contention is measured by bench/contention.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from test_native import needs_cc

from hetforge.kernels import native

pytestmark = needs_cc


def _kernels(threads: int) -> dict[str, torch.Tensor]:
    """Every pooled kernel on fixed inputs with ``threads`` threads (sizes give each call several chunks)."""
    lib = native.library()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(768, generator=g), torch.randn(3072, 768, generator=g)
    wt, b = w.t().contiguous(), torch.randn(3072, generator=g)
    out = {}
    out["nk"] = native.gemv(x, w, b, torch.empty(3072), False, threads=threads)
    out["kn"] = native.gemv(x, wt, b, torch.empty(3072), True, threads=threads)
    y, part = torch.empty(3072), torch.empty(native.split_k_slots(), 3072)
    lib.hf_linear_act(wt.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), 3072, 768, 1, native.ACT_CODES["gelu"],
                      threads, part.data_ptr(), part.shape[0])
    out["linear_act_kn"] = y
    wg, wu, wd = torch.randn(2048, 768, generator=g), torch.randn(2048, 768, generator=g), w[:768, :2048].contiguous()
    h, y2 = torch.empty(2048), torch.empty(768)
    lib.hf_gated_mlp(x.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), h.data_ptr(), y2.data_ptr(), 2048,
                     768, native.ACT_CODES["silu"], threads)
    out["gated_mlp"] = y2
    q, kc, vc = torch.randn(12, 64, generator=g), torch.randn(12, 40, 64, generator=g), torch.randn(12, 40, 64,
                                                                                                   generator=g)
    kn_, vn_ = torch.randn(12, 64, generator=g), torch.randn(12, 64, generator=g)
    mask, att, scratch = torch.zeros(40), torch.empty(12, 64), \
        torch.empty(12, 41)
    lib.hf_decode_attention(q.data_ptr(), kn_.data_ptr(), vn_.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                            mask.data_ptr(), None, att.data_ptr(), scratch.data_ptr(), 12, 12, 40, 64, 0.125, threads)
    out["attention"] = att
    qw, sc = torch.randint(-127, 128, (3072, 768), generator=g, dtype=torch.int8), torch.rand(3072, generator=g)
    y3 = torch.empty(3072)
    lib.hf_gemv_q8(qw.data_ptr(), sc.data_ptr(), x.data_ptr(), None, y3.data_ptr(), 3072, 768, 0, threads)
    out["q8"] = y3
    out["_ref_nk"] = F.linear(x, w, b)
    return out


def test_results_are_bitwise_the_same_for_any_thread_count():
    one = _kernels(1)
    torch.testing.assert_close(one["nk"], one["_ref_nk"], rtol=1e-4, atol=1e-4)
    for threads in (2, 3):
        other = _kernels(threads)
        for name, t in one.items():
            assert torch.equal(t, other[name]), f"{name} differs between 1 and {threads} threads"


def test_a_two_thread_call_is_split_into_chunks_on_the_pool_and_reads_back():
    before = native.pool_info()
    x, w = torch.randn(768), torch.randn(3072, 768)
    native.gemv(x, w, None, torch.empty(3072), False, threads=2)
    after = native.pool_info()
    assert after.helpers >= 1 and after.spin_us == native.SPIN_US  # a helper exists; idle, it spins, then sleeps
    assert after.jobs == before.jobs + 1
    assert after.chunks - before.chunks >= 16  # 3072 rows of 3 KiB: many small chunks, not one block per thread
    one = native.pool_info()
    native.gemv(x, w, None, torch.empty(3072), False, threads=1)  # one thread: inline, the pool is not used
    assert native.pool_info().jobs == one.jobs


CHILD = """
import torch
from hetforge.kernels import native
x, w = torch.randn(768), torch.randn(3072, 768)
ref = native.gemv(x, w, None, torch.empty(3072), False, threads=1)
native.gemv(x, w, None, torch.empty(3072), False, threads=2)  # start the helper
native.pool_config(hold=True)  # from now on helpers claim nothing, as if always descheduled
before = native.pool_info()
for _ in range(200):
    out = native.gemv(x, w, None, torch.empty(3072), False, threads=2)
    assert torch.equal(out, ref)
after = native.pool_info()
assert after.jobs == before.jobs + 200 and after.chunks_by_helpers == before.chunks_by_helpers, (before, after)
print("ok")
"""


def test_a_call_finishes_when_no_helper_ever_takes_work():
    """With an OpenMP team the caller would wait at the barrier for the absent helper (here: forever); the pool's
    caller runs every chunk itself. A subprocess, so a hang fails the test instead of stopping the suite."""
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


STALL_CHILD = """
import time, torch
from hetforge.kernels import native
x, w = torch.randn(768), torch.randn(3072, 768)
ref = native.gemv(x, w, None, torch.empty(3072), False, threads=1)
native.gemv(x, w, None, torch.empty(3072), False, threads=2)  # start the helper

def calls(seconds):
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        assert torch.equal(native.gemv(x, w, None, torch.empty(3072), False, threads=2), ref)
        n += 1
    return n

# stall threshold 0 (and no taking over): the pool never goes solo, however long a helper holds a chunk
native.pool_config(hold="stall", stall_us=0, steal_us=0)
a = native.pool_info(); n = calls(0.3); b = native.pool_info()
assert b.stalls == a.stalls and b.solo_jobs == a.solo_jobs and b.jobs - a.jobs == n, (a, b)
# a helper that holds each chunk it claims (as if descheduled), with taking chunks over off: the caller goes solo,
# for longer and longer
native.pool_config(hold="stall", steal_us=0)
a = native.pool_info(); n = calls(1.5); b = native.pool_info()
stalls, solo = b.stalls - a.stalls, b.solo_jobs - a.solo_jobs
assert stalls >= 1 and solo >= 1 and b.jobs - a.jobs == n, (a, b)
assert stalls <= 40 and solo > 5 * stalls, (stalls, solo, n)  # a fixed 2 ms backoff: one stall per ~3 ms
# the hook off (which ends the solo period): helpers run chunks again
native.pool_config()
a = native.pool_info(); t0 = time.monotonic()
while native.pool_info().chunks_by_helpers == a.chunks_by_helpers and time.monotonic() - t0 < 20:
    calls(0.01)
b = native.pool_info()
assert b.chunks_by_helpers > a.chunks_by_helpers and b.stall_us == native.STALL_US, (a, b)
print("ok", stalls, solo, n)
"""


def test_a_helper_that_stalls_holding_a_chunk_sends_the_caller_solo_for_doubling_periods_with_the_same_bits():
    """A helper descheduled while it holds a chunk (the test hook ``hold="stall"``) makes the caller wait; after
    such a wait the caller runs the next jobs alone, for periods that double while the helper keeps stalling, so
    a busy neighbour costs a few waits a second, not one per job. Results stay bit-equal to one thread.
    A subprocess: the hook and the solo state are the process's pool's."""
    r = subprocess.run([sys.executable, "-c", STALL_CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


STEAL_CHILD = """
import sys, time, torch
sys.path.insert(0, %r)
from test_native_pool import _kernels
from hetforge.kernels import native
ref = _kernels(1)
_kernels(2)  # start the helpers
assert native.pool_info().steal_signal > 0 and native.pool_info().steal_us == native.STEAL_US
for hold in ("stall", "deaf"):
    # each held chunk held ~10 ms (twice stall_us): a thief (at steal_us = 100 µs) always comes first, even on a
    # loaded machine; no wait gets near 5 ms, so none is a stall
    native.pool_config(hold=hold, stall_us=5000)
    a = native.pool_info(); t0 = time.monotonic(); n = 0
    while time.monotonic() - t0 < 1.0:
        got = _kernels(2)
        for name, t in ref.items():
            assert torch.equal(t, got[name]), (hold, name)
        n += 1
    b = native.pool_info()
    steals, unanswered = b.steals - a.steals, b.steals_unanswered - a.steals_unanswered
    assert steals >= 1 and b.stalls == a.stalls and b.solo_jobs == a.solo_jobs, (hold, a, b)
    # "stall": the helper sleeps holding the chunk, and the signal wakes it (mostly within HF_ACK_US: waking a
    # sleeping thread can take longer); "deaf": it blocks the signal meanwhile, so the thief never hears back and
    # takes the chunk on the promise that the helper leaves it when it next runs
    assert (unanswered < steals) if hold == "stall" else (unanswered == steals), (hold, steals, unanswered)
    assert b.chunks_by_helpers == a.chunks_by_helpers, (hold, a, b)  # every held chunk was taken over
    # steals within 50 ms of each other (a busy neighbour) begin quiet periods: idle helpers stop spinning a while
    assert b.quiet_periods > a.quiet_periods, (hold, a, b)
    print(hold, n, steals, unanswered)
native.pool_config()
print("ok")
"""


def test_a_chunk_a_descheduled_helper_holds_is_taken_over_by_the_caller_with_the_same_bits():
    """The caller waits at most ``STEAL_US`` for a chunk a helper holds, then takes it over: it marks the chunk,
    signals the helper (whose handler leaves the chunk, at once or, if the helper is descheduled, before it runs
    anything else) and runs the chunk itself. Checked with both test hooks: a helper that sleeps holding the chunk
    (the signal wakes it and it answers) and one deaf to the signal until its hold ends (the thief goes on without
    an answer; the helper, when it runs on, leaves the chunk instead of writing it). Every pooled kernel's result
    stays bit-equal to one thread's, no call waits long enough to count as a stall, and no held chunk is finished
    by its helper. Taken-over chunks in quick succession start quiet periods (idle helpers sleep at once instead of
    spinning). A subprocess: the hooks are the process's pool's."""
    child = STEAL_CHILD % os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]


BUSY_CHILD = """
import subprocess, sys, time, torch
sys.path.insert(0, %r)
from test_native_pool import _kernels
from hetforge.kernels import native
ref = _kernels(1)
x, w = torch.randn(768), torch.randn(8192, 768)
gref = native.gemv(x, w, None, torch.empty(8192), False, threads=1)
busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(%d)]
try:
    a = native.pool_info(); t0 = time.monotonic(); n = 0
    while time.monotonic() - t0 < 3.0:
        got = _kernels(2)
        for name, t in ref.items():
            assert torch.equal(t, got[name]), name
        for _ in range(50):  # many back-to-back calls, as in a decode step
            assert torch.equal(native.gemv(x, w, None, torch.empty(8192), False, threads=2), gref)
        n += 1
    b = native.pool_info()
finally:
    for p in busy:
        p.kill(); p.wait()
print("ok", n, b.steals - a.steals, b.steals_unanswered - a.steals_unanswered, b.stalls - a.stalls)
"""


def test_pooled_kernels_beside_busy_processes_give_one_threads_bits():
    """Real preemption, not a hook: with one busy process per CPU beside it, helpers are descheduled at random
    points (their chunks taken over, answered or not, or waited for), and every pooled kernel's two-thread result
    must still be bit-equal to one thread's, call after call, for three seconds. How often chunks were taken over
    is printed, not asserted: it depends on the scheduler."""
    child = BUSY_CHILD % (os.path.dirname(os.path.abspath(__file__)), os.cpu_count() or 2)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]
    print(r.stdout.strip())


MOVE_CHILD = """
import os, threading, time, torch
from hetforge.kernels import native
x, w = torch.randn(768), torch.randn(3072, 768)
ref = native.gemv(x, w, None, torch.empty(3072), False, threads=1)
native.gemv(x, w, None, torch.empty(3072), False, threads=2)  # start the helper
main = threading.get_native_id()
out = {}

def caller():
    me = threading.get_native_id()
    os.sched_setaffinity(0, {0})  # this thread calls the kernels, on CPU 0
    others = [int(t) for t in os.listdir("/proc/self/task") if int(t) not in (me, main)]
    for t in others:  # the helper (and any other thread of ours but main) put next to it
        os.sched_setaffinity(t, {0})
    a = native.pool_info(); t0 = time.monotonic()
    while native.pool_info().moves == a.moves and time.monotonic() - t0 < 10:
        assert torch.equal(native.gemv(x, w, None, torch.empty(3072), False, threads=2), ref)
    out["moves"] = native.pool_info().moves - a.moves
    out["away"] = sum(0 not in os.sched_getaffinity(t) for t in others)

th = threading.Thread(target=caller); th.start(); th.join()
assert out["moves"] >= 1 and out["away"] >= 1, out
print("ok", out)
"""


def test_a_helper_woken_on_the_callers_cpu_moves_to_the_processs_other_cpus():
    """A helper pinned next to the caller (both on CPU 0, the process allowed more) moves off the caller's CPU when
    it joins a job (its affinity loses CPU 0: back to the main thread's set without it), and the results stay
    bit-equal. With a single CPU allowed there is nowhere to go: nothing moves. A subprocess: the affinities are
    the process's threads'."""
    cpus = sorted(os.sched_getaffinity(0))
    child = MOVE_CHILD
    if cpus != [0] and 0 not in cpus:  # the child pins to CPU 0: use the first allowed CPU instead
        child = child.replace("{0}", f"{{{cpus[0]}}}").replace("0 not in", f"{cpus[0]} not in")
    if len(cpus) == 1:  # nowhere to move to: the child checks that nothing moved
        child = child.replace("< 10:", "< 1:").replace('out["moves"] >= 1 and out["away"] >= 1',
                                                        'out["moves"] == 0 and out["away"] == 0')
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-1000:] + r.stderr[-2000:]


# Windows has no fork(); the pool re-creates its helpers only after a fork, so there is nothing to check there.
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only; the pool's fork handling is too")
def test_a_forked_child_computes_with_its_own_helpers():
    x, w = torch.randn(768), torch.randn(3072, 768)
    ref = native.gemv(x, w, None, torch.empty(3072), False, threads=2)  # the parent's helpers exist
    pid = os.fork()
    if pid == 0:  # the child inherits no helper threads; the pool starts its own
        ok = torch.equal(native.gemv(x, w, None, torch.empty(3072), False, threads=2), ref)
        os._exit(0 if ok and native.pool_info().helpers >= 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# Acceptable to skip where there is no fork() (Windows): the state checked here only exists in a forked child.
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform, so no forked child can inherit the "
                    "team switch: the case this test checks cannot happen here")
def test_a_forked_child_runs_on_its_own_pool_even_if_the_parent_was_in_team_mode():
    """libgomp's team does not survive fork(): a child forked while the parent's pooled kernels ran on the team
    (``pool_team(True)``) starts with the switch off and computes on its own helpers instead of hanging."""
    x, w = torch.randn(768), torch.randn(3072, 768)
    ref = native.gemv(x, w, None, torch.empty(3072), False, threads=2)
    native.pool_team(True)
    try:
        pid = os.fork()
        if pid == 0:
            ok = not native.pool_info().team and torch.equal(native.gemv(x, w, None, torch.empty(3072), False,
                                                                        threads=2), ref)
            os._exit(0 if ok else 1)
    finally:
        if pid != 0:
            native.pool_team(False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a hang fails the test instead of stopping the suite
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_an_engine_decode_runs_on_the_pool_and_its_tokens_do_not_depend_on_the_thread_count(monkeypatch):
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    monkeypatch.setenv("HETFORGE_ADAPT_THREADS", "0")  # fixed counts: the tuner would probe 1 thread
    old = torch.get_num_threads()
    eng = Engine(load_model("gpt2-tiny"), executor="auto")
    tokens = {}
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            before = native.pool_info()
            g = eng.stream([5, 6, 7, 8], SamplingParams(max_new_tokens=8, ignore_eos=True))
            list(g)
            tokens[threads] = g.result.tokens
            jobs = native.pool_info().jobs - before.jobs
            assert (jobs >= 7) if threads == 2 else (jobs == 0)  # each 2-thread step splits at least its lm head
    finally:
        torch.set_num_threads(old)
    assert tokens[1] == tokens[2]


def test_in_team_mode_every_pooled_kernel_runs_on_the_openmp_team_with_the_same_bits():
    """``pool_team(True)`` (what a prefill program sets: its GEMMs run on torch's OpenMP team) sends every pooled
    kernel to that team: the pool runs no job, and every result is bit-equal to the pool's."""
    on_pool = _kernels(2)
    before = native.pool_info()
    native.pool_team(True)
    try:
        assert native.pool_info().team
        on_team = _kernels(2)
    finally:
        native.pool_team(False)
    after = native.pool_info()
    assert not after.team and after.jobs == before.jobs
    for name, t in on_pool.items():
        assert torch.equal(t, on_team[name]), name
    _kernels(2)
    assert native.pool_info().jobs > after.jobs  # back on the pool
