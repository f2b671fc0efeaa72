"""Thermal simulation of sustained generation: fixed placement vs Φ-guided re-placement (all figures modeled).

The workload is back-to-back decoding of a model (``duty`` of the time; idle the rest) on an SoC. A *plan* is
the model's decode program placed for one situation (:class:`~hetforge.hardware.situation.Situation`: device
temperatures and throttled clocks, so placement sees Φ(T) and slower throttled peaks) and compiled for real;
it is run once and its per-token figures come from the runtime's ledger (the list-scheduled modeled timeline)
re-costed on the nominal SoC: per device, busy time ``b_d`` and energy ``E_d`` at Φ = 1 and full clock, and the
token's makespan ``L``.

Every step of ``dt`` seconds, with device temperatures ``T_d`` and clocks ``f_d`` (1 or the throttled clock):

* token time ``L' = L + Σ_d b_d·(1/f_d − 1)`` (a throttled device's work stretches; serial bound);
* tokens/s ``= duty / L'``;
* device power ``P_d = idle_d + tokens/s · E_d / Φ(T_d)`` (the cost model's leakage term: a hot device spends
  more energy on the same work), held at most at ``TDP_d`` by the power limiter — while throttled, at most at
  the power that settles at its throttle point, ``(throttle − ambient)/R`` (the governor holds the trip
  temperature) — a device whose demand would exceed its cap slows the token (tokens/s and every device's
  active power scale down together); energy per token is kept at a throttled clock (conservative) — the input of the
  lumped RC model (:mod:`hetforge.cost.thermal_rc`), which advances the temperatures and counts throttling
  events.

Policies:

* ``fixed`` — the nominal plan all the time (what a static placement does);
* ``phi`` — every ``control_s`` the runtime predicts each device's temperature ``horizon_s`` ahead under each
  cached plan, places the model again for the predicted situation (the device nearest its throttle point at
  its predicted temperature binned to 10 °C, plus throttled clocks: Φ at that temperature feeds the cost model
  and placement; the result is cached per situation, at most ``MAX_PLANS`` of them), and runs the plan with the least
  Φ-weighted active energy per token (placement's objective: idle power is not charged) among those predicted
  to stay ``margin_c`` below every throttle point; when none does, the one that comes closest, *paced*: run at
  the fraction of full rate at which every device's steady state (Φ at the target) stays ``margin_c`` under
  its throttle point (fewer tokens/s now instead of a throttled clock later); a paced plan keeps its pace
  until another plan is chosen.
  Plans for "device d hot" are compiled ahead for every device.

  Hysteresis and dwell (against flapping between two plans): a *safety* switch — the current plan is predicted
  to come within ``margin_c`` of a throttle point — happens at once (that is what keeps throttling away); an
  *energy* switch — the current plan is predicted to stay cool enough but another one spends less — happens only
  when the other plan's Φ-weighted energy per token is at least ``min_gain`` lower (default 10%: the cost
  model's per-plan figures are not trusted to a few percent, and a switch is not free on a real device: a program
  change, cold caches) and the current plan has run for at least ``min_dwell_s`` (default 60 s = 2 τ of the
  shipped RC estimates, τ = R·C = 30 s: a plan's temperatures need about that long to show its own effect rather
  than the transient left by the previous plan; switching faster reacts to that transient and cycles). Before the
  dwell has passed, a safety switch waits too unless the current plan is predicted to come within ``margin_c`` of
  a throttle point within two control periods (the last look at which the controller can still act): two plans
  that each heat a different device past its limit in the long run then alternate at the RC time scale instead
  of every few control periods.
  ``min_dwell_s=0, min_gain=0.05`` is the controller without dwell (what ran before), kept as policy ``phi-nodwell``.

Nothing here is measured: temperatures, power, energy and tokens/s are the cost model's and the RC model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from hetforge.cost.thermal_rc import ThermalParams, ThermalState, thermal_params
from hetforge.errors import UsageError
from hetforge.hardware.situation import Situation

POLICIES = ("fixed", "phi", "phi-nodwell")
TEMP_BIN_C = 10.0
MAX_PLANS = 16  # placements per simulation; beyond it the controller chooses among the cached ones
MIN_DWELL_S = 60.0  # an energy switch only after the current plan ran this long (2 τ of the shipped estimates)
MIN_GAIN = 0.10  # an energy switch only to a plan at least this much cheaper per token (Φ-weighted, modeled)


@dataclass(frozen=True)
class PlanFigures:
    """Per-token modeled figures of one placed decode program on the nominal SoC."""

    key: str  # the situation it was placed for
    makespan_s: float
    busy_s: dict[str, float]
    energy_j: dict[str, float]
    instructions: dict[str, int]
    tokens: int = 1  # tokens one call handles (1 for decode, the prompt tier for prefill)

    def token_time(self, clocks: dict[str, float]) -> float:
        return self.makespan_s + sum(b * (1.0 / clocks.get(d, 1.0) - 1.0) for d, b in self.busy_s.items())

    def power(self, params: ThermalParams, temps: dict[str, float], clocks: dict[str, float],
              duty: float) -> tuple[dict[str, float], float]:
        """(power per device in W, tokens/s) at ``temps`` and ``clocks``."""
        tps = duty * self.tokens / self.token_time(clocks)
        calls = tps / self.tokens
        act = {n: calls * self.energy_j.get(n, 0.0) / d.phi(temps[n]) for n, d in params.devices.items()}
        # the power limiter: no device draws more than its TDP, and a throttled one no more than the power that
        # settles at its throttle point (the governor holds the trip temperature); a device that would, slows
        # the whole token
        cap = {n: d.tdp_w if clocks.get(n, 1.0) >= 1.0 else
               max(d.idle_w, min(d.tdp_w, (d.throttle_c - params.ambient_c) / d.r_k_per_w))
               for n, d in params.devices.items()}
        scale = min([1.0] + [(cap[n] - d.idle_w) / act[n] for n, d in params.devices.items() if act[n] > 0])
        scale = max(scale, 0.0)
        return {n: d.idle_w + scale * act[n] for n, d in params.devices.items()}, tps * scale

    def to_dict(self) -> dict[str, Any]:
        return {"situation": self.key, "modeled_call_ms": 1e3 * self.makespan_s, "tokens_per_call": self.tokens,
                "modeled_busy_ms": {d: 1e3 * v for d, v in self.busy_s.items()},
                "modeled_energy_mj": {d: 1e3 * v for d, v in self.energy_j.items()},
                "instructions_by_device": self.instructions, "figure": "modeled"}


def plan_figures(program, soc, key: str, args: tuple, tokens: int = 1) -> PlanFigures:
    """Run ``program`` (a placed Program) once on ``args`` and read its per-token figures from the ledger,
    every partition re-costed on the nominal ``soc`` (Φ = 1, full clock)."""
    from hetforge.hetero.runner import CallRecord, RunReport, partition_cost
    from hetforge.runtime.ledger import Ledger, Step, _step_figures

    placed = program.placed
    pg = placed.partitions
    program.run(*args)
    rep = placed.last
    calls = []
    for c in rep.calls:
        pc = partition_cost(pg.partitions[c.partition], soc.device(c.device))
        calls.append(replace(c, modeled_s=pc.time_s, modeled_j=pc.energy_j) if isinstance(c, CallRecord) else c)
    rebased = RunReport(rep.wall_s, calls, list(rep.transfers), rep.output_copies, pg=pg, soc=soc)
    ledger = Ledger(soc.name, [Step("decode", 0.0, rebased, placed)])
    f = _step_figures(ledger.steps[0])
    return PlanFigures(key, f["modeled_ms"] / 1e3, {d: v["modeled_ms"] / 1e3 for d, v in f["by_device"].items()},
                       {d: v["modeled_mj"] / 1e3 for d, v in f["by_device"].items()},
                       placed.compiled.program.count_by_device(), tokens)


@dataclass
class PolicyResult:
    """What one policy did over the simulated time (all modeled)."""

    policy: str
    peak_c: dict[str, float]
    events: list[tuple[float, str, float]]
    energy_j: float
    tokens: float
    switches: list[dict[str, Any]] = field(default_factory=list)
    series: list[dict[str, Any]] = field(default_factory=list)
    plans_used: dict[str, float] = field(default_factory=dict)  # situation key → seconds run

    def to_dict(self, series: bool = True) -> dict[str, Any]:
        secs = self.series[-1]["t_s"] if self.series else 0.0
        d = {"policy": self.policy, "peak_temp_c": self.peak_c, "throttling_events": len(self.events),
             "throttling_events_by_device": {n: sum(1 for e in self.events if e[1] == n) for n in self.peak_c},
             "first_throttle_s": self.events[0][0] if self.events else None,
             "energy_j": self.energy_j, "tokens": self.tokens, "mean_tokens_per_s": self.tokens / secs if secs else 0.0,
             "energy_per_token_mj": 1e3 * self.energy_j / self.tokens if self.tokens else None,
             "re_placements": len(self.switches),
             "re_placements_by_kind": {k: sum(1 for s in self.switches if s.get("kind") == k)
                                       for k in ("safety", "energy", "pace")},
             "switch_log": self.switches[:40], "plans_used_s": self.plans_used,
             "figure": "modeled"}
        if series:
            d["series"] = self.series
        return d


class ThermalSimulation:
    """Plans per situation for one model on one SoC, and the two policies run over simulated time."""

    def __init__(self, soc, workload: str, strategy: str = "greedy", objective: str = "energy", duty: float = 1.0,
                 ambient_c: float | None = None, log=None):
        from hetforge.hardware import load_soc
        from hetforge.models.zoo import load_model
        from hetforge.runtime import Engine
        from hetforge.runtime.replan import SituatedPrograms

        if not 0 < duty <= 1:
            raise UsageError(f"--duty must be in (0, 1], got {duty}")
        if ambient_c is not None and not -40 <= ambient_c <= 60:
            raise UsageError(f"--ambient must be in [-40, 60] °C, got {ambient_c}")
        self.soc = load_soc(soc) if isinstance(soc, str) else soc
        self.params = thermal_params(self.soc)
        if ambient_c is not None:
            src = {**self.params.sources, "ambient_c": {"source": "--ambient", "estimate": False}}
            self.params = replace(self.params, ambient_c=ambient_c, sources=src)
        self.duty = duty
        self.log = log or (lambda s: None)
        # the stand-in backends do not matter here (only modeled figures are read): plain torch for every device
        backends = {d: "emulated:torch-cpu" for d in self.soc.device_names[1:]}
        model, _, phase = workload.partition(":")
        phase = phase or "decode"
        if phase not in ("decode", "prefill"):
            raise UsageError(f"--workload '{workload}': the phase must be decode or prefill (MODEL[:decode|:prefill])")
        self.phase = phase
        loaded = load_model(model)
        self.engine = Engine(loaded, soc=self.soc, strategy=strategy, objective=objective, backends=backends)
        tier, self.length, _ = self.engine.plan(16, 16)
        if phase == "prefill":
            self.length = tier
        self.situated = SituatedPrograms(self.engine)
        self.plans: dict[Situation, PlanFigures] = {}
        self.workload, self.strategy, self.objective = workload, strategy, objective

    def plan(self, sit: Situation) -> PlanFigures:
        """The figures of the decode program placed for ``sit`` (placed, compiled and run on first need)."""
        if sit not in self.plans:
            import torch

            prog, _ = self.situated.get(self.phase, self.length, sit)
            if self.phase == "decode":
                args = (torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long),
                        *self.situated.programs(sit).cache(self.length).buffers)
            else:
                args = (torch.zeros((1, self.length), dtype=torch.long), torch.tensor([self.length - 1]))
            n = 1 if self.phase == "decode" else self.length
            self.plans[sit] = plan_figures(prog, self.soc, sit.key(), args, n)
            self.log(f"plan for {sit.key()}: {self.plans[sit].instructions} "
                     f"({1e3 * self.plans[sit].makespan_s:.3f} ms per {self.phase} call, modeled)")
        return self.plans[sit]

    def situation_for(self, temps: dict[str, float], throttled: dict[str, bool]) -> Situation:
        """The situation placement is asked about: the device closest to its throttle point, when it is above its
        Φ reference, at its temperature binned down to 10 °C (capped at the throttle point), and the throttled
        clocks — few distinct situations, so few compilations."""
        devs = self.params.devices
        hot = min(temps, key=lambda n: devs[n].throttle_c - temps[n])
        binned = {}
        if temps[hot] > devs[hot].t_ref_c:
            binned[hot] = min(devs[hot].throttle_c, TEMP_BIN_C * math.floor(temps[hot] / TEMP_BIN_C))
        clocks = {n: devs[n].throttled_clock for n, on in throttled.items() if on}
        return Situation.make(temps=binned, clocks=clocks)

    def prepare(self) -> None:
        """Nominal plan, and one per device placed as if that device were at its throttle point."""
        self.plan(Situation())
        for n, d in self.params.devices.items():
            self.plan(Situation.make(temps={n: d.throttle_c}))

    def run(self, policy: str, seconds: float, dt_s: float = 1.0, control_s: float = 5.0, horizon_s: float = 60.0,
            margin_c: float = 3.0, sample_s: float = 10.0, min_dwell_s: float = MIN_DWELL_S,
            min_gain: float = MIN_GAIN) -> PolicyResult:
        if policy not in POLICIES:
            raise UsageError(f"unknown policy '{policy}'; allowed: {', '.join(POLICIES)}")
        if not 0 <= min_dwell_s <= 3600:
            raise UsageError(f"--min-dwell must be in [0, 3600] s, got {min_dwell_s:g}")
        if not 0 <= min_gain < 1:
            raise UsageError(f"--min-gain must be in [0, 1), got {min_gain:g}")
        if policy == "phi-nodwell":
            min_dwell_s, min_gain = 0.0, 0.05
        p = self.params
        st = ThermalState(p)
        nominal = Situation()
        cur = nominal
        plan = self.plan(cur)
        peak = dict(st.temps)
        energy = tokens = 0.0
        res = PolicyResult(policy, peak, st.events, 0.0, 0.0)
        pace = 1.0
        since = -math.inf  # when the current plan was chosen (the first plan was not a switch: no dwell on it)
        steps = int(round(seconds / dt_s))
        every = max(1, int(round(control_s / dt_s)))
        sample = max(1, int(round(sample_s / dt_s)))
        for k in range(steps):
            clocks = {n: st.clock(n) for n in p.devices}
            if policy != "fixed" and k % every == 0:
                prev = cur
                cur, plan, pace = self._choose(st, cur, plan, pace, clocks, horizon_s, margin_c, res, k * dt_s,
                                               k * dt_s - since, min_dwell_s, min_gain, 2 * control_s)
                if cur != prev:
                    since = k * dt_s
            power, tps = plan.power(p, st.temps, clocks, self.duty * pace)
            st.step(power, dt_s)
            energy += sum(power.values()) * dt_s
            tokens += tps * dt_s
            res.plans_used[cur.key()] = res.plans_used.get(cur.key(), 0.0) + dt_s
            for n, t in st.temps.items():
                peak[n] = max(peak[n], t)
            if (k + 1) % sample == 0:
                res.series.append({"t_s": (k + 1) * dt_s, "temps_c": {n: round(t, 2) for n, t in st.temps.items()},
                                   "tokens_per_s": tps, "power_w": {n: round(w, 3) for n, w in power.items()},
                                   "throttled": [n for n, on in st.throttled.items() if on], "plan": cur.key(),
                                   "pace": pace})
        res.energy_j, res.tokens = energy, tokens
        return res

    def _choose(self, st: ThermalState, cur: Situation, plan: PlanFigures, pace: float, clocks, horizon_s: float,
                margin_c: float, res: PolicyResult, now_s: float, held_s: float = math.inf,
                min_dwell_s: float = 0.0, min_gain: float = 0.05,
                soon_s: float = 10.0) -> tuple[Situation, PlanFigures, float]:
        p = self.params
        power, _ = plan.power(p, st.temps, clocks, self.duty * pace)
        pred = st.predict(power, horizon_s)
        want = self.situation_for(pred, st.throttled)
        if want in self.plans or len(self.plans) < MAX_PLANS:
            self.plan(want)  # placement with Φ at the predicted temperatures
        best = None
        cur_eval = None
        for sit, fig in self.plans.items():
            pw, tps = fig.power(p, st.temps, clocks, self.duty)
            t_pred = st.predict(pw, horizon_s)
            over = max(t_pred[n] - (d.throttle_c - margin_c) for n, d in p.devices.items())
            e_tok = sum(fig.energy_j.get(n, 0.0) / d.phi(t_pred[n]) for n, d in p.devices.items())
            score = (over > 0, over if over > 0 else e_tok)
            if sit == cur:
                cur_eval, cur_pw = (score, sit, fig, t_pred, e_tok), pw
            if best is None or score < best[0]:
                best = (score, sit, fig, t_pred, e_tok)
        kind = "safety"
        if cur_eval is not None and best[1] != cur:
            if not cur_eval[0][0]:
                # the current plan stays cool enough: an energy switch, only past the dwell and the gain threshold
                kind = "energy"
                if held_s < min_dwell_s:
                    return cur, plan, pace
                if best[4] > (1.0 - min_gain) * cur_eval[4]:
                    best = cur_eval
            elif held_s < min_dwell_s:
                # a safety switch before the dwell only when it cannot wait: the current plan would come within
                # margin_c of a throttle point before the controller's next-but-one look
                soon = st.predict(cur_pw, soon_s)
                if max(soon[n] - (d.throttle_c - margin_c) for n, d in p.devices.items()) <= 0:
                    return cur, plan, pace
        (infeasible, _), sit, fig, t_pred, e_tok = best
        new_pace = 1.0
        if infeasible:  # no placement is cool enough: pace the chosen one so every device settles below its limit
            target = {n: d.throttle_c - margin_c for n, d in p.devices.items()}
            pw, _ = fig.power(p, target, clocks, self.duty)
            for n, d in p.devices.items():
                act = pw[n] - d.idle_w
                allowed = (target[n] - p.ambient_c) / d.r_k_per_w - d.idle_w
                if act > 0:
                    new_pace = min(new_pace, allowed / act)
            new_pace = min(1.0, max(0.05, new_pace))
        elif sit == cur:
            new_pace = pace  # a paced plan keeps its (sustainable) pace; a new plan starts at full rate
        if sit == cur and abs(new_pace - pace) > 0.05:
            res.switches.append({"t_s": now_s, "from": cur.key(), "to": sit.key(), "pace": new_pace, "kind": "pace",
                                 "reason": f"no cached placement is predicted to stay {margin_c:g} °C under every "
                                           f"throttle point; generation paced to {new_pace:.2f} of full rate"})
        if sit != cur:
            hot = max(pred, key=lambda n: pred[n] - p.devices[n].throttle_c)
            reason = (f"{hot} predicted {pred[hot]:.1f} °C in {horizon_s:g} s on the current plan (throttle "
                      f"{p.devices[hot].throttle_c:g} °C); new plan {1e3 * e_tok:.3f} mJ/token with Φ at the "
                      f"predicted temperatures, predicted peak {max(t_pred.values()):.1f} °C")
            if new_pace < 1.0:
                reason += f"; paced to {new_pace:.2f} of full rate (no placement is cool enough)"
            if kind == "energy":
                reason = (f"the current plan stays {margin_c:g} °C under every throttle point, but the new plan spends "
                          f"{1e3 * e_tok:.3f} mJ/token vs {1e3 * cur_eval[4]:.3f} (Φ at the predicted temperatures, "
                          f"≥ {100 * min_gain:g}% less) and the current one has run "
                          f"{'since the start' if math.isinf(held_s) else f'{held_s:g} s'} (≥ {min_dwell_s:g} s)")
            res.switches.append({"t_s": now_s, "from": cur.key(), "to": sit.key(), "pace": new_pace, "kind": kind,
                                 "reason": reason})
        return sit, fig, new_pace

    def compare(self, minutes: float, **kw) -> dict[str, Any]:
        """Both policies over ``minutes`` of simulated time; one JSON-ready document (all modeled)."""
        if not 0 < minutes <= 24 * 60:
            raise UsageError(f"--minutes must be in (0, 1440], got {minutes}")
        self.prepare()
        fixed = self.run("fixed", 60.0 * minutes, **kw)
        phi = self.run("phi", 60.0 * minutes, **kw)
        nodwell = self.run("phi-nodwell", 60.0 * minutes, **kw)  # shares the plans placed so far (a cache)
        return {"soc": self.soc.name, "workload": self.workload, "phase": self.phase, "strategy": self.strategy,
                "objective": self.objective, "minutes": minutes, "duty": self.duty,
                "thermal": self.params.to_dict(),
                "plans": [f.to_dict() for f in self.plans.values()],
                "fixed": fixed.to_dict(), "phi": phi.to_dict(), "phi_nodwell": nodwell.to_dict(series=False),
                "hysteresis": {"min_dwell_s": kw.get("min_dwell_s", MIN_DWELL_S),
                               "min_gain": kw.get("min_gain", MIN_GAIN),
                               "nodwell": {"min_dwell_s": 0.0, "min_gain": 0.05}},
                "labels": {"all": "modeled (cost model + lumped RC thermal model; nothing here is measured)"}}


def plot(doc: dict[str, Any], path) -> None:
    """Temperatures, throttle points and tokens/s over time, fixed vs Φ-guided, to a PNG (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetforge.files import atomic_path

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (n, d) in enumerate(doc["thermal"]["devices"].items()):
        c = colors[i % len(colors)]
        for pol, style in (("fixed", "--"), ("phi", "-")):
            s = doc[pol]["series"]
            ax1.plot([r["t_s"] / 60 for r in s], [r["temps_c"][n] for r in s], style, color=c, label=f"{n} ({pol})")
        ax1.axhline(d["throttle_c"], color=c, lw=0.6, ls=":")
    ax1.set_ylabel("temperature °C (modeled)")
    ax1.legend(fontsize=7, ncol=3)
    for pol, style in (("fixed", "--"), ("phi", "-")):
        s = doc[pol]["series"]
        ev = doc[pol]["throttling_events"]
        ax2.plot([r["t_s"] / 60 for r in s], [r["tokens_per_s"] for r in s], style,
                 label=f"{pol}: {ev} throttling events, {doc[pol]['energy_j'] / 1e3:.1f} kJ")
    ax2.set_ylabel("tokens/s (modeled)")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{doc['workload']} on {doc['soc']}: fixed placement vs Φ-guided re-placement (modeled)", fontsize=10)
    fig.tight_layout()
    with atomic_path(path, "--out", (".png",)) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
