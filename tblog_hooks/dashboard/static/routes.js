/**
 * @file The plugin's routes (docs/dashboard.md), relative to this module's own URL: their JSON
 * read, the requests in flight counted, and the links that download a route's answer.
 */

import { el } from './dom.js';

export const route = (name, query = {}) => {
  const url = new URL(`./${name}`, import.meta.url);
  for (const [key, value] of Object.entries(query)) if (value !== undefined) url.searchParams.set(key, value);
  return url;
};

// The plugin's requests in flight (for scripts and the browser tests: a browser reload while none is
// aborts nothing).
export const requests = { pending: 0 };

export async function fetchJson(name, query) {
  requests.pending += 1;
  try {
    const response = await fetch(route(name, query));
    if (!response.ok) throw new Error(`${name}: ${response.status} ${await response.text()}`);
    return await response.json();
  } finally {
    requests.pending -= 1;
  }
}

// Links that download what a view shows: the route `name`'s answer to `query` as CSV and as JSON.
export function downloads(name, query) {
  return el('span', { class: 'downloads', 'data-route': name }, 'download',
    ...['csv', 'json'].map((format) => el('a', { href: route(name, { ...query, format }).href, download: '', 'data-format': format }, format.toUpperCase())));
}
