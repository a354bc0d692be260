// kvroute dashboard: polls /dashboard/data every second, keeps the last window of
// samples in memory and redraws the worker table, the tiles and the charts.
// Everything it loads comes from the router (no external network).
"use strict";

(function () {
  const POLL_MS = 1000;
  const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2",
    "#db2777", "#65a30d", "#4b5563", "#ea580c"];
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  const headers = token ? { Authorization: "Bearer " + token } : {};
  let samples = [];
  let windowS = 600;
  const charts = {};

  // --- formatting ---------------------------------------------------------------------
  const num = (v, digits = 0) => (v === null || v === undefined) ? "–" :
    Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  const pct = (v) => (v === null || v === undefined) ? "–" : (100 * v).toFixed(1) + "%";
  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 1e-3) return (v * 1e6).toFixed(0) + " µs";
    if (v < 1) return (v * 1e3).toFixed(v < 0.01 ? 2 : 0) + " ms";
    return v.toFixed(2) + " s";
  }
  function ago(t, now) {
    if (!t) return "never";
    const s = Math.max(0, now - t);
    if (s < 60) return s.toFixed(0) + " s ago";
    if (s < 3600) return (s / 60).toFixed(0) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }
  const el = (id) => document.getElementById(id);
  // axis ticks: 250k, 1.5M; small values as they are
  function compact(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a >= 1e6) return +(v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return +(v / 1e3).toFixed(0) + "k";
    if (a >= 1e3) return +(v / 1e3).toFixed(1) + "k";
    return +v.toPrecision(3) + "";
  }

  // --- chart definitions: each gives series keys, labels and one column per key --------
  const dynamicKeys = (field) => {
    const keys = new Set();
    for (const s of samples) for (const k of Object.keys(s[field] || {})) keys.add(k);
    return [...keys].sort();
  };
  const CHARTS = [
    { id: "hit", title: "Token hit ratio (%, 5 s window)", range: [0, 100], series: () => [
      { label: "hit ratio", value: (s) => s.hit_ratio === null ? null : 100 * s.hit_ratio }] },
    { id: "cached", title: "Cached prompt tokens / s: predicted vs actual", series: () => [
      { label: "predicted", value: (s) => s.predicted_cached_rate },
      { label: "actual", value: (s) => s.actual_cached_rate },
      { label: "prompt tokens", value: (s) => s.prompt_tokens_rate }] },
    { id: "ttft", title: "TTFT percentiles (s)", series: () => ["p50", "p90", "p99"].map(
      (q) => ({ label: "TTFT " + q, value: (s) => s["ttft_" + q] })) },
    { id: "tpot", title: "TPOT percentiles (s)", series: () => ["p50", "p90", "p99"].map(
      (q) => ({ label: "TPOT " + q, value: (s) => s["tpot_" + q] })) },
    { id: "status", title: "Requests / s by HTTP status", series: () =>
      dynamicKeys("status_rate").map((k) => ({ label: k, value: (s) => (s.status_rate || {})[k] ?? 0 })) },
    { id: "phases", title: "Decision latency p50 by phase (µs)", series: () =>
      dynamicKeys("phases").map((k) => ({ label: k, value: (s) => {
        const p = (s.phases || {})[k]; return p && p.p50 !== null ? p.p50 * 1e6 : null; } })) },
    { id: "queue", title: "Queue depth and 429 / s", series: () => [
      { label: "queue depth", value: (s) => s.queue_depth },
      { label: "429 / s", value: (s) => s.rate_429 }] },
    { id: "load", title: "Running + waiting per worker", series: () =>
      dynamicKeys("workers").map((w) => ({ label: w, value: (s) => {
        const x = (s.workers || {})[w]; return x ? x.running + x.waiting : null; } })) },
    { id: "kv", title: "KV usage per worker (%)", range: [0, 100], series: () =>
      dynamicKeys("workers").map((w) => ({ label: w, value: (s) => {
        const x = (s.workers || {})[w]; return x ? 100 * x.kv_usage : null; } })) },
  ];

  function chartWidth(box) { return Math.max(300, box.clientWidth - 12); }

  function drawChart(def) {
    const series = def.series();
    const key = series.map((s) => s.label).join("|");
    const data = [samples.map((s) => s.t), ...series.map((ser) => samples.map(ser.value))];
    let entry = charts[def.id];
    if (entry && entry.key === key) {
      entry.plot.setData(data);
      return;
    }
    let box = el("chart-" + def.id);
    if (!box) {
      box = document.createElement("div");
      box.className = "chart";
      box.id = "chart-" + def.id;
      el("charts").appendChild(box);
    }
    if (entry) entry.plot.destroy();
    const opts = {
      title: def.title, width: chartWidth(box), height: 220,
      scales: { x: { time: true } },
      series: [{}, ...series.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false,
        points: { show: false } }))],
      axes: [{}, { size: 64, values: (u, vals) => vals.map(compact) }],
      legend: { live: false },
    };
    if (def.range) opts.scales.y = { range: def.range };
    charts[def.id] = { key, plot: new uPlot(opts, data, box) };
  }

  // --- table and tiles ----------------------------------------------------------------
  function renderWorkers(workers, now) {
    const body = el("workers").tBodies[0];
    body.textContent = "";
    for (const w of workers) {
      const tr = document.createElement("tr");
      tr.className = w.healthy ? "healthy" : "unhealthy";
      tr.dataset.worker = w.worker;
      const kv = document.createElement("span");
      kv.className = "kvbar";
      const fill = document.createElement("span");
      fill.style.width = Math.min(100, 100 * w.kv_usage).toFixed(0) + "%";
      kv.appendChild(fill);
      const cells = [
        w.worker, w.healthy ? "healthy" : "UNHEALTHY", num(w.running), num(w.waiting),
        num(w.inflight), null, num(w.blocks), secs(w.event_lag_s), ago(w.last_sync, now),
        num(w.resyncs), num(w.requests), num(w.req_rate, 1), num(w.prompt_tokens),
        num(w.cached_tokens), pct(w.hit_ratio),
      ];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        if (i === 1) td.className = "health";
        if (i === 5) {
          td.appendChild(kv);
          td.appendChild(document.createTextNode(pct(w.kv_usage)));
        } else {
          td.textContent = text;
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  function renderTiles(workers) {
    const last = samples[samples.length - 1];
    if (!last) return;
    const rps = Object.values(last.status_rate || {}).reduce((a, b) => a + b, 0);
    el("tile-hit").textContent = pct(last.hit_ratio);
    el("tile-rps").textContent = num(rps, 1);
    el("tile-ttft").textContent = [last.ttft_p50, last.ttft_p90, last.ttft_p99].map(secs).join(" / ");
    el("tile-tpot").textContent = [last.tpot_p50, last.tpot_p90, last.tpot_p99].map(secs).join(" / ");
    el("tile-queue").textContent = num(last.queue_depth);
    el("tile-429").textContent = num(last.rate_429, 1);
    const healthy = workers.filter((w) => w.healthy).length;
    const tile = el("tile-workers");
    tile.textContent = healthy + " / " + workers.length;
    tile.style.color = healthy < workers.length ? "#b91c1c" : "";
  }

  // --- polling ------------------------------------------------------------------------
  async function poll() {
    const since = samples.length ? samples[samples.length - 1].t : 0;
    try {
      const resp = await fetch("/dashboard/data?since=" + since, { headers, cache: "no-store" });
      if (resp.status === 401 || resp.status === 403) {
        throw new Error("HTTP " + resp.status + ": open /dashboard#token=<admin token>");
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const data = await resp.json();
      windowS = data.window_s;
      samples = samples.concat(data.samples).filter((s) => s.t > data.now - windowS);
      renderWorkers(data.workers, data.now);
      renderTiles(data.workers);
      for (const def of CHARTS) drawChart(def);
      el("conn").textContent = "live";
      el("conn").className = "conn ok";
      el("updated").textContent = "updated " + new Date(data.now * 1000).toLocaleTimeString();
    } catch (err) {
      el("conn").textContent = "disconnected (" + err.message + ")";
      el("conn").className = "conn down";
    }
    setTimeout(poll, POLL_MS);
  }

  window.addEventListener("resize", () => {
    for (const id of Object.keys(charts)) {
      const box = el("chart-" + id);
      charts[id].plot.setSize({ width: chartWidth(box), height: 220 });
    }
  });
  poll();
})();
