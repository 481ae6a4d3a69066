// The console's shell: pages by URL hash, one poll of /v2/overview every POLL_MS shared by every page, and the
// token dialog.

import { api, setToken, token, whenAuthNeeded } from "./api.js";
import * as layers from "./pages/layers.js";
import * as models from "./pages/models.js";
import * as tryIt from "./pages/try.js";
import * as versions from "./pages/versions.js";

const POLL_MS = 1500;
const HISTORY = 100; // snapshots kept: 150 s at one every 1.5 s
const PAGES = { models, try: tryIt, layers, versions };

const context = {
  overview: null, // the newest /v2/overview
  history: [], // [{t, doc}], oldest first
  refresh: () => poll(),
  go: (hash) => {
    window.location.hash = hash;
  },
};
let page = null;
let polling = null;
let authDismissed = false;

function route() {
  const [path, query = ""] = window.location.hash.replace(/^#\/?/, "").split("?");
  const [name, ...rest] = path.split("/");
  return { name: PAGES[name] ? name : "models", model: rest.length ? decodeURIComponent(rest.join("/")) : "",
    query: new URLSearchParams(query) };
}

function show() {
  const where = route();
  for (const link of document.querySelectorAll("header nav a")) {
    link.classList.toggle("active", link.dataset.page === where.name);
  }
  page?.leave?.();
  const view = document.getElementById("view");
  view.replaceChildren();
  page = PAGES[where.name].mount(view, context, where);
  if (context.overview) page.update?.(context);
}

function setStatus(text, kind) {
  const status = document.getElementById("server-status");
  status.textContent = text;
  status.className = `status ${kind}`;
}

async function poll() {
  if (polling) return polling;
  polling = (async () => {
    try {
      const doc = await api("/v2/overview");
      context.overview = doc;
      context.history.push({ t: doc.server.time, doc });
      if (context.history.length > HISTORY) context.history.shift();
      setStatus(doc.server.ready ? "ready" : "not ready", doc.server.ready ? "ready" : "unready");
      page?.update?.(context);
    } catch (error) {
      setStatus(error.isAuth ? "token needed" : "server unreachable", "down");
    } finally {
      polling = null;
    }
  })();
  return polling;
}

function openTokenDialog(error) {
  const dialog = document.getElementById("token-dialog");
  const message = document.getElementById("token-message");
  if (error) {
    const what = error.status === 401 ? "This server needs a token" : "The token was refused";
    message.textContent = `${what}: ${error.message}.`;
    message.className = "error";
  }
  document.getElementById("token-input").value = "";
  if (!dialog.open) dialog.showModal();
}

function setUpTokenDialog() {
  const dialog = document.getElementById("token-dialog");
  document.getElementById("token-button").addEventListener("click", () => {
    const message = document.getElementById("token-message");
    message.className = "";
    message.textContent = token() ? "A token is in use in this tab. Paste another to replace it."
      : "Paste the API token (or the admin token, which also opens loading, unloading, applying and training).";
    openTokenDialog(null);
  });
  document.getElementById("token-form").addEventListener("submit", () => {
    setToken(document.getElementById("token-input").value.trim());
    authDismissed = false;
    poll();
    show();
  });
  document.getElementById("token-clear").addEventListener("click", () => {
    setToken("");
    dialog.close();
    poll();
  });
  dialog.addEventListener("cancel", () => {
    authDismissed = true;
  });
  whenAuthNeeded((error) => {
    if (!authDismissed) openTokenDialog(error); // once dismissed, the pages' own messages say it
  });
}

setUpTokenDialog();
window.addEventListener("hashchange", show);
show();
poll();
setInterval(() => {
  if (!document.hidden) poll();
}, POLL_MS);
