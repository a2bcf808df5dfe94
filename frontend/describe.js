// A timeline cell's numbers in words, for its tooltip: what is known about
// the tensor at that step (or bucket of steps), never an unknown printed as a
// number. A record with no finite value has no min, max, mean or norm ("no
// finite values"); the norm of a tensor holding NaN is NaN, not the norm of
// its finite values; op-level records hold no sums ("not recorded for ops").

import * as fmt from "./format.js";

/** Whether `kind` is listed as a handled event (information, not a warning) in the summary. */
function isInfoKind(summary, kind) {
  const info = summary?.info;
  return Array.isArray(info) && info.some((i) => i && i.kind === kind);
}

/** The finite values' statistics, or what stands in their place. */
function statsLines(f, bad, finite) {
  const n = fmt.number;
  const size = f.count[0];
  if (size === 0) return ["empty tensor: no values"];
  if (finite <= 0) return ["no finite values: no min, max, mean or norm"];
  const of = bad ? ` (of its ${fmt.count(finite)} finite values)` : "";
  const lines = [`min ${n(f.min[0])} · max ${n(f.max[0])} · max |x| ${n(f.max_abs[0])}${of}`];
  if (f.mean[0] === null) lines.push("mean, std and L2: not recorded for ops");
  else if (bad) lines.push(`mean ${n(f.mean[0])} · std ${n(f.std[0])}${of}; L2 of the tensor ${f.nan[0] ? "NaN" : "+Inf"}`);
  else lines.push(`mean ${n(f.mean[0])} · std ${n(f.std[0])} · L2 ${n(f.l2[0])}`);
  return lines;
}

/**
 * The tooltip's lines for /series of one cell (one point: `maxPoints` 1);
 * `bucket`: whether the cell covers several steps; `summary`: the run's.
 */
export function describeCell(s, { bucket = false, summary = null } = {}) {
  if (!s.steps.length) return ["No record in this range"];
  const f = s.fields;
  const bad = f.nan[0] + f.posinf[0] + f.neginf[0];
  const lines = [];
  const kind = s.kinds && s.kinds[0];
  if (kind) lines.push(`${isInfoKind(summary, kind) ? "information" : "warning"}: ${fmt.kind(kind)}`);
  if (bad > 0) lines.push(fmt.nonfiniteCounts({ nan: f.nan[0], posinf: f.posinf[0], neginf: f.neginf[0], size: f.count[0] }));
  lines.push(...statsLines(f, bad, f.count[0] - bad));
  if (bucket) lines.push("(over the bucket: min of mins, max of maxes, sums of counts)");
  return lines;
}
