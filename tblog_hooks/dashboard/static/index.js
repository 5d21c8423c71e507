/**
 * @file The "Model health" tab of TensorBoard, its entry point: TensorBoard loads this ES module in
 * an iframe and calls render(). Plain DOM and canvas, no build step; the data comes from this
 * plugin's JSON routes (docs/dashboard.md, routes.js).
 */

import { el } from './dom.js';
import { Host } from './host.js';
import { Page } from './page.js';
import { route } from './routes.js';

export async function render() {
  document.head.append(el('link', { rel: 'stylesheet', href: route('style.css').href }));
  const root = el('div', { class: 'health' }, el('div', { class: 'empty' }, 'Loading…'));
  document.body.append(root);
  const plugin = new URL('.', import.meta.url).pathname.split('/').filter(Boolean).pop();  // the route's last folder
  const page = new Page(root, new Host(plugin));
  window.tblogHealth = page;  // for scripts and the browser tests: page.heatmap.centre(module, step)
  try {
    await page.start();
  } catch (error) {
    root.replaceChildren(el('div', { class: 'card bad' }, String(error.message || error)));
    throw error;
  }
}
