// Layers: a searchable table of a version's layer graph (name, class, output shape, inbound). A layer's output can
// be tried at once; layers marked as cut inputs make a V2 request that runs the graph from them.

import { api } from "../api.js";
import { h, replace } from "../dom.js";

const cache = new Map();

// The layer table of a version (fetched once per version).
export function fetchLayers(model, version) {
  const key = `${model}/${version}`;
  if (!cache.has(key)) {
    const path = `/v2/models/${encodeURIComponent(model)}/versions/${version}/layers`;
    cache.set(key, api(path).then((answer) => answer.layers).catch((error) => {
      cache.delete(key);
      throw error;
    }));
  }
  return cache.get(key);
}

function shapeText(layer) {
  return layer.output_shapes.map((shape) => `[${shape.join(", ")}]`).join(" ");
}

export function mount(view, context, where) {
  const select = h("select", { id: "layers-model",
    onchange: () => context.go(`#/layers/${encodeURIComponent(select.value)}`) });
  const search = h("input", { type: "search", id: "layer-search", placeholder: "Search name or class…",
    oninput: () => filter() });
  const count = h("span", { class: "hint" });
  const cutBar = h("div", { class: "controls", id: "cut-bar" });
  const table = h("div", { class: "scroll" });
  const cut = new Set();
  let layerList = [];
  let model = null;
  let shown = "";
  view.append(
    h("div", { class: "controls" }, h("h1", { text: "Layers", style: "margin:0" }), select, search, count),
    h("section", { class: "panel" }, cutBar, table),
  );

  function tryPath(query) {
    return `#/try/${encodeURIComponent(model.name)}?${new URLSearchParams(query)}`;
  }

  function drawCut() {
    const names = [...cut];
    replace(cutBar, names.length
      ? [h("span", {}, "Cut inputs: ", h("strong", { id: "cut-inputs", text: names.join(", ") })),
        h("a", { class: "button", href: tryPath({ inputs: names.join(",") }), text: "Try this cut" }),
        h("button", { class: "ghost small", type: "button", text: "Clear", onclick: () => {
          cut.clear();
          filter();
          drawCut();
        } })]
      : h("span", { class: "hint", text: "Tick layers to feed as inputs (a cut: the graph runs from them to the " +
        "outputs); click a layer's name to see its output in Try it." }));
  }

  function filter() {
    const needle = search.value.trim().toLowerCase();
    const rows = layerList.filter((l) => !needle || l.name.toLowerCase().includes(needle) ||
      l.class_name.toLowerCase().includes(needle));
    count.textContent = `${rows.length} of ${layerList.length} layers`;
    replace(table, h("table", { id: "layers-table" },
      h("thead", {}, h("tr", {}, ["#", "Name", "Class", "Output shape", "Inbound", "Cut input"].map((t) => h("th", { text: t })))),
      h("tbody", {}, rows.map((layer) => h("tr", { "data-layer": layer.name },
        h("td", { class: "muted", text: String(layerList.indexOf(layer)) }),
        h("td", {}, h("a", { href: tryPath({ layer: layer.name }), text: layer.name, title: "see its output in Try it" })),
        h("td", { text: layer.class_name }),
        h("td", { class: "mono", text: shapeText(layer) }),
        h("td", { class: "mono", text: layer.inbound.join(", ") }),
        h("td", {}, layer.inbound.length ? h("input", { type: "checkbox", checked: cut.has(layer.name),
          "aria-label": `feed ${layer.name} as an input`, onchange: (event) => {
            if (event.target.checked) cut.add(layer.name);
            else cut.delete(layer.name);
            drawCut();
          } }) : h("span", { class: "hint", text: "model input" })),
      )))));
  }

  async function draw() {
    const models = context.overview.models.filter((m) => m.versions.some((v) => v.state === "READY"));
    if (models.map((m) => m.name).join() !== [...select.options].map((o) => o.value).join()) {
      replace(select, models.map((m) => h("option", { value: m.name, text: m.name })));
    }
    model = models.find((m) => m.name === where.model) ?? models[0];
    if (!model) return;
    select.value = model.name;
    const version = model.versions.find((v) => v.version === model.active_version) ?? model.versions[0];
    const key = `${model.name}/${version.version}`;
    if (key === shown) return;
    shown = key;
    try {
      layerList = await fetchLayers(model.name, version.version);
    } catch (error) {
      replace(table, h("div", { class: "error", text: error.message }));
      return;
    }
    cut.clear();
    drawCut();
    filter();
  }

  return { update: draw };
}
