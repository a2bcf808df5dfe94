// Light or dark: TensorBoard's own setting (the "dark-mode" class it puts on
// its body, reachable because the plugin's iframe is same-origin), else the
// OS preference. Sets <html data-theme> and tells listeners so canvases redraw.

function parentDark() {
  try {
    const body = window.parent !== window ? window.parent.document.body : null;
    return body ? body.classList.contains("dark-mode") : null;
  } catch {
    return null; // not reachable (cross-origin embedding): fall back to the OS
  }
}

export function watchTheme(onChange) {
  const media = window.matchMedia("(prefers-color-scheme: dark)");
  const apply = () => {
    const fromParent = parentDark();
    const dark = fromParent === null ? media.matches : fromParent;
    const theme = dark ? "dark" : "light";
    if (document.documentElement.dataset.theme !== theme) {
      document.documentElement.dataset.theme = theme;
      onChange(theme);
    }
  };
  apply();
  media.addEventListener("change", apply);
  try {
    if (window.parent !== window) {
      new MutationObserver(apply).observe(window.parent.document.body, { attributes: true, attributeFilter: ["class"] });
    }
  } catch {
    // cross-origin parent: the media query alone decides
  }
}

/** The current value of a CSS colour variable, for canvas drawing. */
export function color(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim();
}
