// The rdzv web view: polls /api/runs and /api/run/<id> and draws the page (no library, no
// request to another host). Text from the store is always set as text, never as HTML.
"use strict";

const POLL_MS = 500;
const RUNS_EVERY = 4;           // the run list: every 4th poll
const MAX_EVENTS = 5000;        // events kept in the page
const MAX_SAMPLES = 5000;       // world-size samples kept in the page
const SVG = "http://www.w3.org/2000/svg";

// Each kind of event: its colour on the chart and in the table.
const KIND_COLOURS = {
  round_formed: "#2f6fde", node_waiting: "#1f9d55", spare_waiting: "#1f9d55",
  node_leaving: "#d58a00", node_lost: "#d64545", node_refused: "#d64545",
  workers_started: "#8a94a3", workers_restarted: "#d58a00",
  worker_failed: "#d64545", training_paused: "#d58a00", switched_in_process: "#7a4fd0",
  recovered_in_process: "#7a4fd0", run_closed: "#1d2430", worker_hung: "#d64545",
  straggler_flagged: "#d58a00", straggler_cleared: "#1f9d55", straggler_replaced: "#d58a00",
};
const LOSS_REASONS = new Set(["connection_lost", "heartbeat_missed"]);
// Events drawn across the chart; the others (workers started, pauses...) as ticks at its foot.
const MAJOR = new Set(["round_formed", "node_waiting", "spare_waiting", "node_leaving",
  "node_lost", "node_refused", "worker_failed", "workers_restarted", "worker_hung",
  "straggler_replaced", "run_closed"]);

const view = { runs: [], selected: null, events: [], nextSeq: 0, samples: [], tick: 0,
  status: null, shownEvents: -1 };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "colour") node.style.background = v;  // (CSSOM: the CSP forbids style="")
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : String(child));
    }
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function clock(t) {
  return typeof t === "number" ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "?";
}
function seconds(s) {
  if (typeof s !== "number" || !isFinite(s)) return "?";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(s < 10 ? 2 : 0)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

// What the JSON holds may be missing or odd (an old server, a hand-written event): read it
// through these, so that the page draws what it can and keeps polling.
function obj(v) { return v !== null && typeof v === "object" && !Array.isArray(v) ? v : {}; }
function arr(v) { return Array.isArray(v) ? v : []; }
function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }
function wantedRun() {  // the run named by the address's #run=..., or "" (also when malformed)
  const hash = location.hash.replace(/^#run=/, "");
  try { return decodeURIComponent(hash); } catch (err) { return ""; }
}
function cleanEvent(e) {
  e = obj(e);
  return { seq: num(e.seq) ?? 0, time: num(e.time) ?? 0, kind: String(e.kind ?? "?"),
    round: num(e.round), node: e.node === null || e.node === undefined ? null : String(e.node),
    fields: obj(e.fields) };
}

// -- polling ---------------------------------------------------------------------------------
async function poll() {
  try {
    if (view.tick % RUNS_EVERY === 0 || !view.selected) await pollRuns();
    if (view.selected) await pollRun();
    showError(null);
    setLive(true, "");
  } catch (err) {
    showError(err.message);
    setLive(false, err.message);
  }
  view.tick += 1;
  setTimeout(poll, POLL_MS);
}

// The badge: "live" while the source answers, "unavailable" (and why, on hover) once it fails.
function setLive(ok, why) {
  const live = document.getElementById("live");
  live.classList.toggle("stale", !ok);
  live.textContent = ok ? "live" : "unavailable";
  live.title = ok ? "updates twice a second" : `the store cannot be read: ${why}`;
}

async function pollRuns() {
  const data = await getJSON("/api/runs");
  view.runs = arr(data.runs).map(obj).filter(r => typeof r.run_id === "string");
  document.getElementById("where").textContent = data.where || "";
  const server = data.server ? obj(data.server) : null;
  document.getElementById("server").textContent = server
    ? `${server.connections} connection(s) · ${server.sessions} session(s) · ${server.keys} key(s)`
      + (server.durable ? " · durable" : " · in memory")
    : "";
  const wanted = wantedRun();
  const ids = view.runs.map(r => r.run_id);
  const choice = ids.includes(wanted) ? wanted : (ids.includes(view.selected) ? view.selected : ids[0]);
  if (choice !== view.selected) select(choice || null);
  drawRuns();
}

async function pollRun() {
  const run = view.selected;
  const data = await getJSON(`/api/run/${encodeURIComponent(run)}?since=${view.nextSeq}`);
  if (run !== view.selected) return;  // switched meanwhile
  const status = obj(data.status);
  status.members = arr(status.members).map(obj);
  view.status = status;
  if (num(data.next_seq) !== null) view.nextSeq = data.next_seq;
  view.events.push(...arr(data.events).map(cleanEvent));
  view.events.sort((a, b) => a.time - b.time || a.seq - b.seq);  // (in the order they happened)
  if (view.events.length > MAX_EVENTS) view.events.splice(0, view.events.length - MAX_EVENTS);
  const last = view.samples[view.samples.length - 1];
  const size = num(status.world_size), now = num(data.time);
  if (num(status.round) !== null && size !== null && now !== null && (!last || last.size !== size)) {
    view.samples.push({ time: now, size });
    if (view.samples.length > MAX_SAMPLES) view.samples.splice(0, view.samples.length - MAX_SAMPLES);
  }
  view.now = now ?? Date.now() / 1000;
  view.corrupt = arr(data.corrupt);
  drawRun();
}

function select(run) {
  view.selected = run;
  view.events = []; view.samples = []; view.nextSeq = 0; view.status = null;
  view.shownEvents = -1;
  if (run) history.replaceState(null, "", `#run=${encodeURIComponent(run)}`);
  document.getElementById("run").hidden = !run;
  drawRuns();
}

function showError(message) {
  const box = document.getElementById("error");
  box.hidden = !message;
  box.textContent = message ? `Cannot read the run now: ${message}` : "";
}

// -- drawing ---------------------------------------------------------------------------------
function drawRuns() {
  const list = document.getElementById("runs");
  list.replaceChildren();
  if (!view.runs.length) list.append(el("li", { class: "muted" }, "no runs yet"));
  for (const run of view.runs) {
    const link = el("a", { href: `#run=${encodeURIComponent(run.run_id)}`, "data-run": run.run_id,
      class: run.run_id === view.selected ? "selected" : "" },
      el("span", {}, run.run_id),
      el("span", { class: `badge ${run.state}` },
        run.round === null || run.round === undefined ? run.state : `${run.world_size}`));
    link.addEventListener("click", ev => { ev.preventDefault(); select(run.run_id); });
    list.append(el("li", {}, link));
  }
}

function drawRun() {
  const s = view.status;
  document.getElementById("run-id").textContent = s.run_id ?? view.selected;
  const badge = document.getElementById("run-state");
  badge.textContent = s.state ?? "?"; badge.className = `badge ${s.state ?? ""}`;
  // the round's formation as its round_formed event says (the events table's number), else
  // the slowest join its nodes reported
  const formed = view.events.filter(e => e.kind === "round_formed" && e.round === num(s.round)
    && typeof e.fields.formation_s === "number").pop();
  const facts = [
    [num(s.round) === null ? "–" : s.round, "round"],
    [s.world_size ?? "?", "nodes"],
    [s.members.reduce((n, m) => n + (num(m.nproc) || 0), 0) || "?", "workers"],
    [s.spares ? `${s.spares} spare` : (s.waiting ?? "?"), "waiting"],
    [seconds(formed ? formed.fields.formation_s : s.last_round_s), "last round formed in"],
    [s.master || "?", "workers' master"],
  ];
  document.getElementById("facts").replaceChildren(
    ...facts.map(([value, label]) => el("div", { class: "fact" }, el("b", {}, value), el("span", {}, label))));
  drawMembers(s);
  drawChart();
  drawEvents();
}

function liveness(m, s) {
  if (m.leaving && !s.closed) return "leaving";
  if (m.alive) return "yes";
  return s.closed ? "left" : "LOST";
}

function drawMembers(s) {
  const body = document.querySelector("#members tbody");
  body.replaceChildren();
  for (const m of s.members) {
    const state = liveness(m, s);
    body.append(el("tr", { "data-rank": m.rank ?? "?" },
      el("td", { class: "num" }, m.rank ?? "?"),
      el("td", {}, el("span", { class: `badge ${state}` }, state === "yes" ? "alive" : state)),
      el("td", {}, m.host || "?"), el("td", { class: "num" }, m.pid || "?"),
      el("td", { class: "num" }, m.nproc || "?"),
      el("td", { class: "num" }, num(m.last_seen_s_ago) === null ? "?" : `${seconds(m.last_seen_s_ago)} ago`),
      el("td", { class: "num" }, seconds(m.started_s_ago)),
      el("td", { class: "num" }, seconds(m.join_s)),
      el("td", { class: "num" }, num(m.step) === null ? "-" : String(m.step)),
      el("td", { class: "num" }, num(m.step_time) === null ? "-" : `${num(m.step_time).toFixed(3)} s`),
      el("td", { class: "num" }, num(m.compute) === null ? "-" : `${num(m.compute).toFixed(3)} s`,
        num(m.straggler) === null ? "" : el("span", { class: "badge straggler",
          title: "its work per step over the other nodes'" }, `straggler ${num(m.straggler).toFixed(1)}x`))));
  }
  if (!s.members.length) body.append(el("tr", {}, el("td", { colspan: 11, class: "empty" },
    num(s.round) === null ? "no round has formed yet" : "no members")));
  document.getElementById("members-note").textContent = num(s.round) === null ? "" : `round ${s.round}`;
  let waiting = "";
  if (s.spares) {
    waiting = `${s.spares} spare node(s) waiting: the job runs at its maximum of ${s.max_nodes}; `
      + "a spare takes the place of a member that leaves or is lost.";
  } else if (s.waiting) {
    waiting = `${s.waiting} node(s) waiting in round ${s.forming_round}`
      + (s.rejoined ? ` (${s.rejoined} of them members coming back)` : "")
      + (s.armed ? "; min_nodes reached, last call running" : "") + ".";
  }
  document.getElementById("waiting").textContent = waiting;
}

// The world size over time: the rounds' sizes from the history, and what this page saw.
function series() {
  const points = view.events.filter(e => e.kind === "round_formed" && typeof e.fields.world_size === "number")
    .map(e => ({ time: e.time, size: e.fields.world_size }));
  points.push(...view.samples);
  points.sort((a, b) => a.time - b.time);
  return points;
}

function eventColour(e) {
  const f = e.fields;
  if (e.kind === "round_formed") {
    if (f.cause === "loss" || arr(f.left).some(l => LOSS_REASONS.has(obj(l).reason))) {
      return "#d64545";
    }
    if (f.cause === "leave") return "#d58a00";
  }
  return KIND_COLOURS[e.kind] || "#8a94a3";
}

function drawChart() {
  const box = document.getElementById("chart");
  const W = Math.max(box.clientWidth, 400), H = 220, L = 36, R = 12, T = 12, B = 26;
  const points = series();
  const now = view.now || Date.now() / 1000;
  const times = points.map(p => p.time).concat(view.events.map(e => e.time));
  let t0 = times.length ? Math.min(...times) : now - 60;
  if (now - t0 < 30) t0 = now - 30;
  const span = now - t0;
  const maxSize = Math.max(1, ...points.map(p => p.size), num(view.status.max_nodes) || 0);
  const x = t => L + (W - L - R) * (t - t0) / span;
  const y = v => T + (H - T - B) * (1 - v / (maxSize + 0.5));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": "nodes over time", id: "chart-svg" });
  for (let v = 0; v <= maxSize; v += Math.max(1, Math.ceil(maxSize / 5))) {
    root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    root.append(svg("text", { class: "tick", x: L - 8, y: y(v) + 4, "text-anchor": "end" }, v));
  }
  for (let i = 0; i <= 4; i++) {
    const t = t0 + span * i / 4;
    root.append(svg("text", { class: "tick", x: x(t), y: H - 6,
      "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" }, clock(t)));
  }
  for (const e of view.events) {
    const colour = eventColour(e);
    const major = MAJOR.has(e.kind);
    const mark = svg("line", { class: major ? "marker" : "minor", x1: x(e.time), x2: x(e.time),
      y1: major ? T : H - B - 6, y2: H - B, stroke: colour, "data-kind": e.kind });
    mark.append(svg("title", {}, `${clock(e.time)} ${e.kind}: ${describe(e)}`));
    root.append(mark);
  }
  if (points.length) {
    let d = "";
    points.forEach((p, i) => {
      d += i === 0 ? `M${x(p.time)},${y(p.size)}` : `H${x(p.time)}V${y(p.size)}`;
    });
    d += `H${x(now)}`;
    const last = points[points.length - 1];
    root.append(svg("path", { class: "area",
      d: `${d}V${y(0)}H${x(points[0].time)}Z` }));
    root.append(svg("path", { class: "line", d, id: "world-size-line" }));
    root.append(svg("circle", { cx: x(now), cy: y(last.size), r: 4, fill: "#2f6fde" }));
    for (const e of view.events.filter(e => e.kind === "round_formed" && typeof e.fields.world_size === "number")) {
      const dot = svg("circle", { cx: x(e.time), cy: y(e.fields.world_size), r: 4.5,
        fill: eventColour(e), stroke: "#fff", "stroke-width": 1.5 });
      dot.append(svg("title", {}, `${clock(e.time)} round ${e.round}: ${describe(e)}`));
      root.append(dot);
    }
  }
  box.replaceChildren(root);
  const kinds = [...new Set(view.events.map(e => e.kind))];
  document.getElementById("legend").replaceChildren(
    el("span", {}, el("span", { class: "dot", colour: "#2f6fde" }), "nodes"),
    ...kinds.map(k => el("span", {}, el("span", { class: "dot",
      colour: KIND_COLOURS[k] || "#8a94a3" }), k.replace(/_/g, " "))));
}

function describe(e) {
  const f = e.fields;
  const list = xs => (Array.isArray(xs) && xs.length ? xs.join(", ") : "");
  switch (e.kind) {
    case "round_formed": {
      const parts = [`${f.world_size ?? "?"} node(s)`];
      if (f.cause) parts.push(`cause: ${f.cause}`);
      if (typeof f.formation_s === "number") parts.push(`formed in ${seconds(f.formation_s)}`);
      if (list(f.newcomers)) parts.push(`joined: ${list(f.newcomers)}`);
      if (arr(f.left).length) {
        parts.push("left: " + f.left.map(obj).map(l =>
          `${l.node ?? "?"} (${String(l.reason || "?").replace(/_/g, " ")})`).join(", "));
      }
      return parts.join("; ");
    }
    case "worker_failed": {
      const how = f.signal ? `signal ${f.signal}` : `exit code ${f.exit_code}`;
      return `rank ${f.rank}: ${how}` + (f.error ? ` — ${f.error}` : "");
    }
    case "worker_hung":
      return `rank ${f.rank ?? "?"} hung after step ${f.step ?? "?"}: no progress for ${seconds(f.silent_s)}; `
        + `${f.why ?? ""}` + (f.frame ? ` at ${f.frame}` : "")
        + (arr(f.stack).length ? " — " + arr(f.stack).map(line => String(line).trim()).join(" ← ") : "");
    case "straggler_flagged":
    case "straggler_cleared":
    case "straggler_replaced": {
      const what = { straggler_flagged: "is a straggler", straggler_cleared: "is no longer a straggler",
        straggler_replaced: "asked to leave for a spare" }[e.kind];
      return `group rank ${f.group_rank ?? "?"} (${f.host || "?"}) ${what}: `
        + `${typeof f.ratio === "number" ? f.ratio.toFixed(2) : "?"}x the others' work per step`;
    }
    default:
      return Object.entries(f).map(([k, v]) => `${k.replace(/_s$/, "").replace(/_/g, " ")}: ${
        typeof v === "number" && k.endsWith("_s") ? seconds(v)
          : (typeof v === "object" ? JSON.stringify(v) : v)}`).join("; ");
  }
}

function drawEvents() {
  const count = view.events.length;
  document.getElementById("events-note").textContent = count
    ? `${count} recorded` + (view.corrupt && view.corrupt.length ? `, ${view.corrupt.length} unreadable (skipped)` : "")
    : "";
  if (count === view.shownEvents) return;
  const fresh = view.shownEvents >= 0 ? count - view.shownEvents : 0;
  view.shownEvents = count;
  const body = document.querySelector("#events tbody");
  body.replaceChildren();
  const shown = view.events.slice(-500).reverse();
  shown.forEach((e, i) => {
    body.append(el("tr", { class: i < fresh ? "fresh" : "", "data-kind": e.kind, title: `seq ${e.seq}` },
      el("td", { class: "num" }, clock(e.time)),
      el("td", { class: "nowrap" }, el("span", { class: "dot", colour: eventColour(e) }),
        el("span", { class: "kind" }, e.kind)),
      el("td", { class: "num" }, e.round === null || e.round === undefined ? "" : e.round),
      el("td", {}, e.node || ""), el("td", {}, describe(e))));
  });
  if (!count) body.append(el("tr", {}, el("td", { colspan: 5, class: "empty" }, "no events recorded yet")));
}

window.addEventListener("hashchange", () => {
  const wanted = wantedRun();
  if (wanted && wanted !== view.selected) select(wanted);
});
window.addEventListener("resize", () => { if (view.status) drawChart(); });
poll();
