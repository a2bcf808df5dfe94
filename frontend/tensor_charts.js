// The charts of the selected tensor (SPEC section 2): min / max / max |x|
// (linear, or max |x| on a log scale: the log toggle also puts the L2 and
// global norms on one, as growth towards overflow spans decades), mean ± std,
// NaN/Inf counts, L2 norm,
// and the run's global gradient norm, all over the same step range with the
// first anomaly and the selected step marked. Other selected runs that logged
// the same tensor are drawn as dashed lines to compare.

import { Chart } from "./chart.js";
import { el } from "./dom.js";

export class TensorCharts {
  constructor({ onZoom, onLogChange }) {
    this.logButton = el("button", { type: "button", class: "log-toggle", "aria-pressed": "false", title: "Draw max |x|, the L2 norm and the global gradient norm on a log scale" }, "log |x|");
    this.logButton.addEventListener("click", () => onLogChange(this.logButton.getAttribute("aria-pressed") !== "true"));
    this.range = new Chart("Range: min, max, max |x|", { onZoom, extra: this.logButton });
    this.moments = new Chart("Mean ± std", { onZoom });
    this.counts = new Chart("NaN / Inf counts", { onZoom });
    this.norm = new Chart("L2 norm", { onZoom });
    this.global = new Chart("Global gradient norm", { onZoom });
    this.all = [this.range, this.moments, this.counts, this.norm, this.global];
    this.element = el("div", { class: "charts" }, this.all.map((c) => c.element));
  }

  /** Shows whether the log scale is on, before the charts have data to draw. */
  setLog(log) {
    this.logButton.setAttribute("aria-pressed", String(log));
  }

  /**
   * series: /series of the selected tensor (decoded); globalSeries: /series of
   * the global_norm row or null; domain: [first, last] step; anomalyStep and
   * selectedStep: markers (or null); others: [{run, series, globalSeries}]
   * of the other selected runs.
   */
  set({ series, globalSeries, domain, anomalyStep, selectedStep, log, others = [] }) {
    const compare = (field, label, pick = (o) => o.series) =>
      others
        .filter((o) => pick(o))
        .map((o, k) => ({ label: `${label} · ${o.run}`, colour: `compare-${k + 1}`, dash: [2, 3], steps: pick(o).steps, ys: pick(o).fields[field] }));
    this.setLog(log);
    const markers = [
      { step: anomalyStep, colour: "nonfinite", label: anomalyStep === null ? "" : "first anomaly" },
      { step: selectedStep, colour: "accent", dash: [4, 3], label: selectedStep === null ? "" : "selected step" },
    ].filter((m) => m.step !== null);
    const f = series.fields;
    const base = { steps: series.steps, stepEnd: series.step_end, domain, health: series.health, markers };
    this.range.set({
      ...base,
      log,
      lines: [
        ...(log
          ? [{ label: "max |x|", colour: "series-3", ys: f.max_abs }]
          : [
              { label: "min", colour: "series-1", ys: f.min },
              { label: "max", colour: "series-2", ys: f.max },
              { label: "max |x|", colour: "series-3", ys: f.max_abs, dash: [5, 3] },
            ]),
        ...compare("max_abs", "max |x|"),
      ],
    });
    this.moments.set({
      ...base,
      lines: [{ label: "mean", colour: "series-1", ys: f.mean }, ...compare("mean", "mean")],
      band: {
        label: "± std",
        lo: f.mean.map((m, i) => (m === null || f.std[i] === null ? null : m - f.std[i])),
        hi: f.mean.map((m, i) => (m === null || f.std[i] === null ? null : m + f.std[i])),
        std: f.std,
      },
    });
    this.counts.set({
      ...base,
      health: null,
      bars: [
        { label: "NaN", colour: "nonfinite", ys: f.nan },
        { label: "+Inf", colour: "warning", ys: f.posinf },
        { label: "-Inf", colour: "series-4", ys: f.neginf },
      ],
    });
    this.norm.set({ ...base, log, lines: [{ label: "L2", colour: "series-1", ys: f.l2 }, ...compare("l2", "L2")] });
    if (globalSeries) {
      // A global_norm record is a scalar: its max is the norm.
      this.global.set({
        steps: globalSeries.steps,
        stepEnd: globalSeries.step_end,
        domain,
        health: globalSeries.health,
        markers,
        log,
        lines: [
          { label: "global norm", colour: "series-2", ys: globalSeries.fields.max },
          ...compare("max", "global norm", (o) => o.globalSeries),
        ],
      });
    } else {
      this.global.message("No global gradient norm in this run: tb_numerics.log_gradients(grads, variables) records it.");
    }
  }

  message(text) {
    for (const c of this.all) c.message(text);
  }

  redraw() {
    for (const c of this.all) c.draw();
  }
}
