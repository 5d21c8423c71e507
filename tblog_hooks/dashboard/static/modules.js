/**
 * @file The module table card: each module's latest values and findings, worst health first,
 * sorted by a click on a column's header; a row chosen with a click or the keyboard.
 */

import { chooseable, el } from './dom.js';
import { finite, format, isValue } from './values.js';

export class ModuleTable {
  // `onChoose(module)` when a row is chosen; `links(module)`: links to its charts (or null).
  constructor({ onChoose, links }) {
    this.onChoose = onChoose;
    this.links = links;
    this.rows = [];
    this.sort = null;
    this.box = el('div', { class: 'modules', id: 'modules' });
    this.node = el('div', { class: 'card' }, el('h2', {}, 'Modules', el('span', { class: 'hint' }, 'latest values, worst health first; click a header to sort')), this.box);
  }

  // While the run is read: no table yet.
  reading(placeholder) {
    this.box.replaceChildren(placeholder);
    this.rows = [];
  }

  // The module table sorted by the column `sortBy` (`null`: forward order), `up` or down; the sort
  // chosen stays when the table is drawn again (a reload).
  show(table, sortBy = this.sort?.by ?? null, up = this.sort?.up ?? false) {
    const columns = ['module', 'findings', ...table.stats];
    if (!columns.includes(sortBy)) sortBy = null;
    this.sort = { by: sortBy, up };
    const key = (row, column) => {
      if (column === 'module') return row.index;
      if (column === 'findings') return row.findings.length;
      const v = row.values[column];
      return finite(v) ? v : isValue(v) ? Infinity : null;
    };
    let rows = table.rows;
    if (sortBy !== null) {
      rows = [...rows].sort((a, b) => {
        const [x, y] = [key(a, sortBy), key(b, sortBy)];
        if (x === null || y === null) return (x === null) - (y === null);
        return up ? x - y : y - x;
      });
    }
    const head = el('tr', {}, ...columns.map((c) => {
      const th = chooseable(el('th', { class: c === 'module' || c === 'findings' ? '' : 'num', onclick: () => this.show(table, c, sortBy === c ? !up : c === 'module') }, c));
      if (c === sortBy) th.classList.add('sorted', ...(up ? ['up'] : []));
      return th;
    }));
    this.rows = rows.map((row) => chooseable(el('tr', { 'data-module': row.module, onclick: () => this.onChoose(row.module) },
      el('td', {}, row.module, this.links(row.module)),
      el('td', {}, ...row.findings.map((k) => el('span', { class: `kind ${k}` }, k))),
      ...table.stats.map((s) => {
        const v = row.values[s];
        return el('td', { class: `num${isValue(v) && !finite(v) ? ' bad' : ''}` }, format(v));
      }))));
    this.box.replaceChildren(el('table', {}, el('thead', {}, head), el('tbody', {}, ...this.rows)));
  }

  // Mark the row of `module` (none without one).
  mark(module) {
    for (const row of this.rows) row.classList.toggle('selected', row.dataset.module === module);
  }
}
