/**
 * @file The heatmap: modules (rows) x logged steps (columns) of one statistic on a canvas, with
 * its findings outlined, a selection, hover, zoom and a drag that narrows the steps.
 */

import { LABEL_FONT, el, ellipsis, escapeHtml } from './dom.js';
import { legend } from './legend.js';
import { Scale, scaleOf } from './scales.js';
import { hideTooltip, showTooltip } from './tooltip.js';
import { format } from './values.js';

// Modules (rows) x steps (columns) on one canvas: the cells are an image of one pixel each,
// scaled up, so drawing costs the same for 10 or 10,000 modules; only the visible rows are drawn.
// With `onRange`, a drag across the steps narrows the map to the steps dragged over and a
// double-click widens it to all of them again (the page chooses the steps: `onRange(from, to)`,
// `onRange(null)`).
export class Heatmap {
  constructor({ height = 560, onSelect = () => {}, onRange = null } = {}) {
    this.maxHeight = height;
    this.onSelect = onSelect;
    this.onRange = onRange;
    this.canvas = el('canvas', { class: 'cells' });
    this.spacer = el('div');
    this.scroller = el('div', { class: 'scroller' }, this.canvas, this.spacer);
    this.legendBox = el('div');
    this.node = el('div', { class: 'heatmap' }, this.scroller, this.legendBox);
    this.rowHeight = 12;
    this.marks = [];
    this.range = null;
    this.selected = null;
    this.hover = null;
    this.drag = null;  // a drag across the steps: where it started and where the pointer is (x)
    this.dragged = false;  // the last press was a drag (its click selects nothing)
    this.scroller.addEventListener('scroll', () => this.draw());
    this.canvas.addEventListener('mousemove', (e) => this.pointer(e));
    this.canvas.addEventListener('mouseleave', () => { this.hover = null; hideTooltip(); this.draw(); });
    this.canvas.addEventListener('click', (e) => {
      const cell = this.dragged ? null : this.cellAt(e);
      if (cell) this.onSelect(this.doc.modules[cell.row], this.doc.steps[cell.col]);
    });
    if (onRange) {
      this.canvas.addEventListener('mousedown', (e) => this.startDrag(e));
      window.addEventListener('mousemove', (e) => this.moveDrag(e));
      window.addEventListener('mouseup', (e) => this.endDrag(e));
      this.canvas.addEventListener('dblclick', () => onRange(null));
    }
    new ResizeObserver(() => this.layout()).observe(this.scroller);
  }

  // Show `doc` (modules x steps) of `stat` with `marks` (findings) on it. `scale`: the colour scale,
  // when it is shared with another heatmap (else this one's own); `range`: the steps the page
  // narrowed the map to (`{from, to}`, or null for all), outside which no mark or selection is
  // drawn. On the same rows as before (a reload, another statistic or range), the rows' height
  // and the scroll stay as the user left them.
  set(doc, stat, marks = [], { scale = null, range = null } = {}) {
    const top = this.scroller.scrollTop;
    const keep = !!this.doc && this.doc.modules.length === doc.modules.length && this.doc.modules.every((m, i) => m === doc.modules[i]);
    this.doc = doc;
    this.stat = stat;
    this.rowOf = new Map(doc.modules.map((m, i) => [m, i]));
    this.marks = marks;
    this.range = range;
    this.gap = undefined;
    this.scale = scale || new Scale(doc.values, scaleOf(stat));
    const rows = doc.modules.length;
    const cols = Math.max(1, doc.steps.length);
    const image = new ImageData(cols, Math.max(1, rows));
    doc.values.forEach((row, r) => row.forEach((v, c) => {
      const [red, green, blue] = this.scale.rgb(v);
      image.data.set([red, green, blue, 255], (r * cols + c) * 4);
    }));
    this.image = document.createElement('canvas');
    [this.image.width, this.image.height] = [cols, Math.max(1, rows)];
    this.image.getContext('2d').putImageData(image, 0, 0);
    if (!keep) this.rowHeight = Math.min(18, Math.max(3, Math.floor((this.maxHeight - 40) / Math.max(1, rows))));
    this.legendBox.replaceChildren(legend(this.scale));
    this.layout();
    if (keep) { this.scroller.scrollTop = top; this.draw(); }
  }

  // Whether `step` is within the steps shown (a mark or a selection there is drawn).
  shows(step) {
    const steps = this.doc.steps;
    if (!steps.length || step > steps[steps.length - 1]) return false;
    return !this.range || (step >= this.range.from && step <= this.range.to);
  }

  // The column under the x of a mouse event, within the columns.
  columnAt(event) {
    const x = event.clientX - this.canvas.getBoundingClientRect().left - this.left;
    return Math.min(this.doc.steps.length - 1, Math.max(0, Math.floor(x / this.colWidth)));
  }

  startDrag(event) {
    this.dragged = false;
    if (event.button !== 0 || !this.doc?.steps.length) return;
    this.drag = { from: event.clientX, to: event.clientX };
  }

  moveDrag(event) {
    if (!this.drag) return;
    this.drag.to = event.clientX;
    hideTooltip();
    this.draw();
  }

  // A drag of a few pixels or more narrows the map to the columns it went over; less is a click.
  endDrag(event) {
    if (!this.drag) return;
    const { from } = this.drag;
    this.drag = null;
    this.draw();
    if (Math.abs(event.clientX - from) < 4) return;
    this.dragged = true;
    const cols = [this.columnAt({ clientX: from }), this.columnAt(event)].sort((a, b) => a - b);
    this.onRange(this.doc.steps[cols[0]], this.doc.steps[cols[1]]);
  }

  zoom(factor) {
    if (!this.doc) return;
    const centre = (this.scroller.scrollTop + this.plotHeight / 2) / this.rowHeight;
    this.rowHeight = Math.min(28, Math.max(2, Math.round(this.rowHeight * factor) || 2));
    this.layout();
    this.scroller.scrollTop = centre * this.rowHeight - this.plotHeight / 2;
  }

  layout() {
    if (!this.doc) return;
    const width = this.scroller.clientWidth || 800;
    const ctx = this.canvas.getContext('2d');
    ctx.font = LABEL_FONT;
    const longest = this.doc.modules.reduce((w, m) => Math.max(w, ctx.measureText(m).width), 0);
    this.left = Math.min(280, Math.ceil(longest) + 22);
    this.axis = 28;
    const content = this.doc.modules.length * this.rowHeight;
    this.plotHeight = Math.min(content, this.maxHeight - this.axis);
    const height = this.plotHeight + this.axis;
    this.scroller.style.height = `${height}px`;
    this.spacer.style.height = `${Math.max(0, content - this.plotHeight)}px`;
    this.width = width;
    this.canvas.width = width * devicePixelRatio;
    this.canvas.height = height * devicePixelRatio;
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    this.colWidth = (width - this.left - 8) / Math.max(1, this.doc.steps.length);
    this.draw();
  }

  // The cell under a mouse event, or null.
  cellAt(event) {
    const box = this.canvas.getBoundingClientRect();
    const x = event.clientX - box.left - this.left;
    const y = event.clientY - box.top + this.scroller.scrollTop;
    const col = Math.floor(x / this.colWidth);
    const row = Math.floor(y / this.rowHeight);
    if (x < 0 || event.clientY - box.top >= this.plotHeight) return null;
    if (col < 0 || col >= this.doc.steps.length || row < 0 || row >= this.doc.modules.length) return null;
    return { row, col };
  }

  // The row of a name: its own, or for a parameter (`{module}.{param}`) its module's.
  rowFor(name) {
    if (!this.rowOf.has(name)) {
      const owners = this.doc.modules.filter((m) => name.startsWith(`${m}.`));
      const owner = owners.reduce((a, b) => (b.length > a.length ? b : a), '');
      this.rowOf.set(name, owner ? this.rowOf.get(owner) : undefined);
    }
    return this.rowOf.get(name);
  }

  // Where a cell's centre is, in the canvas's CSS pixels (the browser tests hover there).
  centre(module, step) {
    const row = this.rowOf.get(module);
    const col = this.doc.steps.indexOf(step);
    return { x: this.left + (col + 0.5) * this.colWidth, y: (row + 0.5) * this.rowHeight - this.scroller.scrollTop };
  }

  pointer(event) {
    const cell = this.cellAt(event);
    if (!cell) { this.hover = null; hideTooltip(); this.draw(); return; }
    this.hover = cell;
    const module = this.doc.modules[cell.row];
    const step = this.doc.steps[cell.col];
    const value = this.doc.values[cell.row][cell.col];
    const found = this.shownMarks().filter((f) => (!f.module || this.rowFor(f.module) === cell.row) && this.column(f.step) === cell.col);
    const gap = this.denser(cell.col) ? ` <span class="hint">(${step - this.doc.steps[cell.col - 1]} after the column before; ${this.gap} elsewhere)</span>` : '';
    const html = `<b>${escapeHtml(module)}</b><br>step ${step}${gap}<br>${escapeHtml(this.stat)} = ${escapeHtml(format(value))}`
      + found.map((f) => `<br><span class="bad">${escapeHtml(f.kind)}${f.module ? '' : ' (whole model)'}</span>`).join('');
    showTooltip(event, html, value === null ? '' : value);
    this.draw();
  }

  // The marks at steps the map shows.
  shownMarks() {
    return this.marks.filter((f) => this.shows(f.step));
  }

  // The columns of the findings about the whole model.
  modelColumns() {
    return [...new Set(this.shownMarks().filter((f) => !f.module).map((f) => this.column(f.step)))];
  }

  // The usual gap between logged steps (the median), and whether column `c` is closer to the one before.
  denser(c) {
    const steps = this.doc.steps;
    if (this.gap === undefined) {
      const gaps = steps.slice(1).map((s, i) => s - steps[i]).sort((a, b) => a - b);
      this.gap = gaps.length ? gaps[gaps.length >> 1] : 0;
    }
    return c > 0 && steps[c] - steps[c - 1] < this.gap;
  }

  // The column a step is drawn in: its own, else the first logged step after it.
  column(step) {
    const steps = this.doc.steps;
    let lo = 0;
    let hi = steps.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (steps[mid] < step) lo = mid + 1; else hi = mid; }
    return Math.min(lo, steps.length - 1);
  }

  // Outline a module's row (and its cell at `step`), or without a module (a finding about the
  // whole model) the column of `step`; nothing when the map has neither.
  // `reveal`: scroll the module's row into view.
  select(module, step, reveal = true) {
    const col = step === undefined || !this.shows(step) ? undefined : this.column(step);
    this.selected = { row: module ? this.rowFor(module) : undefined, col };
    if (this.selected.row === undefined) {
      if (module || col === undefined) this.selected = null;
      this.draw();
      return;
    }
    const y = this.selected.row * this.rowHeight;
    if (reveal && (y < this.scroller.scrollTop || y + this.rowHeight > this.scroller.scrollTop + this.plotHeight)) {
      this.scroller.scrollTop = y - this.plotHeight / 2;
    }
    this.draw();
  }

  draw() {
    if (!this.doc) return;
    const ctx = this.canvas.getContext('2d');
    ctx.setTransform(devicePixelRatio, 0, 0, devicePixelRatio, 0, 0);
    ctx.clearRect(0, 0, this.width, this.plotHeight + this.axis);
    const top = this.scroller.scrollTop;
    const rows = this.doc.modules.length;
    const first = Math.max(0, Math.floor(top / this.rowHeight));
    const last = Math.min(rows, Math.ceil((top + this.plotHeight) / this.rowHeight));
    const plotWidth = this.colWidth * this.doc.steps.length;
    ctx.save();
    ctx.beginPath();
    ctx.rect(0, 0, this.width, this.plotHeight);
    ctx.clip();
    ctx.imageSmoothingEnabled = false;
    if (last > first) {
      ctx.drawImage(this.image, 0, first, this.image.width, last - first,
        this.left, first * this.rowHeight - top, plotWidth, (last - first) * this.rowHeight);
    }
    // Row labels: every row when they fit, else every k-th.
    ctx.font = LABEL_FONT;
    ctx.textBaseline = 'middle';
    ctx.textAlign = 'right';
    const every = Math.max(1, Math.ceil(12 / this.rowHeight));
    const marks = this.shownMarks();
    const flagged = new Set(marks.map((f) => this.rowFor(f.module)));
    for (let r = first; r < last; r++) {
      const y = (r + 0.5) * this.rowHeight - top;
      if (flagged.has(r)) {
        ctx.fillStyle = '#ff1744';
        ctx.fillRect(2, y - Math.min(3, this.rowHeight / 2), 4, Math.min(6, this.rowHeight));
      }
      if (r % every) continue;
      ctx.fillStyle = this.selected && this.selected.row === r ? '#e65100' : '#424242';
      ctx.fillText(ellipsis(ctx, this.doc.modules[r], this.left - 14), this.left - 5, y);
    }
    // Findings, the selection, the hovered cell.
    const w = Math.max(2, this.colWidth);
    const h = Math.max(2, this.rowHeight);
    ctx.lineWidth = 1.5;
    ctx.strokeStyle = '#ff1744';
    for (const f of marks) {
      if (!f.module) continue;
      const r = this.rowFor(f.module);
      if (r === undefined || r < first || r >= last) continue;
      ctx.strokeRect(this.left + this.column(f.step) * this.colWidth + 0.75, r * this.rowHeight - top + 0.75, w - 1.5, h - 1.5);
    }
    // Findings about the whole model (a loss spike): their step's column, dashed.
    ctx.setLineDash([4, 3]);
    for (const col of this.modelColumns()) ctx.strokeRect(this.left + col * this.colWidth + 0.75, 0.75, w - 1.5, this.plotHeight - 1.5);
    ctx.setLineDash([]);
    if (this.selected && this.selected.row === undefined) {
      ctx.strokeStyle = '#000';
      ctx.lineWidth = 2;
      ctx.strokeRect(this.left + this.selected.col * this.colWidth - 1, 0, w + 2, this.plotHeight);
    } else if (this.selected) {
      const y = this.selected.row * this.rowHeight - top;
      ctx.strokeStyle = '#e65100';
      ctx.lineWidth = 1;
      ctx.strokeRect(this.left - 0.5, y - 0.5, plotWidth + 1, this.rowHeight + 1);
      if (this.selected.col !== undefined) {
        ctx.lineWidth = 2.5;
        ctx.strokeStyle = '#000';
        ctx.strokeRect(this.left + this.selected.col * this.colWidth - 1, y - 1, w + 2, h + 2);
      }
    }
    if (this.hover) {
      ctx.strokeStyle = '#fff';
      ctx.lineWidth = 1.5;
      ctx.strokeRect(this.left + this.hover.col * this.colWidth, this.hover.row * this.rowHeight - top, w, h);
    }
    ctx.restore();
    this.drawAxis(ctx, plotWidth);
    if (this.drag) {  // the steps a drag goes over
      const [a, b] = [this.drag.from, this.drag.to].map((x) => this.left + (this.columnAt({ clientX: x }) + 0.5) * this.colWidth);
      ctx.fillStyle = 'rgba(245, 124, 0, 0.25)';
      ctx.fillRect(Math.min(a, b) - this.colWidth / 2, 0, Math.abs(b - a) + this.colWidth, this.plotHeight + this.axis);
    }
  }

  drawAxis(ctx, plotWidth) {
    const y = this.plotHeight;
    const steps = this.doc.steps;
    ctx.fillStyle = '#9e9e9e';
    ctx.fillRect(this.left, y, plotWidth, 1);
    ctx.fillStyle = '#616161';
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    // Columns are logged steps: where they are closer than usual (every step logged after a
    // spike), the axis is marked, so that a column's width is not read as a span of steps.
    ctx.fillStyle = '#ffb74d';
    for (let c = 1; c < steps.length; c++) if (this.denser(c)) ctx.fillRect(this.left + c * this.colWidth, y + 1, Math.max(1, this.colWidth), 3);
    ctx.fillStyle = '#616161';
    const every = Math.max(1, Math.ceil(56 / this.colWidth));
    for (let c = 0; c < steps.length; c += every) {
      const x = this.left + (c + 0.5) * this.colWidth;
      const half = ctx.measureText(String(steps[c])).width / 2;
      ctx.fillRect(x, y, 1, 4);
      ctx.fillText(String(steps[c]), Math.min(this.width - half, Math.max(this.left + half, x)), y + 6);  // whole, right of "step"
    }
    ctx.textAlign = 'right';
    ctx.fillText('step', this.left - 5, y + 6);
  }
}
