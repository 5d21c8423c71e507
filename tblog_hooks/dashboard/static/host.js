/**
 * @file TensorBoard's page around the tab: the message port of its plugin API (its reloads, its
 * runs changed, the tab's state it keeps), its auto-reload settings, and the tab's state written
 * into its URL.
 */

import { isValue } from './values.js';

// TensorBoard's settings, which its page keeps in localStorage (of this tab's origin too):
// `autoReload` ("Reload data" in its settings, off until the user turns it on) and
// `autoReloadPeriodInMs` (TensorBoard takes one over 30 s, else reloads every 30 s).
const TENSORBOARD_SETTINGS = '_tb_global_settings';
const DEFAULT_RELOAD_MS = 30000;

// TensorBoard's plugin API for a tab in an iframe: a message port to the page around it, which
// says when TensorBoard reloaded its data (`DataReloaded`: its reload button, and its auto-reload
// on its period while its page is visible) or its runs changed (`RunsChanged`), and gives the tab's
// state kept in the URL (`p.{plugin}.{key}` entries of its hash).
export class Host {
  constructor(plugin) {
    this.plugin = plugin;
    this.id = 0;
    this.waits = new Map();
    this.listeners = new Map();
    this.port = null;
    if (window.parent === window) return;  // not inside TensorBoard's page
    const channel = new MessageChannel();
    this.port = channel.port1;
    this.port.addEventListener('message', (event) => this.receive(JSON.parse(event.data)));
    this.port.start();
    window.parent.postMessage('experimental.bootstrap', '*', [channel.port2]);
  }

  receive(message) {
    if (message.isReply) {
      const wait = this.waits.get(message.id);
      this.waits.delete(message.id);
      if (wait) wait(message.error ? null : message.payload);
      return;
    }
    const listener = this.listeners.get(message.type);
    Promise.resolve(listener ? listener(message.payload) : null).catch(() => null).then(() => {
      this.port.postMessage(JSON.stringify({ type: message.type, id: message.id, payload: null, error: null, isReply: true }));
    });
  }

  // The host's answer, or null without one within 3 s.
  send(type, payload) {
    if (!this.port) return Promise.resolve(null);
    const id = this.id++;
    this.port.postMessage(JSON.stringify({ type, id, payload, error: null, isReply: false }));
    return new Promise((resolve) => {
      this.waits.set(id, resolve);
      setTimeout(() => { this.waits.delete(id); resolve(null); }, 3000);
    });
  }

  listen(type, listener) { this.listeners.set(type, listener); }

  // TensorBoard's auto-reload as its page has it: `{on, periodMs}`.
  autoReload() {
    let settings = {};
    try { settings = JSON.parse(localStorage.getItem(TENSORBOARD_SETTINGS)) || {}; } catch { /* none readable */ }
    const period = settings.autoReloadPeriodInMs;
    return { on: settings.autoReload === true, periodMs: Number.isFinite(period) && period > DEFAULT_RELOAD_MS ? period : DEFAULT_RELOAD_MS };
  }

  // Call `listener` when the user changes TensorBoard's settings (its page writes them to localStorage).
  onSettings(listener) {
    window.addEventListener('storage', (event) => { if (event.key === TENSORBOARD_SETTINGS || event.key === null) listener(); });
  }

  // The tab's state in the URL: as TensorBoard gives it, and as this tab wrote it into the hash of
  // TensorBoard's page (TensorBoard 2.21 keeps its tabs' URL state apart from the hash it shows).
  async state() {
    const given = (await this.send('experimental.GetURLPluginData', { pluginName: this.plugin })) || {};
    const mine = `p.${this.plugin}.`;
    const written = {};
    try {
      for (const part of window.parent.location.hash.slice(1).split('&')) {
        const [key, value] = part.split('=').map(decodeURIComponent);
        if (value !== undefined && key.startsWith(mine)) written[key.slice(mine.length)] = value;
      }
    } catch { /* another origin's page */ }
    return { ...written, ...given };
  }

  // Keep `state` in the URL of TensorBoard's page (replacing this tab's entries, keeping the others'),
  // so that a browser reload or a shared link opens the tab as it is.
  keep(state) {
    try {
      const url = new URL(window.parent.location.href);
      const mine = `p.${this.plugin}.`;
      const others = url.hash.slice(1).split('&').filter((part) => part && !decodeURIComponent(part.split('=')[0]).startsWith(mine));
      const entries = Object.entries(state).filter(([, v]) => isValue(v) && v !== '')
        .map(([k, v]) => `${encodeURIComponent(mine + k)}=${encodeURIComponent(v)}`);
      url.hash = [...others, ...entries].join('&');
      window.parent.history.replaceState(window.parent.history.state, '', url.href);
    } catch { /* another origin's page, or none */ }
  }
}
