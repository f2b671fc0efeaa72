/* hetforge report: renders the inline JSON (#report-data) into tables and Plotly charts. Plotly.js is inlined
   gzip-compressed (#plotly-gz) and decompressed with the browser's DecompressionStream: no network. */
"use strict";
const D = JSON.parse(document.getElementById("report-data").textContent);
const T0 = performance.now();
const $ = (s, el) => (el || document).querySelector(s);
const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

function si(x, unit) {
  if (x == null || !isFinite(x)) return "–";
  if (x === 0) return "0 " + unit;
  const a = Math.abs(x);
  const pre = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"], [1, ""], [1e-3, "m"], [1e-6, "µ"], [1e-9, "n"]];
  for (const [s, p] of pre) if (a >= s) return (x / s).toPrecision(3) + " " + p + unit;
  return x.toExponential(2) + " " + unit;
}
function bytes(n) {
  if (n == null) return "–";
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(2) + " MiB";
  if (n >= 1024) return (n / 1024).toFixed(1) + " KiB";
  return n + " B";
}
function fig(x, unit) { return unit === "B" ? bytes(x) : si(x, unit); }
function tag(f) { const c = /^measured/.test(f) ? "measured" : /^modeled/.test(f) ? "modeled" : ""; return `<span class="tag ${c}">${esc(f)}</span>`; }
function table(head, rows, numeric) {
  numeric = numeric || [];
  const th = head.map((h, i) => `<th class="${numeric.includes(i) ? "num" : ""}">${esc(h)}</th>`).join("");
  const tr = rows.map((r) => "<tr>" + r.map((c, i) => `<td class="${numeric.includes(i) ? "num" : ""}">${c}</td>`).join("") + "</tr>").join("");
  return `<table><thead><tr>${th}</tr></thead><tbody>${tr}</tbody></table>`;
}
function done(id, n) { const s = document.getElementById(id); if (s) { s.dataset.rendered = "1"; s.dataset.items = String(n); } }
function notReached(id, what) {
  const s = document.getElementById(id); if (!s) return;
  const why = D.failure ? `not reached: the <b>${esc(D.failure.stage)}</b> stage failed` : esc(what || "no data");
  $(".body", s).innerHTML = `<p class="notreached">${why}</p>`;
  s.dataset.rendered = "0";
}
const DEV_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"];
const devColor = (d) => DEV_COLORS[Math.max(0, (D.devices || []).findIndex((x) => x.name === d)) % DEV_COLORS.length];
const LAYOUT = {margin: {l: 70, r: 20, t: 36, b: 50}, font: {size: 12}, hovermode: "closest", legend: {orientation: "h", y: -0.18}};
const CONF = {responsive: true, displaylogo: false};

/* ---------- sections that need no chart library ---------- */
function renderFailure() {
  if (!D.failure) return;
  const s = $("#failure"); s.hidden = false;
  $(".body", s).innerHTML = `<p>Stage <b>${esc(D.failure.stage)}</b> failed: <code>${esc(D.failure.error)}</code></p>` +
    `<p class="muted">Stages: ${(D.stages || []).map((x) => `${esc(x.name)} ${x.status === "ok" ? "✓" : "✗"} (${si(x.seconds, "s")})`).join(" → ")} (measured)</p>`;
}
function renderSummary() {
  const kv = [["model", D.model], ["SoC", `${D.soc} (${(D.devices || []).map((d) => `${d.name}: ${d.kind}, ${d.tdp_w} W`).join("; ")})`],
    ["strategy", D.strategy + (D.objective ? ` (objective ${D.objective})` : "")], ["quantization", D.quantize || "none"]];
  if (D.seq) kv.push(["sequence length", D.seq]);
  if (D.kind === "generation") { kv.push(["prompt", D.prompt]); kv.push(["generated", D.text]); kv.push(["stop", D.stop_reason]); }
  if (D.fidelity) kv.push(["fidelity vs eager (measured)", `<span class="${D.fidelity.passed ? "pass" : "fail"}">${D.fidelity.passed ? "PASS" : "FAIL"}</span> — KL mean ${D.fidelity.kl_mean.toExponential(2)}, max ${D.fidelity.kl_max.toExponential(2)} (threshold ${D.fidelity.kl_threshold}), max |Δ| ${D.fidelity.max_abs_err.toExponential(2)}, top-1 agreement ${D.fidelity.top1_agree}`]);
  if (D.bindings) kv.push(["backends on this host", Object.entries(D.bindings).map(([d, b]) => `${d}: ${b.spec || b.backend}${b.emulated ? " (emulated)" : ""}`).join(", ")]);
  if (D.stages && D.stages.length) kv.push(["stages (measured)", D.stages.map((x) => `${esc(x.name)} ${si(x.seconds, "s")}${x.status === "ok" ? "" : " ✗"}`).join(" · ")]);
  let html = '<div class="kv">' + kv.map(([k, v]) => `<div>${esc(k)}</div><div>${k === "prompt" || k === "generated" ? esc(v) : v}</div>`).join("") + "</div>";
  if (D.totals && D.totals.length) html += "<h3>Totals</h3>" + table(["what", "value", "figure"], D.totals.map((t) => [esc(t.what), fig(t.value, t.unit), tag(t.figure)]), [1]);
  $("#summary .body").innerHTML = html;
  done("summary", kv.length + (D.totals || []).length);
}
function renderPassesTable() {
  const P = D.passes;
  if (!P || !P.enabled) return notReached("passes", P ? "passes were disabled" : "");
  const rows = P.passes.map((p) => [esc(p.name), p.nodes_before, p.nodes_after, p.rewrites,
    p.near_misses ? `<span title="${esc(p.near_miss_list.map((m) => `${m.kind} at ${m.node}: ${m.reason}`).join("\n"))}">${p.near_misses}</span>` : 0,
    esc(Object.entries(p.rewrite_kinds).map(([k, v]) => `${k} ×${v}`).join(", ")), si(p.seconds, "s")]);
  let html = `<p>${P.nodes_before} → ${P.nodes_after} nodes; fused ops: ${esc(Object.entries(P.fused).filter(([, v]) => v).map(([k, v]) => `${k} ×${v}`).join(", ") || "none")}</p>`;
  html += table(["pass", "nodes before", "after", "rewrites", "near-misses", "rewrite kinds", "seconds (measured)"], rows, [1, 2, 3, 4, 6]);
  const nm = P.passes.flatMap((p) => p.near_miss_list.map((m) => [esc(p.name), esc(m.kind), `<code>${esc(m.node)}</code>`, esc(m.reason)]));
  if (nm.length) html += "<h3>Near-misses (left alone on purpose)</h3>" + table(["pass", "pattern", "node", "why"], nm);
  if (P.quantize) html += `<p class="muted">quantization: ${esc(JSON.stringify(P.quantize))}</p>`;
  $("#passes .body").innerHTML = html;
  const sel = $("#rewrite-select");
  sel.innerHTML = P.rewrites.map((r, i) => `<option value="${i}">${esc(r.pass)}: ${esc(r.kind)} — ${r.before.length} node(s) → ${esc(r.after ? r.after[0] : "removed")}</option>`).join("");
  if (P.chosen != null) sel.value = String(P.chosen);
  sel.addEventListener("change", () => showRewrite(+sel.value));
  if (P.rewrites.length) showRewrite(P.chosen || 0);
  done("passes", P.passes.length);
}
function showRewrite(i) {
  const r = D.passes.rewrites[i];
  const node = (n) => `<div class="n"><b>${esc(n[0])}</b> = <span class="op">${esc(n[1])}</span>(${esc((n[2] || []).join(", "))})</div>`;
  const inside = new Set(r.before.map((n) => n[0]));
  const ext = [...new Set(r.before.flatMap((n) => (n[2] || []).filter((a) => !inside.has(a))))];
  $("#rewrite-view").innerHTML = `<div class="graph"><h4>before: ${r.before.length} node(s) matched by ${esc(r.pass)}</h4>` +
    `<div class="muted">inputs from outside: ${esc(ext.join(", ") || "none")}</div>${r.before.map(node).join("")}</div>` +
    `<div class="graph"><h4>after</h4>${r.after ? node(r.after) : '<p class="muted">removed (no replacement)</p>'}` +
    `<p class="muted">${esc(r.detail)}</p></div>`;
}
const NODE = {};
function renderPlacementTable() {
  const P = D.placement;
  if (!P) return notReached("placement");
  const cost = P.plan_cost;
  let html = `<p>strategy <b>${esc(P.strategy)}</b>${P.objective ? `, objective <b>${esc(P.objective)}</b>` : ""}: ` +
    Object.entries(P.counts).map(([d, n]) => `<span style="color:${devColor(d)}">■</span> ${esc(d)} ${n} nodes`).join(", ") + "</p>";
  if (cost) html += `<p class="muted">whole plan (ops in sequence, modeled): ${si(cost.time_s, "s")}, ${si(cost.energy_j, "J")}; ${cost.transfers} transfers (${bytes(cost.transfer_bytes)}), ${cost.switches_fx_order} device switches in graph order</p>`;
  if (P.fallbacks && P.fallbacks.length) html += `<p class="muted">${P.fallbacks.length} node(s) fell back from their preferred device</p>`;
  $("#placement .body").innerHTML = html;
  $("#node-table thead").innerHTML = "<tr><th>node</th><th>op</th><th>stage</th><th>device</th><th class='num'>time</th><th class='num'>energy</th><th>why here</th></tr>";
  const di = Object.fromEntries(P.devices.map((d, i) => [d, i]));
  const fd = $("#device-filter"), fs = $("#stage-filter");
  P.devices.forEach((d) => fd.insertAdjacentHTML("beforeend", `<option value="${esc(d)}">${esc(d)}</option>`));
  [...new Set(P.nodes.map((n) => n.stage))].forEach((s) => fs.insertAdjacentHTML("beforeend", `<option value="${esc(s)}">${esc(s)}</option>`));
  const body = $("#node-table tbody");
  body.innerHTML = P.nodes.map((n, i) => {
    const c = n.costs[di[n.device]] || [];
    NODE[n.name] = n;
    return `<tr class="clickable" data-i="${i}" data-node="${esc(n.name)}" data-device="${esc(n.device)}" data-stage="${esc(n.stage)}">` +
      `<td><code>${esc(n.name)}</code></td><td>${esc(n.op)}</td><td>${esc(n.stage)}</td><td style="color:${devColor(n.device)}">${esc(n.device)}</td>` +
      `<td class="num">${si(c[2], "s")}</td><td class="num">${si(c[3], "J")}</td><td title="${esc(n.reason)}">${esc(n.reason)}</td></tr>`;
  }).join("");
  const hay = P.nodes.map((n) => `${n.name} ${n.op} ${n.stage} ${n.reason}`.toLowerCase());
  const apply = () => {
    const q = $("#node-search").value.trim().toLowerCase(), dv = fd.value, st = fs.value;
    let shown = 0;
    for (const tr of body.rows) {
      const i = +tr.dataset.i, n = P.nodes[i];
      const ok = (!q || hay[i].includes(q)) && (!dv || n.device === dv) && (!st || n.stage === st);
      tr.hidden = !ok; if (ok) shown++;
    }
    $("#node-count").textContent = `${shown} of ${P.nodes.length} nodes`;
  };
  $("#node-search").addEventListener("input", apply); fd.addEventListener("change", apply); fs.addEventListener("change", apply);
  body.addEventListener("click", (e) => { const tr = e.target.closest("tr"); if (tr) showNode(+tr.dataset.i); });
  apply();
  done("placement", P.nodes.length);
}
function showNode(i) {
  const P = D.placement, n = P.nodes[i];
  document.querySelectorAll("#node-table tr.sel").forEach((t) => t.classList.remove("sel"));
  const tr = document.querySelector(`#node-table tr[data-i="${i}"]`); if (tr) tr.classList.add("sel");
  const rows = P.devices.map((d, j) => { const c = n.costs[j];
    return [(d === n.device ? "<b>" + esc(d) + " ★</b>" : esc(d)), c[0] ? "yes" : `<span class="fail">no</span> ${esc(c[1])}`,
      si(c[2], "s"), si(c[3], "J"), c[4] == null ? "–" : c[4].toFixed(3), esc(c[5]), si(c[6], "s"), si(c[7], "s"), si(c[8], "s"), si(c[9], "J")]; });
  $("#node-detail").innerHTML = `<h3><code>${esc(n.name)}</code> → ${esc(n.device)}</h3>` +
    `<p>${esc(n.op)}, stage ${esc(n.stage)}; ${si(n.flops, "FLOP")}, ${bytes(n.bytes)} moved, output ${bytes(n.output_bytes)}</p>` +
    `<p><b>why here:</b> ${esc(n.reason)}</p>` + (n.rejections.length ? `<p><b>rejected:</b> ${n.rejections.map((r) => `${esc(r.device)}: ${esc(r.why)}`).join("; ")}</p>` : "") +
    table(["device", "runs?", "time", "energy", "DASI", "bound", "xfer in", "xfer out", "total time", "total energy"], rows, [2, 3, 4, 6, 7, 8, 9]) +
    '<div id="node-chart" class="chart" style="min-height:260px"></div>';
  if (window.Plotly) {
    const ok = n.costs.map((c) => c[0]);
    Plotly.newPlot("node-chart", [
      {type: "bar", name: "op time (modeled)", x: P.devices, y: n.costs.map((c) => c[2] * 1e6), marker: {color: P.devices.map(devColor), opacity: ok.map((o) => (o ? 1 : 0.3))}},
      {type: "bar", name: "+ transfers (modeled)", x: P.devices, y: n.costs.map((c) => (c[8] - c[2]) * 1e6), marker: {color: "#bbb"}},
    ], {...LAYOUT, barmode: "stack", height: 260, title: {text: "time on each device, µs (modeled)", font: {size: 13}}, yaxis: {title: "µs"}}, CONF);
  }
}
function renderTokensTable() {
  if (D.kind !== "generation") return;
  const rows = (D.tokens || []).map((t) => [t.i, `<code>${esc(JSON.stringify(t.text))}</code>`, esc(t.step), si(t.measured_s, "s"), si(t.modeled_s, "s"), si(t.modeled_j, "J"), t.switches == null ? "–" : t.switches]);
  $("#tokens .body").innerHTML = table(["#", "token", "step", "host time (measured)", "SoC time (modeled)", "SoC energy (modeled)", "switches"], rows, [0, 3, 4, 5, 6]);
  done("tokens", rows.length);
}
function renderReproduce() {
  const cmds = D.reproduce || [];
  $("#reproduce .body").innerHTML = `<p class="muted">Report written ${esc(D.generated_utc)} by hetforge ${esc(D.version)}; every figure above comes from these runs.</p>` +
    `<pre><code>${cmds.map(esc).join("\n")}</code></pre>`;
  done("reproduce", cmds.length);
}

/* ---------- charts (Plotly) ---------- */
function chartPasses() {
  const P = D.passes; if (!P || !P.enabled) return;
  Plotly.newPlot("passes-chart", [
    {type: "bar", name: "nodes before", x: P.passes.map((p) => p.name), y: P.passes.map((p) => p.nodes_before), marker: {color: "#9ab"}},
    {type: "bar", name: "nodes after", x: P.passes.map((p) => p.name), y: P.passes.map((p) => p.nodes_after), marker: {color: "#4c78a8"}},
    {type: "scatter", mode: "markers", name: "rewrites", x: P.passes.map((p) => p.name), y: P.passes.map((p) => p.rewrites), yaxis: "y2", marker: {color: "#f58518", size: 10, symbol: "diamond"}},
  ], {...LAYOUT, title: {text: "graph nodes per pass", font: {size: 13}}, yaxis: {title: "nodes"}, yaxis2: {title: "rewrites", overlaying: "y", side: "right"}}, CONF);
}
function chartPareto() {
  const F = D.pareto;
  if (!F || !F.available) return notReached("pareto", F ? F.why : "");
  const f = F.front, ch = f.filter((p) => p.chosen);
  const hov = (p) => `${p.plan}<br>energy ${si(p.energy_j, "J")}<br>${F.latency_mode} latency ${si(p.latency_s, "s")}<br>min DASI ${p.min_dasi.toFixed(3)}`;
  Plotly.newPlot("pareto-chart", [
    {type: "scatter", mode: "markers+lines", name: `front (${f.length} plans)`, x: f.map((p) => p.latency_s * 1e3), y: f.map((p) => p.energy_j * 1e3),
      text: f.map(hov), hoverinfo: "text", line: {dash: "dot", color: "#aaa"},
      marker: {size: 9, color: f.map((p) => p.min_dasi), colorscale: "Viridis", showscale: true, colorbar: {title: "min DASI"}}},
    {type: "scatter", mode: "markers", name: `chosen (${F.objective})`, x: ch.map((p) => p.latency_s * 1e3), y: ch.map((p) => p.energy_j * 1e3),
      text: ch.map(hov), hoverinfo: "text", marker: {size: 18, symbol: "star", color: "#e45756", line: {width: 1, color: "#000"}}},
    {type: "scatter", mode: "markers", name: "baselines: one device", x: F.baselines.map((b) => b.latency_s * 1e3), y: F.baselines.map((b) => b.energy_j * 1e3),
      text: F.baselines.map((b) => hov(b) + (b.fits ? "" : "<br><b>does not fit in memory</b>")), hoverinfo: "text",
      marker: {size: 12, symbol: F.baselines.map((b) => (b.fits ? "x" : "x-open")), color: "#333"}},
  ], {...LAYOUT, title: {text: "energy vs latency of stage plans (modeled)", font: {size: 13}}, xaxis: {title: `${F.latency_mode} latency, ms`, type: "log"}, yaxis: {title: "energy, mJ", type: "log"}}, CONF);
  const s = F.search || {};
  $("#pareto .body").innerHTML = `<p>${esc(F.source)}; ${F.layers} decoder layers, ${s.plans != null ? Number(s.plans).toLocaleString() + " stage plans" : ""}; embedding → ${esc(F.aux.embed)}, LM head → ${esc(F.aux.head)}.</p>` +
    table(["plan", "energy", `${F.latency_mode} latency`, "min DASI", ""], f.map((p) => [esc(p.plan), si(p.energy_j, "J"), si(p.latency_s, "s"), p.min_dasi.toFixed(3), p.chosen ? "★ chosen" : ""])
      .concat(F.baselines.map((b) => [esc(b.plan) + " (baseline)", si(b.energy_j, "J"), si(b.latency_s, "s"), b.min_dasi.toFixed(3), b.fits ? "" : "does not fit"])), [1, 2, 3]);
  done("pareto", f.length);
}
function chartRoofline() {
  const R = D.roofline; if (!R) return notReached("roofline");
  const ais = R.ops.flatMap((o) => o.pts.filter(Boolean).map((p) => p[0]));
  const lo = Math.min(0.01, ...ais) / 2, hi = Math.max(1000, ...ais) * 2;
  const xs = Array.from({length: 121}, (_, i) => lo * (hi / lo) ** (i / 120));
  const traces = [];
  R.devices.forEach((d, j) => {
    const c = devColor(d.name);
    traces.push({type: "scatter", mode: "lines", name: `${d.name} roof (π ${si(d.peak_flops, "FLOP/s")}, β ${si(d.bandwidth, "B/s")})`, x: xs, y: xs.map((x) => Math.min(d.peak_flops, d.bandwidth * x)), line: {color: c, width: 2}, hoverinfo: "name"});
    const mine = R.ops.filter((o) => o.device === d.name && o.pts[j]);
    const rest = R.ops.filter((o) => o.device !== d.name && o.pts[j]);
    const pt = (arr, vis, sym) => ({type: "scatter", mode: "markers", visible: vis, name: `${d.name}: ${vis === true ? "ops placed here" : "other ops, if run here"}`,
      x: arr.map((o) => o.pts[j][0]), y: arr.map((o) => o.pts[j][1]), marker: {color: c, size: 7, symbol: sym, opacity: 0.75},
      text: arr.map((o) => `${o.name} (${o.op})<br>on ${d.name}: AI ${o.pts[j][0].toPrecision(3)} FLOP/B, ${si(o.pts[j][1], "FLOP/s")}, ${si(o.pts[j][3], "s")}, ${o.pts[j][2]}-bound<br>placed on ${o.device}`), hoverinfo: "text"});
    traces.push(pt(mine, true, "circle"));
    traces.push(pt(rest, "legendonly", "circle-open"));
  });
  const idx = Object.fromEntries((D.placement ? D.placement.nodes : []).map((n, i) => [n.name, i]));
  traces.forEach((t) => { if (t.mode === "markers") t.customdata = t.text.map((s) => s.split(" ")[0]); });
  Plotly.newPlot("roofline-chart", traces, {...LAYOUT, height: 520, title: {text: "attained FLOP/s vs arithmetic intensity (modeled; roofs at fp32 peak)", font: {size: 13}},
    xaxis: {title: "arithmetic intensity, FLOP/byte", type: "log"}, yaxis: {title: "FLOP/s", type: "log"}}, CONF);
  $("#roofline-chart").on("plotly_click", (ev) => {  // a point → that node's "why here" in the placement section
    const name = ev.points[0] && ev.points[0].customdata;
    if (name in idx) { showNode(idx[name]); $("#placement").scrollIntoView({behavior: "smooth"}); }
  });
  const n = R.ops.filter((o) => o.pts.some(Boolean)).length;
  $("#roofline .body").innerHTML = `<p>${n} of ${R.ops.length} ops do arithmetic (the rest move or view data). Ridge points: ${R.devices.map((d) => `${esc(d.name)} ${d.ridge.toFixed(1)} FLOP/B`).join(", ")}. Click a legend entry to show every op's cost on another device; click a point to open that node's placement.</p>`;
  done("roofline", R.ops.length);
}
function chartMemory() {
  const M = D.memory; if (!M) return notReached("memory");
  const box = $("#memory-charts"); box.innerHTML = "";
  const rows = [];
  let k = 0;
  for (const [d, m] of Object.entries(M.devices)) {
    rows.push([esc(d), m.buffers.length, bytes(m.naive_bytes), bytes(m.arena_bytes), bytes(m.lower_bound_bytes), esc(m.algorithm)]);
    if (!m.buffers.length) continue;
    const id = `mem-chart-${k++}`;
    box.insertAdjacentHTML("beforeend", `<div id="${id}" class="chart"></div>`);
    const b = m.buffers;
    Plotly.newPlot(id, [
      {type: "bar", name: "buffer (offset × lifetime)", x: b.map((r) => (r[2] + r[3] + 1) / 2), width: b.map((r) => r[3] - r[2] + 1), base: b.map((r) => r[4]), y: b.map((r) => r[5]),
        marker: {color: devColor(d), opacity: 0.7, line: {color: "#fff", width: 0.5}},
        text: b.map((r) => `%${r[0]} ${r[1]}<br>${bytes(r[5])} at offset ${bytes(r[4])}<br>live at instructions ${r[2]}..${r[3]}`), hoverinfo: "text", textposition: "none"},
      {type: "scatter", mode: "lines", name: "live bytes", x: m.live_bytes.map((_, i) => i), y: m.live_bytes, line: {shape: "hv", color: "#333", width: 1}},
      {type: "scatter", mode: "lines", name: `lower bound ${bytes(m.lower_bound_bytes)}`, x: [0, M.positions], y: [m.lower_bound_bytes, m.lower_bound_bytes], line: {dash: "dash", color: "#e45756"}},
      {type: "scatter", mode: "lines", name: `arena ${bytes(m.arena_bytes)}`, x: [0, M.positions], y: [m.arena_bytes, m.arena_bytes], line: {dash: "dot", color: "#000"}},
    ], {...LAYOUT, bargap: 0, title: {text: `${d} arena: ${b.length} buffers (time × offset)`, font: {size: 13}}, xaxis: {title: "instruction position (final order)"}, yaxis: {title: "byte offset"}}, CONF);
  }
  $("#memory .body").innerHTML = table(["device", "buffers", "naive (one allocation each)", "planned arena", "lower bound (max live)", "packing"], rows, [1, 2, 3, 4]);
  done("memory", rows.length);
}
function chartSchedule() {
  const S = D.schedule;
  if (!S || !S.available) return notReached("schedule", "no partitioned run");
  const kinds = {call: "#4c78a8", switch: "#d62728", transfer: "#7f7f7f"};
  const traces = Object.entries(kinds).map(([k, c]) => {
    const sp = S.spans.filter((s) => s[0] === k);
    return {type: "bar", orientation: "h", name: k === "call" ? "partition call" : k, y: sp.map((s) => s[1]), base: sp.map((s) => s[3] * 1e3), x: sp.map((s) => Math.max(s[4] * 1e3, 1e-6)),
      marker: {color: k === "call" ? sp.map((s) => devColor(s[1])) : c, line: {color: "#fff", width: 0.5}},
      text: sp.map((s) => `${s[2]}<br>${s[1]}: ${si(s[3], "s")} + ${si(s[4], "s")}${s[5] ? `, ${si(s[5], "J")}` : ""}`), hoverinfo: "text", textposition: "none"};
  });
  const lanes = [...new Set(S.spans.map((s) => s[1]))];
  Plotly.newPlot("schedule-chart", traces, {...LAYOUT, height: 160 + 40 * lanes.length, barmode: "overlay",
    title: {text: `${esc(S.label || "")}: modeled list schedule (drag to zoom, double-click to reset)`, font: {size: 13}},
    xaxis: {title: "ms from the start (modeled)", rangeslider: {visible: true}}, yaxis: {categoryorder: "array", categoryarray: lanes.slice().reverse()}}, CONF);
  const m = S.modeled, me = S.measured || {};
  $("#schedule .body").innerHTML = `<p>makespan ${si(m.makespan_s, "s")} vs ${si(m.serial_s, "s")} if nothing overlapped; energy ${si(m.energy_j, "J")}; ` +
    `${m.switches} device switches (${si(m.switch_s, "s")}); ${S.spans.filter((s) => s[0] === "transfer").length} transfers on the timeline (all modeled). ` +
    (S.switches_instr ? `Scheduler: ${S.switches_instr.graph_order} switches in graph order → ${S.switches_instr.scheduled} scheduled. ` : "") +
    (me.wall_measured_s != null ? `On this host the same run took ${si(me.wall_measured_s, "s")} (measured, stand-in backends).` : "") + "</p>";
  done("schedule", S.spans.length);
}
function chartTokens() {
  if (D.kind !== "generation" || !(D.tokens || []).length) return;
  const t = D.tokens;
  Plotly.newPlot("tokens-chart", [
    {type: "scatter", mode: "lines+markers", name: "host time, ms (measured)", x: t.map((r) => r.i), y: t.map((r) => r.measured_s * 1e3)},
    {type: "scatter", mode: "lines+markers", name: "SoC time, ms (modeled)", x: t.map((r) => r.i), y: t.map((r) => (r.modeled_s == null ? null : r.modeled_s * 1e3))},
    {type: "bar", name: "SoC energy, mJ (modeled)", x: t.map((r) => r.i), y: t.map((r) => (r.modeled_j == null ? null : r.modeled_j * 1e3)), yaxis: "y2", opacity: 0.35},
  ], {...LAYOUT, title: {text: "per token", font: {size: 13}}, xaxis: {title: "token #"}, yaxis: {title: "ms", type: "log"}, yaxis2: {title: "mJ", overlaying: "y", side: "right"}}, CONF);
}

async function loadPlotly() {
  let t = performance.now();
  const b64 = document.getElementById("plotly-gz").textContent.trim();
  const bin = atob(b64), u8 = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) u8[i] = bin.charCodeAt(i);
  PHASES.plotly_base64 = Math.round(performance.now() - t); t = performance.now();
  const text = await new Response(new Blob([u8]).stream().pipeThrough(new DecompressionStream("gzip"))).text();
  PHASES.plotly_gunzip = Math.round(performance.now() - t); t = performance.now();
  const s = document.createElement("script"); s.textContent = text; document.head.appendChild(s);
  PHASES.plotly_eval = Math.round(performance.now() - t);
}

const PHASES = {};
function phase(name, fn) { const t = performance.now(); try { return fn(); } finally { PHASES[name] = Math.round(performance.now() - t); } }

async function main() {
  phase("tables", () => { renderFailure(); renderSummary(); renderTokensTable(); renderPassesTable(); renderPlacementTable(); renderReproduce(); });
  if (D.failure && !D.placement) ["pareto", "roofline", "memory", "schedule"].forEach((id) => notReached(id));
  if (typeof DecompressionStream === "undefined") {
    document.body.insertAdjacentHTML("afterbegin", '<p class="fail" style="padding:8px 24px">This browser lacks DecompressionStream, so the charts cannot be drawn; the tables are complete.</p>');
  } else {
    const t = performance.now();
    await loadPlotly();
    PHASES.plotly_load = Math.round(performance.now() - t);
    if (D.passes && D.passes.enabled) phase("passes", chartPasses);
    if (!D.failure || D.placement) {
      phase("pareto", chartPareto); phase("roofline", chartRoofline); phase("memory", chartMemory); phase("schedule", chartSchedule);
    }
    phase("tokens", chartTokens);
    if (D.placement && D.placement.nodes.length) phase("node_detail", () => showNode(0));
  }
  window.hetforgeRenderMs = performance.now() - T0;
  window.hetforgePhases = PHASES;
  document.body.dataset.ready = "1";
}
main().catch((e) => { console.error("hetforge report: " + e); document.body.dataset.ready = "error"; });
