/**
 * @file The cards of the value tables (`heads`, `numerics`): one logged step's table as a grid,
 * with a step chooser (the latest first) and a choice of quantity.
 */

import { el } from './dom.js';
import { Grid } from './grid.js';
import { fetchJson } from './routes.js';
import { scaleOf } from './scales.js';

// The card of one value table (`heads`, `numerics`): a step chooser (the latest first), a choice
// of quantity and the grid; hidden where the run holds no such table.
export class TableCard {
  constructor(name, title, hint) {
    this.name = name;
    this.grid = new Grid(name);
    this.stepSelect = el('select', { id: `${name}-step`, onchange: () => this.load(this.stepSelect.value) });
    this.quantitySelect = el('select', { id: `${name}-quantity`, onchange: () => this.draw() });
    this.node = el('div', { class: 'card', id: name, style: 'display:none' },
      el('h2', {}, title, el('span', { class: 'hint' }, hint)),
      el('div', { class: 'toolbar' }, el('label', {}, 'Step', this.stepSelect), el('label', {}, 'Value', this.quantitySelect)),
      this.grid.node);
  }

  // Show the table of `page`'s model, at the step shown before when `keep` (else the latest).
  async show(page, keep) {
    this.page = page;
    this.model = page.model;
    if (!this.model[this.name]) { this.node.style.display = 'none'; this.doc = null; return; }
    this.node.style.display = '';
    await this.load(keep && this.doc ? this.doc.step : undefined);
  }

  // The table at `step` (the latest when undefined, or when that step is no longer kept), for the
  // page's model as it is now; only the latest of several loads in flight is drawn.
  async load(step) {
    const model = this.page.model;
    const ticket = (this.ticket = (this.ticket || 0) + 1);
    this.model = model;
    let doc;
    try {
      doc = await fetchJson(this.name, this.page.query({ step }));
    } catch (error) {
      if (step === undefined) throw error;
      doc = await fetchJson(this.name, this.page.query());  // that step is no longer kept
    }
    if (this.page.model !== model || this.ticket !== ticket) return;
    this.doc = doc;
    this.stepSelect.replaceChildren(...[...doc.steps].reverse().map((s) => el('option', { value: s }, String(s))));
    this.stepSelect.value = String(doc.step);
    const quantity = this.quantitySelect.value;
    this.quantitySelect.replaceChildren(...doc.quantities.map((q) => el('option', { value: q }, q)));
    if (doc.quantities.includes(quantity)) this.quantitySelect.value = quantity;
    this.draw();
  }

  draw() {
    const doc = this.doc;
    const q = doc.quantities.indexOf(this.quantitySelect.value);
    const quantity = doc.quantities[q];
    if (this.name === 'heads') {
      const columns = Array.from({ length: doc.heads }, (_, h) => `head ${h}`);
      this.grid.set({ modules: doc.modules, columns, values: doc.values.map((heads) => heads.map((v) => v[q])), quantity, scale: scaleOf(`/${quantity}`) });
      return;
    }
    const pairs = doc.roots.flatMap((root, r) => doc.formats.map((fmt, f) => [root, fmt, r, f]));
    this.grid.set({
      modules: doc.modules,
      columns: pairs.map(([root, fmt]) => `${root} ${fmt}`),
      groups: doc.roots.map((root) => [root, doc.formats.length]),
      values: doc.modules.map((_, m) => pairs.map(([, , r, f]) => doc.values[r][m][f][q])),
      quantity: `${quantity} fraction`,
      scale: scaleOf(`/${quantity}`),
    });
  }
}
