// Calls to the server's API with the session's token, and the same call written as a curl line.

const TOKEN_KEY = "layerserve-token";
let onAuthNeeded = () => {};

export class ApiError extends Error {
  constructor(status, message, path) {
    super(message);
    this.status = status;
    this.path = path;
  }

  get isAuth() {
    return this.status === 401 || this.status === 403;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export function whenAuthNeeded(handler) {
  onAuthNeeded = handler;
}

async function send(path, { method = "GET", json, form, accept } = {}) {
  const headers = {};
  if (token()) headers.Authorization = `Bearer ${token()}`;
  if (accept) headers.Accept = accept;
  let body;
  if (json !== undefined) {
    body = JSON.stringify(json);
    headers["Content-Type"] = "application/json";
  } else if (form) {
    body = form;
  }
  let response;
  try {
    response = await fetch(path, { method, headers, body });
  } catch (error) {
    throw new ApiError(0, `the server did not answer (${error.message})`, path);
  }
  if (!response.ok) {
    const text = await response.text();
    let message = `${response.status} ${response.statusText}`;
    try {
      message = JSON.parse(text).error || message;
    } catch {
      // not JSON: the status line says it
    }
    const error = new ApiError(response.status, message, path);
    if (error.isAuth) onAuthNeeded(error);
    throw error;
  }
  return response;
}

// JSON in (optional), JSON out; throws ApiError with the server's {"error"} message.
export async function api(path, options = {}) {
  const response = await send(path, options);
  const text = await response.text();
  return text ? JSON.parse(text) : null;
}

// A NumPy .npy answer (Accept: application/x-npy) as {shape, data} (float32 or int32 data).
export async function apiNpy(path, options = {}) {
  const response = await send(path, { ...options, accept: "application/x-npy" });
  return parseNpy(await response.arrayBuffer());
}

export function parseNpy(buffer) {
  const bytes = new Uint8Array(buffer);
  const major = bytes[6];
  const view = new DataView(buffer);
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(bytes.subarray(start, start + headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header)[1];
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1].split(",").filter((s) => s.trim()).map(Number);
  const offset = start + headerLength;
  const types = { "<f4": Float32Array, "<i4": Int32Array, "<f8": Float64Array, "<i8": BigInt64Array };
  const Type = types[descr];
  if (!Type) throw new Error(`unsupported .npy data type ${descr}`);
  const data = new Type(buffer.slice(offset));
  return { shape, data: Type === BigInt64Array ? Float64Array.from(data, Number) : data };
}

function quote(text) {
  return `'${String(text).replaceAll("'", "'\\''")}'`;
}

// The curl line of a call: `json` as -d, `files` ({field: filename}) and `fields` as -F.
export function curlLine(method, path, { json, files = {}, fields = {}, accept } = {}) {
  const parts = ["curl -s"];
  const hasBody = json !== undefined || Object.keys(files).length || Object.keys(fields).length;
  if (method !== "GET" && !hasBody) parts.push(`-X ${method}`);
  if (token()) parts.push(`-H "Authorization: Bearer $LAYERSERVE_TOKEN"`);
  if (accept) parts.push(`-H ${quote(`Accept: ${accept}`)}`);
  if (json !== undefined) parts.push(`-H 'Content-Type: application/json' -d ${quote(JSON.stringify(json))}`);
  for (const [field, name] of Object.entries(files)) parts.push(`-F ${quote(`${field}=@${name}`)}`);
  for (const [field, value] of Object.entries(fields)) parts.push(`-F ${quote(`${field}=${value}`)}`);
  parts.push(quote(new URL(path, window.location.origin).href));
  return parts.join(" ");
}
