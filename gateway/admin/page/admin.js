// The admin page: every call goes to this gateway's /admin API with the admin key the user
// typed, kept in this tab's sessionStorage only. No framework, no build step, nothing fetched
// from elsewhere; the usage chart is drawn as inline SVG.
"use strict";

const KEY_SLOT = "sluice-admin-key";
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function notice(text) { $("notice").textContent = text || ""; }

async function api(method, path, body) {
  const headers = { Authorization: "Bearer " + sessionStorage.getItem(KEY_SLOT) };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error((data.error && data.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return data;
}

function cell(row, content) {
  const td = row.insertCell();
  if (content instanceof Node) td.append(content); else td.textContent = content;
  return td;
}

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

function renderTenants(tenants) {
  const body = $("tenants");
  body.replaceChildren();
  for (const t of tenants) {
    const row = body.insertRow();
    row.dataset.tenant = t.name;
    cell(row, t.name);
    const { object, name, keys, ...fields } = t;
    const pre = document.createElement("pre");
    pre.textContent = Object.keys(fields).length ? JSON.stringify(fields, null, 1) : "(no limits)";
    cell(row, pre);
    const list = document.createElement("ul");
    for (const k of keys) {
      const item = document.createElement("li");
      item.dataset.key = k.id;
      item.append(k.id + " ", button("Revoke", "revoke", () => revokeKey(k.id)));
      list.append(item);
    }
    cell(row, list);
    cell(row, button("New key", "new-key", () => newKey(t.name)));
  }
}

async function newKey(tenant) {
  try {
    const made = await api("POST", `/admin/tenants/${encodeURIComponent(tenant)}/keys`);
    $("new-key-tenant").textContent = tenant;
    $("new-key").textContent = made.key; // shown once; never stored by the page
    $("new-key-box").hidden = false;
    await refresh();
  } catch (e) { notice(e.message); }
}

async function revokeKey(id) {
  if (!confirm(`Revoke ${id}? Clients using it are refused at once.`)) return;
  try { await api("DELETE", `/admin/keys/${encodeURIComponent(id)}`); await refresh(); }
  catch (e) { notice(e.message); }
}

function svg(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Tokens per day as bars; spend per day as a line on its own scale, where any day has a cost.
function renderChart(rows) {
  const days = new Map();
  for (const r of rows) {
    const d = days.get(r.day) || { tokens: 0, cost: null };
    d.tokens += r.total_tokens;
    if (r.cost !== null) d.cost = (d.cost || 0) + r.cost;
    days.set(r.day, d);
  }
  const entries = [...days.entries()].sort();
  const W = 900, H = 200, pad = 30;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H + 20}`, role: "img" });
  chart.append(svg("title", {}, "Tokens (bars) and spend (line) per day"));
  const maxTokens = Math.max(1, ...entries.map(([, d]) => d.tokens));
  const maxCost = Math.max(0, ...entries.map(([, d]) => d.cost || 0));
  const step = (W - pad) / Math.max(1, entries.length);
  const points = [];
  entries.forEach(([day, d], i) => {
    const h = (d.tokens / maxTokens) * (H - pad);
    const x = pad + i * step;
    const bar = svg("rect", { class: "bar", x, y: H - h, width: Math.min(step * 0.7, 48), height: h });
    bar.append(svg("title", {}, `${day}: ${d.tokens} tokens` + (d.cost === null ? "" : `, ${d.cost}`)));
    chart.append(bar, svg("text", { class: "axis", x, y: H + 14 }, day.slice(5)));
    if (maxCost > 0) points.push(`${x + Math.min(step * 0.35, 24)},${H - ((d.cost || 0) / maxCost) * (H - pad)}`);
  });
  chart.append(svg("text", { class: "axis", x: 2, y: 12 }, `${maxTokens} tokens`));
  if (points.length) chart.append(svg("polyline", { class: "cost", points: points.join(" ") }));
  $("usage-chart").replaceChildren(chart);
}

function renderUsage(rows) {
  const body = $("usage");
  body.replaceChildren();
  for (const r of rows) {
    const row = body.insertRow();
    for (const v of [r.day, r.tenant, r.model, r.runs, r.total_tokens, r.cost ?? "–"]) cell(row, String(v));
  }
  renderChart(rows);
}

function renderAudit(records) {
  const list = $("audit");
  list.replaceChildren();
  for (const r of records.slice(-50).reverse()) {
    const item = document.createElement("li");
    item.textContent = `${r.at} ${r.who} ${r.action} ${r.target} ` +
      `${JSON.stringify(r.before)} → ${JSON.stringify(r.after)}`;
    list.append(item);
  }
}

async function refresh() {
  const [tenants, usage, audit] = await Promise.all([
    api("GET", "/admin/tenants").catch((e) => (e.status === 409 ? { data: [] } : Promise.reject(e))),
    api("GET", "/admin/usage?group_by=day&since=30d"),
    api("GET", "/admin/audit?since=7d"),
  ]);
  renderTenants(tenants.data);
  renderUsage(usage.data);
  renderAudit(audit.data);
}

async function signIn() {
  try {
    await refresh();
    notice("");
    $("console").hidden = false;
  } catch (e) {
    $("console").hidden = true;
    notice(e.status === 401 || e.status === 403 ? "That key is not an admin key." : e.message);
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_SLOT, $("admin-key").value.trim());
  $("admin-key").value = "";
  signIn();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_SLOT);
  $("console").hidden = true;
});
$("new-tenant").addEventListener("submit", async (event) => {
  event.preventDefault();
  try {
    await api("POST", "/admin/tenants", { name: $("new-tenant-name").value.trim() });
    $("new-tenant-name").value = "";
    await refresh();
  } catch (e) { notice(e.message); }
});
$("new-key-done").addEventListener("click", () => {
  $("new-key").textContent = "";
  $("new-key-box").hidden = true;
});
$("refresh").addEventListener("click", () => refresh().catch((e) => notice(e.message)));
if (sessionStorage.getItem(KEY_SLOT)) signIn();
