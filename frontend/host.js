// TensorBoard, seen from the plugin's iframe: the plugin host API of
// TensorBoard 2.x (tensorboard/components/experimental/plugin_util). The
// frame hands TensorBoard one end of a MessageChannel with the window message
// "experimental.bootstrap"; then both sides send JSON messages
// {type, id, payload, error, isReply} over it, and answer each request with
// a reply of the same id. TensorBoard 2.21 answers
//   experimental.GetURLPluginData: its URL's "p.<plugin>.<key>" entries;
//   experimental.GetRuns: its run names, in the order it colours them;
// and sends
//   experimental.DataReloaded: its reload button or auto-reload ran;
//   experimental.RunsChanged: its list of runs changed.
// It has no message to write URL data: the plugin writes its entries into
// TensorBoard's hash itself, in TensorBoard's format ("#numerics&p.numerics.run=a"),
// which the frame may do as TensorBoard serves it from its own origin. And
// 2.21 answers GetURLPluginData from a copy of its hash taken before it
// switched to the real hash, refreshed only by a "hashchange": on a page
// opened from a link it answers {} (seen here). The plugin then reads its
// entries from TensorBoard's hash itself, in the same format.

const PLUGIN = "numerics";
const PREFIX = `p.${PLUGIN}.`;
const REQUEST_TIMEOUT_MS = 1500;

// TensorBoard's default run palette (settings' colorPalette, 2.21), light and dark:
// a run's colour is the entry at its index in TensorBoard's run list.
const PALETTE = [
  ["#425066", "#8e98a3"],
  ["#12b5cb", "#12b5cb"],
  ["#e52592", "#e52592"],
  ["#f9ab00", "#f9ab00"],
  ["#9334e6", "#9334e6"],
  ["#7cb342", "#7cb342"],
  ["#e8710a", "#e8710a"],
];

/** The colour TensorBoard gives the run at `index` of its run list (grouped by run, no override). */
export function runColour(index, dark = false) {
  const entry = PALETTE[((index % PALETTE.length) + PALETTE.length) % PALETTE.length];
  return dark ? entry[1] : entry[0];
}

/** The parent window when it is a TensorBoard of this origin, else null. */
function tensorBoardWindow() {
  try {
    if (window.parent === window) return null;
    const parent = window.parent;
    return parent.location.origin === window.location.origin && parent.tensorboard ? parent : null;
  } catch {
    return null; // another origin: not TensorBoard's own page
  }
}

export class Host {
  constructor(parent) {
    this.parent = parent;
    this.id = 0;
    this.waiting = new Map();
    this.listeners = new Map();
    const channel = new MessageChannel();
    this.port = channel.port1;
    this.port.onmessage = (event) => this.receive(event.data);
    parent.postMessage("experimental.bootstrap", "*", [channel.port2]);
  }

  /** The host, or null outside TensorBoard (the entry page opened alone). */
  static connect() {
    const parent = tensorBoardWindow();
    return parent ? new Host(parent) : null;
  }

  receive(data) {
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      return;
    }
    if (message.isReply) {
      const wait = this.waiting.get(message.id);
      if (!wait) return;
      this.waiting.delete(message.id);
      if (message.error) wait.reject(new Error(String(message.error)));
      else wait.resolve(message.payload);
      return;
    }
    const callback = this.listeners.get(message.type);
    if (callback) callback(message.payload);
    // TensorBoard waits for an answer to what it sends.
    this.port.postMessage(JSON.stringify({ type: message.type, id: message.id, payload: null, error: null, isReply: true }));
  }

  /** Sends a request; its reply's payload, or a rejection after a timeout. */
  request(type, payload = null) {
    const id = this.id++;
    this.port.postMessage(JSON.stringify({ type, id, payload, error: null, isReply: false }));
    return new Promise((resolve, reject) => {
      this.waiting.set(id, { resolve, reject });
      setTimeout(() => {
        if (this.waiting.delete(id)) reject(new Error(`TensorBoard did not answer ${type}`));
      }, REQUEST_TIMEOUT_MS);
    });
  }

  on(type, callback) {
    this.listeners.set(type, callback);
  }

  /** The plugin's entries of TensorBoard's URL, {key: value}: TensorBoard's answer, else its hash read here. */
  async urlData() {
    try {
      const data = await this.request("experimental.GetURLPluginData");
      if (data && typeof data === "object" && Object.keys(data).length) return data;
    } catch {
      // an older or busy TensorBoard: its hash says the same
    }
    return this.hashData();
  }

  /** The "p.numerics.<key>" entries of TensorBoard's hash, parsed as TensorBoard parses them. */
  hashData() {
    const out = {};
    for (const part of this.parent.location.hash.replace(/^#/, "").split("&")) {
      const kv = part.split("=");
      if (kv.length !== 2) continue;
      try {
        const key = decodeURIComponent(kv[0]);
        if (key.startsWith(PREFIX)) out[key.slice(PREFIX.length)] = decodeURIComponent(kv[1]);
      } catch {
        // a malformed escape: not an entry of ours
      }
    }
    return out;
  }

  /** TensorBoard's run names in its own order (the order its colours follow), or null. */
  async runs() {
    try {
      const runs = await this.request("experimental.GetRuns");
      return Array.isArray(runs) ? runs.filter((r) => typeof r === "string") : null;
    } catch {
      return null;
    }
  }

  /** Calls back when TensorBoard's URL changes (a pasted or edited link, back and forward). */
  onUrlChange(callback) {
    this.parent.addEventListener("hashchange", callback);
  }

  /**
   * Writes `dict` as the plugin's entries of TensorBoard's URL, keeping its
   * tab and every other entry, without a history entry.
   */
  writeUrlData(dict) {
    const parts = this.parent.location.hash.replace(/^#/, "").split("&").filter(Boolean);
    const ours = (p) => decodeURIComponent(p.split("=")[0]).startsWith(PREFIX);
    const tab = parts.filter((p) => !p.includes("="));
    const others = parts.filter((p) => p.includes("=") && !ours(p));
    const mine = Object.entries(dict).map(([k, v]) => `${encodeURIComponent(PREFIX + k)}=${encodeURIComponent(v)}`);
    const hash = [...(tab.length ? tab : [PLUGIN]), ...others, ...mine].join("&");
    if (`#${hash}` === this.parent.location.hash) return;
    const url = new URL(this.parent.location.href);
    url.hash = hash;
    this.parent.history.replaceState(this.parent.history.state, "", url.toString());
  }
}
