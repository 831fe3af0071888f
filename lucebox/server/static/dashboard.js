// The status page: polls /dashboard/data every second and draws it with the vendored uPlot.
// The data route sits behind --api-key: on a 401 the page asks for the key, keeps it in localStorage
// and sends it as a Bearer header from then on.
"use strict";

const KEY_STORE = "lucebox-api-key";
const POLL_MS = 1000;
const TIMELINE_ROWS = 30;
const DASH = "\u2014";

// Tile formats (the browser test formats the data endpoint's numbers the same way).
const fmt = {
  int: (v) => (v == null ? DASH : String(Math.round(v))),
  f1: (v) => (v == null ? DASH : v.toFixed(1)),
  f2: (v) => (v == null ? DASH : v.toFixed(2)),
  pct: (v) => (v == null ? DASH : (100 * v).toFixed(1) + "%"),
  ms: (v) => (v == null ? DASH : (1000 * v).toFixed(0) + " ms"),
};
const last = (xs) => (xs.length ? xs[xs.length - 1] : null);
const clockTime = (t) => new Date(t * 1000).toLocaleTimeString();

const TILES = [
  ["running", "running", (d) => d.engine.running, fmt.int],
  ["waiting", "waiting", (d) => d.engine.waiting, fmt.int],
  ["generated-tps", "generated tok/s", (d) => last(d.series.generated_tps), fmt.f1],
  ["prompt-tps", "prompt tok/s", (d) => last(d.series.prompt_tps), fmt.f1],
  ["mean-ttft", "mean TTFT", (d) => d.totals.mean_ttft, fmt.ms],
  ["acceptance-length", "acceptance length", (d) => d.totals.acceptance_length, fmt.f2],
  ["kv-usage", "KV pool in use", (d) => d.engine.kv_usage, fmt.pct],
  ["state-usage", "state pool in use", (d) => d.engine.state_usage, fmt.pct],
  ["prefix-hit-rate", "prefix-cache hits", (d) => d.engine.prefix_hit_rate, fmt.pct],
  ["requests", "requests", (d) => d.totals.requests, fmt.int],
  ["generated-tokens", "generated tokens", (d) => d.totals.generated_tokens, fmt.int],
  ["prompt-tokens", "prompt tokens prefilled", (d) => d.totals.prompt_tokens, fmt.int],
  ["preemptions", "preemptions", (d) => d.engine.preemptions, fmt.int],
];

// Time-series charts: [id, title, [[series key, label, color, scale factor]], y range or null, points]
const COLORS = { blue: "#2563eb", amber: "#f59e0b", green: "#16a34a", purple: "#9333ea", red: "#dc2626",
                 cyan: "#0891b2", teal: "#0d9488", pink: "#db2777", lime: "#65a30d", slate: "#475569" };
const CHARTS = [
  ["chart-requests", "Requests", [["running", "running", COLORS.blue], ["waiting", "waiting", COLORS.amber]]],
  ["chart-throughput", "Throughput (tok/s)", [["generated_tps", "generated", COLORS.green],
                                              ["prompt_tps", "prompt", COLORS.purple]]],
  ["chart-ttft", "Time to first token (ms)", [["ttft", "mean TTFT", COLORS.red, 1000]], null, true],
  ["chart-acceptance", "Acceptance length (tokens per verify)", [["acceptance_length", "mean", COLORS.cyan]],
   null, true],
  ["chart-pools", "Pools and prefix cache (%)", [["kv_usage", "KV pool", COLORS.pink, 100],
                                                 ["state_usage", "state pool", COLORS.lime, 100],
                                                 ["prefix_hit_rate", "prefix hits", COLORS.slate, 100]], [0, 100]],
];

const charts = {};
let apiKey = localStorage.getItem(KEY_STORE) || "";
let timer = null;
window.luceboxDashboard = { updates: 0, data: null };

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  Object.assign(e, attrs || {});
  for (const c of children) e.append(c);
  return e;
}

function card(id, title) {
  const body = el("div", { id });
  document.getElementById("charts").append(el("div", { className: "card" }, el("h2", {}, title), body));
  return body;
}

function chartWidth(body) {
  return Math.max(300, body.clientWidth || 440);
}

function makeTimeChart([id, title, series, range, points], d) {
  const body = card(id, title);
  const opts = {
    width: chartWidth(body), height: 200,
    scales: { x: { time: true }, y: range ? { range: () => range } : { range: (u, lo, hi) => [0, Math.max(hi, 1)] } },
    series: [{}].concat(series.map(([, label, color]) => ({
      label, stroke: color, width: 2, spanGaps: !!points,
      points: points ? { show: true, size: 6, fill: color, stroke: color } : { show: false },
    }))),
    axes: [{ values: (u, ticks) => ticks.map(clockTime), space: 80 }, { size: 50 }],
    legend: { live: false },
  };
  return { id, body, series, plot: new uPlot(opts, timeData(d, series), body) };
}

function timeData(d, series) {
  return [d.series.t].concat(series.map(([key, , , scale]) =>
    d.series[key].map((v) => (v == null ? null : v * (scale || 1)))));
}

function makeAcceptanceChart(d) {
  const body = card("chart-acceptance-position", "Acceptance per draft position (rate, window)");
  const opts = {
    width: chartWidth(body), height: 200,
    scales: { x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] }, y: { range: () => [0, 1] } },
    series: [{ label: "position" }, { label: "accepted", stroke: COLORS.teal, fill: COLORS.teal + "99",
                                      paths: uPlot.paths.bars({ size: [0.6, 60] }), points: { show: false } }],
    axes: [{ incrs: [1] }, { size: 50 }],
    legend: { live: false },
  };
  return { id: "chart-acceptance-position", body, plot: new uPlot(opts, positionData(d), body) };
}

function positionData(d) {
  const rates = d.acceptance_per_position;
  return [rates.map((_, i) => i + 1), rates];
}

function updateTiles(d) {
  const tiles = document.getElementById("tiles");
  for (const [id, label, get, format] of TILES) {
    let value = document.getElementById("tile-" + id);
    if (!value) {
      value = el("div", { className: "value", id: "tile-" + id });
      tiles.append(el("div", { className: "tile" }, el("div", { className: "label" }, label), value));
    }
    value.textContent = format(get(d));
  }
}

function updateCharts(d) {
  if (!charts.time) {
    charts.time = CHARTS.map((spec) => makeTimeChart(spec, d));
    charts.position = makeAcceptanceChart(d);
    window.addEventListener("resize", () => {
      for (const c of charts.time.concat([charts.position])) c.plot.setSize({ width: chartWidth(c.body), height: 200 });
    });
    return;
  }
  for (const c of charts.time) c.plot.setData(timeData(d, c.series));
  charts.position.plot.setData(positionData(d));
}

// The request timeline: one row per request, waiting (arrival -> first token) then generating.
function drawTimeline(d) {
  const canvas = document.getElementById("timeline");
  const rows = d.requests.slice(0, TIMELINE_ROWS);
  const rowH = 16, label = 170, ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = Math.max(1, rows.length) * rowH + 20;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  g.font = "11px system-ui, sans-serif";
  if (!rows.length) {
    g.fillStyle = "#6b7280";
    g.fillText("no requests yet", 4, 14);
    return;
  }
  const t0 = Math.min(...rows.map((r) => r.arrival)), t1 = d.now;
  const x = (t) => label + ((t - t0) / Math.max(t1 - t0, 1e-3)) * (width - label - 10);
  rows.forEach((r, i) => {
    const y = i * rowH;
    g.fillStyle = "#374151";
    g.fillText(`${r.api} ${r.id.slice(-8)}`, 4, y + 12);
    const first = r.first_token == null ? (r.finished == null ? t1 : r.finished) : r.first_token;
    g.fillStyle = COLORS.amber;
    g.fillRect(x(r.arrival), y + 3, Math.max(x(first) - x(r.arrival), 1), rowH - 6);
    if (r.first_token != null) {
      g.fillStyle = r.finish_reason === "abort" ? COLORS.red : COLORS.blue;
      g.fillRect(x(r.first_token), y + 3, Math.max(x(r.finished == null ? t1 : r.finished) - x(r.first_token), 2), rowH - 6);
    }
  });
  g.fillStyle = "#6b7280";
  const axisY = rows.length * rowH + 14;
  g.fillText(clockTime(t0), label, axisY);
  const now = clockTime(t1);
  g.fillText(now, width - 10 - g.measureText(now).width, axisY);
}

function updateTable(d) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren(...d.requests.map((r) => {
    const end = r.finished == null ? d.now : r.finished;
    const generating = r.first_token == null ? null : end - r.first_token;
    const cells = [r.id, r.api, fmt.int(r.prompt_tokens), fmt.int(r.cached_tokens), fmt.int(r.generated_tokens),
                   fmt.ms(r.ttft), (end - r.arrival).toFixed(2) + " s",
                   generating && r.generated_tokens > 1 ? fmt.f1((r.generated_tokens - 1) / generating) : DASH,
                   fmt.f2(r.acceptance_length), r.finish_reason || "running"];
    const row = el("tr", {}, ...cells.map((c) => el("td", {}, c)));
    if (r.finish_reason === "abort") row.lastChild.className = "abort";
    return row;
  }));
}

function showKeyForm(message) {
  document.getElementById("main").hidden = true;
  document.getElementById("key-form").hidden = false;
  document.getElementById("key-error").textContent = message;
  document.getElementById("key").focus();
}

async function poll() {
  const status = document.getElementById("status");
  let response;
  try {
    response = await fetch("/dashboard/data", { headers: apiKey ? { Authorization: "Bearer " + apiKey } : {},
                                                cache: "no-store" });
  } catch (e) {
    status.textContent = "server unreachable";
    status.className = "error";
    return;
  }
  if (response.status === 401) {
    stop();
    showKeyForm(apiKey ? "that key was refused" : "");
    return;
  }
  if (!response.ok) {
    status.textContent = `GET /dashboard/data: HTTP ${response.status}`;
    status.className = "error";
    return;
  }
  const d = await response.json();
  document.getElementById("key-form").hidden = true;
  document.getElementById("main").hidden = false;
  document.getElementById("model").textContent = d.model;
  status.textContent = `updated ${clockTime(d.now)}, up ${Math.round(d.now - d.started)} s`;
  status.className = "";
  updateTiles(d);
  updateCharts(d);
  drawTimeline(d);
  updateTable(d);
  window.luceboxDashboard.data = d;
  window.luceboxDashboard.updates += 1;
}

function start() {
  stop();
  poll();
  timer = setInterval(poll, POLL_MS);
}

function stop() {
  if (timer !== null) clearInterval(timer);
  timer = null;
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("key").value.trim();
  localStorage.setItem(KEY_STORE, apiKey);
  start();
});

start();
