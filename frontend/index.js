// Entry of the Numerics dashboard. TensorBoard's plugin_entry.html imports
// this module (es_module_path "/index.js") inside its iframe and calls render().

import { Dashboard } from "./app.js";

export async function render() {
  const css = document.createElement("link");
  css.rel = "stylesheet";
  css.href = new URL("./styles.css", import.meta.url).href;
  const loaded = new Promise((resolve) => {
    css.onload = resolve;
    css.onerror = resolve; // unstyled beats blank
  });
  document.head.append(css);
  document.title = "Numerics";
  await loaded;
  const dashboard = new Dashboard(document.body);
  await dashboard.start();
}
