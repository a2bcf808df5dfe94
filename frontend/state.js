// The view's state, kept in the URL hash of the plugin's own frame so that a
// link (e.g. /data/plugin_entry.html?name=numerics#run=a&tensor=loss&step=7)
// reproduces it. Inside TensorBoard this is the iframe's location.

/**
 * The safe-range parameters of http_api.md, used until /safe_range answers
 * with the ones the server publishes (which then replace them): every one of
 * them is kept in the hash, so a link reproduces what counts as a warning.
 */
export const SAFE_RANGE_KEYS = [
  "max_abs",
  "grad_norm_limit",
  "spike_factor",
  "spike_window",
  "vanishing_floor",
  "underflow_share",
  "allow_neginf",
];

export function emptyState() {
  return { runs: [], focus: null, tensor: null, step: null, start: null, end: null, log: false, params: {} };
}

function int(value) {
  if (value === null || value === "") return null;
  const n = Number(value);
  return Number.isInteger(n) ? n : null;
}

/**
 * Parses "#run=a&run=b&tensor=t&step=5&start=0&end=9&log=1&max_abs=100";
 * `keys` names the safe-range parameters to take (others are dropped).
 */
export function parse(hash, keys = SAFE_RANGE_KEYS) {
  const q = new URLSearchParams(hash.replace(/^#/, ""));
  const state = emptyState();
  state.runs = q.getAll("run");
  state.focus = q.get("focus");
  state.tensor = q.get("tensor");
  state.step = int(q.get("step"));
  state.start = int(q.get("start"));
  state.end = int(q.get("end"));
  state.log = q.get("log") === "1";
  for (const key of keys) {
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
  for (const [key, value] of Object.entries(state.params)) if (value !== undefined) q.set(key, value);
  return q.toString();
}

export function read(keys = SAFE_RANGE_KEYS) {
  return parse(window.location.hash, keys);
}

/** Writes the hash without adding history entries (TensorBoard's back button stays TensorBoard's). */
export function write(state) {
  const hash = serialize(state);
  const url = `${window.location.pathname}${window.location.search}${hash ? "#" + hash : ""}`;
  if (url !== `${window.location.pathname}${window.location.search}${window.location.hash}`) {
    window.history.replaceState(null, "", url);
  }
}
