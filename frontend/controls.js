// The toolbar: the run shown and the run it is compared with, the safe-range
// parameters (the same ones as the CLI's flags and the HTTP API, defaults
// shown as placeholders, folded until asked for) and the step range that the
// timeline and charts are zoomed to.

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

/** A run's headline health in words, from its /runs entry. */
function healthWords(r) {
  if (r.first_anomaly_step !== null) return `NaN/Inf at step ${r.first_anomaly_step}`;
  if (r.first_warning_step !== null) return `warning at step ${r.first_warning_step}`;
  return Array.isArray(r.problems) && r.problems.length ? "not all read" : "healthy";
}

/**
 * A labelled select of runs, each option with its headline health;
 * `none` (a label) adds a first option for no run.
 */
export class RunSelect {
  constructor(label, onChange, { none = null } = {}) {
    this.none = none;
    this.select = el("select", { "aria-label": label });
    this.select.addEventListener("change", () => onChange(this.select.value || null));
    this.element = el("label", { class: "run-select" }, el("span", {}, label), this.select);
  }

  /** Fills the options from /runs; `selected` is the run chosen (or null), `skip` a run left out. */
  set(runs, selected, skip = null) {
    const options = runs
      .filter((r) => r.run !== skip)
      .map((r) => el("option", { value: r.run, selected: r.run === selected }, `${r.run} (${healthWords(r)})`));
    if (this.none !== null) options.unshift(el("option", { value: "", selected: selected === null }, this.none));
    replace(this.select, options);
    this.select.value = selected ?? "";
  }
}

/**
 * The safe-range form, one field per parameter that /safe_range publishes
 * (the ones of state.js until it answers), folded behind a toggle that says
 * how many are set: Apply (or Enter) sends the values, Reset clears them. A
 * field the server refused is marked with its message, and the form opens.
 */
export class SafeRangeForm {
  constructor(onApply) {
    this.inputs = {};
    this.notes = {};
    this.params = {};
    this.invalid = {};
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
    this.panel = el("fieldset", { class: "safe-range-panel", id: "safe-range-panel", hidden: true }, el("legend", {}, "Safe range"), form);
    this.toggle = el("button", { type: "button", class: "safe-range-toggle", "aria-expanded": "false", "aria-controls": "safe-range-panel" });
    this.toggle.addEventListener("click", () => this.open(this.panel.hidden));
    this.element = this.panel;
    this.build(SAFE_RANGE_KEYS, {}, {});
  }

  /** Shows or folds the fields. */
  open(shown) {
    this.panel.hidden = !shown;
    this.toggle.setAttribute("aria-expanded", String(shown));
    this.label();
  }

  /** "Safe range: defaults", "Safe range: 2 set", "Safe range: 1 refused". */
  label() {
    const set = Object.keys(this.params).length;
    const bad = Object.keys(this.invalid).length;
    const words = bad ? `${bad} refused` : set ? `${set} set` : "defaults";
    replace(this.toggle, `Safe range: ${words} ${this.panel.hidden ? "▸" : "▾"}`);
    this.toggle.classList.toggle("invalid", bad > 0);
  }

  /** The parameter names, in the form's order. */
  keys() {
    return Object.keys(this.inputs);
  }

  /** One text field per parameter; defaults as placeholders, help texts as titles. */
  build(keys, defaults, help) {
    this.inputs = {};
    this.notes = {};
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
      // The server's message, outside the label so that the field's name stays its label.
      this.notes[key] = el("span", { class: "field-error", id: `field-error-${key}`, hidden: true });
      input.setAttribute("aria-describedby", this.notes[key].id);
      return el("div", { class: "field" }, el("label", {}, labelOf(key)[0], input), this.notes[key]);
    });
    replace(this.fields, fields);
    this.set(this.params, this.invalid);
  }

  /** Rebuilds the fields from /safe_range's answer ({defaults, params}). */
  setDefaults({ defaults = {}, params = {} }) {
    const keys = Object.keys(params).length ? Object.keys(params) : SAFE_RANGE_KEYS;
    this.build(keys, defaults, params);
  }

  /** Shows the values of a view; each key of `invalid` is marked with its message. */
  set(params, invalid = {}) {
    this.params = { ...params };
    this.invalid = { ...invalid };
    for (const [key, input] of Object.entries(this.inputs)) {
      input.value = params[key] ?? "";
      const message = Object.hasOwn(invalid, key) ? invalid[key] : null;
      input.setAttribute("aria-invalid", message ? "true" : "false");
      this.notes[key].hidden = !message;
      this.notes[key].textContent = message ? `Not used: ${message}` : "";
    }
    if (Object.keys(this.invalid).length) this.open(true);
    else this.label();
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
