// Entry of the Numerics dashboard. TensorBoard's plugin_entry.html imports
// this module (es_module_path "/index.js") inside its iframe and calls render().

export async function render() {
  const css = document.createElement("link");
  css.rel = "stylesheet";
  css.href = new URL("./styles.css", import.meta.url).href;
  const styled = new Promise((resolve) => {
    css.onload = resolve;
    css.onerror = resolve; // unstyled beats blank
  });
  document.head.append(css);
  document.title = "Numerics";
  // The modules load while the stylesheet does (a static import would load them first).
  const [{ Dashboard }] = await Promise.all([import("./app.js"), styled]);
  await new Dashboard(document.body).start();
}
