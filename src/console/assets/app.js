// hubguard's console. Every text from the server (keys, errors, bodies) is written with
// textContent: nothing a producer or receiver writes can run here; the page's
// Content-Security-Policy allows this script only.
"use strict";

const S = { token: sessionStorage.getItem("hubguard-token") || "", session: null, job: null };

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }
function $(id) { return document.getElementById(id); }
function say(text, bad) { const m = $("message"); m.textContent = text || ""; m.className = bad ? "error" : ""; }

async function api(path, opts) {
  const o = opts || {};
  const headers = { "accept": "application/json" };
  if (S.token) headers["authorization"] = "Bearer " + S.token;
  if (o.body !== undefined) {
    headers["content-type"] = "application/json";
    if (S.session && S.session.csrf) headers["x-hubguard-csrf"] = S.session.csrf;
  }
  const res = await fetch(path, { method: o.method || "GET", headers, body: o.body === undefined ? undefined : JSON.stringify(o.body), credentials: "same-origin" });
  let data = null;
  try { data = await res.json(); } catch (_) { data = null; }
  if (res.status === 401) signIn((data && data.error) || "A credential is needed.");
  return { status: res.status, data: data || {} };
}

// Times: the reader's zone and UTC, and how far from now in words.
function twoZones(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  const local = d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
  const utc = d.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  return local + " (" + utc + ")";
}
function serverNow() { return S.session && S.session.offset !== undefined ? Date.now() + S.session.offset : Date.now(); }
function inWords(iso) {
  if (!iso) return "";
  let s = Math.round((new Date(iso).getTime() - serverNow()) / 1000);
  const past = s < 0; s = Math.abs(s);
  const parts = [];
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), r = s % 60;
  if (d) parts.push(d + " d"); if (h) parts.push(h + " h"); if (m && !d) parts.push(m + " min"); if (!d && !h) parts.push(r + " s");
  return past ? parts.join(" ") + " ago" : "in " + parts.join(" ");
}
function at(iso) { return inWords(iso) + ", at " + twoZones(iso); }

function signIn(why) {
  $("signin").hidden = false;
  $("signin").open = true;
  $("signin-why").textContent = why;
}

async function loadSession() {
  const r = await api("/console/api/session");
  if (r.status !== 200) return;
  S.session = r.data;
  S.session.offset = new Date(r.data.now).getTime() - Date.now();
  // A reader where operators exist may sign in to act.
  $("signin").hidden = !(r.data.role === "reader" && r.data.anyone_can_act);
  $("signin-why").textContent = "Operators: sign in with the operator token to act.";
  $("who").textContent = r.data.who + " · " + (r.data.can_act ? "operator" : "reader");
}

function canAct() { return S.session && S.session.can_act; }

function button(text, onClick, primary) {
  const b = el("button", text, primary ? "primary" : "");
  b.type = "button";
  b.addEventListener("click", onClick);
  if (!canAct()) { b.disabled = true; b.title = "needs the operator role"; }
  return b;
}

async function act(action, body) {
  const r = await api("/console/api/act/" + action, { method: "POST", body });
  if (r.status !== 200) { say(action + ": " + (r.data.error || ("HTTP " + r.status)), true); return null; }
  return r.data;
}

// ---- the key page ----
function row(dl, name, value) { dl.appendChild(el("dt", name)); const dd = el("dd"); if (value instanceof Node) dd.appendChild(value); else dd.textContent = value; dl.appendChild(dd); }

async function lookup(q) {
  const story = clear($("story"));
  if (!q) return;
  say("");
  const r = await api("/console/api/lookup?q=" + encodeURIComponent(q));
  const v = r.data;
  const card = el("div", null, "card");
  story.appendChild(card);
  const head = el("p");
  head.appendChild(el("span", v.state || "?", "state " + (v.state || "")));
  head.appendChild(document.createTextNode(" "));
  head.appendChild(el("span", v.key || v.query || q, "key"));
  card.appendChild(head);
  if (r.status === 404) { card.appendChild(el("p", v.detail)); return; }
  if (r.status !== 200) { card.appendChild(el("p", v.error || ("HTTP " + r.status), "error")); return; }
  if (v.state === "AMBIGUOUS") {
    card.appendChild(el("p", "More than one event matches; choose one:"));
    const ul = el("ul");
    for (const k of v.candidates) { const li = el("li"); const a = el("a", k, "key"); a.href = "#key=" + encodeURIComponent(k); li.appendChild(a); ul.appendChild(li); }
    card.appendChild(ul);
    return;
  }
  if (v.state === "PARKED") {
    const w = v.waits_behind || {};
    card.appendChild(el("p", "Parked behind an earlier event of its ordering key (" + (v.ordering_key || "") + "): place " + v.position + " of " + v.line_length + "."));
    const p = el("p", "It waits behind "); p.appendChild(el("span", w.key || "", "key"));
    p.appendChild(document.createTextNode(w.next_attempt_at ? ", whose attempt " + w.next_attempt + " is " + at(w.next_attempt_at) : ""));
    card.appendChild(p);
    return;
  }
  if (v.state === "RETRY_SCHEDULED" && v.next_attempt_at) {
    const n = el("p", null, "big");
    n.id = "next-attempt";
    n.textContent = "Next attempt (" + (v.attempts + 1) + " of " + v.max_attempts + ") " + at(v.next_attempt_at);
    card.appendChild(n);
  }
  if (v.state === "DEAD_LETTERED") {
    const d = el("p", "Dead-lettered: " + (v.dead_letter_reason || "") + (v.last_error ? " — " + v.last_error : ""), "big error");
    d.id = "dead-letter";
    card.appendChild(d);
  }
  if (v.state === "DELIVERED") card.appendChild(el("p", "Delivered after " + v.attempts + " attempt(s); last change " + twoZones(v.updated_at) + ".", "big"));
  if (v.waiting_because && v.waiting_because.length) {
    card.appendChild(el("h3", "Why it waits"));
    const ul = el("ul", null, "reasons"); ul.id = "why";
    for (const w of v.waiting_because) ul.appendChild(el("li", w));
    card.appendChild(ul);
  }
  const dl = el("dl");
  row(dl, "Event type", v.event_type || "—");
  row(dl, "Correlation id", v.correlation_id);
  row(dl, "Partition / sequence number", v.partition + " / " + v.sequence_number);
  row(dl, "Policy", v.policy);
  row(dl, "First failure", twoZones(v.first_failure_at));
  card.appendChild(dl);
  if (v.schedule) {
    card.appendChild(el("h3", "The rest of its pinned schedule (if every attempt fails)"));
    const ol = el("ol"); ol.id = "schedule";
    for (const s of v.schedule.steps) {
      const when = s.earliest === s.latest ? at(s.earliest) : "between " + twoZones(s.earliest) + " and " + twoZones(s.latest);
      ol.appendChild(el("li", "attempt " + s.attempt + ": " + when));
    }
    card.appendChild(ol);
    if (v.schedule.truncated) card.appendChild(el("p", "…", "muted"));
    const g = v.schedule.gives_up;
    const gives = el("p", g ? "Gives up after attempt " + g.after_attempt + " (" + g.reason + "), " + at(g.earliest) : "No end within the listed attempts.");
    gives.id = "gives-up";
    card.appendChild(gives);
  }
  card.appendChild(el("h3", "Attempts"));
  const t = el("table"); const body = el("tbody");
  const hr = el("tr"); for (const h of ["#", "When", "Outcome", "Error", "Trace"]) hr.appendChild(el("th", h));
  t.appendChild(el("thead")).appendChild(hr);
  for (const h of v.history || []) {
    const tr = el("tr");
    tr.appendChild(el("td", h.attempt));
    tr.appendChild(el("td", twoZones(h.started_at)));
    tr.appendChild(el("td", h.outcome));
    tr.appendChild(el("td", (h.error || "").slice(0, 300)));
    const td = el("td");
    if (h.trace_url && /^https?:\/\//.test(h.trace_url)) {
      const a = el("a", "trace", "trace-link"); a.href = h.trace_url; a.rel = "noopener noreferrer"; a.target = "_blank"; td.appendChild(a);
    } else td.textContent = h.trace_id || "";
    tr.appendChild(td);
    body.appendChild(tr);
  }
  t.appendChild(body);
  const sc = el("div", null, "scroll"); sc.appendChild(t); card.appendChild(sc);
  const acts = el("div", null, "actions");
  if (v.state === "RETRY_SCHEDULED") {
    acts.appendChild(button("Retry now", async () => { const r = await act("retry-now", { key: v.key }); if (r) { say("retry now: " + r.outcome.result); lookup(v.key); } }));
    acts.appendChild(button("Cancel…", async () => { const why = prompt("Why cancel it?"); if (!why) return; const r = await act("cancel", { key: v.key, reason: why }); if (r) { say("cancel: " + r.outcome.result); lookup(v.key); } }));
  }
  if (v.state === "DEAD_LETTERED") acts.appendChild(button("Replay", async () => { const r = await act("replay", { key: v.key }); if (r) { say("replay: " + r.outcome); lookup(v.key); } }, true));
  card.appendChild(acts);
}

// ---- retries ----
async function loadRetries() {
  const p = new URLSearchParams();
  if ($("f-type").value) p.set("event_type", $("f-type").value);
  if ($("f-error").value) p.set("error", $("f-error").value);
  if ($("f-due").value) p.set("due_before", $("f-due").value);
  const r = await api("/console/api/retries?" + p.toString());
  const tb = clear($("retries").tBodies[0]);
  if (r.status !== 200) { $("retries-count").textContent = r.data.error || ""; return; }
  $("retries-count").textContent = r.data.matched + " of " + r.data.waiting + " waiting match; soonest first" + (r.data.shown < r.data.matched ? " (first " + r.data.shown + " shown)" : "") + "; listed " + Math.round(r.data.listed_ago_ms / 1000) + " s ago";
  showRetryPauses(r.data);
  for (const x of r.data.retries) {
    const tr = el("tr");
    tr.appendChild(el("td", inWords(x.due) + " · " + twoZones(x.due), x.overdue ? "error" : ""));
    tr.appendChild(el("td", x.attempt));
    const td = el("td", null, "key"); const a = el("a", x.key); a.href = "#key=" + encodeURIComponent(x.key); td.appendChild(a); tr.appendChild(td);
    tr.appendChild(el("td", x.event_type || ""));
    tr.appendChild(el("td", x.last_error || ""));
    tr.appendChild(el("td", x.paused ? pauseText(x.paused) : "", x.paused ? "paused" : ""));
    const acts = el("td");
    if (!x.paused) acts.appendChild(button("Pause", () => pauseRetries({ key: x.key }, "the retries of " + x.key)));
    tr.appendChild(acts);
    tb.appendChild(tr);
  }
}

// Operators' pauses of retries (`hubguard retries pause|resume`): waiting past their due
// time without counting an attempt, until resumed.
function pauseText(p) { return p.what + ": paused by " + p.by + " since " + twoZones(p.since) + (p.reason ? " — " + p.reason : ""); }
async function pauseRetries(filter, what) {
  const why = prompt("Why pause " + what + "?", "");
  if (why === null) return;
  const r = await act("pause-retries", { retries: filter, reason: why });
  if (r) { say("pause retries: " + r.outcome); loadRetries(); }
}
function showRetryPauses(data) {
  const ul = clear($("retry-pauses"));
  if (data.pauses_unknown) ul.appendChild(el("li", "whether retries are paused is unknown: " + data.pauses_unknown, "error"));
  for (const p of data.pauses || []) {
    const li = el("li", pauseText(p) + " ", "paused");
    li.appendChild(button("Resume", async () => { const r = await act("resume-retries", { retries: p.filter }); if (r) { say("resume retries: " + r.outcome); loadRetries(); } }));
    ul.appendChild(li);
  }
  const box = clear($("retry-pause-actions"));
  const filter = {};
  if ($("f-type").value.trim()) filter.event_type = $("f-type").value.trim();
  if ($("f-error").value.trim()) filter.error = $("f-error").value.trim();
  const what = Object.keys(filter).length ? "the retries this filter matches (type and error)" : "every retry";
  box.appendChild(button(Object.keys(filter).length ? "Pause retries matching the filter" : "Pause every retry", () => pauseRetries(filter, what)));
  if ((data.pauses || []).length > 1) box.appendChild(button("Resume every pause", async () => { const r = await act("resume-retries", { all: true }); if (r) { say("resume retries: " + r.outcome); loadRetries(); } }));
}

// ---- dead letters ----
async function loadDead() {
  const r = await api("/console/api/dead-letters");
  const box = clear($("groups"));
  if (r.status !== 200) { $("dead-count").textContent = r.data.error || ""; return; }
  $("dead-count").textContent = r.data.dead_letters + " dead letter(s) in " + r.data.groups.length + " group(s)" + (r.data.unreadable ? "; " + r.data.unreadable + " unreadable" : "");
  r.data.groups.forEach((g, i) => {
    const c = el("div", null, "card group"); c.id = "group-" + i;
    c.appendChild(el("p", g.count + " × " + g.reason + " · status " + g.status + " · type " + (g.event_type || "(none)"), "big"));
    c.appendChild(el("p", "first seen " + twoZones(g.first_seen) + "; last seen " + twoZones(g.last_seen), "muted"));
    if (g.latest_error) c.appendChild(el("p", g.latest_error, "error"));
    const ul = el("ul");
    g.keys.forEach((k, j) => {
      const li = el("li"); const a = el("a", k, "key"); a.href = "#key=" + encodeURIComponent(k); li.appendChild(a);
      const cid = (g.correlation_ids || [])[j];
      if (cid) li.appendChild(el("span", " · correlation id " + cid, "muted correlation"));
      ul.appendChild(li);
    });
    c.appendChild(ul);
    const filter = { reason: g.reason, status: g.status, event_type: g.event_type };
    const acts = el("div", null, "actions");
    const rate = el("input"); rate.value = "10"; rate.size = 4; rate.className = "rate"; rate.title = "replays a second";
    const bound = el("input"); bound.value = String(g.count); bound.size = 6; bound.className = "bound"; bound.title = "at most this many";
    const go = button("Replay", async () => startJob(filter, false, Number(rate.value), Number(bound.value)), true);
    go.disabled = true; go.classList.add("replay");
    acts.appendChild(button("Dry run", async () => { const done = await startJob(filter, true, 1000, Number(bound.value)); if (done && canAct()) go.disabled = false; }));
    const l1 = el("label", "rate /s "); l1.appendChild(rate); acts.appendChild(l1);
    const l2 = el("label", "at most "); l2.appendChild(bound); acts.appendChild(l2);
    acts.appendChild(go);
    c.appendChild(acts);
    box.appendChild(c);
  });
}

async function startJob(filter, dryRun, rate, limit) {
  const body = { filter: Object.assign({}, filter, S.until ? { until: S.until } : {}), dry_run: dryRun, rate: rate || 10 };
  if (limit > 0) body.limit = limit;
  const r = await act("replay", body);
  if (!r) return false;
  return followJob(r.job);
}

async function followJob(id) {
  const box = clear($("job"));
  const card = el("div", null, "card"); card.id = "job-card"; box.appendChild(card);
  const title = el("p", "Replay job " + id, "big"); const bar = el("progress"); const text = el("p"); text.id = "job-text";
  const stop = button("Stop", async () => { await api("/console/api/jobs/" + id + "/stop", { method: "POST", body: {} }); });
  card.append(title, bar, text, stop);
  for (;;) {
    const r = await api("/console/api/jobs/" + id);
    if (r.status !== 200) { text.textContent = r.data.error || ""; return false; }
    const j = r.data;
    bar.max = Math.max(j.total, 1); bar.value = j.done;
    text.textContent = (j.dry_run ? "dry run: " : "") + j.done + " of " + j.total + " looked at; " + j.replayed + (j.dry_run ? " would be replayed" : " replayed") + ", " + j.skipped + " skipped, " + j.failed + " failed" + (j.finished ? " — finished" + (j.bounded ? " at the bound (the same filter resumes)" : "") : "");
    if (j.error) text.textContent += " — " + j.error;
    if (j.finished) { S.until = j.dry_run ? j.filter.until : null; stop.disabled = true; card.dataset.finished = "true"; return !j.error; }
    await new Promise(res => setTimeout(res, 500));
  }
}

// ---- partitions ----
async function loadPartitions() {
  const r = await api("/console/api/overview");
  if (r.status !== 200) return;
  const rep = r.data.report || {}, ctl = r.data.control || {};
  const ul = clear($("readiness"));
  if (!(rep.not_ready || []).length) ul.appendChild(el("li", "ready"));
  for (const why of rep.not_ready || []) ul.appendChild(el("li", why, "error"));
  // Held entries are named by the partition ("3", "3 (paused)") or by what holds them.
  const heldEntries = Object.entries(rep.held_partitions || {});
  const partOf = k => (k.match(/^(\d+)(\s|$)/) || [])[1];
  const ids = new Set([...Object.keys(rep.owned_partitions || {}), ...(rep.unowned_partitions || []), ...heldEntries.map(([k]) => partOf(k)).filter(Boolean), ...Object.keys(ctl.partitions || {})]);
  const tb = clear($("partitions").tBodies[0]);
  for (const p of [...ids].sort((a, b) => Number(a) - Number(b))) {
    const tr = el("tr"); tr.id = "partition-" + p;
    const owned = rep.owned_partitions && p in rep.owned_partitions;
    const lag = (rep.checkpoint_lag || {})[p];
    const held = heldEntries.filter(([k]) => partOf(k) === p).map(([, h]) => h)[0];
    const pause = (ctl.partitions || {})[p] || ctl.all;
    tr.appendChild(el("td", p));
    tr.appendChild(el("td", owned ? "this replica" + (r.data.owner ? " (" + r.data.owner + ")" : "") : "another replica or none"));
    tr.appendChild(el("td", owned ? String(rep.owned_partitions[p]) : ""));
    tr.appendChild(el("td", lag ? lag.events + " events, " + Math.round(lag.seconds) + " s" : ""));
    tr.appendChild(el("td", held ? [held.cause, held.reason].filter(Boolean).join(": ") + (held.since ? " since " + twoZones(held.since) : "") : ""));
    const rw = (ctl.rewinds || {})[p];
    const rwText = rw ? "from sequence " + rw.first + " (" + rw.asked + ") asked by " + rw.by + ": " + (rw.applied ? "applied by " + rw.applied.by : "waiting for its owner") : "";
    const rwCell = el("td", rwText, rw ? (rw.applied ? "rewound" : "rewinding") : "");
    tr.appendChild(el("td", pause ? "paused by " + pause.by + " since " + twoZones(new Date(pause.since_ms).toISOString()) + (pause.reason ? ": " + pause.reason : "") : "", pause ? "paused" : ""));
    tr.appendChild(rwCell);
    const td = el("td");
    if (pause && !ctl.all) td.appendChild(button("Resume", async () => { if (await act("resume", { partitions: [p] })) loadPartitions(); }));
    else if (!pause) td.appendChild(button("Pause", async () => { const why = prompt("Why pause partition " + p + "?", ""); if (why === null) return; if (await act("pause", { partitions: [p], reason: why })) loadPartitions(); }));
    tr.appendChild(td);
    tb.appendChild(tr);
  }
  const all = clear($("all-actions"));
  all.appendChild(button("Pause all", async () => { const why = prompt("Why pause every partition?", ""); if (why === null) return; if (await act("pause", { partitions: [], reason: why })) loadPartitions(); }));
  all.appendChild(button("Resume all", async () => { if (await act("resume", { partitions: [] })) loadPartitions(); }));
  const dl = clear($("loop"));
  const b = rep.breaker;
  row(dl, "Breaker", b ? b.state + (b.open_until ? " until " + twoZones(b.open_until) : "") + " (" + b.opens + " opens)" : "off");
  const rl = rep.rate_limit;
  row(dl, "Rate limit", rl && rl.limit_per_s ? (rl.rate_per_s || 0).toFixed(1) + "/s of " + rl.limit_per_s + "/s" + (rl.last_decrease_reason ? " (slowed: " + rl.last_decrease_reason + ")" : "") : "none");
  row(dl, "Retry loop", typeof rep.retry_loop === "string" ? rep.retry_loop : JSON.stringify(rep.retry_loop));
  row(dl, "Consumer", typeof rep.consumer === "string" ? rep.consumer : JSON.stringify(rep.consumer));
}

// ---- rewind ----
function rewindBody(dryRun) {
  const parts = $("rw-partitions").value.split(/[\s,]+/).filter(Boolean);
  const body = { partitions: parts, dry_run: dryRun };
  if ($("rw-to").value.trim()) body.to = $("rw-to").value.trim();
  if ($("rw-sequence").value.trim()) body.sequence = Number($("rw-sequence").value.trim());
  return body;
}

async function rewind(dryRun) {
  const box = clear($("rewind-result"));
  const r = await act("rewind", rewindBody(dryRun));
  if (!r) { $("rw-go").disabled = true; return; }
  const card = el("div", null, "card"); card.id = "rewind-card";
  card.appendChild(el("p", (r.dry_run ? "Dry run: " : "") + r.outcome, r.refused ? "big error" : "big"));
  const ul = el("ul");
  for (const l of r.partitions || []) {
    const what = l.result === "refused" ? "refused: " + l.why : l.result === "nothing" ? "nothing to do: " + l.why : l.result === "waiting" ? "waiting for its owner " + (l.owner || "") + " to apply it" : l.result === "applied" ? "rewound (applied by " + l.by + ")" : "would be rewound";
    const from = l.first !== null && l.first !== undefined ? "; delivered again from sequence number " + l.first + (l.events_again !== null && l.events_again !== undefined ? " (" + l.events_again + " events)" : "") : "";
    ul.appendChild(el("li", "partition " + l.partition + ": " + what + from, l.result === "refused" ? "error" : ""));
  }
  card.appendChild(ul);
  box.appendChild(card);
  card.dataset.result = r.refused ? "refused" : (r.dry_run ? "dry-run" : "written");
  $("rw-go").disabled = !(r.dry_run && !r.refused && canAct());
  if (!r.dry_run) loadPartitions();
}

// ---- audit ----
async function loadAudit() {
  const r = await api("/console/api/audit");
  const tb = clear($("audit").tBodies[0]);
  $("audit-note").textContent = r.data.shared ? "Every replica's actions, newest first (the latest " + (r.data.entries || []).length + ")." : (r.data.error || "");
  $("audit-note").className = r.data.shared ? "muted" : "error";
  for (const a of r.data.entries || []) {
    const tr = el("tr");
    tr.append(el("td", twoZones(a.at)), el("td", a.who), el("td", a.action + (a.dry_run ? " (dry run)" : "")), el("td", JSON.stringify(a.target)), el("td", a.outcome), el("td", (a.replica || "") + (a.only_here ? " (this replica only)" : "")));
    tb.appendChild(tr);
  }
}

// ---- routing ----
function route() {
  const h = location.hash.slice(1);
  const [view, arg] = h.split("=");
  const name = ["key", "retries", "dead", "partitions", "audit"].includes(view) ? view : "key";
  for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== "view-" + name;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === name);
  if (name === "key") { const q = arg ? decodeURIComponent(arg) : ""; $("q").value = q; lookup(q); }
  if (name === "retries") loadRetries();
  if (name === "dead") loadDead();
  if (name === "partitions") loadPartitions();
  if (name === "audit") loadAudit();
}

document.addEventListener("DOMContentLoaded", async () => {
  $("signin-form").addEventListener("submit", async e => { e.preventDefault(); S.token = $("token").value.trim(); sessionStorage.setItem("hubguard-token", S.token); await loadSession(); route(); });
  $("lookup-form").addEventListener("submit", e => { e.preventDefault(); const q = $("q").value.trim(); const next = "#key=" + encodeURIComponent(q); if (location.hash === next) route(); else location.hash = next; });
  $("retries-form").addEventListener("submit", e => { e.preventDefault(); loadRetries(); });
  $("rw-dry").addEventListener("click", () => rewind(true));
  $("rw-go").addEventListener("click", () => rewind(false));
  for (const id of ["rw-partitions", "rw-to", "rw-sequence"]) $(id).addEventListener("input", () => { $("rw-go").disabled = true; });
  window.addEventListener("hashchange", route);
  await loadSession();
  route();
});
