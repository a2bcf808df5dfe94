// The first anomaly and first warning of each run, in words (SPEC section 2),
// with buttons that select the tensor and step in the timeline and charts.

import { el, replace } from "./dom.js";
import * as fmt from "./format.js";

function opWords(item) {
  const parts = [];
  if (item.op_type) parts.push(`op ${item.op_type}`);
  if (item.phase) parts.push(`${item.phase} pass`);
  return parts.length ? ` (${parts.join(", ")})` : "";
}

function anomalyBanner(run, s, onShow) {
  const a = s.first_anomaly;
  const lastHealthy =
    a.last_healthy_step === null
      ? "This tensor has no finite record before it."
      : `Last healthy step of this tensor: ${fmt.count(a.last_healthy_step)}.`;
  const cause = a.likely_cause;
  return el(
    "section",
    { class: "banner anomaly", "aria-label": `First anomaly of run ${run}` },
    el("h3", { class: "headline" }, `First non-finite value at step ${fmt.count(a.step)}`),
    el(
      "p",
      {},
      el("span", { class: "tensor-name" }, a.tensor),
      opWords(a),
      ": ",
      el("strong", { class: "counts" }, fmt.nonfiniteCounts(a)),
      "."
    ),
    el("p", { class: "last-healthy" }, lastHealthy),
    a.hint && el("p", { class: "hint" }, el("span", { class: "cause-label" }, "Hint: "), a.hint),
    cause &&
      el(
        "p",
        { class: "cause" },
        el("span", { class: "cause-label" }, "Likely cause: "),
        el("span", { class: "tensor-name" }, cause.tensor),
        ` at step ${fmt.count(cause.step)} was already out of the safe range (${fmt.kind(cause.kind)}: ${cause.detail}).`
      ),
    el("button", { type: "button", class: "show-anomaly", onclick: () => onShow(run, a.tensor, a.step) }, "Show me"),
    cause &&
      el("button", { type: "button", class: "show-cause", onclick: () => onShow(run, cause.tensor, cause.step) }, "Show the likely cause")
  );
}

function warningBanner(run, s, onShow) {
  const w = s.first_warning;
  const before = s.first_anomaly ? " (before the first non-finite value)" : "";
  return el(
    "section",
    { class: "banner warning", "aria-label": `First warning of run ${run}` },
    el("h3", { class: "headline" }, `First warning at step ${fmt.count(w.step)}${before}`),
    el("p", {}, el("span", { class: "tensor-name" }, w.tensor), opWords(w), ": ", el("strong", {}, fmt.kind(w.kind)), "."),
    el("p", { class: "detail" }, w.detail),
    el("button", { type: "button", class: "show-warning", onclick: () => onShow(run, w.tensor, w.step) }, "Show me")
  );
}

function healthyBanner(s) {
  const range = s.first_step === null ? "" : ` in steps ${fmt.steps(s.first_step, s.last_step)}`;
  const warn = s.first_warning ? "" : " and nothing outside the safe range";
  return el(
    "section",
    { class: "banner healthy" },
    el("h3", { class: "headline" }, "Healthy: no NaN or Inf"),
    el("p", {}, `No non-finite values${warn}${range} across ${fmt.count(s.tensors)} tensors (${fmt.count(s.records)} records).`)
  );
}

/**
 * Renders one row per run: [anomaly or healthy] [first warning].
 * `items` is [{run, summary}] or [{run, error}]; onShow(run, tensor, step).
 */
export function renderBanners(container, items, onShow) {
  const rows = items.map(({ run, summary, error }) => {
    const label = el("p", { class: "run-label" }, "Run ", el("span", { class: "tensor-name" }, run));
    if (error) {
      return el("div", { class: "banner-row single", dataset: { run } }, el("section", { class: "banner anomaly" }, label, el("p", { class: "error" }, error)));
    }
    const main = summary.first_anomaly ? anomalyBanner(run, summary, onShow) : healthyBanner(summary);
    main.prepend(label);
    if (summary.problems && summary.problems.length) {
      main.append(el("div", { class: "problems" }, ...summary.problems.map((p) => el("p", {}, "Skipped: ", p))));
    }
    const row = el("div", { class: "banner-row", dataset: { run } }, main);
    if (summary.first_warning) row.append(warningBanner(run, summary, onShow));
    else row.classList.add("single");
    return row;
  });
  replace(container, rows);
}
