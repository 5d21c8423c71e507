// The "Model health" tab of TensorBoard: one ES module, plain DOM and canvas, no build step.
// TensorBoard loads it in an iframe and calls render(); the data comes from this plugin's JSON
// routes (docs/dashboard.md), fetched relative to this module's own URL.

const route = (name, query = {}) => {
  const url = new URL(`./${name}`, import.meta.url);
  for (const [key, value] of Object.entries(query)) if (value !== undefined) url.searchParams.set(key, value);
  return url;
};

// The plugin's requests in flight (for scripts and the browser tests: a browser reload while none is
// aborts nothing).
const requests = { pending: 0 };

async function fetchJson(name, query) {
  requests.pending += 1;
  try {
    const response = await fetch(route(name, query));
    if (!response.ok) throw new Error(`${name}: ${response.status} ${await response.text()}`);
    return await response.json();
  } finally {
    requests.pending -= 1;
  }
}

const isValue = (v) => v !== null && v !== undefined;
const finite = (v) => typeof v === 'number' && Number.isFinite(v);

function format(v, digits = 4) {
  if (!isValue(v)) return '–';
  if (typeof v === 'string') return v;
  if (v === 0) return '0';
  const a = Math.abs(v);
  return a >= 1e5 || a < 1e-3 ? v.toExponential(digits - 1) : String(+v.toPrecision(digits));
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

// How a statistic is drawn, from the table the server sends (`scales`: `log`, `linear` or
// `fraction`, by statistic name: `dead_frac`, `underflow_fp16`, `entropy`).
let SCALES = { default: 'log' };
const scaleOf = (stat) => SCALES[stat.slice(stat.indexOf('/') + 1)] || SCALES.default;
// What each finding kind's `value` is, from the server's table (`kinds`): `label` beside the
// number, `meaning` the sentence (a vanishing finding's value is a ratio, not the norm in its cell).
let KINDS = {};
const measureOf = (kind) => KINDS[kind] || { label: '', meaning: 'the quantity the rule compared: see the message' };

// A colour scale over the finite values of a statistic of scale `kind`: `log` is log10 where they
// are all >= 0 (zeros get their own colour) and linear where some are negative; `linear` is linear
// over the values; `fraction` is linear from 0 to 1.
class Scale {
  constructor(rows, kind) {
    const linear = kind !== 'log';
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
    if (kind === 'fraction') [lo, hi] = [0, 1];
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
    const at = (t) => (this.log ? 10 ** (this.lo + t * (this.hi - this.lo)) : this.lo + t * (this.hi - this.lo));
    if (this.log) {
      const out = [];
      const step = Math.max(1, Math.ceil((Math.floor(this.hi) - Math.ceil(this.lo)) / 6));
      for (let e = Math.ceil(this.lo); e <= this.hi; e += step) out.push([(e - this.lo) / (this.hi - this.lo), `1e${e}`]);
      if (out.length > 1) return out;
      return distinct([0, 1], at);  // within a decade: the ends
    }
    return distinct([0, 0.25, 0.5, 0.75, 1], at);
  }
}

// Labels of the values at positions `ts`, with as many digits as they need to differ.
function distinct(ts, valueAt) {
  for (let digits = 4; digits <= 12; digits++) {
    const labels = ts.map((t) => format(valueAt(t), digits));
    if (new Set(labels).size === labels.length || digits === 12) return ts.map((t, i) => [t, labels[i]]);
  }
  return [];
}

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

const LABEL_FONT = '11px Roboto, Arial, sans-serif';
const measurer = document.createElement('canvas').getContext('2d');

function textWidth(text) {
  measurer.font = LABEL_FONT;
  return measurer.measureText(text).width;
}

let gradients = 0;  // the legends' colour bars, each a gradient with an id of its own

// The colour bar of a scale with its ticks and their labels, as SVG. A label stays whole inside
// the bar's width: centred on its tick where it fits, else moved in from the edge; a label that
// would cover another is left out (the ends first, then the ticks in order).
function colourBar(scale) {
  const [width, left, right] = [260, 10, 250];
  const id = `viridis-${++gradients}`;
  const stops = VIRIDIS.map((rgb, i) => svg('stop', { offset: i / (VIRIDIS.length - 1), 'stop-color': `rgb(${rgb.join(',')})` }));
  const bar = svg('svg', { width, height: 30, viewBox: `0 0 ${width} 30`, role: 'img' },
    svg('defs', {}, svg('linearGradient', { id }, ...stops)),
    svg('rect', { x: left, y: 0, width: right - left, height: 12, fill: `url(#${id})` }));
  const ticks = scale.ticks().map(([t, label]) => {
    const x = left + t * (right - left);
    const half = textWidth(label) / 2 + 1;
    const centre = Math.min(width - half, Math.max(half, x));
    return { t, x, label, from: centre - half, to: centre + half, centre };
  });
  const rank = (tick) => (tick.t === 0 || tick.t === 1 ? 0 : 1);  // the ends first
  const shown = [];
  for (const tick of [...ticks].sort((a, b) => rank(a) - rank(b))) {
    if (!shown.some((s) => tick.from < s.to + 4 && s.from < tick.to + 4)) shown.push(tick);
  }
  for (const tick of ticks) bar.append(svg('rect', { x: tick.x - 0.5, y: 12, width: 1, height: 3, fill: '#616161' }));
  for (const tick of shown.sort((a, b) => a.t - b.t)) {
    bar.append(svg('text', { x: tick.centre, y: 26, 'text-anchor': 'middle', fill: '#616161', style: `font: ${LABEL_FONT}` }, tick.label));
  }
  return bar;
}

function legend(scale, findings = true) {
  const swatch = (rgb, text) => {
    const box = el('i');
    box.style.background = `rgb(${rgb.join(',')})`;
    return el('span', { class: 'swatch' }, box, text);
  };
  return el(
    'div',
    { class: 'legend' },
    colourBar(scale),
    el('span', { class: 'scale-name' }, scale.log ? 'log scale' : 'linear scale'),
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
// With `onRange`, a drag across the steps narrows the map to the steps dragged over and a
// double-click widens it to all of them again (the page chooses the steps: `onRange(from, to)`,
// `onRange(null)`).
class Heatmap {
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
    ctx.font = '11px Roboto, Arial, sans-serif';
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
  set({ modules, columns, groups = [], values, quantity, scale }) {
    Object.assign(this, { modules, columns, groups, values, quantity });
    this.scale = new Scale(values, scale);
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
  const drawn = (v) => finite(v) && (!log || v > 0);
  // Every step with a value: those drawn on the line, and the non-finite ones, marked in red as on the heatmap.
  const held = steps.map((s, i) => [s, values[i]]).filter(([, v]) => isValue(v));
  const points = held.filter(([, v]) => drawn(v));
  const bad = held.filter(([, v]) => !finite(v)).map(([s]) => s);
  const ys = points.map(([, v]) => (log ? Math.log10(v) : v));
  let [lo, hi] = [Math.min(...ys), Math.max(...ys)];
  if (!points.length) [lo, hi] = [0, 1];
  if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
  const [s0, s1] = steps.length ? [steps[0], Math.max(steps[0] + 1, steps[steps.length - 1])] : [0, 1];
  const X = (s) => pad.l + ((s - s0) / (s1 - s0)) * (width - pad.l - pad.r);
  const Y = (y) => pad.t + (1 - (y - lo) / (hi - lo)) * (height - pad.t - pad.b);
  const yOf = (v) => Y(log ? Math.log10(v) : v);
  canvas.xOf = X;  // for the browser tests: where a step is drawn
  const draw = (hover) => {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = '10px Roboto, Arial, sans-serif';
    ctx.fillStyle = '#757575';
    ctx.strokeStyle = '#eeeeee';
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (const [t, text] of distinct([0, 0.5, 1], (t) => (log ? 10 ** (lo + t * (hi - lo)) : lo + t * (hi - lo)))) {
      const y = lo + t * (hi - lo);
      ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(width - pad.r, Y(y)); ctx.stroke();
      ctx.fillText(text, pad.l - 4, Y(y));
    }
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    ctx.fillText(String(s0), X(s0), height - pad.b + 4);
    ctx.fillText(String(steps[steps.length - 1] ?? ''), X(s1), height - pad.b + 4);
    for (const s of marks) {
      ctx.fillStyle = 'rgba(255, 23, 68, 0.55)';
      ctx.fillRect(X(s) - 0.75, pad.t, 1.5, height - pad.t - pad.b);
    }
    for (const s of bad) {
      ctx.fillStyle = `rgba(${NONFINITE_RGB.join(',')}, 0.18)`;
      ctx.fillRect(X(s) - 2, pad.t, 4, height - pad.t - pad.b);
      ctx.fillStyle = `rgb(${NONFINITE_RGB.join(',')})`;
      ctx.fillRect(X(s) - 2.5, pad.t, 5, 5);
    }
    if (at !== undefined) { ctx.fillStyle = '#e65100'; ctx.fillRect(X(at) - 0.5, pad.t, 1, height - pad.t - pad.b); }
    ctx.strokeStyle = '#f57c00';
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let joined = false;  // the line breaks at a step that is not drawn (NaN/Inf, or <= 0 on a log axis)
    for (const [s, v] of held) {
      if (!drawn(v)) { joined = false; continue; }
      if (joined) ctx.lineTo(X(s), yOf(v)); else ctx.moveTo(X(s), yOf(v));
      joined = true;
    }
    ctx.stroke();
    if (points.length < 40) {
      ctx.fillStyle = '#f57c00';
      points.forEach(([s, v]) => ctx.fillRect(X(s) - 1.5, yOf(v) - 1.5, 3, 3));
    }
    if (hover !== undefined && drawn(held[hover][1])) {
      const [s, v] = held[hover];
      ctx.fillStyle = '#212121';
      ctx.beginPath(); ctx.arc(X(s), yOf(v), 3, 0, 2 * Math.PI); ctx.fill();
    }
  };
  draw();
  canvas.addEventListener('mousemove', (e) => {
    if (!held.length) return;
    const x = e.clientX - canvas.getBoundingClientRect().left;
    let best = 0;
    held.forEach(([s], i) => { if (Math.abs(X(s) - x) < Math.abs(X(held[best][0]) - x)) best = i; });
    const [s, v] = held[best];
    draw(best);
    const text = finite(v) ? `<b>${escapeHtml(format(v))}</b>` : `<b class="bad">${escapeHtml(v)}</b>`;
    showTooltip(e, `${escapeHtml(label)}<br>step ${s}: ${text}`, v);
  });
  canvas.addEventListener('mouseleave', () => { draw(); hideTooltip(); });
  return canvas;
}

// Links that download what a view shows: the route `name`'s answer to `query` as CSV and as JSON.
function downloads(name, query) {
  return el('span', { class: 'downloads', 'data-route': name }, 'download',
    ...['csv', 'json'].map((format) => el('a', { href: route(name, { ...query, format }).href, download: '', 'data-format': format }, format.toUpperCase())));
}

// `node` reached with Tab and chosen with Enter or Space, as with a click.
function chooseable(node) {
  node.tabIndex = 0;
  node.addEventListener('keydown', (event) => {
    if (event.key !== 'Enter' && event.key !== ' ') return;
    event.preventDefault();
    node.click();
  });
  return node;
}

// A heatmap document on the columns `steps` (a superset of its own): `null` where it has no value.
function onSteps(doc, steps) {
  if (steps === doc.steps) return doc;
  const at = new Map(doc.steps.map((s, i) => [s, i]));
  const columns = steps.map((s) => at.get(s));
  return { ...doc, steps, values: doc.values.map((row) => columns.map((c) => (c === undefined ? null : row[c]))) };
}

// Whether two findings are the same one (read again, they are other objects).
const sameFinding = (a, b) => !!a && !!b && a.kind === b.kind && a.module === b.module && a.step === b.step;

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

// TensorBoard's settings, which its page keeps in localStorage (of this tab's origin too):
// `autoReload` ("Reload data" in its settings, off until the user turns it on) and
// `autoReloadPeriodInMs` (TensorBoard takes one over 30 s, else reloads every 30 s).
const TENSORBOARD_SETTINGS = '_tb_global_settings';
const DEFAULT_RELOAD_MS = 30000;

// TensorBoard's plugin API for a tab in an iframe: a message port to the page around it, which
// says when TensorBoard reloaded its data (`DataReloaded`: its reload button, and its auto-reload
// on its period while its page is visible) or its runs changed (`RunsChanged`), and gives the tab's
// state kept in the URL (`p.{plugin}.{key}` entries of its hash).
class Host {
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

class Page {
  constructor(root, host) {
    this.root = root;
    this.host = host;
    this.models = [];
    this.model = null;
    this.analysis = null;
    this.selection = null;
    this.queue = Promise.resolve();
    this.requests = requests;  // what is in flight
  }

  async start() {
    const [models, scales, kinds, state] = await Promise.all([fetchJson('runs'), fetchJson('scales'), fetchJson('kinds'), this.host.state()]);
    SCALES = scales;
    KINDS = kinds;
    this.state = state;
    const reload = () => this.reload(false).catch(() => {});  // the server may be gone
    this.host.listen('experimental.DataReloaded', reload);
    this.host.listen('experimental.RunsChanged', reload);
    this.follow = el('span', { class: 'hint', id: 'follow' });
    this.showFollow();
    this.host.onSettings(() => this.showFollow());
    this.models = models;
    if (!models.length) {
      this.root.replaceChildren(el('div', { class: 'card empty', id: 'no-runs' }, 'No run holds tblog_hooks tags yet. ', this.follow));
      return;
    }
    await this.build();
  }

  // Say whether the tab follows the runs as they are written: it reads them again on each of
  // TensorBoard's reloads, which come on their own only with its auto-reload on.
  showFollow() {
    const { on, periodMs } = this.host.autoReload();
    this.follow.dataset.on = String(on);
    this.follow.textContent = on
      ? `Following the runs: TensorBoard's auto-reload reads them every ${Math.round(periodMs / 1000)} s.`
      : 'TensorBoard\'s auto-reload is off: its reload button (⟳) reads the runs again; turn on "Reload data" in its settings (⚙) to follow a training as it runs.';
  }

  async build() {
    this.runSelect = el('select', { id: 'run', onchange: () => this.open(this.models[this.runSelect.value]) });
    this.statSelect = el('select', { id: 'stat', onchange: () => { this.drawHeatmap(); this.keep(); } });
    this.compareSelect = el('select', { id: 'compare', onchange: () => { this.drawHeatmap(); this.keep(); } });
    const narrow = (from, to) => this.narrow(from, to);
    this.compare = new Heatmap({ height: 400, onRange: narrow });
    this.compareTitle = el('span', { id: 'compare-title' });
    this.compareCard = el('div', { class: 'card', id: 'compare-card', style: 'display:none' }, el('h2', {}, this.compareTitle), this.compare.node);
    this.filter = el('input', { id: 'filter', type: 'search', placeholder: 'filter modules (regex)', value: this.state.filter || '', oninput: () => { this.drawHeatmap(); this.keep(); } });
    this.summary = el('span', { class: 'summary', id: 'summary' });
    this.sampling = el('div', { class: 'hint sampling', id: 'sampling', style: 'display:none' });
    const toolbar = el('div', { class: 'toolbar' },
      el('label', {}, 'Run', this.runSelect),
      el('label', {}, 'Statistic', this.statSelect),
      el('label', {}, 'Compare with', this.compareSelect),
      el('label', {}, this.filter),
      el('button', { onclick: () => this.reload(true), title: 'read the run again' }, 'Reload'),
      this.summary,
      this.follow);
    this.heatmap = new Heatmap({ onSelect: (module, step) => this.select(module, step), onRange: narrow });
    this.heatTitle = el('span', { id: 'heatmap-title' });
    this.heatDownloads = el('span');
    this.findingsDownloads = el('span');
    this.seriesDownloads = el('span');
    this.selectionLine = el('span', { class: 'hint selection', id: 'selection' }, 'click a cell or a finding');
    const zoom = el('span', { class: 'zoom' },
      this.rangeHint = el('span', { class: 'hint', id: 'range-hint' }),
      el('button', { onclick: () => this.heatmap.zoom(1 / 1.5), title: 'smaller rows' }, '−'),
      el('button', { onclick: () => this.heatmap.zoom(1.5), title: 'taller rows' }, '+'));
    this.findingsBox = el('div', { class: 'findings', id: 'findings' });
    this.findingsHint = el('span', { class: 'hint', id: 'findings-hint' }, 'click one (or Enter) to see its cell');
    this.findingsRange = el('span', { class: 'hint', id: 'findings-range' });
    this.seriesBox = el('div', { class: 'charts', id: 'series' });
    this.seriesTitle = el('span', {}, 'Module');
    this.seriesLinks = el('span', { id: 'series-links' });
    this.spikesCard = el('div', { class: 'card wide', id: 'spikes' });
    this.attentionCard = el('div', { class: 'card', id: 'attention' });
    this.tables = {
      heads: new TableCard('heads', 'Attention per head', 'each attention module\'s heads at one logged step'),
      numerics: new TableCard('numerics', 'Low precision per format', 'the fraction of each watched module\'s outputs and output gradients each format would lose, at one logged step'),
    };
    this.tableBox = el('div', { class: 'modules', id: 'modules' });
    this.overviewBox = el('div', { class: 'overview' });
    this.overviewCard = el('div', { class: 'card', id: 'overview', style: 'display:none' },
      el('h2', {}, 'Runs', el('span', { class: 'hint' }, 'findings per run, worst first; click one (or Enter) to open it')), this.overviewBox);
    this.root.replaceChildren(
      toolbar,
      this.sampling,
      this.overviewCard,
      el('div', { class: 'grid' },
        el('div', {},
          el('div', { class: 'card', id: 'heatmap' }, el('h2', {}, this.heatTitle, this.selectionLine, this.heatDownloads, zoom), this.heatmap.node),
          this.compareCard),
        el('div', {},
          el('div', { class: 'card' }, el('h2', {}, 'Findings', this.findingsRange, this.findingsHint, this.findingsDownloads), this.findingsBox),
          el('div', { class: 'card' }, el('h2', {}, this.seriesTitle, this.seriesLinks, this.seriesDownloads), this.seriesBox))),
      this.spikesCard,
      this.attentionCard,
      this.tables.heads.node,
      this.tables.numerics.node,
      el('div', { class: 'card' }, el('h2', {}, 'Modules', el('span', { class: 'hint' }, 'latest values, worst health first; click a header to sort')), this.tableBox),
      tooltip);
    this.listModels(this.models, this.state.compare);
    const first = this.models.find((m) => m.name === this.state.run) || this.models[0];
    const step = this.state.step === undefined ? undefined : Number(this.state.step);
    this.selection = this.state.module !== undefined || step !== undefined ? { module: this.state.module || '', step } : null;
    const [from, to] = [this.state.from, this.state.to].map((v) => (v === undefined || v === '' ? NaN : Number(v)));
    this.range = from <= to ? { from, to } : null;  // (NaN: no range)
    this.wantedStat = this.state.stat;
    await this.open(first, false, true);
    await this.drawOverview();
  }

  // With several runs (or prefixes): each one's findings counted by kind, the worst run first
  // (the server judges every run for it, once per change of each).
  // Read again only when a run joined or grew (TensorBoard's reloads come every 30 s).
  async drawOverview() {
    if (this.models.length < 2) { this.overviewCard.style.display = 'none'; return; }
    const version = this.models.map((m) => `${m.name}@${m.max_step}`).join('\n');
    if (version === this.overviewVersion) return;
    const rows = await fetchJson('overview');
    this.overviewVersion = version;
    this.overviewCard.style.display = '';
    // A run the server could not judge says why in its row; the others' rows are whole.
    this.overviewRows = rows.map((r) => chooseable(el('tr', { 'data-name': r.name, onclick: () => this.openNamed(r.name) },
      el('td', {}, r.name),
      ...(r.error ? [el('td', { class: 'message bad', colspan: 4 }, `could not be judged: ${r.error}`)] : [
        el('td', { class: 'num' }, String(r.findings)),
        el('td', {}, r.worst ? el('span', { class: `kind ${r.worst}` }, r.worst) : 'healthy'),
        el('td', {}, ...Object.entries(r.kinds).map(([kind, n]) => el('span', { class: 'count' }, el('span', { class: `kind ${kind}` }, kind), ` ${n}`))),
        el('td', { class: 'num' }, `${r.logged_steps.toLocaleString()}${r.sampled ? ' (sample)' : ''}`)]))));
    this.overviewBox.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ...['run', 'findings', 'worst', 'by kind', 'logged steps'].map((h) => el('th', { class: h === 'findings' || h === 'logged steps' ? 'num' : '' }, h)))),
      el('tbody', {}, ...this.overviewRows)));
    this.markOverview();
  }

  markOverview() {
    for (const row of this.overviewRows || []) row.classList.toggle('selected', row.dataset.name === this.model?.name);
  }

  // Open the run (or prefix) named `name`, as choosing it in the Run list does.
  async openNamed(name) {
    const model = this.models.find((m) => m.name === name);
    if (model && model !== this.model) await this.open(model);
  }

  // Fill the Run and Compare lists from `models`, keeping what they show (or showing `compare`).
  listModels(models, compare = this.compareModel()?.name) {
    this.models = models;
    const shown = this.model?.name;
    this.runSelect.replaceChildren(...models.map((m, i) => el('option', { value: i }, m.name)));
    this.compareSelect.replaceChildren(el('option', { value: '' }, '—'), ...models.map((m, i) => el('option', { value: i }, m.name)));
    const index = (name) => models.findIndex((m) => m.name === name);
    if (index(shown) >= 0) this.runSelect.value = String(index(shown));
    this.compareSelect.value = index(compare) >= 0 ? String(index(compare)) : '';
  }

  compareModel() {
    return this.compareSelect.value === '' ? null : this.models[this.compareSelect.value];
  }

  // The tab's state, in TensorBoard's URL.
  keep() {
    const stat = this.statSelect.value;
    const selection = this.selection || {};
    this.host.keep({
      run: this.model?.name, stat, compare: this.compareModel()?.name, module: selection.module, step: selection.step,
      filter: this.filter.value, from: this.range?.from, to: this.range?.to,
    });
  }

  // Narrow the heatmaps and the findings to the steps from `from` to `to` (`null`: all steps).
  narrow(from, to) {
    this.range = from === null ? null : { from, to };
    this.keep();
    if (this.analysis) this.drawFindings();
    return this.drawHeatmap(true);
  }

  inRange(step) {
    return !this.range || (step >= this.range.from && step <= this.range.to);
  }

  query(extra = {}) {
    return { run: this.model.run, prefix: this.model.prefix, ...extra };
  }

  // When TensorBoard reloads (its reload button, its auto-reload), read the runs again: new runs join
  // the lists, and the run shown is read again if it grew (always with `always`, the tab's Reload):
  // all of it where that took the server under 3 s, else the heatmap and the tables only (the
  // findings of a large run are read again on Reload). One reload at a time.
  reload(always) {
    this.queue = this.queue.then(() => this.reloadNow(always));
    return this.queue;
  }

  async reloadNow(always) {
    const models = await fetchJson('runs');
    if (!this.runSelect) {  // the page waits for a first run
      this.models = models;
      if (models.length) await this.build();
      return;
    }
    this.listModels(models);
    await this.drawOverview().catch(() => {});
    const now = models.find((m) => m.name === this.model.name);
    if (!now || (!always && now.max_step === this.model.max_step)) return;
    const step = this.model.max_step;
    if (always || this.openTook < 3000) {
      await this.open(now, true);
      return;
    }
    this.model = now;
    await Promise.all([this.drawHeatmap(true), ...Object.values(this.tables).map((card) => card.show(this, true))]);
    this.summary.textContent = `${this.summary.textContent.split(' · findings as of')[0]} · findings as of step ${step}: Reload to update`;
  }

  // Show `model`: with `keep`, as it was (a reload: new steps join at the right, and the selection,
  // the rows' height, the scroll and the sort stay); else keeping the statistic and the selection
  // where the run has them. `restore`: the state from the URL (its selection is the run's own).
  async open(model, keep = false, restore = false) {
    hideTooltip();
    this.opening = model;  // until it is all drawn (the browser tests wait for it)
    const started = performance.now();
    const stat = this.wantedStat ?? this.statSelect.value;
    this.wantedStat = undefined;
    const selection = this.selection;
    const other = model !== this.model && !restore;
    this.model = model;
    this.runSelect.value = String(this.models.indexOf(model));
    this.markOverview();
    this.statSelect.replaceChildren(...model.stats.map((s) => el('option', { value: s }, s)));
    if (model.stats.includes(stat)) this.statSelect.value = stat;
    this.analysis = null;
    if (!keep) {
      this.heatmap.marks = [];
      const reading = () => el('div', { class: 'empty' }, 'Reading the whole run…');
      this.findingsBox.replaceChildren(reading());
      this.findingsDownloads.replaceChildren();
      this.tableBox.replaceChildren(reading());
      this.findingRows = [];
      this.tableRows = [];
    }
    await this.drawHeatmap(keep);  // first: the rest reads the whole run, which takes the server longer
    // A selection belongs to its run: it stays where this run has its module (or it is about the whole model).
    const held = selection && (!selection.module || this.holds(selection.module));
    this.selection = held ? selection : null;
    if (!held || other) {
      this.selectionLine.textContent = 'click a cell or a finding';
      delete this.selectionLine.dataset.module;
      delete this.selectionLine.dataset.step;
      this.heatmap.select(null, undefined);
      this.seriesTitle.textContent = 'Module';
      this.seriesLinks.replaceChildren();
      this.seriesDownloads.replaceChildren();
      this.seriesBox.replaceChildren(el('div', { class: 'empty' }, 'Click a row of the heatmap to see that module\'s statistics.'));
    }
    this.keep();
    const [findings, table, spikes] = await Promise.all([
      fetchJson('findings', this.query()), fetchJson('modules', this.query()), model.spikes ? fetchJson('spikes', this.query()) : null]);
    if (this.model !== model) return;
    this.analysis = { findings, table, spikes };
    this.findingsDownloads.replaceChildren(downloads('findings', this.query()));
    this.heatmap.marks = findings;
    this.heatmap.draw();
    this.summary.textContent = `${table.rows.length} modules · ${findings.length} finding${findings.length === 1 ? '' : 's'}`;
    this.showSampling();
    this.drawFindings();
    this.drawTable();
    this.drawSpikes();
    await Promise.all([this.drawAttention(), ...Object.values(this.tables).map((card) => card.show(this, keep))]);
    if (this.selection) await this.select(this.selection.module, this.selection.step, this.selection.finding, !keep);
    this.openTook = performance.now() - started;
    if (this.opening === model) this.opening = null;
  }

  // TensorBoard's own tab (`scalars`, `histograms`) with its tag filter `filter` and its run filter
  // showing this run alone (TensorBoard 2.21's `tagFilter` and `regexInput`: its `runSelectionState`
  // in a URL leaves the run list empty). It opens in a browser tab of its own: TensorBoard reads a
  // tab's filters from the URL when it first shows that tab, not when only the URL's hash changes.
  chartsUrl(tab, filter) {
    let url;
    try { url = new URL(window.parent.location.href); } catch { url = new URL('../../../', import.meta.url); }
    const run = `^${this.model.run.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}$`;
    url.hash = `${tab}&tagFilter=${encodeURIComponent(filter)}&regexInput=${encodeURIComponent(run)}`;
    return url.href;
  }

  // Links to the Scalars and Histograms charts of `name` (a module, or a parameter: its module's;
  // Histograms where the run holds some of them), or with '' to the Scalars of the whole model's
  // every-step series; null where none is known.
  chartLinks(name) {
    const table = this.analysis?.table;
    if (!table) return null;
    const owners = name ? table.rows.filter((r) => name === r.module || name.startsWith(`${r.module}.`)) : [];
    const row = owners.reduce((a, b) => (!a || b.module.length > a.module.length ? b : a), null);
    const filter = name ? row?.tag_filter : table.model_tag_filter;
    if (!filter) return null;
    const link = (tab, text) => el('a', {
      href: this.chartsUrl(tab, filter), target: '_blank', rel: 'noopener', class: 'tb-link', 'data-tab': tab,
      title: `TensorBoard's ${text} tab, filtered to ${name ? (row.module === name ? 'this module' : `${row.module}, this parameter's module`) : 'the whole model\'s series'}`,
      onclick: (event) => event.stopPropagation(),
    }, `${text} ↗`);
    return el('span', { class: 'tb-links' }, link('scalars', 'Scalars'), row?.histograms ? link('histograms', 'Histograms') : null);
  }

  // Whether the run shown has a module (or parameter) of that name.
  holds(module) {
    const names = this.doc?.modules || [];
    return names.includes(module) || names.some((m) => module.startsWith(`${m}.`) || m.startsWith(`${module}.`));
  }

  // Say where TensorBoard's sample is what the page shows (it keeps 1,000 values of a scalar tag by default).
  showSampling() {
    const parts = [];
    const table = this.analysis?.table;
    if (this.doc?.sampled || table?.sampled) {
      const steps = this.doc.steps;
      parts.push(`TensorBoard kept a sample of ${(table?.logged_steps ?? steps.length).toLocaleString()} of this run's logged steps (steps ${steps[0]} to ${steps[steps.length - 1]}, more were written): the heatmap shows them and the findings are judged on them.`);
    }
    this.sampling.style.display = parts.length ? '' : 'none';
    this.sampling.textContent = parts.length ? `${parts.join(' ')} tblog-hooks report reads every value; or start TensorBoard with --samples_per_plugin scalars=100000,tblog_hooks=100000.` : '';
    this.findingsHint.textContent = table?.sampled ? `judged on TensorBoard's sample of ${table.logged_steps.toLocaleString()} logged steps · click one (or Enter) to see its cell` : 'click one (or Enter) to see its cell';
  }

  // The chosen statistic's heatmap (and the compared run's beside it) on the steps of the range;
  // `keep`: the same view drawn again (a reload, a new range), which does not scroll the selected
  // row into view.
  async drawHeatmap(keep = false) {
    const model = this.model;
    const stat = this.statSelect.value;
    if (!stat) { this.heatTitle.textContent = 'No per-module statistics in this run'; return; }
    const other = this.compareModel();
    const compared = other && other !== model && other.stats.includes(stat);
    const [doc, otherDoc] = await Promise.all([
      fetchJson('heatmap', this.query({ tag: stat })),
      compared ? fetchJson('heatmap', { run: other.run, prefix: other.prefix, tag: stat }) : null]);
    if (this.model !== model || this.statSelect.value !== stat || this.compareModel() !== other) return;
    this.doc = doc;
    this.heatDownloads.replaceChildren(downloads('heatmap', this.query({ tag: stat })));
    const { doc: filteredDoc, invalid } = this.filtered(doc);
    this.filter.classList.toggle('invalid', invalid);
    this.filter.title = invalid ? 'not a regular expression: every row is shown' : '';
    // Side by side, both heatmaps share one step axis and one colour scale, so that a column is one
    // step and a colour one value in both.
    const every = otherDoc ? [...new Set([...doc.steps, ...otherDoc.steps])].sort((a, b) => a - b) : doc.steps;
    const steps = this.range ? every.filter((s) => this.inRange(s)) : every;
    const shown = onSteps(filteredDoc, steps);
    const otherShown = otherDoc && onSteps(this.filtered(otherDoc).doc, steps);
    const rows = shown.modules.length === doc.modules.length ? `${doc.modules.length}` : `${shown.modules.length} of ${doc.modules.length}`;
    const own = doc.steps.filter((s) => this.inRange(s)).length;
    const columns = this.range ? `${own} of ${doc.steps.length} · steps ${this.range.from} to ${this.range.to}` : `${doc.steps.length}`;
    this.rangeHint.textContent = this.range ? 'double-click for all steps' : 'drag across the steps to narrow them';
    this.heatTitle.textContent = `${stat} · ${rows} × ${columns}${invalid ? ' · invalid filter: every row shown' : ''}${doc.sampled ? ' · TensorBoard\'s sample of the steps' : ''}`;
    const scale = otherShown ? new Scale([...shown.values, ...otherShown.values], scaleOf(stat)) : null;
    this.heatmap.set(shown, stat, this.analysis ? this.analysis.findings : [], { scale, range: this.range });
    if (this.selection) this.heatmap.select(this.selection.module, this.selection.step, !keep);
    this.compareCard.style.display = other && other !== model ? '' : 'none';
    if (this.analysis) this.showSampling();
    if (other && other !== model) {
      this.compareTitle.textContent = compared ? `${other.name} · ${stat} · same step axis and colour scale` : `${other.name} holds no ${stat}`;
      import('./compare.js').then((m) => m.showDifference(this, otherShown && other, stat, shown, otherShown));
      if (otherShown) {
        this.compare.set(otherShown, stat, [], { scale, range: this.range });
        const found = await fetchJson('findings', { run: other.run, prefix: other.prefix }).catch(() => []);
        if (this.compare.doc === otherShown) { this.compare.marks = found; this.compare.draw(); }
      }
    }
  }

  // The rows of a heatmap document that the filter's regular expression matches (all when it is
  // empty or `invalid`).
  filtered(doc) {
    const pattern = this.filter.value.trim();
    let re = null;
    try { re = pattern ? new RegExp(pattern) : null; } catch { return { doc, invalid: true }; }
    if (!re) return { doc, invalid: false };
    const keep = doc.modules.map((m, i) => (re.test(m) ? i : -1)).filter((i) => i >= 0);
    return { doc: { ...doc, modules: keep.map((i) => doc.modules[i]), values: keep.map((i) => doc.values[i]) }, invalid: false };
  }

  // The findings at the steps of the range (all without one), the one selected marked.
  drawFindings() {
    const all = this.analysis.findings;
    const findings = all.filter((f) => this.inRange(f.step));
    this.findingsRange.textContent = this.range ? `${findings.length} of ${all.length} in steps ${this.range.from} to ${this.range.to}` : '';
    if (!findings.length) {
      const none = this.range && all.length ? `No findings in steps ${this.range.from} to ${this.range.to}.` : 'No findings: every rule stayed quiet.';
      this.findingsBox.replaceChildren(el('div', { class: 'empty' }, none));
      this.findingRows = [];
      return;
    }
    const body = el('tbody');
    this.findingRows = findings.map((f) => {
      const row = chooseable(el('tr', { 'data-module': f.module, 'data-step': f.step, onclick: () => this.select(f.module, f.step, f) },
        el('td', {}, el('span', { class: `kind ${f.kind}` }, f.kind)),
        el('td', { class: 'num' }, String(f.step)),
        el('td', { class: 'module' }, f.module || '(model)', this.chartLinks(f.module)),
        el('td', { class: 'num value', title: measureOf(f.kind).meaning }, format(f.value), el('span', { class: 'unit' }, measureOf(f.kind).label)),
        el('td', { class: 'message' }, f.message)));
      row.finding = f;
      row.classList.toggle('selected', sameFinding(f, this.selection?.finding));
      body.append(row);
      return row;
    });
    this.findingsBox.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ...['kind', 'step', 'module', 'value', 'message'].map((h) => el('th', {
        class: h === 'step' || h === 'value' ? 'num' : '',
        title: h === 'value' ? 'what the rule compared, which differs by kind (under each value; hover it for the sentence)' : '',
      }, h)))), body));
  }

  // Select `module` at `step` (from `finding`, when one was chosen); `reveal`: scroll its row of
  // the heatmap into view (a reload leaves the scroll as it is).
  async select(module, step, finding = undefined, reveal = true) {
    this.selection = { module, step, finding };
    this.selectionLine.textContent = !module ? `step ${step} (whole model)` : step === undefined ? module : `${module} · step ${step}`;
    this.selectionLine.dataset.module = module;
    this.selectionLine.dataset.step = step;
    for (const row of this.findingRows || []) row.classList.toggle('selected', sameFinding(row.finding, finding));
    for (const row of this.tableRows || []) row.classList.toggle('selected', row.dataset.module === module);
    this.heatmap.select(module, step, reveal);
    this.keep();
    if (module) await this.drawSeries(module, step);
  }

  async drawSeries(module, step) {
    const model = this.model;
    const doc = await fetchJson('series', this.query({ module }));
    if (this.model !== model || this.selection?.module !== module) return;
    hideTooltip();
    this.seriesTitle.textContent = `Module ${module}`;
    this.seriesLinks.replaceChildren(this.chartLinks(module) || '');
    this.seriesDownloads.replaceChildren(downloads('series', this.query({ module })));
    const marks = (this.analysis?.findings || []).filter((f) => f.module && (f.module === module || f.module.startsWith(`${module}.`))).map((f) => f.step);
    const width = Math.max(200, Math.floor((this.seriesBox.clientWidth - 40) / 2));  // two a row, room for a scrollbar
    const charts = doc.series.map((s) => {
      const title = s.name === module ? s.stat : `${s.stat} · ${s.name.slice(module.length + 1)}`;
      const chart = el('div', { class: 'chart', 'data-stat': s.stat, 'data-name': s.name }, el('div', { class: 'title', title: s.name }, title),
        lineChart({ steps: doc.steps, values: s.values, width, height: 110, log: positive(s.values) && scaleOf(s.stat) === 'log', marks, at: step, label: `${s.name} ${s.stat}` }));
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
      lineChart({ ...line, width, height: 160, log: positive(line.values) && scaleOf(name) === 'log', marks: spikes.spikes.filter((f) => f.kind === kind).map((f) => f.step), label: name }));
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
    const key = stats.join('\n');
    if (this.attentionMaps?.key !== key) {  // a map per statistic, kept while the runs shown hold the same ones
      const maps = stats.map(() => new Heatmap({ height: 260, onSelect: (m, s) => this.select(m, s) }));
      this.attentionMaps = { key, maps };
      this.attentionCard.replaceChildren(el('h2', {}, 'Attention', el('span', { class: 'hint' }, 'per module (the scaled_dot_product_attention calls inside it), over the logged steps')),
        el('div', { class: 'charts wide' }, ...maps.map((map, i) => el('div', { class: 'chart' }, el('div', { class: 'title' }, stats[i]), map.node))));
    }
    const marks = this.analysis.findings.filter((f) => f.kind.startsWith('attention_'));
    this.attentionMaps.maps.forEach((map, i) => map.set(docs[i], stats[i], marks));
  }

  // The module table sorted by the column `sortBy` (`null`: forward order), `up` or down; the sort
  // chosen stays when the table is drawn again (a reload).
  drawTable(sortBy = this.tableSort?.by ?? null, up = this.tableSort?.up ?? false) {
    const { table } = this.analysis;
    const columns = ['module', 'findings', ...table.stats];
    if (!columns.includes(sortBy)) sortBy = null;
    this.tableSort = { by: sortBy, up };
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
      const th = chooseable(el('th', { class: c === 'module' || c === 'findings' ? '' : 'num', onclick: () => this.drawTable(c, sortBy === c ? !up : c === 'module') }, c));
      if (c === sortBy) th.classList.add('sorted', ...(up ? ['up'] : []));
      return th;
    }));
    this.tableRows = rows.map((row) => chooseable(el('tr', { 'data-module': row.module, onclick: () => this.select(row.module, undefined) },
      el('td', {}, row.module, this.chartLinks(row.module)),
      el('td', {}, ...row.findings.map((k) => el('span', { class: `kind ${k}` }, k))),
      ...table.stats.map((s) => {
        const v = row.values[s];
        return el('td', { class: `num${isValue(v) && !finite(v) ? ' bad' : ''}` }, format(v));
      }))));
    this.tableBox.replaceChildren(el('table', {}, el('thead', {}, head), el('tbody', {}, ...this.tableRows)));
  }
}

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

// For the difference view (compare.js), which draws with the same pieces.
export { Heatmap, Scale, el, escapeHtml, fetchJson, format, legend, showTooltip };
