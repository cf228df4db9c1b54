// One job's attempt timeline as an SVG picture: a lane per attempt on a shared time axis, with
// the claim (thin bar, ○ at the claim), the run (thick bar from ▷ start), heartbeats (ticks),
// the stretch the attempt was suspect (hatched), the lease still ahead of a live attempt
// (dashed), and the outcome at the end. The job's own events (enqueued, requeued, canceled)
// are on the top lane. Colours come from style.css through classes.

const NS = 'http://www.w3.org/2000/svg';
const WIDTH = 960;
const LEFT = 150;
const RIGHT = 110;
const TOP = 30;
const LANE = 36;

function svg(tag, attrs = {}, ...children) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
const title = (text) => svg('title', {}, text);
const ms = (t) => (t ? Date.parse(t) : undefined);
const statusName = (s) => String(s ?? '').replace(/^ATTEMPT_STATUS_|^JOB_STATUS_/, '').toLowerCase();
const clock = (t) => new Date(t).toLocaleTimeString();

const STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400].map((s) => s * 1000);
const OUTCOME_MARK = { succeeded: '✓', failed: '✗', lease_expired: '!', claim_expired: '!', timed_out: '!', canceled: '–' };

/**
 * Draws `detail` (an AdminService.GetJob answer) with `heartbeats` (attempt id → Set of times in
 * ms seen while watching). Returns an <svg> element.
 */
export function renderTimeline(detail, heartbeats = new Map()) {
  const { job, attempts, events } = detail;
  const now = ms(detail.now) ?? Date.now();
  const ends = attempts.map((a) => ms(a.endedAt) ?? now);
  const t0 = Math.min(ms(job.createdAt) ?? now, ...attempts.map((a) => ms(a.claimedAt) ?? now), ...events.map((e) => ms(e.at) ?? now));
  const live = attempts.find((a) => !a.endedAt);
  // A job still in play runs to now (and its lease ahead); a finished one to its end.
  const open = !['JOB_STATUS_SUCCEEDED', 'JOB_STATUS_FAILED', 'JOB_STATUS_DEAD', 'JOB_STATUS_CANCELED'].includes(job.status);
  const t1Raw = Math.max(open ? now : 0, ms(job.finishedAt) ?? 0, ...ends, ...events.map((e) => ms(e.at) ?? 0), live && job.leaseExpiresAt ? ms(job.leaseExpiresAt) : 0);
  const span = Math.max(t1Raw - t0, 1000);
  const t1 = t0 + span * 1.03;
  const x = (t) => LEFT + ((t - t0) / (t1 - t0)) * (WIDTH - LEFT - RIGHT);
  const height = TOP + LANE * (attempts.length + 1) + 24;

  const root = svg('svg', {
    viewBox: `0 0 ${WIDTH} ${height}`,
    width: WIDTH,
    height,
    class: 'timeline',
    role: 'img',
    'aria-label': `attempt timeline of job ${job.id}: ${attempts.length} attempt(s), ${statusName(job.status)}`,
  });
  root.append(
    svg(
      'defs',
      {},
      svg('pattern', { id: 'suspect-hatch', width: 6, height: 6, patternUnits: 'userSpaceOnUse', patternTransform: 'rotate(45)' }, svg('rect', { width: 3, height: 6, class: 'hatch' })),
    ),
  );

  // Axis: ticks at a round step, labelled from the first moment on the picture.
  const step = STEPS.find((s) => span / s <= 8) ?? STEPS.at(-1);
  const axis = svg('g', { class: 'axis' });
  for (let t = 0; t <= t1 - t0; t += step) {
    const px = x(t0 + t);
    const label = t < 60_000 ? `+${t / 1000}s` : t < 3_600_000 ? `+${Math.round(t / 60_000)}m` : `+${(t / 3_600_000).toFixed(1)}h`;
    axis.append(svg('line', { x1: px, x2: px, y1: TOP - 6, y2: height - 20, class: 'grid' }), svg('text', { x: px, y: TOP - 10, 'text-anchor': 'middle' }, label));
  }
  axis.append(svg('text', { x: 8, y: TOP - 10, class: 'axis-start' }, clock(t0)));
  if (now <= t1) {
    const nowX = x(now);
    axis.append(svg('line', { x1: nowX, x2: nowX, y1: TOP - 4, y2: height - 20, class: 'now' }, title(`now (database time) ${clock(now)}`)));
  }
  root.append(axis);

  // The job's lane: enqueue, requeue and cancel.
  const jobY = TOP + LANE / 2;
  const jobLane = svg('g', { class: 'lane job-lane' }, svg('text', { x: 8, y: jobY + 4, class: 'label' }, 'job'));
  for (const e of events.filter((ev) => ['enqueued', 'requeued', 'canceled', 'dead'].includes(ev.kind))) {
    const px = x(ms(e.at));
    jobLane.append(
      svg('path', { d: `M${px} ${jobY - 6} L${px + 6} ${jobY} L${px} ${jobY + 6} L${px - 6} ${jobY} Z`, class: `event ${e.kind}` }, title(`${e.kind} at ${clock(ms(e.at))}`)),
      svg('text', { x: px + 8, y: jobY - 8, class: 'event-label' }, e.kind),
    );
  }
  root.append(jobLane);

  // Which attempt the stored last heartbeat belongs to: the newest one running at that time.
  const lastBeat = ms(detail.heartbeatAt);
  const beatOwner = lastBeat === undefined ? undefined : [...attempts].reverse().find((a) => a.startedAt && ms(a.startedAt) <= lastBeat && lastBeat <= (ms(a.endedAt) ?? now));

  attempts.forEach((a, i) => {
    const y = TOP + LANE * (i + 1) + LANE / 2;
    const status = statusName(a.status);
    const claimed = ms(a.claimedAt);
    const started = ms(a.startedAt);
    const end = ms(a.endedAt) ?? now;
    const g = svg('g', { class: `lane attempt ${status}`, 'data-attempt-id': a.id });
    g.append(
      svg('text', { x: 8, y: y + 4, class: 'label' }, `#${a.attemptNo} ${a.agentId}`, title(`attempt ${a.id}`)),
      // The claim: from the claim to the start (or to its end, if it never started).
      svg('line', { x1: x(claimed), x2: x(started ?? end), y1: y, y2: y, class: 'claim' }),
      svg('circle', { cx: x(claimed), cy: y, r: 5, class: 'claimed-mark' }, title(`claimed at ${clock(claimed)}, start by ${clock(ms(a.claimDeadline))}`)),
    );
    if (started !== undefined) {
      g.append(
        svg('rect', { x: x(started), y: y - 7, width: Math.max(2, x(end) - x(started)), height: 14, rx: 3, class: 'run' }, title(`ran from ${clock(started)} to ${a.endedAt ? clock(end) : 'now'}`)),
        svg('path', { d: `M${x(started)} ${y - 8} L${x(started) + 9} ${y} L${x(started)} ${y + 8} Z`, class: 'started-mark' }, title(`started at ${clock(started)}`)),
      );
    }
    const suspect = ms(a.suspectSince);
    if (suspect !== undefined) {
      g.append(svg('rect', { x: x(suspect), y: y - 10, width: Math.max(2, x(end) - x(suspect)), height: 20, class: 'suspect', fill: 'url(#suspect-hatch)' }, title(`suspect since ${clock(suspect)}: the agent's stream was lost`)));
    }
    const beats = new Set(heartbeats.get(a.id) ?? []);
    if (beatOwner === a && lastBeat !== undefined) beats.add(lastBeat);
    for (const b of [...beats].sort()) {
      if (started !== undefined && (b < started || b > end)) continue;
      g.append(svg('line', { x1: x(b), x2: x(b), y1: y - 11, y2: y + 11, class: 'heartbeat' }, title(`heartbeat at ${clock(b)}`)));
    }
    if (!a.endedAt) {
      // A live attempt: its start deadline or lease, still ahead.
      const until = ms(job.leaseExpiresAt);
      if (until !== undefined && until > now) g.append(svg('line', { x1: x(now), x2: x(until), y1: y, y2: y, class: 'lease' }, title(`${started ? 'lease' : 'start deadline'} until ${clock(until)}`)));
      g.append(svg('text', { x: x(Math.max(now, until ?? now)) + 8, y: y + 4, class: 'outcome-label' }, status));
    } else {
      const mark = OUTCOME_MARK[status] ?? '•';
      g.append(
        svg('circle', { cx: x(end), cy: y, r: 8, class: `outcome ${status}` }, title(`${status} at ${clock(end)}`)),
        svg('text', { x: x(end), y: y + 4, 'text-anchor': 'middle', class: 'outcome-mark' }, mark),
        svg('text', { x: x(end) + 12, y: y + 4, class: 'outcome-label' }, status.replace('_', ' ')),
      );
    }
    root.append(g);
  });
  return root;
}
