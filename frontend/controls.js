// The toolbar: which runs to show, the safe-range parameters (the same ones
// as the CLI's flags and the HTTP API, defaults shown as placeholders) and
// the step range that the timeline and charts are zoomed to.

import { el, replace } from "./dom.js";
import { SAFE_RANGE_KEYS } from "./state.js";

const LABELS = {
  max_abs: ["Max |x|", "dtype margin"],
  grad_norm_limit: ["Gradient-norm limit", "none"],
  spike_factor: ["Spike factor", null],
};

/** Checkboxes of the runs, each with a dot coloured by its headline health. */
export class RunPicker {
  constructor(onChange) {
    this.onChange = onChange;
    this.list = el("div", { class: "runs" });
    this.element = el("fieldset", {}, el("legend", {}, "Runs"), this.list);
  }

  set(runs, selected) {
    replace(
      this.list,
      runs.map((r) => {
        const health = r.first_anomaly_step !== null ? "nonfinite" : r.first_warning_step !== null ? "warning" : "healthy";
        const words = { nonfinite: "has a non-finite value", warning: "has a warning", healthy: "healthy" }[health];
        const box = el("input", { type: "checkbox", value: r.run, checked: selected.includes(r.run) });
        box.addEventListener("change", () => this.onChange(this.checked()));
        return el(
          "label",
          { title: `${r.run}: ${words}` },
          box,
          el("span", { class: `dot ${health}`, "aria-hidden": "true" }),
          el("span", { class: "run-name" }, r.run),
          el("span", { class: "sr-only" }, `(${words})`)
        );
      })
    );
  }

  checked() {
    return [...this.list.querySelectorAll("input:checked")].map((b) => b.value);
  }
}

/** The safe-range form: Apply (or Enter) sends the values, Reset clears them. */
export class SafeRangeForm {
  constructor(onApply) {
    this.inputs = {};
    const fields = SAFE_RANGE_KEYS.map((key) => {
      const input = el("input", { type: "text", inputmode: "decimal", name: key, autocomplete: "off" });
      this.inputs[key] = input;
      return el("label", {}, LABELS[key][0], input);
    });
    const form = el(
      "form",
      { class: "safe-range" },
      ...fields,
      el("button", { type: "submit" }, "Apply"),
      el("button", { type: "button", onclick: () => onApply({}) }, "Reset")
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      onApply(this.values());
    });
    this.element = el("fieldset", {}, el("legend", {}, "Safe range"), form);
  }

  /** Placeholders from /safe_range's defaults; help texts as titles. */
  setDefaults({ defaults = {}, params = {} }) {
    for (const key of SAFE_RANGE_KEYS) {
      const d = defaults[key];
      this.inputs[key].placeholder = d === null || d === undefined ? LABELS[key][1] || "" : String(d);
      if (params[key]) this.inputs[key].title = params[key];
    }
  }

  set(params, invalidKey = null) {
    for (const key of SAFE_RANGE_KEYS) {
      this.inputs[key].value = params[key] ?? "";
      this.inputs[key].setAttribute("aria-invalid", key === invalidKey ? "true" : "false");
    }
  }

  values() {
    const out = {};
    for (const key of SAFE_RANGE_KEYS) {
      const v = this.inputs[key].value.trim();
      if (v) out[key] = v;
    }
    return out;
  }
}

/** "Steps from [ ] to [ ]" with Reset; drag on a chart fills it too. */
export class ZoomForm {
  constructor(onZoom) {
    this.from = el("input", { type: "number", step: "1", "aria-label": "First step" });
    this.to = el("input", { type: "number", step: "1", "aria-label": "Last step" });
    const form = el(
      "form",
      { class: "zoom" },
      "Steps",
      this.from,
      "to",
      this.to,
      el("button", { type: "submit" }, "Zoom"),
      el("button", { type: "button", onclick: () => onZoom(null, null) }, "All steps")
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const int = (input) => (input.value === "" ? null : Math.round(Number(input.value)));
      onZoom(int(this.from), int(this.to));
    });
    this.element = form;
  }

  set(start, end, placeholders) {
    this.from.value = start ?? "";
    this.to.value = end ?? "";
    this.from.placeholder = placeholders[0] ?? "";
    this.to.placeholder = placeholders[1] ?? "";
  }
}
