// zserve's web console: the cluster's processes and a chat playground, through the same public API as any client.
// Keys typed here live in this tab's sessionStorage only. All URLs are relative, so the page works behind a proxy
// that adds a path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = window.sessionStorage;
const POLL_MS = 2000;

// -- keys ---------------------------------------------------------------------------------------------------------
for (const id of ["api-key", "admin-key"]) {
  $(id).value = STORE.getItem(id) || "";
  $(id).addEventListener("input", () => { STORE.setItem(id, $(id).value); refreshCluster(); });
}
$("keys").addEventListener("submit", (e) => e.preventDefault());

function headers(admin) {
  const key = (admin && $("admin-key").value) || $("api-key").value;
  const h = {"Content-Type": "application/json"};
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The API's own error message (OpenAI's shape: {"error": {"message"}}), else the status line.
async function apiError(r) {
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    if (body && body.error) message = `${r.status}: ${body.error.message || body.error}`;
  } catch (_) { /* not JSON */ }
  return message;
}

async function getJSON(path, admin) {
  const r = await fetch(path, {headers: headers(admin)});
  if (!r.ok) throw new Error(await apiError(r));
  return r.json();
}

function show(el, message) {
  el.textContent = message || "";
  el.hidden = !message;
}

// -- tabs -----------------------------------------------------------------------------------------------------------
const tabs = [$("tab-cluster"), $("tab-playground")];
function select(tab) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  STORE.setItem("tab", tab.id);
  if (tab.id === "tab-playground") loadModels();
  else { refreshCluster(); refreshLoad(); }
}
tabs.forEach((t, i) => {
  t.addEventListener("click", () => select(t));
  t.addEventListener("keydown", (e) => {  // arrow keys move between tabs, as the ARIA tabs pattern does
    if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
    const next = tabs[(i + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length];
    next.focus();
    select(next);
  });
});

// -- cluster ------------------------------------------------------------------------------------------------------
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === undefined || text === null ? "–" : String(text);
  if (cls) td.className = cls;
  return td;
}

function duration(s) {
  if (s === undefined || s === null) return "–";
  if (s < 120) return `${Math.round(s)}s`;
  if (s < 7200) return `${Math.round(s / 60)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}

function load(p) {
  if (p.endpoint) return `at ${p.endpoint}`;
  if (p.tier !== "engine") return `in flight ${p.in_flight ?? "–"}`;
  const kv = p.kv_used === undefined || p.kv_used === null ? "–" : `${Math.round(p.kv_used * 100)}%`;
  let text = `running ${p.running ?? "–"} · waiting ${p.waiting ?? "–"} · KV ${kv}`;
  if (p.loras && p.loras.length) text += ` · adapters ${p.loras.join(", ")}`;
  if (p.sleeping) text += ` · asleep (level ${p.sleeping})`;
  if (p.weight_version && p.weight_version !== "default") text += ` · weights ${p.weight_version}`;
  return text;
}

function card(label, value, wide) {
  const div = document.createElement("div");
  div.className = wide ? "card wide" : "card";
  const b = document.createElement("b");
  b.textContent = value;
  const span = document.createElement("span");
  span.textContent = label;
  div.append(b, span);
  return div;
}

let clusterTimer = null;
async function refreshCluster() {
  clearTimeout(clusterTimer);
  clusterTimer = setTimeout(refreshCluster, POLL_MS);
  if ($("view-cluster").hidden) return;
  let info, status;
  try {
    [info, status] = await Promise.all([getJSON("server_info", true), getJSON("status", false)]);
  } catch (e) {
    show($("cluster-error"), e.message);
    $("actions").hidden = true;
    return;
  }
  show($("cluster-error"), info.supervisor_error || "");
  lastServerInfo = info;
  showActions(info);
  const sup = info.supervisor || {};
  const procs = info.processes || [];
  const summary = $("summary");
  summary.replaceChildren(
    card("version", info.version),
    card("models", info.models.map((m) => m.id).join(", "), true),
    card("gateways", `${procs.filter((p) => p.tier === "gateway" && p.state === "ready").length}`
      + ` / ${sup.desired ? sup.desired.gateway : "–"}`),
    card("engines", `${procs.filter((p) => p.tier === "engine" && p.state === "ready").length}`
      + ` / ${sup.desired ? sup.desired.engine : "–"}`),
    card("in flight here", String(status.in_flight)),
    card("state", status.paused ? "paused" : (status.draining ? "draining" : "serving")),
    // An expert-parallel model's group: its members, generation and the phase of a resize under way.
    ...Object.entries(sup.expert_parallel || {}).map(([model, g]) => card(`expert parallel ${model}`,
      `${g.size} members · gen ${g.generation} · ${g.phase || "serving"}`, true)),
  );
  const rows = procs.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.tier = p.tier;
    tr.dataset.index = p.index;
    const state = p.crash_looping ? `crash-looping (${p.last_exit || "?"})` : p.state;
    tr.append(cell(p.tier), cell(p.index), cell(p.model || ""), cell(p.pid || "–"),
      cell(state, "state-" + (p.crash_looping ? "failed" : p.state)), cell(p.restarts), cell(duration(p.uptime_s)),
      cell(load(p)));
    return tr;
  });
  $("processes").tBodies[0].replaceChildren(...rows);
  const holds = status.holds || [];
  $("holds").replaceChildren(...(holds.length ? holds : [null]).map((h) => {
    const li = document.createElement("li");
    if (!h) { li.className = "muted"; li.textContent = "none"; return li; }
    li.textContent = `${h.model || "every model"}: ${h.reason}${h.detail ? " — " + h.detail : ""}`;
    return li;
  }));
  $("updated").textContent = "Last update " + new Date().toLocaleTimeString() + ".";
}

// -- admin actions: scale a tier, pause and resume admission ----------------------------------------------------------
let pending = null;  // the scale under way: {tier, model, count, since}

function fillSelect(select, options) {  // [value, label] pairs; the choice is kept when it is still offered
  const chosen = select.value;
  if ([...select.options].map((o) => o.value).join() === options.map(([v]) => v).join()) return;
  select.replaceChildren(...options.map(([value, label]) => {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = label;
    return o;
  }));
  if (options.some(([v]) => v === chosen)) select.value = chosen;
}

function showActions(info) {
  // Shown with an admin key typed, or when the server answered /server_info with no key at all (it has none).
  const open = !$("admin-key").value && !$("api-key").value;
  $("actions").hidden = !($("admin-key").value || open);
  const models = info.models.map((m) => m.id);
  fillSelect($("scale-tier"), [["gateway", "gateways"], ...models.map((m) => [`engine:${m}`, `engines of ${m}`])]);
  fillSelect($("pause-model"), [["", "every model"], ...models.map((m) => [m, m])]);
  const procs = info.processes || [];
  if (!$("scale-count").value) {
    $("scale-count").value = procs.filter((p) => p.tier === "gateway").length || 1;
  }
  reloadProgress(procs);
  if (pending) {
    const mine = procs.filter((p) => p.tier === pending.tier && (pending.tier === "gateway" || p.model === pending.model));
    const ready = mine.filter((p) => p.state === "ready").length;
    const what = pending.tier === "gateway" ? "gateways" : `engines of ${pending.model}`;
    const seconds = ((Date.now() - pending.since) / 1000).toFixed(0);
    if (ready === pending.count && mine.length === pending.count) {
      status(`${what}: ${pending.count} ready, done in ${seconds} s`);
      pending = null;
    } else {
      status(`scaling ${what} to ${pending.count}: ${ready} ready of ${mine.length} (${seconds} s)`);
    }
  }
}

function status(message, error) {
  const el = $("action-status");
  el.textContent = message;
  el.classList.toggle("error", Boolean(error));
}

async function post(path, body) {
  const r = await fetch(path, {method: "POST", headers: headers(true), body: JSON.stringify(body)});
  if (!r.ok) throw new Error(await apiError(r));
  return r.json();
}

$("scale-tier").addEventListener("change", () => {
  const [tier, model] = $("scale-tier").value.split(/:(.*)/s);
  const procs = (lastServerInfo && lastServerInfo.processes) || [];
  $("scale-count").value = procs.filter((p) => p.tier === tier && (tier === "gateway" || p.model === model)).length || 1;
});

$("scale-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const [tier, model] = $("scale-tier").value.split(/:(.*)/s);
  const count = Number($("scale-count").value);
  const what = tier === "gateway" ? "the gateways" : `the engines of ${model}`;
  if (!window.confirm(`Scale ${what} to ${count}?`)) return;
  try {
    await post("scale", tier === "gateway" ? {tier, count} : {tier, count, model});
    pending = {tier, model, count, since: Date.now()};
    status(`scaling ${what} to ${count}…`);
    refreshCluster();
  } catch (err) {
    status(err.message, true);
  }
});

let reloading = null;  // the rolling restart under way: {pids: {tier/index: pid}, since}

$("reload-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  if (!window.confirm("Replace every process, one at a time (a rolling restart)?")) return;
  const procs = (lastServerInfo && lastServerInfo.processes) || [];
  try {
    const r = await fetch("reload", {method: "POST", headers: headers(true), body: "{}"});
    if (!r.ok) throw new Error(await apiError(r));
    reloading = {pids: Object.fromEntries(procs.map((p) => [`${p.tier}/${p.index}`, p.pid])), since: Date.now()};
    status("rolling restart: started");
  } catch (err) {
    status(err.message, true);
  }
});

// A rolling restart's progress: how many of the processes it found are running again as new ones.
function reloadProgress(procs) {
  if (!reloading) return;
  const keys = Object.keys(reloading.pids);
  const now = Object.fromEntries(procs.map((p) => [`${p.tier}/${p.index}`, p]));
  const done = keys.filter((k) => now[k] && now[k].pid !== reloading.pids[k] && now[k].state === "ready").length;
  const seconds = ((Date.now() - reloading.since) / 1000).toFixed(0);
  if (done === keys.length) {
    status(`rolling restart: ${done} processes replaced, done in ${seconds} s`);
    reloading = null;
  } else {
    status(`rolling restart: ${done} of ${keys.length} processes replaced (${seconds} s)`);
  }
}

async function admission(pause) {
  const model = $("pause-model").value;
  const what = model || "every model";
  if (!window.confirm(`${pause ? "Pause" : "Resume"} admission of ${what}?`)) return;
  try {
    const r = await post(pause ? "pause" : "resume", model ? {model} : {});
    const late = r.unacknowledged && r.unacknowledged.length ? ` (not yet applied by ${r.unacknowledged.join(", ")})` : "";
    status(`${pause ? "paused" : "resumed"}: ${what}, on every gateway${late}`);
    refreshCluster();
  } catch (err) {
    status(err.message, true);
  }
}
$("pause-form").addEventListener("submit", (e) => { e.preventDefault(); admission(true); });
$("resume").addEventListener("click", () => admission(false));

// -- load: the charts and the models table, from /ui/api/series ------------------------------------------------------
const SERIES_MS = 1000;
const WINDOW_S = 300;
const COLORS = ["#2f6fdf", "#d9822b", "#1f9d55", "#b3261e", "#8e44ad", "#607d8b"];
let samples = [];
let lastServerInfo = null;

// One line chart: ``lines`` is [{name, values: [[t, v], ...]}]; y from 0 to the largest value, x the last WINDOW_S.
function chart(id, lines, format) {
  const fig = $(id);
  const svg = fig.querySelector("svg");
  const w = svg.clientWidth || 320, h = svg.clientHeight || 110, left = 40, bottom = 4, top = 6;
  const now = Date.now() / 1000;
  let max = 0;
  for (const l of lines) for (const [, v] of l.values) if (v !== null && v > max) max = v;
  max = max > 0 ? max * 1.1 : 1;
  const x = (t) => left + (w - left - 2) * (1 - (now - t) / WINDOW_S);
  const y = (v) => top + (h - top - bottom) * (1 - v / max);
  const ns = "http://www.w3.org/2000/svg";
  const parts = [];
  for (const frac of [0, 0.5, 1]) {
    const gy = y(max * frac);
    const line = document.createElementNS(ns, "line");
    Object.entries({x1: left, x2: w, y1: gy, y2: gy, class: "grid"}).forEach(([k, v]) => line.setAttribute(k, v));
    const label = document.createElementNS(ns, "text");
    Object.entries({x: left - 4, y: gy + 3, "text-anchor": "end"}).forEach(([k, v]) => label.setAttribute(k, v));
    label.textContent = format(max * frac);
    parts.push(line, label);
  }
  lines.forEach((l, i) => {
    const points = l.values.filter(([t, v]) => v !== null && now - t <= WINDOW_S).map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    if (!points.length) return;
    const pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", points.join(" "));
    pl.setAttribute("stroke", COLORS[i % COLORS.length]);
    const title = document.createElementNS(ns, "title");
    title.textContent = l.name;
    pl.append(title);
    parts.push(pl);
  });
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren(...parts);
  // The latest value of each line, in its color, beside the caption.
  let legend = fig.querySelector(".now");
  if (!legend) {
    legend = document.createElement("span");
    legend.className = "now";
    fig.querySelector("figcaption").append(legend);
  }
  legend.replaceChildren(...lines.map((l, i) => {
    const span = document.createElement("span");
    const last = l.values.length ? l.values[l.values.length - 1][1] : null;
    span.style.color = COLORS[i % COLORS.length];
    span.textContent = ` ${l.name} ${last === null || last === undefined ? "–" : format(last)}`;
    return span;
  }));
}

const number = (v) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2));
const ms = (v) => number(v * 1000);

function drawLoad() {
  const pick = (key) => samples.map((p) => [p.t, p[key] === undefined ? null : p[key]]);
  chart("chart-requests", [{name: "req/s", values: pick("requests_per_s")}], number);
  chart("chart-tokens", [{name: "tok/s", values: pick("tokens_per_s")}], number);
  chart("chart-ttft", [{name: "p50", values: pick("ttft_p50")}, {name: "p99", values: pick("ttft_p99")}], ms);
  chart("chart-itl", [{name: "p50", values: pick("itl_p50")}, {name: "p99", values: pick("itl_p99")}], ms);
  chart("chart-queue", [{name: "running", values: pick("running")}, {name: "waiting", values: pick("waiting")}],
    (v) => v.toFixed(0));
  const codes = [...new Set(samples.flatMap((p) => Object.keys(p.errors_per_s || {})))].sort();
  chart("chart-errors", (codes.length ? codes : ["none"]).map((c) => ({name: c,
    values: samples.map((p) => [p.t, (p.errors_per_s || {})[c] || 0])})), number);
  const latest = samples.length ? samples[samples.length - 1].models : {};
  const adapters = {};
  for (const m of (lastServerInfo && lastServerInfo.models) || []) adapters[m.id] = m.loras || [];
  const names = [...new Set([...Object.keys(adapters), ...Object.keys(latest)])];
  $("models").tBodies[0].replaceChildren(...names.map((name) => {
    const m = latest[name] || {};
    const tr = document.createElement("tr");
    tr.dataset.model = name;
    const pct = (v) => (v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`);
    tr.append(cell(name), cell(m.engines), cell(m.running), cell(m.waiting), cell(pct(m.kv_used)),
      cell(m.tokens_per_s === undefined ? "–" : number(m.tokens_per_s)), cell(pct(m.prefix_hit_rate)),
      cell((adapters[name] || []).join(", ") || "–"));
    return tr;
  }));
}

let seriesTimer = null;
async function refreshLoad() {
  clearTimeout(seriesTimer);
  seriesTimer = setTimeout(refreshLoad, SERIES_MS);
  if ($("view-cluster").hidden) return;
  const since = samples.length ? samples[samples.length - 1].t : 0;
  let body;
  try {
    body = await getJSON(`ui/api/series?since=${since}`, false);
  } catch (e) {
    show($("cluster-error"), e.message);
    return;
  }
  samples = samples.concat(body.samples).filter((p) => Date.now() / 1000 - p.t <= WINDOW_S);
  drawLoad();
}

// -- playground -----------------------------------------------------------------------------------------------------
let conversation = [];
let controller = null;

// Each mode's models: chat with those that generate (an adapter's entry generates as its base does), embeddings and
// rerank with those that embed or score.
const MODES = {chat: ["chat-form", "model", (t) => t.includes("generate")],
               embed: ["embed-form", "embed-model", (t) => t.includes("embed")],
               rerank: ["rerank-form", "rerank-model", (t) => t.includes("embed") || t.includes("score")]};

async function loadModels() {
  try {
    const body = await getJSON("v1/models", false);
    for (const [, select, fits] of Object.values(MODES)) {
      const chosen = $(select).value || STORE.getItem(select);
      fillSelect($(select), body.data.filter((m) => fits(m.tasks || ["generate"])).map((m) => [m.id, m.id]));
      if (chosen && [...$(select).options].some((o) => o.value === chosen)) $(select).value = chosen;
    }
    show($("chat-error"), "");
  } catch (e) {
    show($("chat-error"), e.message);
  }
}
for (const [, select] of Object.values(MODES)) {
  $(select).addEventListener("change", () => STORE.setItem(select, $(select).value));
}

function setMode(mode) {
  for (const [name, [form]] of Object.entries(MODES)) $(form).hidden = name !== mode;
  STORE.setItem("mode", mode);
  show($("chat-error"), "");
}
document.querySelectorAll('input[name="mode"]').forEach((r) => {
  r.addEventListener("change", () => r.checked && setMode(r.value));
  if (r.value === (STORE.getItem("mode") || "chat")) { r.checked = true; setMode(r.value); }
});

const lines = (id) => $(id).value.split("\n").map((l) => l.trim()).filter(Boolean);

$("embed-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const texts = lines("embed-texts");
  if (!texts.length) return;
  const start = performance.now();
  try {
    const r = await fetch("v1/embeddings", {method: "POST", headers: headers(false),
      body: JSON.stringify({model: $("embed-model").value, input: texts})});
    if (!r.ok) throw new Error(await apiError(r));
    const body = await r.json();
    const vectors = body.data.sort((a, b) => a.index - b.index).map((d) => d.embedding);
    const norm = (v) => Math.sqrt(v.reduce((a, x) => a + x * x, 0)) || 1;
    const cos = (a, b) => a.reduce((acc, x, i) => acc + x * b[i], 0) / (norm(a) * norm(b));
    $("embed-stats").textContent = `${vectors.length} vectors of ${vectors[0].length} dimensions · `
      + `${body.usage ? body.usage.prompt_tokens : "–"} tokens · ${Math.round(performance.now() - start)} ms · `
      + "cosine similarity of each pair:";
    const head = document.createElement("tr");
    head.append(document.createElement("th"), ...texts.map((_, j) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = `#${j + 1}`;
      return th;
    }));
    $("similarity").replaceChildren(head, ...texts.map((t, i) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = `#${i + 1} ${t}`;
      th.title = t;
      tr.append(th, ...vectors.map((v) => cell(cos(vectors[i], v).toFixed(3))));
      return tr;
    }));
    show($("chat-error"), "");
  } catch (err) {
    show($("chat-error"), err.message);
  }
});

$("rerank-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const documents = lines("rerank-docs");
  if (!documents.length || !$("rerank-query").value.trim()) return;
  try {
    const r = await fetch("rerank", {method: "POST", headers: headers(false),
      body: JSON.stringify({model: $("rerank-model").value, query: $("rerank-query").value, documents})});
    if (!r.ok) throw new Error(await apiError(r));
    const results = (await r.json()).results.sort((a, b) => b.relevance_score - a.relevance_score);
    const top = Math.max(...results.map((x) => x.relevance_score), 1e-9);
    $("ranking").replaceChildren(...results.map((x) => {
      const li = document.createElement("li");
      li.textContent = `${documents[x.index]} — ${x.relevance_score.toFixed(3)}`;
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.max(0, x.relevance_score / top) * 100}%`;
      li.append(bar);
      return li;
    }));
    show($("chat-error"), "");
  } catch (err) {
    show($("chat-error"), err.message);
  }
});

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  div.append(who, body);
  $("transcript").append(div);
  div.scrollIntoView({block: "end"});
  return body;
}

function requestBody() {
  const body = {
    model: $("model").value,
    messages: [...($("system").value.trim() ? [{role: "system", content: $("system").value}] : []), ...conversation],
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: {include_usage: true},
  };
  const tools = $("tools").value.trim();
  if (tools) {
    try { body.tools = JSON.parse(tools); } catch (e) { throw new Error("the tools are not JSON: " + e.message); }
  }
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error("the JSON schema is not JSON: " + e.message); }
    body.response_format = {type: "json_schema", json_schema: {name: "console", schema: parsed, strict: true}};
  }
  return body;
}

// Server-sent events as the OpenAI API streams them: "data: {json}" lines, then "data: [DONE]".
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send() {
  const text = $("message").value;
  if (!text.trim() || controller) return;
  let body;
  conversation.push({role: "user", content: text});
  try {
    body = requestBody();
  } catch (e) {
    conversation.pop();
    show($("chat-error"), e.message);
    return;
  }
  show($("chat-error"), "");
  $("message").value = "";
  bubble("user", text);
  const reasoning = bubble("reasoning", "");
  reasoning.parentElement.hidden = true;
  const answer = bubble("assistant", "");
  const calls = bubble("tool-calls", "");
  calls.parentElement.hidden = true;
  const toolCalls = [];
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let first = null;
  let usage = null;
  let content = "";
  try {
    const r = await fetch("v1/chat/completions", {method: "POST", headers: headers(false),
      body: JSON.stringify(body), signal: controller.signal});
    if (!r.ok) throw new Error(await apiError(r));
    for await (const chunk of events(r)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (first === null && (d.content || d.reasoning_content || d.tool_calls)) first = performance.now();
        if (d.reasoning_content) {
          reasoning.parentElement.hidden = false;
          reasoning.textContent += d.reasoning_content;
        }
        if (d.content) {
          content += d.content;
          answer.textContent = content;
        }
        for (const t of d.tool_calls || []) {  // pieces of calls, by index: name first, arguments in parts
          const call = toolCalls[t.index] || (toolCalls[t.index] = {name: "", arguments: ""});
          if (t.function && t.function.name) call.name = t.function.name;
          if (t.function && t.function.arguments) call.arguments += t.function.arguments;
          calls.parentElement.hidden = false;
          calls.textContent = toolCalls.map((c) => `${c.name}(${c.arguments})`).join("\n");
        }
        answer.parentElement.scrollIntoView({block: "end"});
      }
    }
    conversation.push({role: "assistant", content});
  } catch (e) {
    conversation.pop();
    answer.parentElement.remove();
    if (e.name !== "AbortError") show($("chat-error"), e.message);
  } finally {
    const end = performance.now();
    if (usage) {
      const decode = first !== null && usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / ((end - first) / 1000) : null;
      $("stats").textContent = `${usage.completion_tokens} tokens · first after ${first === null ? "–" : Math.round(first - start) + " ms"}`
        + ` · ${decode === null ? "–" : decode.toFixed(1)} tokens/s · prompt ${usage.prompt_tokens} tokens`;
    }
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  conversation = [];
  $("transcript").replaceChildren();
  $("stats").textContent = "";
});

select($(STORE.getItem("tab") || "tab-cluster") || tabs[0]);
