/**
 * @file The grid: modules (rows) x a few columns (heads, formats) of one logged step on a canvas,
 * a cell each, coloured on its own scale, with hover.
 */

import { LABEL_FONT, el, ellipsis, escapeHtml } from './dom.js';
import { legend } from './legend.js';
import { Scale } from './scales.js';
import { hideTooltip, showTooltip } from './tooltip.js';
import { format } from './values.js';

// Modules (rows) x a few columns (heads, formats) of one logged step on one canvas, a cell each,
// with the column labels above and the module names on the left; a deep model's scrolls.
export class Grid {
  constructor(id) {
    this.canvas = el('canvas', { class: 'cells', id: `${id}-cells` });
    this.legendBox = el('div');
    this.node = el('div', { class: 'grid-cells' }, el('div', { class: 'scroller' }, this.canvas), this.legendBox);
    this.hover = null;
    this.canvas.addEventListener('mousemove', (e) => this.pointer(e));
    this.canvas.addEventListener('mouseleave', () => { this.hover = null; hideTooltip(); this.draw(); });
  }

  // `values[row][col]`; `columns`: their labels; `groups`: labels over runs of columns ([label, count]).
  set({ modules, columns, groups = [], values, quantity, scale }) {
    Object.assign(this, { modules, columns, groups, values, quantity });
    this.scale = new Scale(values, scale);
    const ctx = this.canvas.getContext('2d');
    ctx.font = LABEL_FONT;
    this.left = Math.min(280, Math.ceil(modules.reduce((w, m) => Math.max(w, ctx.measureText(m).width), 0)) + 12);
    this.top = groups.length ? 34 : 20;
    this.colWidth = Math.max(16, Math.min(44, Math.floor(720 / Math.max(1, columns.length))));
    this.rowHeight = Math.min(18, Math.max(4, Math.floor(520 / Math.max(1, modules.length))));
    this.width = this.left + this.colWidth * columns.length + 8;
    this.height = this.top + this.rowHeight * modules.length + 2;
    this.canvas.width = this.width * devicePixelRatio;
    this.canvas.height = this.height * devicePixelRatio;
    this.canvas.style.width = `${this.width}px`;
    this.canvas.style.height = `${this.height}px`;
    this.legendBox.replaceChildren(legend(this.scale, false));
    this.draw();
  }

  // Where a cell's centre is, in the canvas's CSS pixels (the browser tests hover there).
  centre(module, col) {
    return { x: this.left + (col + 0.5) * this.colWidth, y: this.top + (this.modules.indexOf(module) + 0.5) * this.rowHeight };
  }

  cellAt(event) {
    const box = this.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - box.left - this.left) / this.colWidth);
    const row = Math.floor((event.clientY - box.top - this.top) / this.rowHeight);
    if (col < 0 || col >= this.columns.length || row < 0 || row >= this.modules.length) return null;
    return { row, col };
  }

  pointer(event) {
    const cell = this.cellAt(event);
    this.hover = cell;
    if (!cell) { hideTooltip(); this.draw(); return; }
    const value = this.values[cell.row][cell.col];
    const html = `<b>${escapeHtml(this.modules[cell.row])}</b><br>${escapeHtml(this.columns[cell.col])}`
      + `<br>${escapeHtml(this.quantity)} = ${escapeHtml(format(value))}`;
    showTooltip(event, html, value === null ? '' : value);
    this.draw();
  }

  draw() {
    const ctx = this.canvas.getContext('2d');
    ctx.setTransform(devicePixelRatio, 0, 0, devicePixelRatio, 0, 0);
    ctx.clearRect(0, 0, this.width, this.height);
    this.values.forEach((row, r) => row.forEach((v, c) => {
      ctx.fillStyle = `rgb(${this.scale.rgb(v).join(',')})`;
      ctx.fillRect(this.left + c * this.colWidth, this.top + r * this.rowHeight, this.colWidth - 1, this.rowHeight - 1);
    }));
    ctx.font = LABEL_FONT;
    ctx.fillStyle = '#424242';
    ctx.textBaseline = 'middle';
    ctx.textAlign = 'right';
    const every = Math.max(1, Math.ceil(12 / this.rowHeight));
    this.modules.forEach((m, r) => {
      if (r % every === 0) ctx.fillText(ellipsis(ctx, m, this.left - 8), this.left - 5, this.top + (r + 0.5) * this.rowHeight);
    });
    ctx.textAlign = 'center';
    ctx.fillStyle = '#616161';
    this.columns.forEach((label, c) => {
      ctx.fillText(ellipsis(ctx, label.split(' ').pop(), this.colWidth - 2), this.left + (c + 0.5) * this.colWidth, this.top - 9);
    });
    let at = 0;
    for (const [label, count] of this.groups) {
      ctx.fillText(label, this.left + (at + count / 2) * this.colWidth, 9);
      ctx.fillRect(this.left + at * this.colWidth + 2, 17, count * this.colWidth - 5, 1);
      at += count;
    }
    if (this.hover) {
      ctx.strokeStyle = '#fff';
      ctx.lineWidth = 1.5;
      ctx.strokeRect(this.left + this.hover.col * this.colWidth, this.top + this.hover.row * this.rowHeight, this.colWidth - 1, this.rowHeight - 1);
    }
  }
}
