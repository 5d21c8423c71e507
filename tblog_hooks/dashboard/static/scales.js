/**
 * @file Colour scales: viridis and the colours of zero, non-finite and missing cells, the
 * `Scale` a map colours its values with, and the server's table of how each statistic is drawn.
 */

import { distinct, finite, isValue } from './values.js';

// Viridis, 9 stops: perceptually even, readable in grey, distinct from the red of non-finite cells.
export const VIRIDIS = ['#440154', '#472d7b', '#3b528b', '#2c728e', '#21918c', '#28ae80', '#5ec962', '#addc30', '#fde725']
  .map((h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)));
export const NONFINITE_RGB = [211, 47, 47];
export const ZERO_RGB = [189, 189, 189];
export const NONE_RGB = [255, 255, 255];

function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * f));
}

// How a statistic is drawn, from the table the server sends (`scales`: `log`, `linear` or
// `fraction`, by statistic name: `dead_frac`, `underflow_fp16`, `entropy`); `useScales` sets it
// when the page starts.
let SCALES = { default: 'log' };
export const useScales = (table) => { SCALES = table; };
export const scaleOf = (stat) => SCALES[stat.slice(stat.indexOf('/') + 1)] || SCALES.default;

// A colour scale over the finite values of a statistic of scale `kind`: `log` is log10 where they
// are all >= 0 (zeros get their own colour) and linear where some are negative; `linear` is linear
// over the values; `fraction` is linear from 0 to 1.
export class Scale {
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
