// The view's state, kept in the URL hash of the plugin's own frame so that a
// link (e.g. /data/plugin_entry.html?name=numerics#run=a&tensor=loss&step=7)
// reproduces it. Inside TensorBoard this is the iframe's location.

/** The safe-range parameters the controls set (http_api.md). */
export const SAFE_RANGE_KEYS = ["max_abs", "grad_norm_limit", "spike_factor"];

export function emptyState() {
  return { runs: [], focus: null, tensor: null, step: null, start: null, end: null, log: false, params: {} };
}

function int(value) {
  if (value === null || value === "") return null;
  const n = Number(value);
  return Number.isInteger(n) ? n : null;
}

/** Parses "#run=a&run=b&tensor=t&step=5&start=0&end=9&log=1&max_abs=100". */
export function parse(hash) {
  const q = new URLSearchParams(hash.replace(/^#/, ""));
  const state = emptyState();
  state.runs = q.getAll("run");
  state.focus = q.get("focus");
  state.tensor = q.get("tensor");
  state.step = int(q.get("step"));
  state.start = int(q.get("start"));
  state.end = int(q.get("end"));
  state.log = q.get("log") === "1";
  for (const key of SAFE_RANGE_KEYS) {
    const value = q.get(key);
    if (value !== null && value !== "") state.params[key] = value;
  }
  return state;
}

export function serialize(state) {
  const q = new URLSearchParams();
  for (const run of state.runs) q.append("run", run);
  if (state.focus !== null) q.set("focus", state.focus);
  if (state.tensor !== null) q.set("tensor", state.tensor);
  for (const key of ["step", "start", "end"]) if (state[key] !== null) q.set(key, String(state[key]));
  if (state.log) q.set("log", "1");
  for (const key of SAFE_RANGE_KEYS) if (state.params[key] !== undefined) q.set(key, state.params[key]);
  return q.toString();
}

export function read() {
  return parse(window.location.hash);
}

/** Writes the hash without adding history entries (TensorBoard's back button stays TensorBoard's). */
export function write(state) {
  const hash = serialize(state);
  const url = `${window.location.pathname}${window.location.search}${hash ? "#" + hash : ""}`;
  if (url !== `${window.location.pathname}${window.location.search}${window.location.hash}`) {
    window.history.replaceState(null, "", url);
  }
}
