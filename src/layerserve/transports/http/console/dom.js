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
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(2)} GB` : `${Math.round(bytes / 2 ** 20)} MB`;
}

export function percent(fraction) {
  return fraction === null || Number.isNaN(fraction) ? "–" : `${(fraction * 100).toFixed(1)}%`;
}
