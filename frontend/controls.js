// The toolbar: which runs to show, the safe-range parameters (the same ones
// as the CLI's flags and the HTTP API, defaults shown as placeholders) and
// the step range that the timeline and charts are zoomed to.

import { el, replace } from "./dom.js";
import { SAFE_RANGE_KEYS } from "./state.js";

// Label and placeholder (for a default of null or none) of the parameters
// known here; a parameter the server adds gets its name as the label.
const LABELS = {
  max_abs: ["Max |x|", "dtype margin"],
  grad_norm_limit: ["Gradient-norm limit", "none"],
  spike_factor: ["Spike factor", null],
  spike_window: ["Spike window", null],
  vanishing_floor: ["Vanishing floor", null],
  underflow_share: ["Underflow share", null],
  allow_neginf: ["Allow -Inf in (tag patterns)", "e.g. attention/*/mask"],
};

function labelOf(key) {
  const name = key.replace(/_/g, " ");
  return LABELS[key] || [name.charAt(0).toUpperCase() + name.slice(1), null];
}

/** A default as a placeholder: lists joined by commas, null as "none". */
function placeholderOf(key, value) {
  const fallback = labelOf(key)[1] || "none";
  if (value === null || value === undefined) return fallback;
  if (Array.isArray(value)) return value.length ? value.join(", ") : fallback;
  return String(value);
}

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

/**
 * The safe-range form, one field per parameter that /safe_range publishes
 * (the ones of state.js until it answers): Apply (or Enter) sends the
 * values, Reset clears them.
 */
export class SafeRangeForm {
  constructor(onApply) {
    this.inputs = {};
    this.params = {};
    this.invalidKey = null;
    this.fields = el("div", { class: "fields" });
    const form = el(
      "form",
      { class: "safe-range" },
      this.fields,
      el("div", { class: "buttons" }, el("button", { type: "submit" }, "Apply"), el("button", { type: "button", onclick: () => onApply({}) }, "Reset"))
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      onApply(this.values());
    });
    this.element = el("fieldset", {}, el("legend", {}, "Safe range"), form);
    this.build(SAFE_RANGE_KEYS, {}, {});
  }

  /** The parameter names, in the form's order. */
  keys() {
    return Object.keys(this.inputs);
  }

  /** One text field per parameter; defaults as placeholders, help texts as titles. */
  build(keys, defaults, help) {
    this.inputs = {};
    const fields = keys.map((key) => {
      const list = Array.isArray(defaults[key]);
      const input = el("input", {
        type: "text",
        inputmode: list ? "text" : "decimal",
        name: key,
        autocomplete: "off",
        spellcheck: "false",
        class: list ? "patterns" : null,
        placeholder: placeholderOf(key, defaults[key]),
        title: typeof help[key] === "string" ? `${key}: ${help[key]}` : key,
      });
      this.inputs[key] = input;
      return el("label", {}, labelOf(key)[0], input);
    });
    replace(this.fields, fields);
    this.set(this.params, this.invalidKey);
  }

  /** Rebuilds the fields from /safe_range's answer ({defaults, params}). */
  setDefaults({ defaults = {}, params = {} }) {
    const keys = Object.keys(params).length ? Object.keys(params) : SAFE_RANGE_KEYS;
    this.build(keys, defaults, params);
  }

  /** Shows the values of a view; `invalidKey`'s field is marked invalid. */
  set(params, invalidKey = null) {
    this.params = { ...params };
    this.invalidKey = invalidKey;
    for (const [key, input] of Object.entries(this.inputs)) {
      input.value = params[key] ?? "";
      input.setAttribute("aria-invalid", key === invalidKey ? "true" : "false");
    }
  }

  values() {
    const out = {};
    for (const [key, input] of Object.entries(this.inputs)) {
      const v = input.value.trim();
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
