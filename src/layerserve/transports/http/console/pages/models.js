// Models: every model with its versions, state and reason, engine, active and pinned version, batching, queue, cache
// hit rate, resident memory and last use, with Load and Unload, a filter, and the memory budget when one is set;
// live charts of requests, latency, batching, queue and compute time, CPU, memory and GPU memory.

import { act } from "../action.js";
import { COLORS, lineChart } from "../charts.js";
import { ago, formatBytes, formatMs, formatNumber, h, percent, refreshAgo, replace } from "../dom.js";
import { difference, histogramBetween, mean, quantile, sumHistograms } from "../stats.js";

const WINDOW = 3; // snapshots between the two that a rate or quantile is taken from (about 4.5 s)
const STATES = ["READY", "LOADING", "UNAVAILABLE", "FAILED"];
const CHARTED = 8; // models drawn in a per-model chart at most: the busiest, when there are more

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

const COLUMNS = ["Model", "State", "Versions", "Engine", "Input", "Batching", "Req/s", "p50", "Cache hits", "Memory",
  "Last use", ""];
const NUMERIC = new Set(["Req/s", "p50", "Cache hits", "Memory", "Last use"]);

// What a model's versions take (resident bytes of the loaded ones; null if none is), and their last use.
function modelMemory(model) {
  const loaded = model.versions.filter((v) => v.memory?.total_bytes !== undefined);
  return loaded.length ? loaded.reduce((sum, v) => sum + v.memory.total_bytes, 0) : null;
}

function modelLastUsed(model) {
  const times = model.versions.map((v) => v.last_used).filter((t) => t !== null && t !== undefined);
  return times.length ? Math.max(...times) : null;
}

// A version as a chip: its number (outlined when active), its state unless READY; the rest in its tooltip.
function versionChip(model, v) {
  const title = [v.state + (v.reason ? `: ${v.reason}` : "")];
  if (v.memory?.total_bytes !== undefined) title.push(`${formatBytes(v.memory.total_bytes)} resident`);
  title.push(v.last_used ? `last used ${new Date(v.last_used * 1000).toLocaleString()}` : "never used");
  const pinned = v.version === model.pinned_version ? " pinned" : "";
  return h("span", { class: `chip${v.version === model.active_version ? " active" : ""}`, title: title.join(" · "),
    text: `${v.version}${pinned}${v.state === "READY" ? "" : ` ${v.state}`}` });
}

// A cell: the values it shows (its key: it is rebuilt only when they change) and how to draw them.
function cell(values, draw, className = "") {
  return { key: JSON.stringify(values), draw: () => draw(...values), className };
}

// A model's row as cells; `act` runs a load or unload from its buttons.
function modelCells(model, doc, span, act) {
  const series = doc.series[model.name];
  const active = model.versions.find((v) => v.version === model.active_version) ?? model.versions[0];
  const state = modelState(model);
  const lookups = series ? series.cache_hits + series.cache_misses : 0;
  const requestRate = span && series ? rate(span[1], span[0], (d) => d.series[model.name]?.requests ?? 0) : null;
  const p50 = span && series ? windowQuantile(span[0], span[1], model.name, "latency_s", 0.5) : null;
  const batching = active?.engine ? active.batching : null; // a version never loaded has no batching yet
  const memory = modelMemory(model);
  const lastUsed = modelLastUsed(model);
  const isLoaded = model.versions.some((v) => v.state === "READY" || v.state === "LOADING");
  const name = encodeURIComponent(model.name);
  return [
    cell([model.name, active?.description ?? ""], (shownName, description) =>
      [h("strong", { text: shownName }), h("div", { class: "hint", text: description })]),
    cell([state, model.reason || (active && active.state !== "READY" ? active.reason : "")], (shown, reason) =>
      [h("span", { class: `badge ${shown}`, "data-state": shown, text: shown, title: reason || null }),
        h("div", { class: "hint reason", text: reason })]),
    cell([model.versions.map((v) => [v.version, v.state, v.reason, v.memory?.total_bytes ?? null,
      Math.round(v.last_used ?? 0)]),
      model.active_version, model.pinned_version], () => model.versions.map((v) => versionChip(model, v))),
    cell([active?.engine ?? "–", active?.engine_reason ?? ""],
      (engine, why) => [engine, h("div", { class: "hint", text: why })]),
    cell([active?.input ?? "–"], (input) => input),
    cell([batching ? `≤${batching.max_batch_size} rows, ${formatNumber(batching.max_delay_ms)} ms` : "–",
      series ? `${series.queued} queued` : ""], (text, queued) => [text, h("div", { class: "hint", text: queued })],
    "mono"),
    cell([formatNumber(requestRate)], (text) => text, "num"),
    cell([formatMs(p50)], (text) => text, "num"),
    cell([active?.cache ? (lookups ? percent(series.cache_hits / lookups) : "no lookups") : "off"], (text) => text,
      "num"),
    cell([memory], (bytes) => h("span", { class: "memory", "data-bytes": bytes ?? "", text: formatBytes(bytes) }),
      "num"),
    cell([lastUsed === null ? null : Math.round(lastUsed)], // whole seconds: what it shows
      () => ago("span", lastUsed, doc.server.time, { class: "last-use" }), "num"),
    cell([model.name, isLoaded, state], () => [
      h("a", { href: `#/try/${name}`, text: "try" }), " · ", h("a", { href: `#/layers/${name}`, text: "layers" }),
      " · ", h("a", { href: `#/versions/${name}`, text: "versions" }), " ",
      isLoaded ? null : h("button", { class: "small", type: "button", "data-action": "load", text: "Load",
        onclick: (event) => act(model.name, "load", event.currentTarget) }),
      isLoaded ? h("button", { class: "danger small", type: "button", "data-action": "unload", text: "Unload",
        onclick: (event) => act(model.name, "unload", event.currentTarget) }) : null,
    ], "actions"),
  ];
}

// Fill a row's cells, redrawing only those whose values changed: a button under the pointer stays put, and a
// thousand rows cost little when few change.
function fillRow(row, cells) {
  cells.forEach((spec, index) => {
    const td = row.cells[index] ?? row.appendChild(h("td", { class: spec.className }));
    if (td.shownKey === spec.key) return;
    td.shownKey = spec.key;
    replace(td, spec.draw());
  });
}

// The models table, kept across polls: one row per model that passes the filter, each redrawn where it changed.
function modelsTable(act) {
  const rows = new Map();
  const body = h("tbody");
  const table = h("table", { id: "models-table" },
    h("thead", {}, h("tr", {}, COLUMNS.map((title) => h("th", { class: NUMERIC.has(title) ? "num" : "",
      text: title })))), body);

  function update(context, shown) {
    const { doc } = context.history[context.history.length - 1];
    const span = recent(context.history);
    const names = new Set(shown.map((m) => m.name));
    for (const name of rows.keys()) if (!names.has(name)) rows.delete(name);
    const order = shown.map((model) => {
      const row = rows.get(model.name) ?? h("tr", { "data-model": model.name });
      rows.set(model.name, row);
      fillRow(row, modelCells(model, doc, span, act));
      return row;
    });
    if (order.length !== body.rows.length || order.some((row, i) => body.rows[i] !== row)) {
      body.replaceChildren(...order);
    }
    refreshAgo(body, doc.server.time);
  }

  return { table, update };
}

// The memory budget: what the loaded versions take of it (every worker summed), shown only when one is set.
function budgetLine(doc) {
  const { budget_bytes: budget = 0, resident_bytes: resident = 0 } = doc.memory ?? {};
  if (!budget) return null;
  const fraction = resident / budget;
  return h("div", { id: "budget", class: "budget", "data-budget-bytes": budget, "data-resident-bytes": resident,
    title: "what the loaded versions take under model_memory_budget: a load unloads the least recently used idle " +
      "versions to make room" },
    h("span", { class: "hint", text: "Memory budget" }),
    h("div", { class: `progress${fraction > 1 ? " over" : ""}`, role: "progressbar",
      "aria-valuenow": Math.round(fraction * 100) }, h("div", { style: `width:${Math.min(1, fraction) * 100}%` })),
    h("span", { id: "budget-text", text: `${formatBytes(resident)} of ${formatBytes(budget)}` +
      `${doc.server.workers > 1 ? ` (${doc.server.workers} workers summed)` : ""}` }));
}

// The models with the most requests over the history, `count` at most (every one when there are no more).
function busiest(history, count) {
  const [first, last] = [history[0].doc, history[history.length - 1].doc];
  const names = Object.keys(last.series);
  if (names.length <= count) return names;
  const requests = (name) => difference(last.series[name].requests, first.series[name]?.requests);
  const top = new Set(names.map((name) => [requests(name), name]).sort((a, b) => b[0] - a[0]).slice(0, count)
    .map(([, name]) => name));
  return names.filter((name) => top.has(name)); // in the models' order: a model keeps its colour while it stays

}

function charts(context, focus) {
  const { history } = context;
  const doc = history[history.length - 1].doc;
  // The last two minutes, or less while the page is new (at least 20 s): the lines fill the chart.
  const windowS = Math.min(120, Math.max(20, doc.server.time - history[0].t));
  const steps = pairs(history);
  const names = busiest(history, CHARTED);
  const capped = names.length < Object.keys(doc.series).length ? ` · the ${names.length} busiest` : "";
  const perModel = (title, pick, format) => lineChart(title, names.map((name) => ({
    name, points: steps.map(([previous, current]) => [current.t, pick(previous, current, name)]),
  })), { format, now: doc.server.time, windowS, note: capped });
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
  const filter = h("input", { type: "search", id: "model-filter", placeholder: "Filter by name", oninput: () => draw() });
  const stateFilter = h("select", { id: "state-filter", onchange: () => draw() },
    ["", ...STATES].map((state) => h("option", { value: state, text: state || "any state" })));
  const shownCount = h("span", { class: "hint", id: "models-shown" });
  const budget = h("span", { id: "budget-box" });
  const actionOut = h("div", { id: "models-action" });
  const models = modelsTable((name, verb, button) => {
    button.disabled = true;
    act(context, actionOut, "POST", `/v2/repository/models/${encodeURIComponent(name)}/${verb}`).finally(() => {
      button.disabled = false; // it stays when the action changed nothing
    });
  });
  const table = h("div", { class: "scroll" }, h("p", { class: "muted", text: "Asking the server…" }));
  const chartGrid = h("div", { class: "charts", id: "charts" });
  const summary = h("span", { class: "muted" });
  view.append(
    h("h1", {}, "Models ", summary),
    h("section", { class: "panel" },
      h("div", { class: "controls" }, filter, stateFilter, shownCount,
        h("span", { class: "spacer" }), budget), actionOut, table),
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
    const text = filter.value.trim().toLowerCase();
    const shown = doc.models.filter((m) => (!text || m.name.toLowerCase().includes(text)) &&
      (!stateFilter.value || modelState(m) === stateFilter.value));
    shownCount.textContent = shown.length === doc.models.length ? ""
      : `${shown.length.toLocaleString("en")} of ${doc.models.length.toLocaleString("en")} shown`;
    replace(budget, budgetLine(doc));
    if (table.firstChild !== models.table) replace(table, models.table);
    models.update(context, shown);
    replace(chartGrid, charts(context, focus));
  }

  return { update: draw };
}
