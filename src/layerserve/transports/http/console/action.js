// An admin action a button takes (load, unload, apply): the call, then its curl line, or the server's error above
// it, in the page's result box; the overview is polled again at once.

import { api, curlLine } from "./api.js";
import { h, replace } from "./dom.js";

export async function act(context, out, method, path, json) {
  replace(out, h("p", { class: "muted", text: `${method} ${path}…` }));
  const line = curlLine(method, path, json === undefined ? {} : { json });
  try {
    await api(path, { method, json });
    replace(out, h("div", { class: "curl" }, h("pre", { text: line })));
  } catch (error) {
    replace(out, h("div", { class: "error", role: "alert", text: error.message }),
      h("div", { class: "curl" }, h("pre", { text: line })));
  }
  await context.refresh();
}
