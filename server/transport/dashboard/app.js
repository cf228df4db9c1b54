// The Leasehold dashboard: queue depths, agents online with their suspect attempts, recent
// failures and dead letters (with a requeue button), recent jobs, and one job's attempt
// timeline. It calls AdminService in Connect JSON on this origin with the key the operator typed
// (kept in sessionStorage, so it is gone when the tab closes) and polls every 1.5 s while live.
// Every value from the server is written with textContent, never as HTML.
import { renderTimeline } from './timeline.js';

const KEY_STORAGE = 'leasehold.adminKey';
const POLL_MS = 1500;

const $ = (id) => document.getElementById(id);
const state = {
  key: sessionStorage.getItem(KEY_STORAGE) ?? '',
  jobId: decodeURIComponent(location.hash.slice(1)),
  timer: undefined,
  busy: false,
  /** Heartbeat times seen per attempt while watching a job (the server keeps only the latest). */
  heartbeats: new Map(),
};

/** Calls an AdminService method; throws an Error with `status` on a non-2xx answer. */
async function call(method, body = {}) {
  const res = await fetch(`/leasehold.v1.AdminService/${method}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${state.key}` },
    body: JSON.stringify(body),
  });
  const json = await res.json().catch(() => ({}));
  if (!res.ok) {
    const err = new Error(json.message || `HTTP ${res.status}`);
    err.status = res.status;
    throw err;
  }
  return json;
}

/** Creates an element: `el('td', { class: 'x' }, 'text', child)`. Strings become text nodes. */
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'dataset') Object.assign(e.dataset, v);
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c ?? '')));
  return e;
}

const statusName = (s) => String(s ?? '').replace(/^JOB_STATUS_|^ATTEMPT_STATUS_/, '').toLowerCase();
const time = (t) => (t ? new Date(t).toLocaleTimeString() : '-');
const dateTime = (t) => (t ? new Date(t).toLocaleString([], { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit' }) : '-');
const seconds = (d) => (d ? Number.parseFloat(d) : 0);
function age(s) {
  if (s < 60) return `${Math.round(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}
const shortId = (id) => id.slice(0, 8);

function jobLink(id) {
  return el('a', { href: `#${id}`, class: 'job-link', title: id, dataset: { jobId: id }, onclick: (ev) => { ev.preventDefault(); openJob(id); } }, shortId(id));
}

function setRows(table, rows, empty) {
  const body = table.tBodies[0];
  body.replaceChildren(...(rows.length ? rows : [el('tr', { class: 'empty' }, el('td', { colspan: table.tHead.rows[0]?.cells.length ?? 1 }, empty))]));
}

function show(message, kind = 'info') {
  const m = $('message');
  m.textContent = message;
  m.className = `message ${kind}`;
  m.hidden = !message;
}

// ── panels ──

const STATUSES = ['QUEUED', 'CLAIMED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'DEAD', 'CANCELED'];

function renderQueues(stats) {
  const queues = [...new Set([...stats.depths.map((d) => d.queue), ...stats.waiting.map((w) => w.queue)])].sort();
  const head = $('queues').tHead;
  head.replaceChildren(el('tr', {}, el('th', {}, 'Queue'), ...STATUSES.map((s) => el('th', { class: 'num' }, s.toLowerCase())), el('th', { class: 'num' }, 'due'), el('th', { class: 'num' }, 'oldest wait')));
  const count = (q, s) => Number(stats.depths.find((d) => d.queue === q && d.status === `JOB_STATUS_${s}`)?.count ?? 0);
  const max = Math.max(1, ...queues.flatMap((q) => STATUSES.map((s) => count(q, s))));
  setRows(
    $('queues'),
    queues.map((q) => {
      const w = stats.waiting.find((x) => x.queue === q);
      return el(
        'tr',
        { dataset: { queue: q } },
        el('td', {}, q),
        ...STATUSES.map((s) => {
          const n = count(q, s);
          const cell = el('td', { class: `num depth ${s.toLowerCase()}`, title: `${n} ${s.toLowerCase()}` }, String(n));
          cell.style.setProperty('--fill', `${Math.round((100 * n) / max)}%`);
          return cell;
        }),
        el('td', { class: 'num' }, String(w ? Number(w.due) : 0)),
        el('td', { class: `num ${w && seconds(w.oldestAge) > 60 ? 'warn' : ''}` }, w ? age(seconds(w.oldestAge)) : '-'),
      );
    }),
    'no jobs yet',
  );
  const f = (n) => Number(n).toFixed(2);
  $('rates').textContent =
    `last ${stats.windowMinutes} min: ${f(stats.completionsPerMinute)} completions/min · ${f(stats.failuresPerMinute)} failures/min · ` +
    `${f(stats.expiriesPerMinute)} expiries/min · ${Number(stats.staleReports)} stale reports`;
}

function renderAgents(list) {
  const online = list.agents.filter((a) => a.sessions.length || a.attempts.length);
  setRows(
    $('agents'),
    online.map((a) =>
      el(
        'tr',
        { dataset: { agentId: a.agentId }, class: a.suspect ? 'has-suspect' : '' },
        el('td', {}, a.agentId, a.sessions.some((s) => s.drainingSince) ? el('span', { class: 'badge' }, 'draining') : '', a.registered ? '' : el('span', { class: 'badge' }, 'key')),
        el('td', { class: 'num' }, String(a.sessions.length)),
        el('td', { class: 'num' }, String(a.slots)),
        el('td', { class: 'num' }, String(a.attempts.length)),
        el('td', { class: `num ${a.suspect ? 'bad' : ''}` }, String(a.suspect)),
        el('td', {}, [...new Set(a.sessions.flatMap((s) => s.queues))].join(', ') || '-'),
      ),
    ),
    'no agent connected',
  );
  const suspects = online.flatMap((a) => a.attempts.filter((h) => h.suspectSince).map((h) => ({ ...h, agentId: a.agentId })));
  $('suspects').replaceChildren(
    ...(suspects.length
      ? [
          el('h3', {}, 'Suspect attempts (stream lost; the lease runs down)'),
          el(
            'ul',
            { class: 'suspects' },
            ...suspects.map((h) =>
              el('li', { dataset: { attemptId: h.attemptId } }, jobLink(h.jobId), ` #${h.attemptNo} on ${h.queue} by ${h.agentId}, suspect since ${time(h.suspectSince)}, lease until ${time(h.leaseExpiresAt)}`),
            ),
          ),
        ]
      : []),
  );
}

function renderFailures(page) {
  setRows(
    $('failures'),
    page.jobs.map((j) =>
      el(
        'tr',
        { dataset: { jobId: j.id }, class: statusName(j.status) },
        el('td', {}, jobLink(j.id)),
        el('td', {}, j.queue),
        el('td', {}, el('span', { class: `pill ${statusName(j.status)}` }, statusName(j.status))),
        el('td', { class: 'num' }, `${j.attemptsStarted}/${j.maxAttempts}`),
        el('td', {}, time(j.finishedAt)),
        el('td', { class: 'error', title: j.error?.message ?? '' }, j.error?.message ?? '-'),
        el('td', {}, el('button', { type: 'button', class: 'requeue', dataset: { jobId: j.id }, onclick: (ev) => requeue(j.id, ev.currentTarget) }, 'Requeue')),
      ),
    ),
    'no failures',
  );
}

function renderJobs(page) {
  setRows(
    $('jobs'),
    page.jobs.map((j) =>
      el(
        'tr',
        { dataset: { jobId: j.id }, class: j.id === state.jobId ? 'selected' : '' },
        el('td', {}, jobLink(j.id)),
        el('td', {}, j.queue),
        el('td', {}, el('span', { class: `pill ${statusName(j.status)}` }, statusName(j.status))),
        el('td', { class: 'num' }, String(j.attemptNo)),
        el('td', {}, j.agentId || '-'),
        el('td', {}, dateTime(j.createdAt)),
      ),
    ),
    'no jobs yet',
  );
}

function renderJob(d) {
  const j = d.job;
  $('job-panel').hidden = false;
  $('job-title').textContent = `Job ${j.id}`;
  $('job-summary').replaceChildren(
    el('span', { class: `pill ${statusName(j.status)}` }, statusName(j.status)),
    ` queue ${j.queue} · attempt ${j.attemptNo} (${j.attemptsStarted} started of ${j.maxAttempts}) · created ${dateTime(j.createdAt)}`,
    j.error && j.status !== 'JOB_STATUS_SUCCEEDED' ? el('span', { class: 'error' }, ` · last error: ${j.error.message ?? ''}`) : '',
  );
  // Remember every heartbeat seen while watching; only the latest is stored by the server.
  const last = d.attempts.at(-1);
  if (last && d.heartbeatAt) {
    const seen = state.heartbeats.get(last.id) ?? new Set();
    seen.add(Date.parse(d.heartbeatAt));
    state.heartbeats.set(last.id, seen);
  }
  $('timeline').replaceChildren(renderTimeline(d, state.heartbeats));
  $('timeline-caption').textContent =
    `Each lane is one attempt: claimed ○, started ▷, heartbeats | (the last one stored, and those seen while this page watched), ` +
    `suspect (stream lost) hatched, outcome at the end. Lease ${seconds(d.leaseTtl)} s, heartbeat every ${seconds(d.heartbeatInterval)} s.`;
  setRows($('events'), d.events.map((e) => el('tr', {}, el('td', {}, time(e.at)), el('td', {}, e.kind), el('td', { class: 'mono' }, e.attemptId ? shortId(e.attemptId) : '-'))), 'no events');
}

// ── actions ──

async function requeue(jobId, button) {
  button.disabled = true;
  try {
    const r = await call('RequeueJob', { jobId });
    show(`job ${r.job.id} requeued on ${r.job.queue}`, 'ok');
    await refresh();
  } catch (err) {
    show(`requeue failed: ${err.message}`, 'error');
    button.disabled = false;
  }
}

async function openJob(id) {
  state.jobId = id;
  history.replaceState(null, '', `#${id}`);
  await refresh();
  $('job-panel').scrollIntoView({ block: 'nearest' });
}

async function refresh() {
  if (!state.key || state.busy) return;
  state.busy = true;
  try {
    const [stats, agents, failures, jobs, job] = await Promise.all([
      call('GetStats', { windowMinutes: 15 }),
      call('ListAgents', {}),
      call('ListJobs', { statuses: ['JOB_STATUS_FAILED', 'JOB_STATUS_DEAD'], pageSize: 15 }),
      call('ListJobs', { pageSize: 15 }),
      state.jobId ? call('GetJob', { jobId: state.jobId }).catch((err) => (err.status === 404 || err.status === 400 ? null : Promise.reject(err))) : null,
    ]);
    renderQueues(stats);
    renderAgents(agents);
    renderFailures(failures);
    renderJobs(jobs);
    if (job) renderJob(job);
    else $('job-panel').hidden = true;
    $('main').hidden = false;
    $('status').textContent = `connected · updated ${new Date().toLocaleTimeString()}`;
    $('status').className = 'status ok';
  } catch (err) {
    if (err.status === 401 || err.status === 403) {
      disconnect(`the key was refused: ${err.message}`);
    } else {
      $('status').textContent = `cannot refresh: ${err.message}`;
      $('status').className = 'status error';
    }
  } finally {
    state.busy = false;
  }
}

function schedule() {
  clearTimeout(state.timer);
  if (!state.key || !$('live').checked) return;
  state.timer = setTimeout(async () => {
    if (!document.hidden) await refresh();
    schedule();
  }, POLL_MS);
}

function connect(key) {
  state.key = key;
  sessionStorage.setItem(KEY_STORAGE, key);
  $('key-form').hidden = true;
  $('session').hidden = false;
  show('');
  refresh().then(schedule);
}

function disconnect(why) {
  clearTimeout(state.timer);
  state.key = '';
  sessionStorage.removeItem(KEY_STORAGE);
  $('key-form').hidden = false;
  $('session').hidden = true;
  $('main').hidden = true;
  $('status').textContent = 'not connected';
  $('status').className = 'status';
  if (why) show(why, 'error');
}

$('key-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  connect($('key').value.trim());
  $('key').value = '';
});
$('forget').addEventListener('click', () => disconnect(''));
$('live').addEventListener('change', () => ($('live').checked ? refresh().then(schedule) : clearTimeout(state.timer)));
$('find-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const id = $('find').value.trim();
  if (id) openJob(id);
});
window.addEventListener('hashchange', () => {
  const id = decodeURIComponent(location.hash.slice(1));
  if (id && id !== state.jobId) openJob(id);
});
if (state.key) connect(state.key);
