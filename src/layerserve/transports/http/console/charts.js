// Charts drawn with SVG and canvas, no library: live line charts, label bars, a histogram of values and a
// heatmap of a spatial layer over the photo.

import { h } from "./dom.js";

export const COLORS = ["#4f46e5", "#16a34a", "#ea580c", "#0891b2", "#c026d3", "#ca8a04", "#dc2626", "#475569"];
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 320; // a chart's drawing units: it scales to its box, so a wider box gets a wider chart
const HEIGHT = 150;
const PAD = { left: 58, right: 8, top: 8, bottom: 18 };  // left: room for "1000.0 ms"

function svg(tag, attributes = {}, text = "") {
  const element = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text) element.textContent = text;
  return element;
}

// A line chart of series [{name, points: [[x, value | null]]}] from `xStart` to `xEnd`, with `xLabels` ([[text, x]]).
// `top`: a fixed top of the value axis (1 for a fraction), else the values' maximum with headroom.
function plot(title, series, { format, xStart, xEnd, xLabels, width = WIDTH, top: fixedTop, note = "" }) {
  const span = xEnd - xStart || 1;
  const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && Number.isFinite(v));
  const top = fixedTop ?? (Math.max(...values, 0) * 1.15 || 1);
  const x = (t) => PAD.left + ((t - xStart) / span) * (width - PAD.left - PAD.right);
  const y = (v) => HEIGHT - PAD.bottom - (v / top) * (HEIGHT - PAD.top - PAD.bottom);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${HEIGHT}`, role: "img" });
  for (const fraction of [0, 0.5, 1]) {
    const value = top * fraction;
    chart.append(svg("line", { x1: PAD.left, x2: width - PAD.right, y1: y(value), y2: y(value), class: "gridline" }));
    chart.append(svg("text", { x: PAD.left - 4, y: y(value) + 3, "text-anchor": "end", class: "axis" }, format(value)));
  }
  for (const [label, t] of xLabels) {
    const anchor = t === xStart ? "start" : t === xEnd ? "end" : "middle";
    chart.append(svg("text", { x: x(t), y: HEIGHT - 4, "text-anchor": anchor, class: "axis" }, label));
  }
  series.forEach((s, index) => {
    const color = s.color ?? COLORS[index % COLORS.length];
    let path = "";
    let pen = "M";
    for (const [t, v] of s.points) {
      if (v === null || !Number.isFinite(v) || t < xStart) {
        pen = "M";
        continue;
      }
      path += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)} `;
      pen = "L";
    }
    if (path) chart.append(svg("path", { d: path, fill: "none", stroke: color, "stroke-width": 1.8,
      "vector-effect": "non-scaling-stroke", "stroke-linejoin": "round" }));
  });
  const legend = h("div", { class: "legend" }, series.map((s, index) => {
    const last = [...s.points].reverse().find((p) => p[1] !== null && Number.isFinite(p[1]));
    return h("span", {}, h("i", { style: `background:${s.color ?? COLORS[index % COLORS.length]}` }),
      `${s.name} ${last ? format(last[1]) : "–"}`);
  }));
  return h("div", { class: "chart", "data-chart": title }, h("h3", { text: title + note }), chart, legend);
}

// A live line chart: points at unix seconds, over the last `windowS` seconds up to `now`.
// `note` follows the title in its heading (the chart keeps its title as its name).
export function lineChart(title, series, { format = (v) => v.toFixed(1), windowS = 120, now, note = "" } = {}) {
  const end = now ?? Date.now() / 1000;
  const start = end - windowS;
  const ago = (seconds) => (seconds >= 90 ? `-${(seconds / 60).toFixed(seconds % 60 ? 1 : 0)} min` : `-${Math.round(seconds)} s`);
  const xLabels = [[ago(windowS), start], [ago(windowS / 2), start + windowS / 2], ["now", end]];
  return plot(title, series, { format, xStart: start, xEnd: end, xLabels, note });
}

// A chart per training epoch: points at epochs 1..`epochs`; `top` fixes the value axis (1 for accuracy).
export function epochChart(title, series, epochs, { format = (v) => v.toFixed(2), top } = {}) {
  const xLabels = [["epoch 1", 1], [`${epochs}`, Math.max(epochs, 2)]];
  return plot(title, series, { format, xStart: 1, xEnd: Math.max(epochs, 2), xLabels, width: 460, top });
}

// Horizontal bars of [{label, value}] (scores 0..1), the first one marked.
export function bars(items) {
  return h("div", { class: "bars", role: "list" }, items.map((item, index) => [
    h("div", { class: `label${index === 0 ? " first" : ""}`, title: item.label, text: item.label, role: "listitem" }),
    h("div", { class: `track${index === 0 ? " first" : ""}` },
      h("div", { class: "fill", style: `width:${Math.max(0, Math.min(1, item.value)) * 100}%` })),
    h("div", { class: "value", text: `${(item.value * 100).toFixed(1)}%` }),
  ]));
}

// A histogram of every value of a layer's output, `bins` wide (counts on a log scale: activations are often mostly
// zeros), with its range and mean.
export function histogram(values, bins = 48, width = 640) {
  let min = Infinity;
  let max = -Infinity;
  let sum = 0;
  for (const v of values) {
    if (v < min) min = v;
    if (v > max) max = v;
    sum += v;
  }
  const binWidth = max > min ? (max - min) / bins : 1;
  const counts = new Array(bins).fill(0);
  for (const v of values) counts[Math.min(bins - 1, Math.floor((v - min) / binWidth))] += 1;
  const peak = Math.log1p(Math.max(...counts, 1));
  const chart = svg("svg", { viewBox: `0 0 ${width} ${HEIGHT}`, role: "img" });
  const barWidth = (width - 8) / bins;
  counts.forEach((count, index) => {
    const barHeight = (Math.log1p(count) / peak) * (HEIGHT - PAD.bottom - 6);
    const bar = svg("rect", { x: 4 + index * barWidth, y: HEIGHT - PAD.bottom - barHeight, width: barWidth - 1,
      height: barHeight, fill: COLORS[0] });
    bar.append(svg("title", {}, `${count.toLocaleString("en")} from ${(min + index * binWidth).toPrecision(3)}`));
    chart.append(bar);
  });
  chart.append(svg("text", { x: 4, y: HEIGHT - 4, class: "axis" }, min.toPrecision(3)));
  chart.append(svg("text", { x: width - 4, y: HEIGHT - 4, "text-anchor": "end", class: "axis" }, max.toPrecision(3)));
  const mean = values.length ? sum / values.length : 0;
  return h("div", { class: "chart", "data-chart": "histogram" }, h("h3", { text: "Values (count, log scale)" }), chart,
    h("div", { class: "legend", text: `${values.length.toLocaleString("en")} values, min ${min.toPrecision(3)}, ` +
      `mean ${mean.toPrecision(3)}, max ${max.toPrecision(3)}` }));
}

// "Inferno"-like colours from 0 (dark) to 1 (bright yellow).
function heat(t) {
  const stops = [[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]];
  const scaled = Math.max(0, Math.min(1, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(scaled));
  const f = scaled - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
}

// Draw the mean over channels of an [1, H, W, C] output as a translucent heatmap on `canvas` (upsampled
// smoothly to the canvas' size).
export function drawHeatmap(canvas, shape, data) {
  const [, rows, columns, channels] = shape;
  const map = new Float32Array(rows * columns);
  for (let cell = 0; cell < rows * columns; cell += 1) {
    let total = 0;
    for (let c = 0; c < channels; c += 1) total += data[cell * channels + c];
    map[cell] = total / channels;
  }
  let low = Infinity;
  let high = -Infinity;
  for (const v of map) {
    low = Math.min(low, v);
    high = Math.max(high, v);
  }
  const small = document.createElement("canvas");
  small.width = columns;
  small.height = rows;
  const pixels = small.getContext("2d").createImageData(columns, rows);
  map.forEach((v, cell) => {
    const [r, g, b] = heat(high > low ? (v - low) / (high - low) : 0);
    pixels.data.set([r, g, b, 255], cell * 4);
  });
  small.getContext("2d").putImageData(pixels, 0, 0);
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  context.globalAlpha = 0.55;
  context.imageSmoothingEnabled = true;
  context.imageSmoothingQuality = "high";
  context.drawImage(small, 0, 0, canvas.width, canvas.height);
  return { rows, columns, low, high };
}
