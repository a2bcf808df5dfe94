// The first anomaly and first warning of each run, in words (SPEC section 2),
// with buttons that select the tensor and step in the timeline and charts.
// Every field of /summary is rendered defensively: names are text, never
// HTML, and a field that is absent (or not of the documented shape) renders
// nothing, so a server that adds or leaves out fields never breaks the page.

import { toNumber } from "./api.js";
import { el, replace } from "./dom.js";
import * as fmt from "./format.js";

// Op-level records are named "ops/" + the op's name (tb_numerics.oplevel).
const OP_TAG_PREFIX = "ops/";
// Informational events listed in a banner; the rest are counted.
const INFO_SHOWN = 3;

/** A string or number as text; anything else (objects, null) as null. */
function text(v) {
  return typeof v === "string" || (typeof v === "number" && Number.isFinite(v)) ? String(v) : null;
}

function isObject(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

/** A whole count from the JSON, or null. */
function countOf(v) {
  const n = toNumber(v);
  return Number.isInteger(n) && n >= 0 ? n : null;
}

/** "forward pass", or for the batch as it arrived (phase "input"), "input batch". */
function phaseWords(phase) {
  return phase === "input" ? "input batch" : `${phase} pass`;
}

function opWords(item) {
  const parts = [];
  if (text(item.op_type)) parts.push(`op ${item.op_type}`);
  if (text(item.phase)) parts.push(phaseWords(item.phase));
  return parts.length ? ` (${parts.join(", ")})` : "";
}

/** "record 1 of 2 logged at this step", for a tag logged more than once per step. */
function occurrenceWords(a) {
  const o = a.occurrence;
  if (!isObject(o)) return null;
  const index = countOf(o.index);
  const of = countOf(o.of);
  if (index === null || of === null || of < 2) return null;
  return el("p", { class: "occurrence" }, `In record ${fmt.count(index)} of the ${fmt.count(of)} records of this tensor at this step.`);
}

/**
 * The last healthy and the last finite step, each saying what it is: healthy
 * is neither a warning nor NaN/Inf; between the two, every record of the
 * tensor was finite but out of the safe range.
 */
function lastHealthyWords(a) {
  const healthy = countOf(a.last_healthy_step);
  const finite = countOf(a.last_finite_step);
  const words = [
    healthy === null
      ? "This tensor has no healthy record before it."
      : `Last healthy step of this tensor: ${fmt.count(healthy)} (inside the safe range, no NaN/Inf).`,
  ];
  if (finite !== null && finite !== healthy) {
    const from = healthy === null ? "" : ` from step ${fmt.count(healthy + 1)}`;
    words.push(`Last finite step: ${fmt.count(finite)} (no NaN/Inf, but out of the safe range${from}).`);
  } else if (finite === null && healthy === null && "last_finite_step" in a) words.push("No finite record before it either.");
  return el("p", { class: "last-healthy" }, words.join(" "));
}

/** "64×1024", or null for a shape that is not a list of sizes. */
function shapeWords(shape) {
  return Array.isArray(shape) && shape.every((d) => d === null || Number.isInteger(d)) ? shape.map((d) => d ?? "?").join("×") || "scalar" : null;
}

/**
 * One input at the failing step: what made it (the op, where the replay saw
 * it run) and its shape, then its range: "input 1 (mlp/dense_2/Relu,
 * 64×64): min 0 · max 3.2 · 12 exact zeros of 4,096".
 */
function inputWords(input, i) {
  if (!isObject(input)) return null;
  const parts = [];
  if (input.min !== undefined) parts.push(`min ${fmt.number(toNumber(input.min))}`);
  if (input.max !== undefined) parts.push(`max ${fmt.number(toNumber(input.max))}`);
  const zeros = countOf(input.zeros);
  const size = countOf(input.size) ?? countOf(input.count);
  if (zeros !== null) parts.push(`${fmt.count(zeros)} exact zero${zeros === 1 ? "" : "s"}${size !== null ? ` of ${fmt.count(size)}` : ""}`);
  else if (size !== null) parts.push(`${fmt.count(size)} values`);
  const what = [text(input.name), shapeWords(input.shape)].filter(Boolean).join(", ");
  if (!parts.length && !what) return null;
  return el("li", {}, `input ${i + 1}`, what ? [" (", el("span", { class: "tensor-name" }, what), ")"] : null, parts.length ? `: ${parts.join(" · ")}` : "");
}

/** first_anomaly.op, or for an op-level anomaly without it, the same from its own record. */
function opOf(a) {
  if (isObject(a.op)) return a.op;
  if (typeof a.tensor !== "string" || !a.tensor.startsWith(OP_TAG_PREFIX)) return null;
  // Op-level records carry the source line as their description.
  return { name: a.tensor.slice(OP_TAG_PREFIX.length), type: a.op_type, phase: a.phase, source: a.tensor_description };
}

/**
 * The exact op (first_anomaly.op, from op-level records or a replay): name,
 * type, phase, the user's source line and its inputs' ranges.
 */
function opDetail(a) {
  const op = opOf(a);
  if (!op) return null;
  const source = text(op.source);
  const name = text(op.name);
  const kind = [text(op.type), text(op.phase) && phaseWords(op.phase)].filter(Boolean).join(", ");
  const parts = [];
  if (name || kind) {
    parts.push(el("span", { class: "cause-label" }, "Op: "), name && el("span", { class: "tensor-name op-name" }, name), kind && (name ? ` (${kind})` : kind));
  }
  if (source) parts.push(parts.length ? ", created at " : el("span", { class: "cause-label" }, "Created at: "), el("code", { class: "source" }, source));
  const inputs = Array.isArray(op.inputs) ? op.inputs.map(inputWords).filter(Boolean) : [];
  if (!parts.length && !inputs.length) return null;
  return el(
    "div",
    { class: "op" },
    parts.length ? el("p", {}, ...parts, ".") : null,
    inputs.length ? el("p", { class: "inputs-label" }, "Its inputs at this step:") : null,
    inputs.length ? el("ul", { class: "inputs" }, ...inputs) : null
  );
}

/** A replay of the step that did not reproduce the failure says so, and why. */
function replayWords(a) {
  const r = a.replay;
  if (!isObject(r) || r.reproduced !== false) return null;
  const why = text(r.why);
  // The optimizer made it (phase update): a replay of the step has no op to find.
  const words = a.phase === "update"
    ? `no op of the step to name${why ? ` (${why})` : ""}; the answer above is from the records of the update.`
    : `replaying this step at op level did not reproduce the failure${why ? ` (${why})` : ""}; the answer above is from the layer-level records.`;
  return el("p", { class: "replay" }, el("span", { class: "cause-label" }, "Replay: "), words);
}

/** "Show me" goes to the op's own row where the timeline has one. */
function showTargets(a) {
  const name = isObject(a.op) ? text(a.op.name) : null;
  return name ? [OP_TAG_PREFIX + name, a.tensor] : [a.tensor];
}

/** The headline with the banner's buttons beside it (one line saved on a small screen). */
function head(headline, ...buttons) {
  return el("div", { class: "banner-head" }, el("h3", { class: "headline" }, headline), el("div", { class: "actions" }, ...buttons));
}

function anomalyBanner(run, s, onShow) {
  const a = s.first_anomaly;
  const cause = isObject(a.likely_cause) ? a.likely_cause : null;
  return el(
    "section",
    { class: "banner anomaly", "aria-label": `First anomaly of run ${run}` },
    head(
      `First non-finite value at step ${fmt.count(a.step)}`,
      el("button", { type: "button", class: "show-anomaly", onclick: () => onShow(run, showTargets(a), a.step) }, "Show me"),
      cause && el("button", { type: "button", class: "show-cause", onclick: () => onShow(run, [cause.tensor], cause.step) }, "Show the likely cause")
    ),
    el("p", {}, el("span", { class: "tensor-name" }, a.tensor), opWords(a), ": ", el("strong", { class: "counts" }, fmt.nonfiniteCounts(a)), "."),
    occurrenceWords(a),
    opDetail(a),
    replayWords(a),
    s.preliminary
      ? el("p", { class: "preliminary" }, "Found in the run's event files before the whole run is read: its last healthy step, the likely cause and the hint follow once it is.")
      : lastHealthyWords(a),
    text(a.hint) && el("p", { class: "hint" }, el("span", { class: "cause-label" }, "Hint: "), a.hint),
    cause &&
      el(
        "p",
        { class: "cause" },
        el("span", { class: "cause-label" }, "Likely cause: "),
        el("span", { class: "tensor-name" }, cause.tensor),
        ` at step ${fmt.count(cause.step)} was already out of the safe range (`,
        el("span", { class: "kind", title: text(cause.kind) }, fmt.kind(cause.kind)),
        `: ${text(cause.detail) ?? ""}).`
      )
  );
}

function warningBanner(run, s, onShow) {
  const w = s.first_warning;
  const before = s.first_anomaly ? " (before the first non-finite value)" : "";
  return el(
    "section",
    { class: "banner warning", "aria-label": `First warning of run ${run}` },
    head(
      `First warning at step ${fmt.count(w.step)}${before}`,
      el("button", { type: "button", class: "show-warning", onclick: () => onShow(run, [w.tensor], w.step) }, "Show me")
    ),
    el(
      "p",
      {},
      el("span", { class: "tensor-name" }, w.tensor),
      opWords(w),
      ": ",
      el("strong", { class: "kind", title: text(w.kind) }, fmt.kind(w.kind)),
      "."
    ),
    text(w.detail) && el("p", { class: "detail" }, w.detail),
    text(w.hint) && el("p", { class: "hint" }, el("span", { class: "cause-label" }, "Hint: "), w.hint)
  );
}

/**
 * A run that holds more than one training (summary.restarts): the steps a
 * later training wrote again, whose records replace the earlier ones.
 */
function restartWords(s) {
  const r = Array.isArray(s.restarts) ? s.restarts.find(isObject) : null;
  const lo = r ? countOf(r.first_step) : null;
  const hi = r ? countOf(r.last_step) : null;
  if (lo === null || hi === null) return null;
  return el(
    "p",
    { class: "restart" },
    el("span", { class: "cause-label" }, "More than one training in this run: "),
    `steps ${fmt.steps(lo, hi)} were written again by a later training (a restart from a checkpoint, or another script logging to the same directory); ` +
      "those steps show the later training's records, the others the earlier one's. Give each training its own log directory to see each whole."
  );
}

/** Handled events (e.g. a loss-scale skip the next step recovered from): not warnings. */
function infoList(s) {
  const items = Array.isArray(s.info) ? s.info.filter((i) => isObject(i) && countOf(i.step) !== null) : [];
  if (!items.length) return null;
  const lines = items.slice(0, INFO_SHOWN).map((i) =>
    el(
      "li",
      {},
      `Step ${fmt.count(i.step)}: `,
      el("span", { class: "kind", title: text(i.kind) }, fmt.kind(i.kind)),
      text(i.tensor) ? [" in ", el("span", { class: "tensor-name" }, i.tensor)] : null,
      text(i.detail) ? ` (${i.detail})` : null
    )
  );
  if (items.length > INFO_SHOWN) lines.push(el("li", {}, `and ${fmt.count(items.length - INFO_SHOWN)} more`));
  return el("div", { class: "info" }, el("p", { class: "cause-label" }, "Information (handled, not a warning):"), el("ul", {}, ...lines));
}

/** The first action events a banner lists; the rest are counted. */
const ACTIONS_SHOWN = 5;

/**
 * What the training did about its anomalies (summary.actions): the words
 * ("survived 3 non-finite steps (skipped), 1 rewind at step 4,200 with lr × 0.5"),
 * then a line per event: step, epoch and batch, action, what triggered it,
 * and the op the replay named or that the fault was not reproducible.
 */
function actionsList(s) {
  const actions = isObject(s.actions) ? s.actions : null;
  const events = actions && Array.isArray(actions.events) ? actions.events.filter((e) => isObject(e) && countOf(e.step) !== null) : [];
  if (!events.length) return null;
  const lines = events.slice(0, ACTIONS_SHOWN).map((e) => {
    const where = ["epoch", "batch"].filter((k) => countOf(e[k]) !== null).map((k) => `${k} ${fmt.count(e[k])}`);
    const replay = isObject(e.replay) ? e.replay : {};
    const op = isObject(e.op) && text(e.op.type) ? ` · op ${e.op.type}${text(e.op.source) ? ` at ${e.op.source}` : ""}` : "";
    const transient = replay.reproducible === false ? " · not reproducible on replay (non-determinism or hardware)" : "";
    return el(
      "li",
      { class: `action ${text(e.action) ?? ""}` },
      `Step ${fmt.count(e.step)}${where.length ? ` (${where.join(", ")})` : ""}: `,
      el("strong", {}, text(e.action) ?? "?"),
      text(e.detail) ? ` (${e.detail})` : "",
      op,
      transient,
      text(e.reason) ? ` · ${e.reason}` : ""
    );
  });
  if (events.length > ACTIONS_SHOWN) lines.push(el("li", {}, `and ${fmt.count(events.length - ACTIONS_SHOWN)} more`));
  return el(
    "div",
    { class: "training-actions" },
    el("p", {}, el("span", { class: "cause-label" }, "Training acted: "), text(actions.words) ?? ""),
    el("ul", {}, ...lines)
  );
}

/** No anomaly: "Healthy" only where every record was read (as the CLI's exit code 3 says). */
function healthyBanner(s) {
  const range = s.first_step === null ? "" : ` in steps ${fmt.steps(s.first_step, s.last_step)}`;
  const warn = s.first_warning ? "" : " and nothing outside the safe range";
  const unread = Array.isArray(s.problems) && s.problems.length > 0;
  const read = s.records ? `across ${fmt.count(s.tensors)} tensors (${fmt.count(s.records)} records)` : "";
  return el(
    "section",
    { class: unread ? "banner unread" : "banner healthy" },
    el("h3", { class: "headline" }, unread ? "Not all read: no NaN or Inf among the records read" : "Healthy: no NaN or Inf"),
    el(
      "p",
      {},
      unread && !s.records
        ? "No record of this run could be read, so none was checked: see below."
        : `No non-finite values${warn}${range} ${read}.` +
            (unread ? " What could not be read was not checked: see below." : "")
    )
  );
}

/**
 * Renders one row per run: [anomaly or healthy] [first warning].
 * `items` is [{run, summary}] or [{run, error}]; onShow(run, tensors, step)
 * selects the first of `tensors` that the run's timeline has.
 */
export function renderBanners(container, items, onShow) {
  const rows = items.map(({ run, summary, error }) => {
    const label = el("p", { class: "run-label" }, "Run ", el("span", { class: "tensor-name" }, run));
    if (error) {
      return el("div", { class: "banner-row single", dataset: { run } }, el("section", { class: "banner anomaly" }, label, el("p", { class: "error" }, error)));
    }
    const main = isObject(summary.first_anomaly) ? anomalyBanner(run, summary, onShow) : healthyBanner(summary);
    if (Array.isArray(summary.problems) && summary.problems.length) {
      main.append(el("div", { class: "problems" }, ...summary.problems.map((p) => el("p", {}, "Reading the run: ", text(p) ?? ""))));
    }
    const acted = actionsList(summary);
    if (acted) main.append(acted);
    const restart = restartWords(summary);
    if (restart) main.append(restart);
    const info = infoList(summary);
    if (info) main.append(info);
    const row = el("div", { class: "banner-row", dataset: { run } }, main);
    if (isObject(summary.first_warning)) row.append(warningBanner(run, summary, onShow));
    else row.classList.add("single");
    return row;
  });
  replace(container, rows);
}
