// The operator's page: plain script, no build chain. Served at /ui.js;
// the page's Content-Security-Policy allows no other script.
"use strict";
const $ = (sel, el = document) => el.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const when = (ms) => ms ? new Date(ms).toLocaleString() : "–";
const badge = (status, parked) => parked ? `<span class="badge s-parked" title="${esc(status)}">parked</span>` : `<span class="badge s-${esc(status)}">${esc(status)}</span>`;
const json = (v) => esc(JSON.stringify(v));
let access = "write";

const tokenInput = $("#token");
tokenInput.value = localStorage.getItem("keel.token") || "";
tokenInput.addEventListener("change", () => { localStorage.setItem("keel.token", tokenInput.value.trim()); route(); });

async function api(path, options = {}) {
  const headers = {"Accept": "application/json"};
  const token = localStorage.getItem("keel.token");
  if (token) headers["Authorization"] = "Bearer " + token;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch("/api/v1" + path, {method: options.method || "GET", headers, body: options.body === undefined ? undefined : JSON.stringify(options.body)});
  const body = await res.json().catch(() => ({}));
  if (!res.ok) {
    const e = body.error || {};
    throw new Error((e.field ? e.field + ": " : "") + (e.message || res.statusText) + ` (${res.status})`);
  }
  return {status: res.status, body};
}

const commandId = (what) => `ui-${what}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;

async function whoami() {
  try {
    const {body} = await api("/whoami");
    access = body.access;
    $("#who").textContent = body.token_required ? `signed in: ${access === "write" ? "operator" : "read-only"}` : "open (loopback, no token)";
    tokenInput.style.display = body.token_required ? "" : "none";
  } catch (e) {
    $("#who").textContent = e.message;
  }
}

// ------------------------------------------------------------------ list
async function listPage() {
  const q = new URLSearchParams(location.search);
  const main = $("#main");
  main.innerHTML = `
    <h1>Runs</h1>
    <div class="counts" id="store-counts" title="Runs in the whole store, by status"></div>
    <form class="filters" id="filters">
      <label>Status<select name="status"><option value="">any</option>${["running","completed","failed","cancelled","terminated","timed-out","continued-as-new"].map((s) => `<option>${s}</option>`).join("")}</select></label>
      <label>Type<input name="type" placeholder="demo.order" size="14"></label>
      <label>Started after<input name="from" type="datetime-local"></label>
      <label>Started before<input name="to" type="datetime-local"></label>
      <label>Filter (search attributes…)<input name="where" placeholder='customer = "c-42"' size="30"></label>
      <button type="submit">Apply</button>
      <label class="note"><span><input type="checkbox" name="live" checked> live</span></label>
    </form>
    <div class="counts" id="counts"></div>
    <div id="list-error"></div>
    <table><thead><tr><th>Instance</th><th>Type</th><th>Status</th><th>Events</th><th>Started</th><th>Closed</th><th>Attributes</th></tr></thead><tbody id="rows"></tbody></table>
    <div class="pager"><button class="secondary" id="first" type="button">First page</button><button class="secondary" id="next" type="button">Next page</button><span class="note" id="pageinfo"></span></div>`;
  const form = $("#filters");
  for (const k of ["status", "type", "where", "from", "to"]) if (q.get(k)) form.elements[k].value = q.get(k);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    for (const k of ["status", "type", "where", "from", "to"]) if (form.elements[k].value) p.set(k, form.elements[k].value);
    history.pushState(null, "", "/?" + p.toString());
    route();
  });
  $("#first").onclick = () => { const p = new URLSearchParams(location.search); p.delete("after"); history.pushState(null, "", "/?" + p); route(); };
  const load = async () => {
    const where = [];
    if (q.get("where")) where.push(q.get("where"));
    if (q.get("from")) where.push(`start_time >= ${new Date(q.get("from")).getTime()}`);
    if (q.get("to")) where.push(`start_time < ${new Date(q.get("to")).getTime()}`);
    const p = new URLSearchParams({page_size: "50"});
    if (where.length) p.set("where", where.join(" and "));
    for (const k of ["status", "type", "after"]) if (q.get(k)) p.set(k, q.get(k));
    try {
      const {body} = await api("/runs?" + p);
      $("#list-error").innerHTML = "";
      $("#rows").innerHTML = body.runs.map((r) => `<tr>
        <td><a href="/runs/${encodeURIComponent(r.run_id)}">${esc(r.instance_id)}</a><div class="note mono">${esc(r.run_id)}</div></td>
        <td>${esc(r.workflow_type)}</td><td>${badge(r.status, r.parked)}</td><td>${r.events}</td>
        <td>${when(r.started_at)}</td><td>${when(r.closed_at)}</td>
        <td class="mono">${Object.entries(r.search_attributes || {}).map(([k, v]) => esc(k + "=" + v)).join(" ") || "–"}</td></tr>`).join("") || `<tr><td colspan="7" class="note">No runs match.</td></tr>`;
      const counts = {};
      for (const r of body.runs) { const s = r.parked ? "parked" : r.status; counts[s] = (counts[s] || 0) + 1; }
      $("#counts").innerHTML = `<span>${body.runs.length} on this page${body.next ? "+" : ""}</span>` + Object.entries(counts).map(([s, n]) => `<span>${badge(s === "parked" ? "running" : s, s === "parked")} ${n}</span>`).join("");
      const next = $("#next");
      next.disabled = !body.next;
      next.onclick = () => { const np = new URLSearchParams(location.search); np.set("after", body.next); history.pushState(null, "", "/?" + np); route(); };
      $("#pageinfo").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      $("#list-error").innerHTML = `<div class="error">${esc(e.message)}</div>`;
    }
    try {
      // Store-wide, each count capped at `limit` (shown as "limit+").
      const {body} = await api("/counts");
      const n = (v) => v >= body.limit ? `${body.limit}+` : String(v);
      const chips = Object.entries(body.counts).filter(([, v]) => v > 0).map(([s, v]) => `<a href="/?status=${encodeURIComponent(s)}">${badge(s)} ${n(v)}</a>`);
      if (body.parked > 0) chips.push(`<span>${badge("running", true)} ${n(body.parked)}</span>`);
      $("#store-counts").innerHTML = `<span>in the store</span>` + (chips.join("") || `<span>no runs yet</span>`);
    } catch (e) {
      $("#store-counts").innerHTML = "";
    }
  };
  await load();
  const timer = setInterval(() => { if (!document.body.contains(form)) return clearInterval(timer); if (form.elements.live.checked) load(); }, 3000);
}

// ------------------------------------------------------------------ schedules
const span = (ms) => ms % 86400000 === 0 ? `${ms / 86400000} d` : ms % 3600000 === 0 ? `${ms / 3600000} h` : ms % 60000 === 0 ? `${ms / 60000} min` : ms % 1000 === 0 ? `${ms / 1000} s` : `${ms} ms`;
const calendar = (spec) => [...(spec.intervals || []).map((i) => `every ${span(i.every_ms)}${i.offset_ms ? " + " + span(i.offset_ms) : ""}`), ...(spec.cron || []).map((c) => `cron ${c}`)].join("; ") + (spec.time_zone ? ` (${spec.time_zone})` : "");
const outcomeText = (o) => typeof o === "string" ? o.toLowerCase() : Object.entries(o || {}).map(([k, v]) => `${k.toLowerCase()}: ${v}`).join("");
const scheduleBadge = (paused) => paused ? `<span class="badge s-paused">paused</span>` : `<span class="badge s-running">active</span>`;
const runLink = (instance) => `<a href="/runs/${encodeURIComponent(instance)}">${esc(instance)}</a>`;

async function schedulesPage() {
  const main = $("#main");
  main.innerHTML = `<h1>Schedules</h1><div id="schedules" class="note">Loading…</div>`;
  try {
    const {body} = await api("/schedules");
    const rows = body.schedules.map((s) => {
      const m = s.summary || {};
      const counts = m.counts ? esc(`${m.counts.started} started, ${m.counts.completed} completed, ${m.counts.failed} failed, ${m.counts.skipped} skipped, ${m.counts.missed} missed`) : "–";
      return `<tr><td><a href="/schedules/${encodeURIComponent(s.id)}">${esc(s.id)}</a></td><td>${esc(m.workflow_type || "–")}</td>
        <td class="mono">${m.spec ? esc(calendar(m.spec)) : "–"}</td><td>${scheduleBadge(m.paused)}</td>
        <td>${m.last ? `${when(m.last.nominal)}: ${esc(outcomeText(m.last.outcome))}` : "–"}</td><td>${counts}</td></tr>`;
    });
    const box = $("#schedules");
    box.className = "";
    box.innerHTML = `<table><thead><tr><th>Schedule</th><th>Starts</th><th>Calendar</th><th>State</th><th>Last trigger</th><th>Counts</th></tr></thead>
      <tbody id="schedule-rows">${rows.join("") || `<tr><td colspan="6" class="note">No schedules.</td></tr>`}</tbody></table>`;
  } catch (e) {
    $("#schedules").innerHTML = `<div class="error">${esc(e.message)}</div>`;
  }
}

async function schedulePage(id) {
  const main = $("#main");
  let d;
  try {
    d = (await api("/schedules/" + encodeURIComponent(id))).body;
  } catch (e) {
    main.innerHTML = `<h1>Schedule</h1><div class="error">${esc(e.message)}</div><p><a href="/schedules">All schedules</a></p>`;
    return;
  }
  const ro = access !== "write" ? "disabled title='needs the operator token'" : "";
  const verb = d.paused ? "unpause" : "pause";
  main.innerHTML = `
    <p><a href="/schedules">← All schedules</a></p>
    <h1>${esc(d.id)} ${scheduleBadge(d.paused)}</h1>
    <div id="action-result"></div>
    <div class="grid">
      <div class="panel"><dl>
        <dt>Starts</dt><dd>${esc(d.workflow_type)}</dd>
        <dt>Calendar</dt><dd class="mono">${esc(calendar(d.spec))}</dd>
        <dt>Window</dt><dd>${d.spec.start_at ? when(d.spec.start_at) : "–"} to ${d.spec.end_at ? when(d.spec.end_at) : "–"}</dd>
        <dt>Jitter</dt><dd>${d.spec.jitter_ms ? "up to " + esc(span(d.spec.jitter_ms)) : "–"}</dd>
        <dt>Overlap</dt><dd>${esc(d.policies.overlap)}</dd>
        <dt>Catch-up</dt><dd>${esc(span(d.policies.catchup_window_ms))}</dd>
        <dt>Its own run</dt><dd>${runLink(d.instance_id)}</dd>
      </dl></div>
      <div class="panel"><dl>
        <dt>Next</dt><dd id="next-times">${(d.next || []).map(when).join("<br>") || (d.paused ? "– (paused)" : "–")}</dd>
        <dt>Open runs</dt><dd>${(d.running || []).map(runLink).join("<br>") || "–"}</dd>
        <dt>Waiting</dt><dd>${(d.pending || []).map((p) => `${when(p.nominal)} (${esc(p.overlap)})`).join("<br>") || "–"}</dd>
        <dt>Counts</dt><dd>${Object.entries(d.counts || {}).map(([k, v]) => esc(`${k.replaceAll("_", " ")} ${v}`)).join(", ")}</dd>
        <dt>Note</dt><dd>${esc(d.note) || "–"}</dd>
      </dl></div>
      <div class="panel actions"><form id="pause-form"><strong>${d.paused ? "Unpause" : "Pause"} calendar triggers</strong>
        <input name="note" placeholder="note: why" maxlength="1024">
        <button ${ro}>${d.paused ? "Unpause" : "Pause"}</button></form></div>
    </div>
    <h2>Recent triggers</h2>
    <table><thead><tr><th>Time</th><th>Started</th><th>Instance</th><th>Outcome</th><th>By</th></tr></thead>
      <tbody id="triggers">${(d.recent || []).slice().reverse().map((t) => `<tr><td>${when(t.nominal)}</td><td>${when(t.started_at)}</td>
        <td>${t.started_at ? runLink(t.instance) : esc(t.instance)}</td><td>${esc(outcomeText(t.outcome))}</td><td>${t.manual ? "a person" : "the calendar"}</td></tr>`).join("")
        || `<tr><td colspan="5" class="note">None yet.</td></tr>`}</tbody></table>`;
  $("#pause-form").onsubmit = async (ev) => {
    ev.preventDefault();
    try {
      await api(`/schedules/${encodeURIComponent(d.id)}/${verb}`, {method: "POST", body: {note: ev.target.elements.note.value}});
      $("#action-result").innerHTML = `<div class="panel">${verb === "pause" ? "Paused" : "Unpaused"}.</div>`;
      setTimeout(() => schedulePage(id), 400);
    } catch (e) {
      $("#action-result").innerHTML = `<div class="error">${esc(e.message)}</div>`;
    }
  };
}

// ------------------------------------------------------------------ run
// A parked run's history replayed against this build: where the recorded
// and the new command part ways, side by side.
async function showDivergence(target) {
  const box = $("#divergence");
  try {
    const r = (await api(target + "/replay")).body;
    if (!document.body.contains(box)) return;
    if (r.result === "diverged") {
      box.className = "divergence";
      box.innerHTML = `<table class="side"><thead><tr><th>Step ${esc(r.step)}: recorded in the history</th><th>Issued by this build's code</th></tr></thead>
        <tbody><tr><td class="mono recorded">${esc(r.recorded)}</td><td class="mono issued">${esc(r.issued)}</td></tr></tbody></table>
        <p class="note">Deploy code that issues the recorded command at this step (or branch on a version marker), then resume.</p>`;
    } else if (r.result === "ok") {
      box.className = "divergence note";
      box.textContent = `This build replays all ${r.events} events as recorded: resuming re-checks the run and lets it go on.`;
    } else {
      box.className = "divergence note";
      box.textContent = `Replay against this build: ${r.kind}${r.step != null ? " at step " + r.step : ""}: ${r.message}`;
    }
  } catch (e) {
    box.textContent = "Could not replay: " + e.message;
  }
}

const kindClass = (k) => /Completed|Fired|Delivered|Received/.test(k) ? "k-done" : /Failed|TimedOut|Terminated|Cancel/.test(k) ? "k-fail" : /Timer|Signal/.test(k) ? "k-wait" : "";

async function runPage(id) {
  const main = $("#main");
  let d;
  try {
    d = (await api("/runs/" + encodeURIComponent(id))).body;
  } catch (e) {
    main.innerHTML = `<h1>Run</h1><div class="error">${esc(e.message)}</div><p><a href="/">All runs</a></p>`;
    return;
  }
  const ro = access !== "write" ? "disabled title='needs the operator token'" : "";
  const open = d.status === "running";
  main.innerHTML = `
    <p><a href="/">← All runs</a></p>
    <h1>${esc(d.instance_id)} ${badge(d.status, d.parked)}</h1>
    <div id="action-result"></div>
    ${d.parked ? `<div class="panel parked"><strong>Parked: ${esc(d.parked.kind)}</strong> since ${when(d.parked.at)}<pre class="mono" style="white-space:pre-wrap">${esc(d.parked.reason)}</pre><div id="divergence" class="note">Replaying the history against this build…</div><button id="resume" ${ro}>Resume (re-check against this build's code)</button></div>` : ""}
    <div class="grid">
      <div class="panel"><dl>
        <dt>Run</dt><dd class="mono">${esc(d.run_id)}</dd>
        <dt>Type</dt><dd>${esc(d.workflow_type)}</dd>
        <dt>Started</dt><dd>${when(d.started_at)}</dd>
        <dt>Updated</dt><dd>${when(d.updated_at)}</dd>
        <dt>Closed</dt><dd>${when(d.closed_at)}</dd>
        <dt>Events</dt><dd>${d.history_len}</dd>
        <dt>Parent</dt><dd>${d.parent ? `<a href="/runs/${esc(d.parent.run_id)}">${esc(d.parent.run_id)}</a> step ${d.parent.step}` : "–"}</dd>
        <dt>Outcome</dt><dd class="mono">${d.outcome ? json(d.outcome) : "–"}</dd>
        <dt>Cancel</dt><dd>${d.cancel_requested ? "requested" : "–"}</dd>
        <dt>Store</dt><dd>${esc(d.store_health)}</dd>
      </dl></div>
      <div class="panel"><dl>
        <dt>Memo</dt><dd class="mono">${Object.keys(d.memo || {}).length ? json(d.memo) : "–"}</dd>
        <dt>Attributes</dt><dd class="mono">${Object.keys(d.search_attributes || {}).length ? json(d.search_attributes) : "–"}</dd>
        <dt>Waits for signals</dt><dd>${(d.signal_waits || []).map(([n, c]) => `<span class="mono">${esc(n)}</span> (${c})`).join(", ") || "–"}</dd>
        <dt>Coroutines</dt><dd>${d.coroutines ?? "– (not in memory)"}</dd>
      </dl></div>
      ${open ? `<div class="panel actions">
        <form id="signal-form"><strong>Signal</strong>
          <input name="name" placeholder="signal name" value="${esc((d.signal_waits || [])[0]?.[0] || "")}" required>
          <textarea name="payload" rows="2" placeholder='JSON payload, e.g. "ops-team"'>null</textarea>
          <button ${ro}>Send signal</button></form>
        <form id="cancel-form"><strong>Cancel or terminate</strong>
          <input name="reason" placeholder="reason">
          <span><button ${ro} name="cancel" class="secondary">Request cancel</button> <button ${ro} name="terminate" class="danger">Terminate</button></span></form>
      </div>` : ""}
    </div>
    <h2>Open waits</h2>
    ${table(["Step", "Kind", "Name", "Group path", "Since", "Attempt", "Due / fires", "Last failure"], (d.pending || []).map((p) => [p.step, p.kind, p.name || "–", groupText(p.group), when(p.since), p.attempt ?? "–", when(p.fire_at || p.due), p.last_failure || "–"]))}
    <h2>Attempts</h2>
    ${table(["Step", "Attempt", "State", "Lease owner", "Epoch", "Expires / due", "Deliveries", "Delayed by"], (d.attempts || []).map((a) => [a.step, a.attempt_id, a.state, a.lease_owner || "–", a.epoch, when(a.expires_at), a.deliveries, a.delayed_by || "–"]))}
    <h2>Scopes</h2>
    ${table(["Step", "Parent", "State"], (d.scopes || []).map((s) => [s.step ?? "–", s.parent ?? "–", JSON.stringify(Object.fromEntries(Object.entries(s).filter(([k]) => k !== "step" && k !== "parent")))]))}
    <h2>Children</h2>
    <table><thead><tr><th>Step</th><th>Instance</th><th>Type</th><th>Status</th></tr></thead><tbody>${(d.children || []).map((c) => `<tr><td>${c.step}</td><td><a href="/runs/${encodeURIComponent(c.run_id)}">${esc(c.instance_id)}</a></td><td>${esc(c.workflow_type)}</td><td>${c.status ? badge(String(c.status).toLowerCase()) : "not started"}</td></tr>`).join("") || `<tr><td colspan="4" class="note">None.</td></tr>`}</tbody></table>
    <h2>History</h2>
    <div class="timeline" id="timeline" title="events over the run's life"></div>
    <table><thead><tr><th>Seq</th><th>Time</th><th>Kind</th><th>Step</th><th>Details</th></tr></thead><tbody id="events"></tbody></table>
    <div class="pager"><button class="secondary" id="more" type="button">Load more</button><span class="note" id="history-info"></span></div>`;
  const report = (msg, bad) => { $("#action-result").innerHTML = `<div class="${bad ? "error" : "panel"}">${esc(msg)}</div>`; };
  const act = async (path, body, done) => {
    try { await api(path, {method: "POST", body}); report(done); setTimeout(() => runPage(id), 400); }
    catch (e) { report(e.message, true); }
  };
  const target = "/runs/" + encodeURIComponent(d.run_id);
  if ($("#divergence")) showDivergence(target);
  if ($("#resume")) $("#resume").onclick = async () => {
    try { const {body} = await api(target + "/resume", {method: "POST", body: {}}); report(body.fits ? "Resumed: the history replays against this build." : "Still parked: " + body.reason, !body.fits); setTimeout(() => runPage(id), 600); }
    catch (e) { report(e.message, true); }
  };
  if ($("#signal-form")) $("#signal-form").onsubmit = (ev) => {
    ev.preventDefault();
    let payload;
    try { payload = JSON.parse(ev.target.elements.payload.value || "null"); } catch (e) { return report("payload: not JSON: " + e.message, true); }
    act(target + "/signal", {name: ev.target.elements.name.value, payload, command_id: commandId("signal")}, "Signal committed.");
  };
  if ($("#cancel-form")) {
    const f = $("#cancel-form");
    f.onsubmit = (ev) => ev.preventDefault();
    f.elements.cancel.onclick = () => act(target + "/cancel", {reason: f.elements.reason.value, command_id: commandId("cancel")}, "Cancellation requested.");
    f.elements.terminate.onclick = () => { if (confirm("Terminate this run without running its code?")) act(target + "/terminate", {reason: f.elements.reason.value, command_id: commandId("terminate")}, "Terminated."); };
  }
  let from = 1;
  const all = [];
  const more = async () => {
    try {
      const {body} = await api(`${target}/history?from=${from}&limit=200`);
      all.push(...body.events);
      $("#events").insertAdjacentHTML("beforeend", body.events.map((e) => {
        const rest = Object.entries(e).filter(([k]) => !["seq", "at", "time", "kind", "step", "group"].includes(k));
        return `<tr><td>${e.seq}</td><td>${when(e.at)}</td><td class="mono">${esc(e.kind)}</td><td>${e.step ?? "–"}</td><td class="mono">${rest.map(([k, v]) => esc(k) + "=" + json(v)).join(" ")}</td></tr>`;
      }).join(""));
      from = body.next_from || from;
      $("#more").disabled = !body.next_from;
      $("#history-info").textContent = `${all.length} of ${body.total} events`;
      const t0 = all[0]?.at || 0, t1 = Math.max(all[all.length - 1]?.at || t0, t0 + 1);
      $("#timeline").innerHTML = all.map((e) => `<i class="${kindClass(e.kind)}" style="left:${(1 + 98 * (e.at - t0) / (t1 - t0)).toFixed(2)}%" title="#${e.seq} ${esc(e.kind)} ${when(e.at)}"></i>`).join("");
    } catch (e) { $("#history-info").textContent = e.message; }
  };
  $("#more").onclick = more;
  await more();
}

function groupText(g) {
  if (!g || !g.length) return "–";
  return g.map((x) => `${x.step}[${x.index}/${x.size}]`).join(" › ");
}

function table(heads, rows) {
  return `<table><thead><tr>${heads.map((h) => `<th>${h}</th>`).join("")}</tr></thead><tbody>${rows.map((r) => `<tr>${r.map((c) => `<td>${esc(c)}</td>`).join("")}</tr>`).join("") || `<tr><td colspan="${heads.length}" class="note">None.</td></tr>`}</tbody></table>`;
}

async function route() {
  await whoami();
  const m = location.pathname.match(/^\/runs\/(.+)$/);
  const s = location.pathname.match(/^\/schedules\/(.+)$/);
  if (m) await runPage(decodeURIComponent(m[1]));
  else if (s) await schedulePage(decodeURIComponent(s[1]));
  else if (location.pathname === "/schedules") await schedulesPage();
  else await listPage();
}
window.addEventListener("popstate", route);
route();
