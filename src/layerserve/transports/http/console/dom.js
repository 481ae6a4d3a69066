// Building the page without a framework: h() makes an element, and a few number formats.

export function h(tag, props = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) element.addEventListener(key.slice(2).toLowerCase(), value);
    else if (key === "class") element.className = value;
    else if (key === "text") element.textContent = value;
    else if (key in element && typeof value !== "string") element[key] = value;
    else element.setAttribute(key, value === true ? "" : value);
  }
  element.append(...children.flat(Infinity).filter((child) => child !== null && child !== undefined && child !== false));
  return element;
}

export function replace(element, ...children) {
  element.replaceChildren(...children.flat(Infinity).filter((child) => child !== null && child !== undefined));
  return element;
}

export function formatNumber(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en");
  return value.toFixed(digits);
}

export function formatMs(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  return seconds < 0.01 ? `${(seconds * 1000).toFixed(2)} ms` : `${(seconds * 1000).toFixed(1)} ms`;
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  if (bytes >= 2 ** 30) return `${(bytes / 2 ** 30).toFixed(2)} GB`;
  const megabytes = bytes / 2 ** 20;
  return megabytes > 0 && megabytes < 9.95 ? `${megabytes.toFixed(1)} MB` : `${Math.round(megabytes)} MB`;
}

// How long ago a Unix time was, from `now` (the server's clock): "3 s ago", "5 min ago"; "never" for none.
export function formatAgo(time, now) {
  if (time === null || time === undefined) return "never";
  const seconds = Math.max(0, now - time);
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 90 * 60) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 36 * 3600) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

// An element saying how long ago `time` was; refreshAgo() moves it on without rebuilding what holds it.
export function ago(tag, time, now, props = {}) {
  return h(tag, { ...props, "data-since": time ?? "", title: time ? new Date(time * 1000).toLocaleString() : null,
    text: formatAgo(time, now) });
}

export function refreshAgo(root, now) {
  for (const element of root.querySelectorAll("[data-since]")) {
    const text = formatAgo(element.dataset.since ? Number(element.dataset.since) : null, now);
    if (element.textContent !== text) element.textContent = text;
  }
}

export function percent(fraction) {
  return fraction === null || Number.isNaN(fraction) ? "–" : `${(fraction * 100).toFixed(1)}%`;
}
