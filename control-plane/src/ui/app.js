// The status page: polls the server's /ui/api/* every few seconds and
// updates the page in place. Every string it shows goes in as text
// (textContent, DOM nodes), never as markup: a run's command is a user's.
"use strict";

const POLL_MS = 3000;
const SANDBOX_PAGE = 50;
const PHASES = [
  ["queued", "queued"],
  ["commit_to_assignment_sent", "commit→sent"],
  ["assignment_sent_to_delivery_confirmed", "sent→confirmed"],
  ["delivery_confirmed_to_started", "confirmed→start (install)"],
];

// Runs whose install steps are shown: kept open across the updates.
const openSteps = new Set();

// Sandbox paging: the cursor of the page shown, and those before it.
const paging = { cursor: null, previous: [], next: null };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  if (value < 1000) return value + " ms";
  if (value < 60000) return (value / 1000).toFixed(value < 10000 ? 2 : 1) + " s";
  return (value / 60000).toFixed(1) + " min";
}

function time(rfc3339) {
  if (!rfc3339) return "–";
  const date = new Date(rfc3339);
  return isNaN(date) ? rfc3339 : date.toLocaleTimeString();
}

function tile(key, label, value, target, note) {
  return el("div", { class: "tile", dataset: { key } },
    el("div", { class: "label", text: label }),
    el("div", { class: "value" }, el("span", { class: "count", text: value }),
      target === null ? null : el("span", { class: "target", text: " / " + target })),
    note ? el("div", { class: "note muted", text: note }) : null);
}

class SignedOut extends Error {}

async function getJson(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401) throw new SignedOut();
  if (!response.ok) throw new Error(path + ": " + response.status);
  return response.json();
}

function renderSummary(summary) {
  const pool = summary.pool;
  document.getElementById("pool").replaceChildren(
    tile("ready", "Standby ready", pool.ready, pool.pool_target, pool.standby + " standby in all"),
    tile("running", "Running", pool.running, pool.running_cap || "no cap", pool.assigned + " with a run"),
    tile("parked_running", "Parked running", pool.parked_running, null, "Tier 2"),
    tile("parked_stopped", "Parked stopped", pool.parked_stopped, null, "Tier 1, or archived"),
    tile("resuming", "Resuming", pool.resuming, null, null),
    tile("retired", "Retired", pool.retired, null, "still in memory"));
  const hour = summary.last_hour;
  const share = hour.cold_share === null ? "–" : Math.round(hour.cold_share * 100) + " %";
  document.getElementById("hour").replaceChildren(
    tile("arrivals", "Arrivals", (hour.truncated ? "≥ " : "") + hour.arrivals, null, hour.started + " started"),
    tile("cold_share", "Cold path", share, null, hour.cold + " of " + hour.placed + " placed"),
    tile("p50", "Submit→start p50", ms(hour.submit_to_start_p50_ms), null, null),
    tile("p99", "Submit→start p99", ms(hour.submit_to_start_p99_ms), null, null));
  const chips = Object.entries(summary.runs_by_state).map(([state, count]) =>
    el("span", { class: "chip state-" + state + (count === 0 ? " zero" : ""), dataset: { state, count: String(count) } },
      el("span", { text: state }), " ", el("strong", { text: count })));
  document.getElementById("run-states").replaceChildren(...chips);
  const total = pool.standby + pool.assigned + pool.parked_running + pool.parked_stopped + pool.resuming + pool.retired;
  document.getElementById("sandbox-count").textContent = total + " in memory";
  renderCluster(summary.cluster);
  document.getElementById("updated").textContent = "updated " + time(summary.now);
}

function renderCluster(cluster) {
  const section = document.getElementById("cluster");
  const role = document.getElementById("role");
  section.hidden = cluster === null;
  role.hidden = cluster === null;
  if (cluster === null) return;
  role.textContent = cluster.role + " · " + cluster.replica_id;
  document.getElementById("leader").textContent = cluster.leader ? cluster.leader.id : "none";
  document.getElementById("epoch").textContent = String(cluster.epoch);
  document.getElementById("lease").textContent = time(cluster.lease_expires_at);
  const leader = cluster.leader ? cluster.leader.id : null;
  document.getElementById("replicas").replaceChildren(...cluster.replicas.map((replica) =>
    el("tr", { dataset: { replica: replica.id } },
      el("td", {}, el("span", { text: replica.id }), replica.id === leader ? el("span", { class: "badge", text: "leader" }) : null),
      el("td", { text: replica.url }),
      el("td", { text: time(replica.seen_at) }))));
}

function waterfall(run, scale) {
  const bar = el("div", { class: "waterfall" });
  const parts = [];
  for (const segment of run.waterfall) {
    const label = PHASES.find(([name]) => name === segment.phase);
    const name = label ? label[1] : segment.phase;
    parts.push(name + " " + ms(segment.ms) + (segment.open ? " (so far)" : ""));
    const span = el("span", { class: "seg " + segment.phase + (segment.open ? " open" : ""), title: name + ": " + ms(segment.ms) });
    span.style.width = Math.max(0.5, (segment.ms / scale) * 100) + "%";
    bar.append(span);
  }
  bar.title = parts.join(" · ");
  return bar;
}

// The agent's own timing of the start (contract 1.3): one bar per step,
// each from the assignment's arrival at the agent (the steps run in
// parallel), on the scale of the slowest of them.
function installSteps(run) {
  if (!run.install_steps || run.install_steps.length === 0) return null;
  const us = (value) => (value / 1000).toFixed(1) + " ms";
  const total = run.install_steps.find((step) => step.name === "critical_path");
  const scale = Math.max(1, ...run.install_steps.map((step) => step.us));
  const details = el("details", { class: "steps", dataset: { runId: run.id } },
    el("summary", { text: "agent: " + (total ? us(total.us) + " assignment→start" : "install steps") }));
  if (openSteps.has(run.id)) details.open = true;
  details.addEventListener("toggle", () => {
    if (details.open) openSteps.add(run.id); else openSteps.delete(run.id);
  });
  for (const step of run.install_steps) {
    const bar = el("span", { class: "step-bar step-" + step.name });
    bar.style.width = Math.max(0.5, (step.us / scale) * 100) + "%";
    details.append(el("div", { class: "step", dataset: { step: step.name } },
      el("span", { class: "step-name", text: step.name }),
      el("span", { class: "step-track" }, bar),
      el("span", { class: "step-ms num", text: us(step.us) })));
  }
  return details;
}

function renderRuns(runs) {
  // One scale for every bar: the slowest start shown (a run still waiting
  // fills its bar rather than shrinking every finished one to a sliver).
  const total = (run) => run.waterfall.reduce((sum, segment) => sum + segment.ms, 0);
  const started = runs.filter((run) => run.durations_ms.submit_to_start !== null);
  const scale = Math.max(1, ...(started.length ? started : runs).map(total));
  const rows = runs.map((run) => {
    const link = el("a", { href: "/ui/runs/" + encodeURIComponent(run.id) + "/log", class: "mono", text: run.id, title: "its log" });
    return el("tr", { dataset: { runId: run.id, state: run.state } },
      el("td", {}, link),
      el("td", {}, el("span", { class: "chip state-" + run.state, text: run.state })),
      el("td", { text: run.path || "–" }),
      el("td", { class: "command" }, el("code", { text: run.command.join(" ") })),
      el("td", { class: "mono thread", text: run.thread_id || "" }),
      el("td", { text: time(run.timestamps.submitted) }),
      el("td", { class: "num", text: ms(run.durations_ms.submit_to_start) }),
      el("td", { class: "wide" }, waterfall(run, scale), installSteps(run)));
  });
  document.getElementById("runs").replaceChildren(...rows);
}

function renderSandboxes(page) {
  paging.next = page.next_cursor;
  const rows = page.sandboxes.map((sandbox) => el("tr", { dataset: { sandboxId: sandbox.id, state: sandbox.state } },
    el("td", { class: "mono", text: sandbox.id }),
    el("td", { text: sandbox.kind }),
    el("td", {}, el("span", { class: "chip sandbox-" + sandbox.state, text: sandbox.state })),
    el("td", { text: (sandbox.connected ? "connected" : "–") + (sandbox.candidate ? ", ready" : "") }),
    el("td", { class: "mono", text: sandbox.run_id || "" }),
    el("td", { class: "mono thread", text: sandbox.thread_id || "" }),
    el("td", { text: sandbox.park ? sandbox.park.mode : "" }),
    el("td", { text: time(sandbox.created_at) }),
    el("td", { text: time(sandbox.last_heartbeat_at) })));
  document.getElementById("sandboxes").replaceChildren(...rows);
  const number = paging.previous.length + 1;
  document.getElementById("sandbox-page").textContent = "page " + number + " · " + page.sandboxes.length + " shown";
  document.getElementById("prev").disabled = paging.previous.length === 0;
  document.getElementById("first").disabled = paging.previous.length === 0;
  document.getElementById("next").disabled = !paging.next;
}

function sandboxesPath() {
  const query = new URLSearchParams({ limit: String(SANDBOX_PAGE) });
  const state = document.getElementById("sandbox-state").value;
  if (state) query.set("state", state);
  if (paging.cursor) query.set("cursor", paging.cursor);
  return "/ui/api/sandboxes?" + query.toString();
}

let timer = null;
// Each refresh's number: only the latest one renders and schedules the
// next, so a click during a poll never shows an older answer over a newer.
let generation = 0;

async function refresh() {
  const mine = ++generation;
  clearTimeout(timer);
  const error = document.getElementById("error");
  try {
    const [summary, runs, sandboxes] = await Promise.all([
      getJson("/ui/api/summary"), getJson("/ui/api/runs"), getJson(sandboxesPath())]);
    if (mine !== generation) return;
    renderSummary(summary);
    renderRuns(runs.runs);
    renderSandboxes(sandboxes);
    error.hidden = true;
    document.body.dataset.loaded = String(mine);
  } catch (failure) {
    if (mine !== generation) return;
    if (failure instanceof SignedOut) {
      window.location.assign("/ui/sign-in");
      return;
    }
    error.textContent = "The server did not answer (" + failure.message + "); retrying.";
    error.hidden = false;
  }
  timer = setTimeout(refresh, POLL_MS);
}

function legend() {
  const items = PHASES.map(([phase, label]) => el("span", {}, el("span", { class: "seg " + phase }), label));
  document.getElementById("legend").replaceChildren(...items);
}

function page(move) {
  move();
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  legend();
  document.getElementById("sandbox-state").addEventListener("change", () =>
    page(() => { paging.cursor = null; paging.previous = []; }));
  document.getElementById("first").addEventListener("click", () =>
    page(() => { paging.cursor = null; paging.previous = []; }));
  document.getElementById("prev").addEventListener("click", () =>
    page(() => { paging.cursor = paging.previous.pop() || null; }));
  document.getElementById("next").addEventListener("click", () => {
    if (!paging.next) return;
    page(() => { paging.previous.push(paging.cursor); paging.cursor = paging.next; });
  });
  refresh();
});
