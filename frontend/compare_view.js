// The run against its reference run (/compare): the first step, and within
// it the first tensor in execution order, where the run's records leave the
// reference's band, with a button that selects that tensor and step (whose
// charts then draw both runs' series). Names are text, never HTML.

import { toNumber } from "./api.js";
import { el, replace } from "./dom.js";
import * as fmt from "./format.js";

/** A run's name with a swatch of its TensorBoard colour. */
function runName(run, colour) {
  return el("span", { class: "run-name" }, el("i", { class: "swatch", style: `background: ${colour}` }), el("span", { class: "tensor-name" }, run));
}

/**
 * Renders `answer` (/compare, or {error}) into `container`; `run`, `compare`
 * and their `colours` name the two runs; onShow(tensor, step) selects.
 */
export function renderComparison(container, answer, { run, compare, colours }, onShow) {
  const head = el("h3", { class: "headline" }, "Compared with ", runName(compare, colours[1]), ": ");
  if (answer.error) return replace(container, el("section", { class: "banner compare" }, head, el("p", { class: "error" }, answer.error)));
  const d = answer.first_departure;
  const span = Array.isArray(answer.steps_compared) ? ` over steps ${fmt.steps(answer.steps_compared[0], answer.steps_compared[1])}` : "";
  const compared = `${fmt.count(toNumber(answer.tensors_compared) || 0)} tensors logged by both runs compared${span}`;
  if (!d || typeof d !== "object") {
    head.append(runName(run, colours[0]), " stays within its band");
    return replace(container, el("section", { class: "banner compare", "aria-label": "Comparison" }, head, el("p", {}, `${compared}.`)));
  }
  head.append(runName(run, colours[0]), ` leaves its band at step ${fmt.count(toNumber(d.step))}`);
  const band = answer.band || {};
  replace(
    container,
    el(
      "section",
      {
        class: "banner compare",
        "aria-label": "Comparison",
        title: `${compared}. A tensor leaves the band when its max |x| or L2 norm moves beyond ×${band.factor} of the reference's records around that step (${band.window} on each side), its share of exact zeros by more than ${band.zero_share}, or it holds NaN/Inf where they do not.`,
      },
      el("div", { class: "banner-head" }, head, el("div", { class: "actions" }, el("button", { type: "button", class: "show-departure", onclick: () => onShow(String(d.tensor), toNumber(d.step)) }, "Show me both"))),
      el("p", {}, "First in execution order: ", el("span", { class: "tensor-name" }, String(d.tensor)), d.phase ? ` (${d.phase} pass): ` : ": ", String(d.detail ?? ""), ".")
    )
  );
}
