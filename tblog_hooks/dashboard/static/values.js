/**
 * @file Values as the tab writes them: whether a value is there and finite (the server sends
 * NaN and the infinities as strings, no value as null), and numbers with as many digits as they need.
 */

export const isValue = (v) => v !== null && v !== undefined;
export const finite = (v) => typeof v === 'number' && Number.isFinite(v);

export function format(v, digits = 4) {
  if (!isValue(v)) return '–';
  if (typeof v === 'string') return v;
  if (v === 0) return '0';
  const a = Math.abs(v);
  return a >= 1e5 || a < 1e-3 ? v.toExponential(digits - 1) : String(+v.toPrecision(digits));
}

// Labels of the values at positions `ts`, with as many digits as they need to differ.
export function distinct(ts, valueAt) {
  for (let digits = 4; digits <= 12; digits++) {
    const labels = ts.map((t) => format(valueAt(t), digits));
    if (new Set(labels).size === labels.length || digits === 12) return ts.map((t, i) => [t, labels[i]]);
  }
  return [];
}
