// The view's state. Inside TensorBoard it lives in TensorBoard's own URL,
// as the "p.numerics.<key>" entries that TensorBoard hands back to the
// plugin (host.js), so that the address bar reproduces the view; the
// plugin's own frame keeps a copy in its hash, so that the entry page alone
// (/data/plugin_entry.html?name=numerics#run=a&tensor=loss&step=7) works too.

/**
 * The safe-range parameters of http_api.md, used until /safe_range answers
 * with the ones the server publishes (which then replace them): every one of
 * them is kept in the link, so a link reproduces what counts as a warning.
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

/** run: the run shown; compare: the reference run it is compared with (or null). */
export function emptyState() {
  return { run: null, compare: null, tensor: null, step: null, start: null, end: null, log: false, params: {} };
}

function int(value) {
  if (value === null || value === undefined || value === "") return null;
  const n = Number(value);
  return Number.isInteger(n) ? n : null;
}

/**
 * The state of a dictionary of strings (TensorBoard's URL data, or a hash
 * parsed below); `keys` names the safe-range parameters to take.
 */
export function fromDict(dict, keys = SAFE_RANGE_KEYS) {
  const get = (k) => (Object.hasOwn(dict, k) && dict[k] !== "" ? dict[k] : null);
  const state = emptyState();
  state.run = get("run");
  state.compare = get("compare");
  if (state.compare === state.run) state.compare = null;
  state.tensor = get("tensor");
  state.step = int(get("step"));
  state.start = int(get("start"));
  state.end = int(get("end"));
  state.log = get("log") === "1";
  for (const key of keys) {
    const value = get(key);
    if (value !== null) state.params[key] = value;
  }
  return state;
}

/**
 * Parses "#run=a&compare=b&tensor=t&step=5&start=0&end=9&log=1&max_abs=100".
 * An older link's second "run" (several runs ticked) becomes the reference
 * run, and its "focus" the run shown.
 */
export function parse(hash, keys = SAFE_RANGE_KEYS) {
  const q = new URLSearchParams(hash.replace(/^#/, ""));
  const dict = Object.fromEntries(q.entries());
  const runs = q.getAll("run");
  const focus = q.get("focus");
  if (runs.length) dict.run = focus && runs.includes(focus) ? focus : runs[0];
  if (!dict.compare && runs.length > 1) dict.compare = runs.find((r) => r !== dict.run);
  return fromDict(dict, keys);
}

/** The state as a dictionary of strings, the keys of a link. */
export function toDict(state) {
  const out = {};
  for (const key of ["run", "compare", "tensor"]) if (state[key] !== null) out[key] = state[key];
  for (const key of ["step", "start", "end"]) if (state[key] !== null) out[key] = String(state[key]);
  if (state.log) out.log = "1";
  for (const [key, value] of Object.entries(state.params)) if (value !== undefined) out[key] = value;
  return out;
}

export function serialize(state) {
  return new URLSearchParams(toDict(state)).toString();
}

export function read(keys = SAFE_RANGE_KEYS) {
  return parse(window.location.hash, keys);
}

/** Writes the frame's hash without adding history entries (TensorBoard's back button stays TensorBoard's). */
export function write(state) {
  const hash = serialize(state);
  const url = `${window.location.pathname}${window.location.search}${hash ? "#" + hash : ""}`;
  if (url !== `${window.location.pathname}${window.location.search}${window.location.hash}`) {
    window.history.replaceState(null, "", url);
  }
}
