// The plugin's HTTP routes (tb_numerics/http_api.md). Paths are relative:
// inside TensorBoard's iframe <base href="plugin/numerics/"> makes "./runs"
// reach /data/plugin/numerics/runs.

/** A route answered 4xx/5xx: `message` is the server's {"error": ...}. */
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// TensorBoard's JSON encoder sends NaN and +-Infinity as these strings.
const NONFINITE = { NaN: NaN, Infinity: Infinity, "-Infinity": -Infinity };

/** A JSON number, or one of the strings above, as a JS number. */
export function toNumber(v) {
  if (typeof v === "number") return v;
  if (typeof v === "string" && v in NONFINITE) return NONFINITE[v];
  return v === null || v === undefined ? NaN : Number(v);
}

async function get(route, params = {}, signal) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") query.set(key, String(value));
  }
  const qs = query.toString();
  let response;
  try {
    response = await fetch(`./${route}${qs ? "?" + qs : ""}`, { signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`Cannot reach TensorBoard (${e.message})`, 0);
  }
  const text = await response.text();
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    // Not JSON (e.g. a proxy's HTML error page): report the status below.
  }
  if (!response.ok) {
    const message = body && typeof body.error === "string" ? body.error : `${response.status} ${response.statusText}`;
    throw new ApiError(message, response.status);
  }
  if (body === null) throw new ApiError(`/${route} did not answer JSON`, response.status);
  return body;
}

export const safeRange = (signal) => get("safe_range", {}, signal);

export const rules = (signal) => get("rules", {}, signal);

export const runs = (params, signal) => get("runs", params, signal);

export const summary = (run, params, signal) => get("summary", { run, ...params }, signal);

export const timeline = (run, width, { start, end } = {}, params, signal) =>
  get("timeline", { run, width, start, end, ...params }, signal);

/** /series with every statistic decoded to numbers (NaN/Inf included; null,
 * a statistic the record does not hold, stays null: a gap, not a NaN). */
export async function series(run, tensor, { start, end, maxPoints } = {}, params, signal) {
  const body = await get("series", { run, tensor, start, end, max_points: maxPoints, ...params }, signal);
  const fields = {};
  for (const [name, values] of Object.entries(body.fields || {})) fields[name] = values.map((v) => (v === null ? null : toNumber(v)));
  return { ...body, fields };
}

/** /compare: where `run` first leaves the band of the reference run `against`. */
export const compare = (run, against, band = {}, signal) => get("compare", { run, against, ...band }, signal);
