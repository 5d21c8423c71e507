/**
 * @file The attention card: per-module attention (max logit, entropy) over the logged steps, a
 * small heatmap each; hidden where the run holds none.
 */

import { el } from './dom.js';
import { Heatmap } from './heatmap.js';
import { fetchJson } from './routes.js';

export class AttentionCard {
  constructor() {
    this.node = el('div', { class: 'card', id: 'attention' });
    this.maps = null;
  }

  // The attention statistics of `page`'s model, its attention findings marked; a click selects in `page`.
  async show(page) {
    const model = page.model;
    const stats = model.stats.filter((s) => s.startsWith('attention/'));
    if (!stats.length) { this.node.style.display = 'none'; return; }
    this.node.style.display = '';
    const docs = await Promise.all(stats.map((tag) => fetchJson('heatmap', page.query({ tag }))));
    if (page.model !== model) return;
    const key = stats.join('\n');
    if (this.maps?.key !== key) {  // a map per statistic, kept while the runs shown hold the same ones
      const maps = stats.map(() => new Heatmap({ height: 260, onSelect: (m, s) => page.select(m, s) }));
      this.maps = { key, maps };
      this.node.replaceChildren(el('h2', {}, 'Attention', el('span', { class: 'hint' }, 'per module (the scaled_dot_product_attention calls inside it), over the logged steps')),
        el('div', { class: 'charts wide' }, ...maps.map((map, i) => el('div', { class: 'chart' }, el('div', { class: 'title' }, stats[i]), map.node))));
    }
    const marks = page.analysis.findings.filter((f) => f.kind.startsWith('attention_'));
    this.maps.maps.forEach((map, i) => map.set(docs[i], stats[i], marks));
  }
}
