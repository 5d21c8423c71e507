// The "Model health" tab of TensorBoard: one ES module, plain DOM and canvas, no build step.
// TensorBoard loads it in an iframe and calls render(); the data comes from this plugin's JSON
// routes (docs/dashboard.md), fetched relative to this module's own URL.

const route = (name, query = {}) => {
  const url = new URL(`./${name}`, import.meta.url);
  for (const [key, value] of Object.entries(query)) if (value !== undefined) url.searchParams.set(key, value);
  return url;
};

async function fetchJson(name, query) {
  const response = await fetch(route(name, query));
  if (!response.ok) throw new Error(`${name}: ${response.status} ${await response.text()}`);
  return response.json();
}

const isValue = (v) => v !== null && v !== undefined;
const finite = (v) => typeof v === 'number' && Number.isFinite(v);

function format(v) {
  if (!isValue(v)) return '–';
  if (typeof v === 'string') return v;
  if (v === 0) return '0';
  const a = Math.abs(v);
  return a >= 1e5 || a < 1e-3 ? v.toExponential(3) : String(+v.toPrecision(4));
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === 'class') node.className = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null) node.append(child);
  return node;
}

// Viridis, 9 stops: perceptually even, readable in grey, distinct from the red of non-finite cells.
const VIRIDIS = ['#440154', '#472d7b', '#3b528b', '#2c728e', '#21918c', '#28ae80', '#5ec962', '#addc30', '#fde725']
  .map((h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)));
const NONFINITE_RGB = [211, 47, 47];
const ZERO_RGB = [189, 189, 189];
const NONE_RGB = [255, 255, 255];

function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * f));
}

// A colour scale over the finite values: log10 where they are all >= 0 (zeros get their own
// colour), linear where some are negative or `linear` (by default: the statistic is a fraction).
class Scale {
  constructor(rows, stat, linear = stat.endsWith('_frac')) {
    let lo = Infinity;
    let hi = -Infinity;
    let negative = false;
    for (const row of rows) {
      for (const v of row) {
        if (!finite(v)) continue;
        if (v < 0) negative = true;
        if (v > 0 || linear) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
      }
    }
    this.log = !negative && !linear;
    if (negative) {
      for (const row of rows) for (const v of row) if (finite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    if (lo === Infinity) [lo, hi] = this.log ? [1, 10] : [0, 1];  // nothing to scale: an empty (or all-zero) map
    if (this.log) { lo = Math.log10(lo); hi = Math.log10(hi); }
    if (hi - lo < 1e-12) { hi = lo + (this.log ? 1 : Math.max(1e-12, Math.abs(lo))); }
    [this.lo, this.hi] = [lo, hi];
  }

  rgb(v) {
    if (!isValue(v)) return NONE_RGB;
    if (!finite(v)) return NONFINITE_RGB;
    if (this.log && v <= 0) return ZERO_RGB;
    const x = this.log ? Math.log10(v) : v;
    return viridis((x - this.lo) / (this.hi - this.lo));
  }

  ticks() {
    if (this.log) {
      const out = [];
      const step = Math.max(1, Math.ceil((Math.floor(this.hi) - Math.ceil(this.lo)) / 6));
      for (let e = Math.ceil(this.lo); e <= this.hi; e += step) out.push([(e - this.lo) / (this.hi - this.lo), `1e${e}`]);
      return out.length > 1 ? out : [[0, format(10 ** this.lo)], [1, format(10 ** this.hi)]];  // within a decade: the ends
    }
    return [0, 0.25, 0.5, 0.75, 1].map((t) => [t, format(this.lo + t * (this.hi - this.lo))]);
  }
}

function legend(scale, findings = true) {
  const width = 260;
  const canvas = el('canvas', { width: width * devicePixelRatio, height: 30 * devicePixelRatio });
  canvas.style.width = `${width}px`;
  canvas.style.height = '30px';
  const ctx = canvas.getContext('2d');
  ctx.scale(devicePixelRatio, devicePixelRatio);
  for (let x = 0; x < width - 20; x++) {
    ctx.fillStyle = `rgb(${viridis(x / (width - 21)).join(',')})`;
    ctx.fillRect(x + 10, 0, 1, 12);
  }
  ctx.fillStyle = '#616161';
  ctx.font = '11px Roboto, Arial, sans-serif';
  ctx.textAlign = 'center';
  for (const [t, label] of scale.ticks()) {
    const x = 10 + t * (width - 21);
    ctx.fillRect(x, 12, 1, 3);
    ctx.fillText(label, x, 26);
  }
  const swatch = (rgb, text) => {
    const box = el('i');
    box.style.background = `rgb(${rgb.join(',')})`;
    return el('span', { class: 'swatch' }, box, text);
  };
  return el(
    'div',
    { class: 'legend' },
    canvas,
    el('span', {}, scale.log ? 'log scale' : 'linear scale'),
    scale.log ? swatch(ZERO_RGB, '0') : null,
    swatch(NONFINITE_RGB, 'NaN/Inf'),
    swatch(NONE_RGB, 'no value'),
    findings ? el('span', { class: 'swatch' }, el('i', { style: 'border:2px solid #ff1744;background:none' }), 'finding') : null,
  );
}

const tooltip = el('div', { class: 'tooltip', id: 'tooltip' });

function showTooltip(event, html, value) {
  tooltip.innerHTML = html;
  tooltip.dataset.value = value === undefined ? '' : String(value);
  tooltip.style.display = 'block';
  const x = Math.min(event.clientX + 14, innerWidth - tooltip.offsetWidth - 4);
  const y = Math.min(event.clientY + 14, innerHeight - tooltip.offsetHeight - 4);
  tooltip.style.left = `${x}px`;
  tooltip.style.top = `${y}px`;
}

const hideTooltip = () => { tooltip.style.display = 'none'; };
const escapeHtml = (s) => String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]);

// Modules (rows) x steps (columns) on one canvas: the cells are an image of one pixel each,
// scaled up, so drawing costs the same for 10 or 10,000 modules; only the visible rows are drawn.
class Heatmap {
  constructor({ height = 560, onSelect = () => {} } = {}) {
    this.maxHeight = height;
    this.onSelect = onSelect;
    this.canvas = el('canvas', { class: 'cells' });
    this.spacer = el('div');
    this.scroller = el('div', { class: 'scroller' }, this.canvas, this.spacer);
    this.legendBox = el('div');
    this.node = el('div', { class: 'heatmap' }, this.scroller, this.legendBox);
    this.rowHeight = 12;
    this.marks = [];
    this.selected = null;
    this.hover = null;
    this.scroller.addEventListener('scroll', () => this.draw());
    this.canvas.addEventListener('mousemove', (e) => this.pointer(e));
    this.canvas.addEventListener('mouseleave', () => { this.hover = null; hideTooltip(); this.draw(); });
    this.canvas.addEventListener('click', (e) => {
      const cell = this.cellAt(e);
      if (cell) this.onSelect(this.doc.modules[cell.row], this.doc.steps[cell.col]);
    });
    new ResizeObserver(() => this.layout()).observe(this.scroller);
  }

  // `scale`: the colour scale, when it is shared with another heatmap (else this one's own).
  set(doc, stat, marks = [], scale = null) {
    this.doc = doc;
    this.stat = stat;
    this.rowOf = new Map(doc.modules.map((m, i) => [m, i]));
    this.marks = marks;
    this.scale = scale || new Scale(doc.values, stat);
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
    this.rowHeight = Math.min(18, Math.max(3, Math.floor((this.maxHeight - 40) / Math.max(1, rows))));
    this.legendBox.replaceChildren(legend(this.scale));
    this.layout();
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
    ctx.font = '11px Roboto, Arial, sans-serif';
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
    const found = this.marks.filter((f) => this.rowFor(f.module) === cell.row && this.column(f.step) === cell.col);
    const html = `<b>${escapeHtml(module)}</b><br>step ${step}<br>${escapeHtml(this.stat)} = ${escapeHtml(format(value))}`
      + found.map((f) => `<br><span class="bad">${escapeHtml(f.kind)}</span>`).join('');
    showTooltip(event, html, value === null ? '' : value);
    this.draw();
  }

  // The column a step is drawn in: its own, else the first logged step after it.
  column(step) {
    const steps = this.doc.steps;
    let lo = 0;
    let hi = steps.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (steps[mid] < step) lo = mid + 1; else hi = mid; }
    return Math.min(lo, steps.length - 1);
  }

  select(module, step) {
    this.selected = { row: this.rowFor(module), col: step === undefined ? undefined : this.column(step) };
    if (this.selected.row === undefined) { this.selected = null; this.draw(); return; }
    const y = this.selected.row * this.rowHeight;
    if (y < this.scroller.scrollTop || y + this.rowHeight > this.scroller.scrollTop + this.plotHeight) {
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
    ctx.font = '11px Roboto, Arial, sans-serif';
    ctx.textBaseline = 'middle';
    ctx.textAlign = 'right';
    const every = Math.max(1, Math.ceil(12 / this.rowHeight));
    const flagged = new Set(this.marks.map((f) => this.rowFor(f.module)));
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
    for (const f of this.marks) {
      const r = this.rowFor(f.module);
      if (r === undefined || r < first || r >= last) continue;
      ctx.strokeRect(this.left + this.column(f.step) * this.colWidth + 0.75, r * this.rowHeight - top + 0.75, w - 1.5, h - 1.5);
    }
    if (this.selected) {
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
  }

  drawAxis(ctx, plotWidth) {
    const y = this.plotHeight;
    const steps = this.doc.steps;
    ctx.fillStyle = '#9e9e9e';
    ctx.fillRect(this.left, y, plotWidth, 1);
    ctx.fillStyle = '#616161';
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    const every = Math.max(1, Math.ceil(56 / this.colWidth));
    for (let c = 0; c < steps.length; c += every) {
      const x = this.left + (c + 0.5) * this.colWidth;
      ctx.fillRect(x, y, 1, 4);
      ctx.fillText(String(steps[c]), x, y + 6);
    }
    ctx.textAlign = 'right';
    ctx.fillText('step', this.left - 5, y + 6);
  }
}

// Modules (rows) x a few columns (heads, formats) of one logged step on one canvas, a cell each,
// with the column labels above and the module names on the left; a deep model's scrolls.
class Grid {
  constructor(id) {
    this.canvas = el('canvas', { class: 'cells', id: `${id}-cells` });
    this.legendBox = el('div');
    this.node = el('div', { class: 'grid-cells' }, el('div', { class: 'scroller' }, this.canvas), this.legendBox);
    this.hover = null;
    this.canvas.addEventListener('mousemove', (e) => this.pointer(e));
    this.canvas.addEventListener('mouseleave', () => { this.hover = null; hideTooltip(); this.draw(); });
  }

  // `values[row][col]`; `columns`: their labels; `groups`: labels over runs of columns ([label, count]).
  set({ modules, columns, groups = [], values, quantity, linear = false }) {
    Object.assign(this, { modules, columns, groups, values, quantity });
    this.scale = new Scale(values, quantity, linear);
    const ctx = this.canvas.getContext('2d');
    ctx.font = '11px Roboto, Arial, sans-serif';
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
    ctx.font = '11px Roboto, Arial, sans-serif';
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

function ellipsis(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let keep = text.length;
  while (keep > 1 && ctx.measureText(`…${text.slice(text.length - keep)}`).width > width) keep--;
  return `…${text.slice(text.length - keep)}`;  // the end of a name tells modules apart
}

// A line over steps on a canvas, with hover, vertical marks (spikes, the selected step) and an
// optional log y axis.
function lineChart({ steps, values, width = 300, height = 130, log = false, marks = [], at = undefined, label = '' }) {
  const canvas = el('canvas');
  const dpr = devicePixelRatio;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext('2d');
  const pad = { l: 46, r: 8, t: 6, b: 18 };
  const points = steps.map((s, i) => [s, values[i]]).filter(([, v]) => finite(v) && (!log || v > 0));
  const ys = points.map(([, v]) => (log ? Math.log10(v) : v));
  let [lo, hi] = [Math.min(...ys), Math.max(...ys)];
  if (!points.length) [lo, hi] = [0, 1];
  if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
  const [s0, s1] = steps.length ? [steps[0], Math.max(steps[0] + 1, steps[steps.length - 1])] : [0, 1];
  const X = (s) => pad.l + ((s - s0) / (s1 - s0)) * (width - pad.l - pad.r);
  const Y = (y) => pad.t + (1 - (y - lo) / (hi - lo)) * (height - pad.t - pad.b);
  const draw = (hover) => {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = '10px Roboto, Arial, sans-serif';
    ctx.fillStyle = '#757575';
    ctx.strokeStyle = '#eeeeee';
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (const t of [0, 0.5, 1]) {
      const y = lo + t * (hi - lo);
      ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(width - pad.r, Y(y)); ctx.stroke();
      ctx.fillText(format(log ? 10 ** y : y), pad.l - 4, Y(y));
    }
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    ctx.fillText(String(s0), X(s0), height - pad.b + 4);
    ctx.fillText(String(steps[steps.length - 1] ?? ''), X(s1), height - pad.b + 4);
    for (const s of marks) {
      ctx.fillStyle = 'rgba(255, 23, 68, 0.55)';
      ctx.fillRect(X(s) - 0.75, pad.t, 1.5, height - pad.t - pad.b);
    }
    if (at !== undefined) { ctx.fillStyle = '#e65100'; ctx.fillRect(X(at) - 0.5, pad.t, 1, height - pad.t - pad.b); }
    ctx.strokeStyle = '#f57c00';
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    points.forEach(([s], i) => (i ? ctx.lineTo(X(s), Y(ys[i])) : ctx.moveTo(X(s), Y(ys[i]))));
    ctx.stroke();
    if (points.length < 40) {
      ctx.fillStyle = '#f57c00';
      points.forEach(([s], i) => ctx.fillRect(X(s) - 1.5, Y(ys[i]) - 1.5, 3, 3));
    }
    if (hover !== undefined) {
      const [s] = points[hover];
      ctx.fillStyle = '#212121';
      ctx.beginPath(); ctx.arc(X(s), Y(ys[hover]), 3, 0, 2 * Math.PI); ctx.fill();
    }
  };
  draw();
  canvas.addEventListener('mousemove', (e) => {
    if (!points.length) return;
    const x = e.clientX - canvas.getBoundingClientRect().left;
    let best = 0;
    points.forEach(([s], i) => { if (Math.abs(X(s) - x) < Math.abs(X(points[best][0]) - x)) best = i; });
    const [s, v] = points[best];
    draw(best);
    showTooltip(e, `${escapeHtml(label)}<br>step ${s}: <b>${escapeHtml(format(v))}</b>`, v);
  });
  canvas.addEventListener('mouseleave', () => { draw(); hideTooltip(); });
  return canvas;
}

const positive = (values) => values.some(finite) && values.every((v) => !finite(v) || v > 0);

// The card of one value table (`heads`, `numerics`): a step chooser (the latest first), a choice
// of quantity and the grid; hidden where the run holds no such table.
class TableCard {
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

  async load(step) {
    const model = this.model;
    let doc;
    try {
      doc = await fetchJson(this.name, this.page.query({ step }));
    } catch (error) {
      if (step === undefined) throw error;
      doc = await fetchJson(this.name, this.page.query());  // that step is no longer kept
    }
    if (this.page.model !== model) return;
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
      this.grid.set({ modules: doc.modules, columns, values: doc.values.map((heads) => heads.map((v) => v[q])), quantity, linear: quantity === 'entropy' });
      return;
    }
    const pairs = doc.roots.flatMap((root, r) => doc.formats.map((fmt, f) => [root, fmt, r, f]));
    this.grid.set({
      modules: doc.modules,
      columns: pairs.map(([root, fmt]) => `${root} ${fmt}`),
      groups: doc.roots.map((root) => [root, doc.formats.length]),
      values: doc.modules.map((_, m) => pairs.map(([, , r, f]) => doc.values[r][m][f][q])),
      quantity: `${quantity} fraction`,
    });
  }
}

class Page {
  constructor(root) {
    this.root = root;
    this.models = [];
    this.model = null;
    this.analysis = null;
    this.selection = null;
  }

  async start() {
    this.models = await fetchJson('runs');
    if (!this.models.length) {
      this.root.replaceChildren(el('div', { class: 'card empty' }, 'No run holds tblog_hooks tags yet.'));
      return;
    }
    this.runSelect = el('select', { id: 'run', onchange: () => this.open(this.models[this.runSelect.value]) });
    this.models.forEach((m, i) => this.runSelect.append(el('option', { value: i }, m.name)));
    this.statSelect = el('select', { id: 'stat', onchange: () => this.drawHeatmap() });
    this.compareSelect = el('select', { id: 'compare', onchange: () => this.drawHeatmap() }, el('option', { value: '' }, '—'));
    this.models.forEach((m, i) => this.compareSelect.append(el('option', { value: i }, m.name)));
    this.compare = new Heatmap({ height: 400 });
    this.compareTitle = el('span', { id: 'compare-title' });
    this.compareCard = el('div', { class: 'card', id: 'compare-card', style: 'display:none' }, el('h2', {}, this.compareTitle), this.compare.node);
    this.filter = el('input', { id: 'filter', type: 'search', placeholder: 'filter modules (regex)', oninput: () => this.drawHeatmap() });
    this.summary = el('span', { class: 'summary', id: 'summary' });
    const toolbar = el('div', { class: 'toolbar' },
      el('label', {}, 'Run', this.runSelect),
      el('label', {}, 'Statistic', this.statSelect),
      el('label', {}, 'Compare with', this.compareSelect),
      el('label', {}, this.filter),
      el('button', { onclick: () => this.reload(true), title: 'read the run again' }, 'Reload'),
      this.summary);
    this.heatmap = new Heatmap({ onSelect: (module, step) => this.select(module, step) });
    this.heatTitle = el('span', { id: 'heatmap-title' });
    this.selectionLine = el('span', { class: 'hint selection', id: 'selection' }, 'click a cell or a finding');
    const zoom = el('span', { class: 'zoom' },
      el('button', { onclick: () => this.heatmap.zoom(1 / 1.5), title: 'smaller rows' }, '−'),
      el('button', { onclick: () => this.heatmap.zoom(1.5), title: 'taller rows' }, '+'));
    this.findingsBox = el('div', { class: 'findings', id: 'findings' });
    this.seriesBox = el('div', { class: 'charts', id: 'series' });
    this.seriesTitle = el('span', {}, 'Module');
    this.spikesCard = el('div', { class: 'card wide', id: 'spikes' });
    this.attentionCard = el('div', { class: 'card', id: 'attention' });
    this.tables = {
      heads: new TableCard('heads', 'Attention per head', 'each attention module\'s heads at one logged step'),
      numerics: new TableCard('numerics', 'Low precision per format', 'the fraction of each watched module\'s outputs and output gradients each format would lose, at one logged step'),
    };
    this.tableBox = el('div', { class: 'modules', id: 'modules' });
    this.root.replaceChildren(
      toolbar,
      el('div', { class: 'grid' },
        el('div', {},
          el('div', { class: 'card', id: 'heatmap' }, el('h2', {}, this.heatTitle, this.selectionLine, zoom), this.heatmap.node),
          this.compareCard),
        el('div', {},
          el('div', { class: 'card' }, el('h2', {}, 'Findings', el('span', { class: 'hint' }, 'click one to see its cell')), this.findingsBox),
          el('div', { class: 'card' }, el('h2', {}, this.seriesTitle), this.seriesBox))),
      this.spikesCard,
      this.attentionCard,
      this.tables.heads.node,
      this.tables.numerics.node,
      el('div', { class: 'card' }, el('h2', {}, 'Modules', el('span', { class: 'hint' }, 'latest values, worst health first; click a header to sort')), this.tableBox),
      tooltip);
    await this.open(this.models[0]);
    this.watch();
  }

  query(extra = {}) {
    return { run: this.model.run, prefix: this.model.prefix, ...extra };
  }

  // TensorBoard reloads its own tabs; this one asks every 30 s whether the run grew, and reads it
  // again if so: all of it where that took the server under 3 s, else the heatmap only (the
  // findings of a large run are read again on Reload).
  watch() {
    setInterval(() => {
      if (!document.hidden && this.model) this.reload(false).catch(() => {});  // the server may be gone
    }, 30000);
  }

  // Read the runs again; open the current one again (keeping the statistic and selection) if it
  // grew, or always when `always`.
  async reload(always) {
    const models = await fetchJson('runs');
    const now = models.find((m) => m.run === this.model.run && m.prefix === this.model.prefix);
    if (!now || (!always && now.max_step === this.model.max_step)) return;
    const [before, step] = [this.model, this.model.max_step];
    this.models[this.models.indexOf(before)] = now;
    if (always || this.openTook < 3000) {
      await this.open(now, true);
      return;
    }
    this.model = now;
    await this.drawHeatmap();
    this.summary.textContent = `${this.summary.textContent.split(' · findings as of')[0]} · findings as of step ${step}: Reload to update`;
  }

  async open(model, keep = false) {
    const started = performance.now();
    const [stat, selection] = keep ? [this.statSelect.value, this.selection] : [null, null];
    this.model = model;
    this.selection = selection;
    this.statSelect.replaceChildren(...model.stats.map((s) => el('option', { value: s }, s)));
    if (model.stats.includes(stat)) this.statSelect.value = stat;
    if (!selection) {
      this.seriesTitle.textContent = 'Module';
      this.seriesBox.replaceChildren(el('div', { class: 'empty' }, 'Click a row of the heatmap to see that module\'s statistics.'));
    }
    this.analysis = null;
    await this.drawHeatmap();  // first: the rest reads the whole run, which takes the server longer
    if (!keep) {
      const reading = () => el('div', { class: 'empty' }, 'Reading the whole run…');
      this.findingsBox.replaceChildren(reading());
      this.tableBox.replaceChildren(reading());
    }
    const [findings, table, spikes] = await Promise.all([
      fetchJson('findings', this.query()), fetchJson('modules', this.query()), model.spikes ? fetchJson('spikes', this.query()) : null]);
    if (this.model !== model) return;
    this.analysis = { findings, table, spikes };
    this.heatmap.marks = findings.filter((f) => f.module);
    this.heatmap.draw();
    this.summary.textContent = `${table.rows.length} modules · ${findings.length} finding${findings.length === 1 ? '' : 's'}`;
    this.drawFindings();
    this.drawTable();
    this.drawSpikes();
    await Promise.all([this.drawAttention(), ...Object.values(this.tables).map((card) => card.show(this, keep))]);
    if (selection) await this.select(selection.module, selection.step);
    this.openTook = performance.now() - started;
  }

  async drawHeatmap() {
    const model = this.model;
    const stat = this.statSelect.value;
    if (!stat) { this.heatTitle.textContent = 'No per-module statistics in this run'; return; }
    const other = this.models[this.compareSelect.value];
    const compared = other && other !== model && other.stats.includes(stat);
    const [doc, otherDoc] = await Promise.all([
      fetchJson('heatmap', this.query({ tag: stat })),
      compared ? fetchJson('heatmap', { run: other.run, prefix: other.prefix, tag: stat }) : null]);
    if (this.model !== model || this.statSelect.value !== stat || this.models[this.compareSelect.value] !== other) return;
    this.doc = doc;
    this.heatTitle.textContent = `${stat} · ${doc.modules.length} × ${doc.steps.length}`;
    const [shown, otherShown] = [this.filtered(doc), otherDoc && this.filtered(otherDoc)];
    // Side by side, both heatmaps share one colour scale, so that a colour is one value in both.
    const scale = otherShown ? new Scale([...shown.values, ...otherShown.values], stat) : null;
    this.heatmap.set(shown, stat, this.analysis ? this.analysis.findings.filter((f) => f.module) : [], scale);
    if (this.selection) this.heatmap.select(this.selection.module, this.selection.step);
    this.compareCard.style.display = other && other !== model ? '' : 'none';
    if (other && other !== model) {
      this.compareTitle.textContent = compared ? `${other.name} · ${stat} · same colour scale` : `${other.name} holds no ${stat}`;
      if (otherShown) this.compare.set(otherShown, stat, [], scale);
    }
    if (other && other !== model) import('./compare.js').then((m) => m.showDifference(this, otherShown && other, stat, shown, otherShown));
  }

  // The rows of a heatmap document that the filter's regular expression matches (all when it is empty or invalid).
  filtered(doc) {
    const pattern = this.filter.value.trim();
    let re = null;
    try { re = pattern ? new RegExp(pattern) : null; } catch { re = null; }
    if (!re) return doc;
    const keep = doc.modules.map((m, i) => (re.test(m) ? i : -1)).filter((i) => i >= 0);
    return { ...doc, modules: keep.map((i) => doc.modules[i]), values: keep.map((i) => doc.values[i]) };
  }

  drawFindings() {
    const { findings } = this.analysis;
    if (!findings.length) {
      this.findingsBox.replaceChildren(el('div', { class: 'empty' }, 'No findings: every rule stayed quiet.'));
      return;
    }
    const body = el('tbody');
    this.findingRows = findings.map((f) => {
      const row = el('tr', { 'data-module': f.module, 'data-step': f.step, onclick: () => this.select(f.module, f.step, f) },
        el('td', {}, el('span', { class: `kind ${f.kind}` }, f.kind)),
        el('td', { class: 'num' }, String(f.step)),
        el('td', {}, f.module || '(model)'),
        el('td', { class: 'num' }, format(f.value)),
        el('td', { class: 'message' }, f.message));
      row.finding = f;
      body.append(row);
      return row;
    });
    this.findingsBox.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ...['kind', 'step', 'module', 'value', 'message'].map((h) => el('th', { class: h === 'step' || h === 'value' ? 'num' : '' }, h)))), body));
  }

  async select(module, step, finding = undefined) {
    this.selection = { module, step };
    this.selectionLine.textContent = module ? `${module} · step ${step}` : `step ${step}`;
    this.selectionLine.dataset.module = module;
    this.selectionLine.dataset.step = step;
    for (const row of this.findingRows || []) row.classList.toggle('selected', row.finding === finding);
    for (const row of this.tableRows || []) row.classList.toggle('selected', row.dataset.module === module);
    if (module) this.heatmap.select(module, step);
    if (module) await this.drawSeries(module, step);
  }

  async drawSeries(module, step) {
    const model = this.model;
    const doc = await fetchJson('series', this.query({ module }));
    if (this.model !== model || this.selection?.module !== module) return;
    this.seriesTitle.textContent = `Module ${module}`;
    const marks = (this.analysis?.findings || []).filter((f) => f.module === module || f.module.startsWith(`${module}.`)).map((f) => f.step);
    const width = Math.max(200, Math.floor((this.seriesBox.clientWidth - 40) / 2));  // two a row, room for a scrollbar
    const charts = doc.series.map((s) => {
      const title = s.name === module ? s.stat : `${s.stat} · ${s.name.slice(module.length + 1)}`;
      const chart = el('div', { class: 'chart' }, el('div', { class: 'title', title: s.name }, title),
        lineChart({ steps: doc.steps, values: s.values, width, height: 110, log: positive(s.values) && !s.stat.endsWith('_frac'), marks, at: step, label: `${s.name} ${s.stat}` }));
      chart.style.width = `${width}px`;
      return chart;
    });
    this.seriesBox.replaceChildren(...(charts.length ? charts : [el('div', { class: 'empty' }, 'No statistics for this module.')]));
  }

  drawSpikes() {
    const { spikes } = this.analysis;
    if (!spikes || (!spikes.grad_norm.steps.length && !spikes.loss.steps.length)) { this.spikesCard.style.display = 'none'; return; }
    this.spikesCard.style.display = '';
    const width = Math.max(320, Math.floor((this.spikesCard.clientWidth || 900) / 2) - 30);
    const chart = (name, line, kind) => el('div', { class: 'chart' }, el('div', { class: 'title' }, `${name} · every step · spike steps marked`),
      lineChart({ ...line, width, height: 160, log: positive(line.values), marks: spikes.spikes.filter((f) => f.kind === kind).map((f) => f.step), label: name }));
    this.spikesCard.replaceChildren(el('h2', {}, 'Spikes', el('span', { class: 'hint' }, `${spikes.spikes.length} spike${spikes.spikes.length === 1 ? '' : 's'}`)),
      el('div', { class: 'charts' },
        spikes.grad_norm.steps.length ? chart('step/grad_norm', spikes.grad_norm, 'gradient_spike') : null,
        spikes.loss.steps.length ? chart('step/loss', spikes.loss, 'loss_spike') : null));
  }

  // Per-module attention (max logit, entropy) over the logged steps, as two small heatmaps.
  async drawAttention() {
    const model = this.model;
    const stats = model.stats.filter((s) => s.startsWith('attention/'));
    if (!stats.length) { this.attentionCard.style.display = 'none'; return; }
    this.attentionCard.style.display = '';
    const docs = await Promise.all(stats.map((tag) => fetchJson('heatmap', this.query({ tag }))));
    if (this.model !== model) return;
    const maps = stats.map((stat, i) => {
      const map = new Heatmap({ height: 260, onSelect: (m, s) => this.select(m, s) });
      return [map, stat, docs[i]];
    });
    this.attentionCard.replaceChildren(el('h2', {}, 'Attention', el('span', { class: 'hint' }, 'per module (the scaled_dot_product_attention calls inside it), over the logged steps')),
      el('div', { class: 'charts wide' }, ...maps.map(([map, stat]) => el('div', { class: 'chart' }, el('div', { class: 'title' }, stat), map.node))));
    const marks = this.analysis.findings.filter((f) => f.kind.startsWith('attention_'));
    for (const [map, stat, doc] of maps) map.set(doc, stat, marks);
  }

  drawTable(sortBy = null, up = false) {
    const { table } = this.analysis;
    const columns = ['module', 'findings', ...table.stats];
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
      const th = el('th', { class: c === 'module' || c === 'findings' ? '' : 'num', onclick: () => this.drawTable(c, sortBy === c ? !up : c === 'module') }, c);
      if (c === sortBy) th.classList.add('sorted', ...(up ? ['up'] : []));
      return th;
    }));
    this.tableRows = rows.map((row) => el('tr', { 'data-module': row.module, onclick: () => this.select(row.module, undefined) },
      el('td', {}, row.module),
      el('td', {}, ...row.findings.map((k) => el('span', { class: `kind ${k}` }, k))),
      ...table.stats.map((s) => {
        const v = row.values[s];
        return el('td', { class: `num${isValue(v) && !finite(v) ? ' bad' : ''}` }, format(v));
      })));
    this.tableBox.replaceChildren(el('table', {}, el('thead', {}, head), el('tbody', {}, ...this.tableRows)));
  }
}

export async function render() {
  document.head.append(el('link', { rel: 'stylesheet', href: route('style.css').href }));
  const root = el('div', { class: 'health' }, el('div', { class: 'empty' }, 'Loading…'));
  document.body.append(root);
  const page = new Page(root);
  window.tblogHealth = page;  // for scripts and the browser tests: page.heatmap.centre(module, step)
  try {
    await page.start();
  } catch (error) {
    root.replaceChildren(el('div', { class: 'card bad' }, String(error.message || error)));
    throw error;
  }
}

// For the difference view (compare.js), which draws with the same pieces.
export { Heatmap, Scale, el, escapeHtml, fetchJson, format, legend, showTooltip };
