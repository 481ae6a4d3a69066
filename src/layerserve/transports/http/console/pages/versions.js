// Versions and training: a model's versions with their resident memory and last use, apply (pin), unpin, unload and
// load; training jobs started from a pasted or uploaded CSV/TSV, with progress, loss and accuracy per epoch, cancel,
// and apply once they succeed.
// These routes need the admin token when the server has one.

import { act as actOn } from "../action.js";
import { api, curlLine } from "../api.js";
import { epochChart } from "../charts.js";
import { ago, formatBytes, h, refreshAgo, replace } from "../dom.js";
import { modelState } from "./models.js";

const SAMPLE = "text\tlabel\n这个手机很好用，电池也耐用\tpositive\n太差了，用了两天就坏了\tnegative\n";

function modelPath(name) {
  return `/v2/models/${encodeURIComponent(name)}`;
}

function jobProgress(job) {
  if (job.state === "succeeded") return 1;
  const p = job.progress ?? {};
  if (!p.epochs) return 0;
  const within = p.steps ? p.step / p.steps : 0;
  return Math.min(0.99, (p.epoch - 1 + within) / p.epochs); // 100% once its version is written and served
}

function jobSummary(job) {
  const p = job.progress ?? {};
  const parts = [];
  if (p.epochs_run && p.epochs_run < p.epochs) parts.push(`stopped early after ${p.epochs_run} of ${p.epochs} epochs`);
  else if (p.epoch) parts.push(`epoch ${p.epoch} of ${p.epochs}`);
  const kept = p.best_epoch ? job.history.find((row) => row.epoch === p.best_epoch) : null;
  const shown = kept ?? p; // once it ended: the epoch whose weights were kept
  if (kept) parts.push(`weights of epoch ${p.best_epoch}`);
  if (shown.loss !== undefined) parts.push(`loss ${shown.loss.toFixed(3)}`);
  if (shown.val_accuracy !== undefined) parts.push(`validation accuracy ${shown.val_accuracy.toFixed(3)}`);
  if (job.model_version) parts.push(`version ${job.model_version}`);
  if (job.error) parts.push(job.error);
  return parts.join(" · ");
}

function curves(job) {
  const epochs = job.progress?.epochs_run ?? job.progress?.epochs ?? job.history.length;
  const line = (key) => job.history.filter((row) => row[key] !== undefined).map((row) => [row.epoch, row[key]]);
  return h("div", { class: "charts" },
    epochChart("Loss", [{ name: "training", points: line("loss") }, { name: "validation", points: line("val_loss") }],
      epochs),
    epochChart("Accuracy", [{ name: "training", points: line("accuracy") },
      { name: "validation", points: line("val_accuracy") }], epochs, { top: 1 }));
}

export function mount(view, context, where) {
  const select = h("select", { id: "versions-model",
    onchange: () => context.go(`#/versions/${encodeURIComponent(select.value)}`) });
  const versionsBox = h("div", { id: "versions" });
  const actionOut = h("div", { id: "action-result" });
  const jobsBox = h("div", { id: "jobs" });
  const trainOut = h("div", { id: "train-result" });
  let model = null;
  let fetchingJobs = false;
  let versionsKey = "";
  let jobsKey = "";

  const act = (method, path, json) => actOn(context, actionOut, method, path, json);

  function drawVersions() {
    // Memory and last use move by themselves: left out of the key, and updated in place (updateUsage).
    const key = JSON.stringify(model, (k, value) => (k === "memory" || k === "last_used" ? undefined : value));
    if (key === versionsKey) return; // unchanged: the buttons stay where the pointer is
    versionsKey = key;
    if (!model) {
      replace(versionsBox, h("p", { class: "muted", text: "No models yet." }));
      return;
    }
    const path = modelPath(model.name);
    const state = modelState(model);
    const rows = model.versions.map((v) => h("tr", { "data-version": String(v.version) },
      h("td", {}, h("strong", { text: v.version })),
      h("td", {}, h("span", { class: `badge ${v.state}`, text: v.state })),
      h("td", { class: "hint", text: v.reason }),
      h("td", { text: v.engine }),
      h("td", { class: "num memory" }),
      h("td", { class: "num" }, ago("span", null, 0, { class: "last-use" })),
      h("td", { text: [v.version === model.active_version ? "active" : "",
        v.version === model.pinned_version ? "pinned" : ""].filter(Boolean).join(", ") }),
      h("td", {}, v.state === "READY" && v.version !== model.pinned_version
        ? h("button", { class: "small", type: "button", text: `Apply ${v.version}`,
          onclick: () => act("POST", `${path}/versions/${v.version}/apply`) })
        : null),
    ));
    replace(versionsBox,
      h("div", { class: "controls" },
        h("span", {}, h("strong", { text: model.name }), " ", h("span", { class: `badge ${state}`, id: "model-state",
          "data-state": state, text: state })),
        model.reason ? h("span", { class: "hint", text: model.reason }) : null,
        model.pinned_version ? h("button", { class: "ghost small", type: "button", id: "unpin", text: "Unpin (serve the latest)",
          onclick: () => act("POST", `${path}/apply`, { version: "latest" }) }) : null,
        h("span", { class: "spacer" }),
        h("button", { class: "small", type: "button", id: "load-model", text: "Load",
          onclick: () => act("POST", `/v2/repository/models/${encodeURIComponent(model.name)}/load`) }),
        h("button", { class: "danger small", type: "button", id: "unload-model", text: "Unload",
          onclick: () => act("POST", `/v2/repository/models/${encodeURIComponent(model.name)}/unload`) })),
      model.versions.length
        ? h("table", {}, h("thead", {}, h("tr", {}, ["Version", "State", "Reason", "Engine", "Memory", "Last use",
          "Serving", ""].map((t) => h("th", { class: ["Memory", "Last use"].includes(t) ? "num" : "", text: t })))),
        h("tbody", {}, rows))
        : h("p", { class: "muted", text: "No version is loaded." }));
  }

  function updateUsage() {
    for (const v of model?.versions ?? []) {
      const row = versionsBox.querySelector(`tr[data-version="${v.version}"]`);
      if (!row) continue;
      const memory = row.querySelector(".memory");
      memory.dataset.bytes = v.memory?.total_bytes ?? "";
      memory.textContent = formatBytes(v.memory?.total_bytes);
      row.querySelector(".last-use").dataset.since = v.last_used ?? "";
    }
    refreshAgo(versionsBox, context.overview.server.time);
  }

  // The training form: a model name, a dataset pasted or uploaded, params, and whether to apply the result.
  const name = h("input", { id: "train-model", value: where.model || "reviews", size: 18 });
  const pasted = h("textarea", { id: "train-data", rows: 6, text: SAMPLE });
  const upload = h("input", { type: "file", id: "train-file", accept: ".csv,.tsv,.txt,.jsonl" });
  const epochs = h("input", { type: "number", id: "train-epochs", value: "20", min: "1", max: "1000", style: "width:80px",
    title: "the most: training stops once the validation loss no longer improves, keeping the best epoch" });
  const split = h("select", { id: "train-split" }, h("option", { value: "character", text: "characters (Chinese)" }),
    h("option", { value: "whitespace", text: "words (English)" }));
  const applyWhenDone = h("input", { type: "checkbox", id: "train-apply" });

  async function startTraining() {
    const file = upload.files[0];
    const content = file ?? new Blob([pasted.value], { type: "text/plain" });
    const filename = file ? file.name : pasted.value.split("\n")[0].includes("\t") ? "pasted.tsv" : "pasted.csv";
    const params = { epochs: Number(epochs.value), split: split.value };
    const form = new FormData();
    form.append("file", content, filename);
    form.append("params", JSON.stringify(params));
    form.append("apply", applyWhenDone.checked ? "true" : "false");
    const path = `${modelPath(name.value.trim())}/train`;
    const line = curlLine("POST", path, { files: { file: filename },
      fields: { params: JSON.stringify(params), apply: String(applyWhenDone.checked) } });
    try {
      const job = await api(path, { method: "POST", form });
      replace(trainOut, h("p", { class: "hint", text: `job ${job.job_id} queued` }), h("div", { class: "curl" }, h("pre", { text: line })));
      refreshJobs();
    } catch (error) {
      replace(trainOut, h("div", { class: "error", role: "alert", text: error.message }), h("div", { class: "curl" }, h("pre", { text: line })));
    }
  }

  async function refreshJobs() {
    if (fetchingJobs) return;
    fetchingJobs = true;
    try {
      const { jobs } = await api("/v2/jobs");
      const models = new Map(context.overview.models.map((m) => [m.name, m]));
      const key = JSON.stringify([jobs, [...models.values()].map((m) => [m.pinned_version, m.versions.map((v) => v.state)])]);
      if (key === jobsKey) return;
      jobsKey = key;
      replace(jobsBox, jobs.length ? [...jobs].reverse().map((job) => {
        const served = models.get(job.model_name);
        const version = job.model_version ?? "";
        const canApply = job.state === "succeeded" && version && served?.pinned_version !== version &&
          served?.versions.some((v) => v.version === version && v.state === "READY");
        return h("div", { class: "job", "data-job": job.id, "data-state": job.state },
          h("div", { class: "head" },
            h("strong", { text: job.model_name }), h("span", { class: `badge ${job.state}`, text: job.state }),
            h("div", { class: "progress", role: "progressbar", "aria-valuenow": Math.round(jobProgress(job) * 100) },
              h("div", { style: `width:${jobProgress(job) * 100}%` })),
            h("span", { class: "progress-text", text: `${Math.round(jobProgress(job) * 100)}%` }),
            h("span", { class: "hint", text: jobSummary(job) }),
            h("span", { class: "spacer" }),
            ["queued", "running"].includes(job.state) ? h("button", { class: "danger small", type: "button", text: "Cancel",
              onclick: () => api(`/v2/jobs/${job.id}/cancel`, { method: "POST" }).then(refreshJobs, refreshJobs) }) : null,
            canApply ? h("button", { class: "small", type: "button", text: `Apply version ${job.model_version}`,
              onclick: () => act("POST", `${modelPath(job.model_name)}/versions/${job.model_version}/apply`) }) : null),
          job.history.length ? curves(job) : null);
      }) : h("p", { class: "muted", text: "No training jobs yet." }));
    } catch (error) {
      jobsKey = "";
      replace(jobsBox, h("div", { class: "error", text: `Jobs: ${error.message}` }));
    } finally {
      fetchingJobs = false;
    }
  }

  view.append(
    h("div", { class: "controls" }, h("h1", { text: "Versions & training", style: "margin:0" }), select),
    h("section", { class: "panel" }, h("h2", { text: "Versions" }), versionsBox, actionOut),
    h("div", { class: "row" },
      h("section", { class: "panel grow" }, h("h2", { text: "Train a text classifier" }),
        h("div", { class: "controls" }, h("label", {}, "Model", name), h("label", {}, "Epochs (at most)", epochs),
          h("label", {}, "Tokens", split), h("label", {}, applyWhenDone, "apply when done")),
        h("p", { class: "hint", text: "Paste CSV or TSV with a header (columns text and label), or upload a file:" }),
        pasted, h("div", { class: "controls", style: "margin-top:8px" }, upload,
          h("button", { type: "button", id: "start-training", text: "Start training", onclick: startTraining })),
        trainOut),
      h("section", { class: "panel grow" }, h("h2", { text: "Jobs" }), jobsBox)),
  );

  function draw() {
    const models = context.overview.models;
    if (models.map((m) => m.name).join() !== [...select.options].map((o) => o.value).join()) {
      replace(select, models.map((m) => h("option", { value: m.name, text: m.name })));
    }
    model = models.find((m) => m.name === where.model) ?? models[0] ?? null;
    if (model) select.value = model.name;
    drawVersions();
    updateUsage();
    refreshJobs();
  }

  return { update: draw };
}
