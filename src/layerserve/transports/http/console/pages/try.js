// Try it: a photo through an image model (top-k bars; any layer's output as a histogram and, for spatial maps, a
// heatmap over the photo; an explanation of the top class as a heatmap), texts through a text model, a V2 request for any model (prefilled from its signature,
// or from a cut chosen on the Layers page). Every action shows the curl line that does the same.

import { api, apiNpy, curlLine } from "../api.js";
import { bars, drawHeatmap, histogram } from "../charts.js";
import { h, replace } from "../dom.js";
import { modelState } from "./models.js";
import { fetchLayers } from "./layers.js";

function curlBox(line) {
  const copy = h("button", { class: "ghost small", type: "button", text: "Copy", onclick: async () => {
    await navigator.clipboard?.writeText(line).catch(() => {});
    copy.textContent = "Copied";
  } });
  return h("div", { class: "curl" }, h("pre", { class: "curl-line", text: line }), copy);
}

// Where an action's curl line goes; until the first, a hint that it will.
function curlArea() {
  const hint = "Each request sent from this page shows here as a curl line.";
  return h("div", { class: "curls" }, h("p", { class: "hint", text: hint }));
}

function errorBox(error) {
  return h("div", { class: "error", role: "alert", text: error.message });
}

function activeVersion(model) {
  return model.versions.find((v) => v.version === model.active_version) ?? model.versions[0];
}

function modelPath(name) {
  return `/v2/models/${encodeURIComponent(name)}`;
}

// A V2 JSON request for `inputs` ([{name, datatype, shape}]), -1 dims as 1, and `outputs` (names).
export function sampleRequest(inputs, outputs) {
  let seed = 1;
  const random = () => {
    seed = (seed * 16807) % 2147483647;
    return Math.round((seed / 2147483647) * 1000) / 1000;
  };
  return {
    inputs: inputs.map((spec) => {
      const shape = spec.shape.map((d) => (d < 0 ? 1 : d));
      const size = shape.reduce((a, b) => a * b, 1);
      const isFloat = spec.datatype.startsWith("FP");
      return { name: spec.name, shape, datatype: spec.datatype,
        data: Array.from({ length: size }, () => (isFloat ? random() : 0)) };
    }),
    outputs: outputs.map((name) => ({ name })),
  };
}

function drawPhoto(canvas, image, inputShape) {
  // The model's view of the photo: its centre cropped to the input's aspect (the default `resize: center_crop`).
  const [, rows = image.height, columns = image.width] = inputShape;
  const aspect = columns > 0 && rows > 0 ? columns / rows : image.width / image.height;
  const width = Math.min(image.width, image.height * aspect);
  const height = width / aspect;
  canvas.width = 320;
  canvas.height = Math.round(320 / aspect);
  canvas.getContext("2d").drawImage(image, (image.width - width) / 2, (image.height - height) / 2, width, height,
    0, 0, canvas.width, canvas.height);
}

function layerPicker(layerList, selected) {
  const options = layerList.map((layer) => h("option", { value: layer.name,
    text: `${layer.name} · ${layer.class_name} · [${(layer.output_shapes[0] ?? []).join(", ")}]` }));
  const select = h("select", { id: "layer-select" }, options);
  const spatial = [...layerList].reverse().find((l) => (l.output_shapes[0] ?? []).length === 4);
  select.value = selected || spatial?.name || layerList[layerList.length - 1]?.name || "";
  return select;
}

function layerResult(answer, layer, photoOverlay) {
  const shape = answer.shape;
  const parts = [h("p", {}, h("strong", { text: layer }), " output shape ",
    h("code", { id: "layer-shape", text: `[${shape.join(", ")}]` }))];
  if (shape.length === 4 && photoOverlay) {
    const map = drawHeatmap(photoOverlay, shape, answer.data);
    parts.push(h("p", { class: "hint", id: "heatmap-note",
      text: `Heatmap over the photo: the mean over ${shape[3]} channels of the ${map.rows}×${map.columns} map, upsampled.` }));
  }
  parts.push(histogram(answer.data));
  return parts;
}

function imagePanel(model, version, layerList, query) {
  const inputShape = version.inputs[0]?.shape ?? [];
  const photo = h("canvas", { id: "photo" });
  const overlay = h("canvas", { class: "overlay", id: "heatmap" });
  const frame = h("div", { class: "photo", hidden: true }, photo, overlay);
  const top = h("div", { id: "top-k" });
  const layerOut = h("div", { id: "layer-output" });
  const curls = curlArea();
  const picker = layerPicker(layerList, query.get("layer"));
  let file = null;

  async function classify() {
    const form = new FormData();
    form.append("image", file, file.name);
    const path = `${modelPath(model.name)}/classify?top_k=5`;
    replace(top, h("p", { class: "muted", text: "classifying…" }));
    try {
      const answer = await api(path, { method: "POST", form });
      replace(top, h("h2", { text: `Top 5 · version ${answer.model_version}` }),
        bars(answer.predictions[0].map((p) => ({ label: p.label ?? `class ${p.index}`, value: p.score }))));
    } catch (error) {
      replace(top, errorBox(error));
    }
    curls.replaceChildren(curlBox(curlLine("POST", path, { files: { image: file.name } })));
  }

  async function showLayer() {
    if (!file) {
      replace(layerOut, h("p", { class: "notice", text: "Pick a photo first." }));
      return;
    }
    const layer = picker.value;
    const form = new FormData();
    form.append("image", file, file.name);
    const path = `${modelPath(model.name)}/features?layer=${encodeURIComponent(layer)}&pool=none`;
    replace(layerOut, h("p", { class: "muted", text: `computing ${layer}…` }));
    try {
      const answer = await apiNpy(path, { method: "POST", form });
      overlay.width = photo.width;
      overlay.height = photo.height;
      overlay.getContext("2d").clearRect(0, 0, overlay.width, overlay.height);
      replace(layerOut, layerResult(answer, layer, overlay));
    } catch (error) {
      replace(layerOut, errorBox(error));
    }
    curls.append(curlBox(curlLine("POST", path, { files: { image: file.name }, accept: "application/x-npy" })));
  }

  async function explain() {
    if (!file) {
      replace(layerOut, h("p", { class: "notice", text: "Pick a photo first." }));
      return;
    }
    const form = new FormData();
    form.append("image", file, file.name);
    const path = `${modelPath(model.name)}/explain`;
    replace(layerOut, h("p", { class: "muted", text: "explaining the top class…" }));
    try {
      const answer = await api(path, { method: "POST", form });
      overlay.width = photo.width;
      overlay.height = photo.height;
      drawHeatmap(overlay, [1, answer.rows, answer.columns, 1], answer.heatmap.flat());
      const how = answer.method === "score-cam" ? `Score-CAM over ${answer.layer}` : "occlusion";
      replace(layerOut, h("p", { id: "explanation", text: `Where the model saw "${answer.class.label}" ` +
        `(score ${answer.class.score.toFixed(3)}): ${how}, a ${answer.rows}×${answer.columns} map over the photo.` }));
    } catch (error) {
      replace(layerOut, errorBox(error));
    }
    curls.append(curlBox(curlLine("POST", path, { files: { image: file.name } })));
  }

  async function take(picked) {
    if (!picked) return;
    file = picked;
    const image = await createImageBitmap(file).catch(() => null);
    if (image) {
      drawPhoto(photo, image, inputShape);
      frame.hidden = false;
    }
    replace(layerOut);
    await classify();
    if (query.get("layer")) await showLayer();
  }

  const input = h("input", { type: "file", accept: "image/*", id: "photo-input",
    onchange: () => take(input.files[0]) });
  const drop = h("div", { class: "drop", id: "drop",
    ondragover: (event) => { event.preventDefault(); drop.classList.add("over"); },
    ondragleave: () => drop.classList.remove("over"),
    ondrop: (event) => { event.preventDefault(); drop.classList.remove("over"); take(event.dataTransfer.files[0]); },
  }, h("p", { text: "Drop a photo here, or " }), input);
  return h("div", {},
    h("div", { class: "row" },
      h("section", { class: "panel", style: "flex: 0 0 360px" }, h("h2", { text: "Photo" }), drop,
        h("div", { style: "margin-top:12px" }, frame)),
      h("section", { class: "panel grow" }, top,
        // A pipeline has no layers of its own (its steps' models have): explanations only.
        h("h2", { text: layerList.length ? "A layer's output" : "Why", style: "margin-top:18px" }),
        h("div", { class: "controls" }, ...(layerList.length ? [picker, h("button", { type: "button",
          id: "show-layer", text: "Show output", onclick: showLayer })] : []), h("button", { type: "button",
          id: "explain", text: "Explain the top class", onclick: explain })), layerOut)),
    h("section", { class: "panel" }, h("h2", { text: "The same with curl" }), curls));
}

function textPanel(model, layerList, query) {
  const texts = h("textarea", { id: "texts", rows: 5,
    text: "这个手机很好用，电池也耐用，非常满意\n太差了，用了两天就坏了，客服也不理人" });
  const out = h("div", { id: "text-results" });
  const layerOut = h("div", { id: "layer-output" });
  const curls = curlArea();
  const picker = layerPicker(layerList, query.get("layer"));
  const lines = () => texts.value.split("\n").map((t) => t.trim()).filter(Boolean);

  async function classify() {
    const json = { texts: lines() };
    const path = `${modelPath(model.name)}/classify?top_k=3`;
    try {
      const answer = await api(path, { method: "POST", json });
      replace(out, answer.predictions.map((predictions, i) => h("div", { class: "panel" },
        h("p", { text: json.texts[i] }),
        bars(predictions.map((p) => ({ label: p.label ?? `class ${p.index}`, value: p.score }))))));
    } catch (error) {
      replace(out, errorBox(error));
    }
    replace(curls, curlBox(curlLine("POST", path, { json })));
  }

  async function showLayer() {
    const json = { texts: lines().slice(0, 1) };
    const path = `${modelPath(model.name)}/features?layer=${encodeURIComponent(picker.value)}&pool=none`;
    try {
      replace(layerOut, layerResult(await apiNpy(path, { method: "POST", json }), picker.value, null));
    } catch (error) {
      replace(layerOut, errorBox(error));
    }
    curls.append(curlBox(curlLine("POST", path, { json, accept: "application/x-npy" })));
  }

  return h("div", {},
    h("section", { class: "panel" }, h("h2", { text: "Texts, one per line" }), texts,
      h("div", { class: "controls", style: "margin-top:8px" },
        h("button", { type: "button", id: "classify-texts", text: "Classify", onclick: classify }))),
    out,
    layerList.length ? h("section", { class: "panel" }, h("h2", { text: "A layer's output (the first text)" }),
      h("div", { class: "controls" }, picker, h("button", { type: "button", text: "Show output", onclick: showLayer })),
      layerOut) : null,
    h("section", { class: "panel" }, h("h2", { text: "The same with curl" }), curls));
}

function tensorPanel(model, version, layerList, query) {
  const byName = new Map(layerList.map((l) => [l.name, l]));
  const cutInputs = (query.get("inputs") ?? "").split(",").filter((n) => byName.has(n));
  const inputs = cutInputs.length
    ? cutInputs.map((name) => ({ name, datatype: byName.get(name).datatype, shape: byName.get(name).output_shapes[0] }))
    : version.inputs;
  const outputs = (query.get("outputs") ?? query.get("layer") ?? "").split(",").filter(Boolean);
  const request = sampleRequest(inputs, outputs.length ? outputs : version.outputs.map((o) => o.name));
  const body = h("textarea", { id: "infer-body", rows: 14, text: JSON.stringify(request, null, 1) });
  const out = h("div", { id: "infer-answer" });
  const curls = curlArea();

  async function send() {
    let json;
    try {
      json = JSON.parse(body.value);
    } catch (error) {
      replace(out, errorBox(new Error(`the request is not JSON: ${error.message}`)));
      return;
    }
    const path = `${modelPath(model.name)}/infer`;
    try {
      const answer = await api(path, { method: "POST", json });
      const text = JSON.stringify(answer, null, 1);
      replace(out, h("pre", { class: "answer", text: text.length > 20000 ? `${text.slice(0, 20000)}\n…` : text }));
    } catch (error) {
      replace(out, errorBox(error));
    }
    replace(curls, curlBox(curlLine("POST", path, { json })));
  }

  const note = cutInputs.length
    ? `A cut: the graph runs from ${cutInputs.join(", ")} (fed as those layers' outputs) to the outputs asked for.`
    : "Prefilled from the model's signature; any layer may be added to outputs (see Layers).";
  return h("div", {},
    h("section", { class: "panel" }, h("h2", { text: "V2 inference request" }), h("p", { class: "hint", text: note }),
      body, h("div", { class: "controls", style: "margin-top:8px" },
        h("button", { type: "button", id: "send-infer", text: "Send", onclick: send })), out),
    h("section", { class: "panel" }, h("h2", { text: "The same with curl" }), curls));
}

export function mount(view, context, where) {
  const select = h("select", { id: "try-model", onchange: () => context.go(`#/try/${encodeURIComponent(select.value)}`) });
  const body = h("div");
  view.append(h("div", { class: "controls" }, h("h1", { text: "Try it", style: "margin:0" }), select), body);
  let shown = "";

  async function draw() {
    const models = context.overview.models.filter((m) => m.versions.length);
    const names = models.map((m) => m.name).join();
    if (names !== [...select.options].map((o) => o.value).join()) {
      replace(select, models.map((m) => h("option", { value: m.name, text: m.name })));
    }
    const model = models.find((m) => m.name === where.model) ?? models.find((m) => modelState(m) === "READY");
    if (!model) return;
    select.value = model.name;
    const version = activeVersion(model);
    const key = `${model.name}/${version.version}/${version.state}`;
    if (key === shown) return;
    shown = key;
    if (version.state !== "READY") {
      replace(body, h("p", { class: "notice", text: `${model.name} is ${version.state}${version.reason ? `: ${version.reason}` : ""}` }));
      return;
    }
    let layerList = [];
    try {
      layerList = await fetchLayers(model.name, version.version);
    } catch (error) {
      replace(body, errorBox(error));
      return;
    }
    const isCut = where.query.has("inputs"); // a cut from the Layers page: tensors in, whatever the model takes
    const panel = version.input === "image" && !isCut ? imagePanel(model, version, layerList, where.query)
      : version.input === "text" && !isCut ? textPanel(model, layerList, where.query)
        : tensorPanel(model, version, layerList, where.query);
    replace(body, h("p", { class: "hint", text: `${model.name}, version ${version.version} (${version.engine}); ` +
      `inputs ${version.inputs.map((i) => `${i.name} ${i.datatype} [${i.shape.join(", ")}]`).join(", ")}` }), panel);
  }

  return { update: draw };
}
