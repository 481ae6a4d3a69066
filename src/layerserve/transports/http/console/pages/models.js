// Models: every model with its versions, state and reason, engine, active and pinned version, batching, queue and
// cache hit rate; live charts of requests, latency, batching, queue and compute time, CPU, memory and GPU memory.

import { COLORS, lineChart } from "../charts.js";
import { formatBytes, formatMs, formatNumber, h, percent, replace } from "../dom.js";
import { difference, histogramBetween, mean, quantile, sumHistograms } from "../stats.js";

const WINDOW = 3; // snapshots between the two that a rate or quantile is taken from (about 4.5 s)

export function modelState(model) {
  const active = model.versions.find((v) => v.version === model.active_version);
  if (active) return active.state;
  if (!model.versions.length) return "UNAVAILABLE";
  return model.versions.some((v) => v.state === "LOADING") ? "LOADING" : model.versions[0].state;
}

function pairs(history) {
  const result = [];
  for (let i = 1; i < history.length; i += 1) result.push([history[Math.max(0, i - WINDOW)], history[i]]);
  return result;
}

function rate(current, previous, pick) {
  const seconds = current.t - previous.t;
  return seconds > 0 ? difference(pick(current.doc), pick(previous.doc)) / seconds : null;
}

function histogramOf(doc, focus, key) {
  const names = focus ? [focus] : Object.keys(doc.series);
  return sumHistograms(names.filter((name) => doc.series[name]).map((name) => doc.series[name][key]));
}

function windowQuantile(previous, current, focus, key, q) {
  return quantile(q, histogramBetween(histogramOf(current.doc, focus, key), histogramOf(previous.doc, focus, key)));
}

function recent(history) {
  return history.length > 1 ? [history[Math.max(0, history.length - 1 - WINDOW)], history[history.length - 1]] : null;
}

function modelsTable(context) {
  const { doc } = context.history[context.history.length - 1];
  const span = recent(context.history);
  const rows = doc.models.map((model) => {
    const series = doc.series[model.name];
    const active = model.versions.find((v) => v.version === model.active_version) ?? model.versions[0];
    const state = modelState(model);
    const lookups = series ? series.cache_hits + series.cache_misses : 0;
    const requestRate = span && series ? rate(span[1], span[0], (d) => d.series[model.name]?.requests ?? 0) : null;
    const p50 = span ? windowQuantile(span[0], span[1], model.name, "latency_s", 0.5) : null;
    const batching = active?.batching;
    return h("tr", { "data-model": model.name },
      h("td", {}, h("strong", { text: model.name }), h("div", { class: "hint", text: active?.description ?? "" })),
      h("td", {}, h("span", { class: `badge ${state}`, "data-state": state, text: state }),
        h("div", { class: "hint", text: model.reason || (active && active.state !== "READY" ? active.reason : "") })),
      h("td", {}, model.versions.map((v) => h("span", {
        class: `chip${v.version === model.active_version ? " active" : ""}`,
        title: `${v.state}${v.reason ? `: ${v.reason}` : ""}`,
        text: `${v.version}${v.version === model.pinned_version ? " pinned" : ""}${v.state === "READY" ? "" : ` ${v.state}`}`,
      }))),
      h("td", {}, active?.engine ?? "–", h("div", { class: "hint", text: active?.engine_reason ?? "" })),
      h("td", { text: active?.input ?? "–" }),
      h("td", { class: "mono" }, batching ? `≤${batching.max_batch_size} rows, ${formatNumber(batching.max_delay_ms)} ms` : "–",
        h("div", { class: "hint", text: series ? `${series.queued} queued` : "" })),
      h("td", { class: "num", text: formatNumber(requestRate) }),
      h("td", { class: "num", text: formatMs(p50) }),
      h("td", { class: "num", text: active?.cache ? (lookups ? percent(series.cache_hits / lookups) : "no lookups") : "off" }),
      h("td", {}, h("a", { href: `#/try/${encodeURIComponent(model.name)}`, text: "try" }), " · ",
        h("a", { href: `#/layers/${encodeURIComponent(model.name)}`, text: "layers" }), " · ",
        h("a", { href: `#/versions/${encodeURIComponent(model.name)}`, text: "versions" })),
    );
  });
  return h("table", { id: "models-table" },
    h("thead", {}, h("tr", {}, ["Model", "State", "Versions", "Engine", "Input", "Batching", "Req/s", "p50",
      "Cache hits", ""].map((title, i) => h("th", { class: i >= 6 && i <= 8 ? "num" : "", text: title })))),
    h("tbody", {}, rows));
}

function charts(context, focus) {
  const { history } = context;
  const doc = history[history.length - 1].doc;
  // The last two minutes, or less while the page is new (at least 20 s): the lines fill the chart.
  const windowS = Math.min(120, Math.max(20, doc.server.time - history[0].t));
  const steps = pairs(history);
  const names = Object.keys(doc.series);
  const perModel = (title, pick, format) => lineChart(title, names.map((name) => ({
    name, points: steps.map(([previous, current]) => [current.t, pick(previous, current, name)]),
  })), { format, now: doc.server.time, windowS });
  const focused = (title, lines, format) => lineChart(title, lines.map(([name, pick]) => ({
    name, points: steps.map(([previous, current]) => [current.t, pick(previous, current)]),
  })), { format, now: doc.server.time, windowS });
  const ms = (v) => `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms`;
  const processes = doc.processes.map((p) => p.id);
  const perProcess = (title, pick, format) => lineChart(title, processes.map((id) => ({
    name: id, points: steps.map(([previous, current]) => [current.t, pick(previous, current, id)]),
  })), { format, now: doc.server.time, windowS });
  const process = (d, id) => d.processes.find((p) => p.id === id);
  const list = [
    perModel("Requests / s", (p, c, name) => rate(c, p, (d) => d.series[name]?.requests ?? 0), (v) => formatNumber(v)),
    focused(`Latency${focus ? ` · ${focus}` : ""}`, [
      ["p50", (p, c) => windowQuantile(p, c, focus, "latency_s", 0.5)],
      ["p99", (p, c) => windowQuantile(p, c, focus, "latency_s", 0.99)],
    ], ms),
    perModel("Batch size (rows per call)", (p, c, name) => {
      const series = c.doc.series[name];
      return series ? mean(histogramBetween(series.batch_size, p.doc.series[name]?.batch_size)) : null;
    }, (v) => v.toFixed(1)),
    focused(`Queue and compute (p50)${focus ? ` · ${focus}` : ""}`, [
      ["queue", (p, c) => windowQuantile(p, c, focus, "queue_s", 0.5)],
      ["compute", (p, c) => windowQuantile(p, c, focus, "compute_s", 0.5)],
    ], ms),
    perProcess("CPU (% of one core)", (p, c, id) => {
      const [before, after] = [process(p.doc, id), process(c.doc, id)];
      return before && after && c.t > p.t ? (100 * difference(after.cpu_s, before.cpu_s)) / (c.t - p.t) : null;
    }, (v) => `${Math.round(v)}%`),
    perProcess("Memory (resident, with engine processes)", (p, c, id) => process(c.doc, id)?.rss_bytes ?? null,
      formatBytes),
  ];
  if (doc.gpus.length) {
    list.push(lineChart("GPU memory", doc.gpus.map((gpu, index) => ({
      name: `GPU ${gpu.device}`, color: COLORS[index],
      points: history.map(({ t, doc: d }) => [t, d.gpus.find((g) => g.device === gpu.device)?.used_bytes ?? null]),
    })), { format: formatBytes, now: doc.server.time, windowS }));
  }
  return list;
}

export function mount(view, context) {
  let focus = "";
  const select = h("select", { id: "focus", onchange: () => {
    focus = select.value;
    draw();
  } });
  const table = h("div", { class: "scroll" }, h("p", { class: "muted", text: "Asking the server…" }));
  const chartGrid = h("div", { class: "charts", id: "charts" });
  const summary = h("span", { class: "muted" });
  view.append(
    h("h1", {}, "Models ", summary),
    h("section", { class: "panel" }, table),
    h("div", { class: "controls" }, h("h2", { text: "Live", style: "margin:0" }),
      h("label", {}, "Latency and queue of", select),
      h("span", { class: "hint", text: "Every worker (and replica) summed; a point every 1.5 s, up to the last 2 minutes." })),
    chartGrid,
  );

  function draw() {
    if (!context.history.length) return;
    const { doc } = context.history[context.history.length - 1];
    const names = doc.models.map((m) => m.name);
    if ([...select.options].map((o) => o.value).join() !== ["", ...names].join()) {
      replace(select, h("option", { value: "", text: "all models" }), names.map((n) => h("option", { value: n, text: n })));
      select.value = focus;
    }
    const ready = doc.models.filter((m) => modelState(m) === "READY").length;
    summary.textContent = `${ready} of ${doc.models.length} ready · layerserve ${doc.server.version}` +
      `${doc.server.workers > 1 ? ` · ${doc.server.workers} workers` : ""}`;
    replace(table, modelsTable(context));
    replace(chartGrid, charts(context, focus));
  }

  return { update: draw };
}
