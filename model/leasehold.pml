/*
 * Leasehold: the lease/fence protocol of one job, in Promela, for spin.
 *
 *   spin -a leasehold.pml && gcc -O2 -DSAFETY -DNOCLAIM -o pan pan.c && ./pan -m100000
 *
 * in a scratch directory holding a copy of this file (spin writes pan.* there). model/README.md
 * has the liveness run, the broken configuration and the mapping to the store verbs.
 *
 * What is modelled is the transitions of server/store/ (claim.ts, start.ts, heartbeat.ts,
 * complete.ts, fail.ts, rescue.ts, cancel.ts): each verb is ONE
 * SQL statement there, so it is ONE atomic step here, guarded by the same fence as its WHERE
 * clause. A call whose fence does not match changes nothing; the follow-up read that names the
 * outcome (explain() in explain.ts) is modelled inside the same step and only sets `outcome`.
 *
 * Processes: two agents (claim, then start / heartbeat / complete / fail on their token, resend
 * any of them, or lose the token: crash, lost Assign), a late reporter (any attempt id ever
 * issued, sent as either agent: a superseded attempt, an outbox resend, another replica), the
 * clock (a held lease may pass at any time: time is abstract), the reaper (ends a passed lease)
 * and an operator who may cancel once.
 *
 * Invariants of /work/shared/DESIGN.md checked in EVERY reachable state (check() ends every step,
 * and every change of state is inside one step):
 *   (1) at most one current attempt, and it is the fence; every applied attempt write comes from
 *       the current attempt of the agent that holds it (applied());
 *   (2) a job reaches a terminal state at most once, and its status and stored result never
 *       change afterwards;
 *   (4) no job is lost: terminal, or queued with no attempt, or held by exactly one live attempt;
 *       and (ltl lease_ends, under weak fairness) a lease that passed does not stay passed:
 *       the holder renews or finishes, or the reaper ends it.
 *
 * -DNO_FENCE_ON_COMPLETE drops `current_attempt_id = attempt_id` from completion: the checker
 * must then report an assertion violation.
 */

#ifndef MAXA
#define MAXA   2        /* jobs.max_attempts */
#endif
#ifndef MAXID
#define MAXID  5        /* attempts explored: ids 1..MAXID, never reused (claims stop there) */
#endif
#define NAGENTS 2

mtype = { QUEUED, CLAIMED, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELED };
mtype = { OK, DUPLICATE, CONFLICT, STALE, FORBIDDEN, NOT_FOUND, PENDING };

/* attempts.status */
#define A_NONE          0
#define A_CLAIMED       1
#define A_RUNNING       2
#define A_SUCCEEDED     3
#define A_FAILED        4
#define A_CLAIM_EXPIRED 5
#define A_LEASE_EXPIRED 6
#define A_CANCELED      7

/* completions row of an attempt: kind and report */
#define C_NONE      0
#define C_RESULT1   1   /* completed with result r = 1 */
#define C_RESULT2   2   /* completed with result r = 2 */
#define C_RETRY     3   /* failed, retryable */
#define C_FINAL     4   /* failed, final */

/* jobs.result / jobs.error, as one value: who wrote it and what */
#define RESULT(a, r)   ((a) * 4 + (r))   /* r = 1 | 2 */
#define ERROR(a)       ((a) * 4 + 3)     /* a failure report, or the reaper's lease_expired */

/* ───────────── the jobs row (one job) ───────────── */
mtype status = QUEUED;
byte  cur = 0;          /* current_attempt_id (0 = NULL) */
byte  holder = 0;       /* agent_id (0 = NULL) */
byte  attempt_no = 0;   /* also the id of the newest attempt: ids are fresh and never reused */
byte  started = 0;      /* attempts_started */
bool  passed = false;   /* lease_expires_at < now() */
byte  stored = 0;       /* result or error */

/* ───────────── attempts and completions tables ───────────── */
byte att[MAXID + 1];        /* attempts.status, by id */
byte att_agent[MAXID + 1];  /* attempts.agent_id */
byte comp[MAXID + 1];       /* completions: C_* */

/* ───────────── ghosts (for the invariants only) ───────────── */
mtype fin_status = 0;   /* the terminal status, once reached */
byte  fin_stored = 0;   /* the stored result when it was reached */

/* not part of the state vector: scratch of one step */
hidden mtype outcome;
hidden byte k, nlive;
hidden mtype s_status; hidden byte s_cur, s_holder, s_no, s_started, s_stored, s_passed;

#define HELD        (status == CLAIMED || status == RUNNING)
#define TERMINAL    (status == SUCCEEDED || status == FAILED || status == DEAD || status == CANCELED)
#define LIVE(a)     (att[a] == A_CLAIMED || att[a] == A_RUNNING)

/* The fence of every write made on behalf of an attempt (besides the states it may act in):
 * jobs.current_attempt_id = $attempt AND jobs.agent_id = $agent. */
#define FENCE(a, ag)          (cur == (a) && holder == (ag))
#ifdef NO_FENCE_ON_COMPLETE
#define COMPLETE_FENCE(a, ag) (holder == (ag))
#else
#define COMPLETE_FENCE(a, ag) FENCE(a, ag)
#endif

/* ───────────── invariants ───────────── */

/* (1), per applied write: it is made by the job's current attempt, live, of the agent holding it. */
inline applied(a, ag) {
  printf("STEP write applied for attempt %d of agent %d (attempt %d of agent %d holds the job %e)\n",
         a, ag, cur, holder, status);
  assert(a == cur && att_agent[a] == ag && holder == ag && LIVE(a))
}

/* (2): the first terminal transition records what was reached. */
inline terminate() {
  assert(fin_status == 0);
  fin_status = status;
  fin_stored = stored
}

/* "Changes nothing": a call whose fence failed leaves the jobs row as it was. */
inline snap() {
  s_status = status; s_cur = cur; s_holder = holder; s_no = attempt_no;
  s_started = started; s_passed = passed; s_stored = stored
}
inline unchanged() {
  assert(s_status == status && s_cur == cur && s_holder == holder && s_no == attempt_no &&
         s_started == started && s_passed == passed && s_stored == stored);
  assert(outcome != OK)
}

/* (1), (2), (4) on the state as it stands: run at the end of every step. */
inline check() {
  /* (1) at most one live attempt, and it is the job's current attempt */
  nlive = 0;
  for (k : 1 .. MAXID) {
    if
    :: LIVE(k) -> nlive++; assert(k == cur)
    :: else -> skip
    fi
  }
  assert(nlive <= 1);
  assert(attempt_no <= MAXID && started <= MAXA);
  /* (4) no job is lost: held by exactly one live attempt, or queued, or terminal */
  if
  :: status == CLAIMED ->
       assert(cur != 0 && nlive == 1 && att[cur] == A_CLAIMED && att_agent[cur] == holder && holder != 0)
  :: status == RUNNING ->
       assert(cur != 0 && nlive == 1 && att[cur] == A_RUNNING && att_agent[cur] == holder && holder != 0 &&
              started >= 1)
  :: status == QUEUED ->
       assert(cur == 0 && holder == 0 && nlive == 0 && !passed && started < MAXA)
  :: else ->
       assert(TERMINAL && cur == 0 && holder == 0 && nlive == 0 && !passed)
  fi;
  /* (2) terminal at most once (terminate()), and nothing changes afterwards */
  if
  :: fin_status != 0 -> assert(status == fin_status && stored == fin_stored)
  :: else -> assert(!TERMINAL)
  fi;
  k = 0; nlive = 0
}

/* ───────────── the store verbs: one statement = one atomic step ───────────── */

/* jobClaim: status = 'queued' ... FOR UPDATE SKIP LOCKED; attempt_no + 1, fresh attempt id.
 * It does not steal a passed lease (docs/decisions.md): only queued jobs. */
inline claim(ag) {
  attempt_no++;
  cur = attempt_no; holder = ag; status = CLAIMED; passed = false;   /* fresh claim TTL */
  att[cur] = A_CLAIMED; att_agent[cur] = ag;
  printf("STEP claim(agent %d): OK; job %e, attempt %d\n", ag, status, cur)
}

/* Why a fenced write matched nothing (explain(): attempt lookup, then agent, then repeat). */
inline lookup(a, ag) {
  if
  :: att[a] == A_NONE -> outcome = NOT_FOUND
  :: else ->
       if
       :: att_agent[a] != ag -> outcome = FORBIDDEN
       :: else -> outcome = STALE   /* the caller refines it to DUPLICATE / CONFLICT / PENDING */
       fi
  fi
}

/* attemptStart: current_attempt_id = $1 AND agent_id = $2 AND status = 'claimed'. */
inline start(a, ag) {
  if
  :: FENCE(a, ag) && status == CLAIMED ->
       applied(a, ag);
       status = RUNNING; started++; passed = false;   /* the run lease */
       att[a] = A_RUNNING; outcome = OK
  :: else ->
       snap(); lookup(a, ag);
       if
       :: outcome == STALE && ((cur == a && status == RUNNING) || comp[a] != C_NONE) -> outcome = DUPLICATE
       :: else -> skip
       fi;
       unchanged()
  fi;
  printf("STEP start(attempt %d, agent %d): %e; job %e, attempt %d\n", a, ag, outcome, status, cur)
}

/* attemptHeartbeat: current_attempt_id = $1 AND agent_id = $2 AND status = 'running'
 * (execution deadline abstracted away). Renews the lease. */
inline heartbeat(a, ag) {
  if
  :: FENCE(a, ag) && status == RUNNING ->
       applied(a, ag);
       passed = false; outcome = OK
  :: else ->
       snap(); lookup(a, ag);
       if
       :: outcome == STALE && cur == a && HELD -> outcome = PENDING
       :: else -> skip
       fi;
       unchanged()
  fi;
  printf("STEP heartbeat(attempt %d, agent %d): %e; job %e, attempt %d\n", a, ag, outcome, status, cur)
}

/* A repeat of complete / fail: the same report is DUPLICATE, another is CONFLICT, none is STALE. */
inline repeat(a, c) {
  if
  :: outcome == STALE && comp[a] == (c) -> outcome = DUPLICATE
  :: outcome == STALE && comp[a] != C_NONE && comp[a] != (c) -> outcome = CONFLICT
  :: else -> skip
  fi
}

/* attemptComplete: current_attempt_id = $1 AND agent_id = $2 AND status IN ('claimed','running').
 * A claimed attempt is started implicitly (counted). */
inline complete(a, ag, r) {
  if
  :: COMPLETE_FENCE(a, ag) && HELD ->
       applied(a, ag);
       started = started + (status == CLAIMED);
       status = SUCCEEDED; stored = RESULT(a, r);
       cur = 0; holder = 0; passed = false;
       att[a] = A_SUCCEEDED; comp[a] = r;
       terminate(); outcome = OK
  :: else ->
       snap(); lookup(a, ag); repeat(a, r); unchanged()
  fi;
  printf("STEP complete(attempt %d, agent %d, result %d): %e; job %e, attempt %d\n", a, ag, r, outcome, status, cur)
}

/* attemptFail: the fence of complete; next = failed (final) | dead (started reached the cap)
 * | queued (retry after a backoff: time is abstract, so the job is claimable again). */
inline fail(a, ag, retryable) {
  if
  :: FENCE(a, ag) && HELD ->
       applied(a, ag);
       started = started + (status == CLAIMED);
       stored = ERROR(a);
       cur = 0; holder = 0; passed = false;
       att[a] = A_FAILED;
       if
       :: !retryable -> status = FAILED; comp[a] = C_FINAL; terminate()
       :: retryable && started >= MAXA -> status = DEAD; comp[a] = C_RETRY; terminate()
       :: retryable && started < MAXA -> status = QUEUED; comp[a] = C_RETRY
       fi;
       outcome = OK
  :: else ->
       snap(); lookup(a, ag);
       if
       :: retryable -> repeat(a, C_RETRY)
       :: else -> repeat(a, C_FINAL)
       fi;
       unchanged()
  fi;
  printf("STEP fail(attempt %d, agent %d, retryable %d): %e; job %e, attempt %d\n", a, ag, retryable, outcome, status, cur)
}

/* jobRescueExpired: status IN ('claimed','running') AND lease_expires_at < now(), SKIP LOCKED.
 * A claim never started goes back where it stood and does not count; a running attempt whose
 * lease passed goes back, or to dead when its started attempts reached the cap. */
inline rescue() {
  if
  :: status == CLAIMED ->
       att[cur] = A_CLAIM_EXPIRED; status = QUEUED
  :: status == RUNNING ->
       att[cur] = A_LEASE_EXPIRED; stored = ERROR(cur);
       if
       :: started >= MAXA -> status = DEAD
       :: else -> status = QUEUED
       fi
  fi;
  printf("STEP reaper ends attempt %d: job %e\n", cur, status);
  cur = 0; holder = 0; passed = false;
  if
  :: status == DEAD -> terminate()
  :: else -> skip
  fi
}

/* jobCancel: status IN ('queued','claimed','running'); the current attempt, if any, ends. */
inline cancel() {
  if
  :: cur != 0 -> att[cur] = A_CANCELED
  :: else -> skip
  fi;
  printf("STEP operator cancels; attempt %d ends\n", cur);
  status = CANCELED; cur = 0; holder = 0; passed = false;
  terminate()
}

/* One call made on behalf of an attempt: 1 start, 2 heartbeat, 3 / 4 complete with result 1 / 2,
 * 5 / 6 fail retryable / final. */
inline report(a, ag, call) {
  if
  :: call == 1 -> start(a, ag)
  :: call == 2 -> heartbeat(a, ag)
  :: call == 3 || call == 4 -> complete(a, ag, (call - 2))
  :: call == 5 || call == 6 -> fail(a, ag, (call == 5))
  fi
}

/* ───────────── processes ───────────── */

/* An agent with one slot. Its token is the attempt id the claim gave it; it keeps using (and
 * resending) it until it forgets it: a crash, a lost Assign, or done after an ack or a Revoke. */
proctype Agent(byte me) {
  byte mine = 0, call;
end:
  do
  :: atomic { mine == 0 && status == QUEUED && attempt_no < MAXID -> claim(me); mine = cur; check() }
  :: atomic { mine != 0 -> select(call : 1 .. 6); report(mine, me, call); check(); call = 0 }
  :: mine != 0 -> printf("STEP agent %d forgets attempt %d\n", me, mine); mine = 0
  od
}

/* The late reporter: any attempt ever issued, sent on behalf of any agent, at any time: an
 * agent superseded by the reaper still reporting, an outbox resend after a crash, a report
 * relayed by another coordinator replica, a forged call with another agent's attempt id. */
proctype Late() {
  byte a, ag, call;
end:
  do
  :: atomic { attempt_no > 0 ->
       select(a : 1 .. attempt_no); select(ag : 1 .. NAGENTS); select(call : 1 .. 6);
       report(a, ag, call);
       check(); a = 0; ag = 0; call = 0 }
  od
}

/* Time: a held lease (or claim TTL) may pass at any moment. Expiry is lazy: passing changes
 * only what the reaper may do, the holder can still start, renew, complete or fail. */
proctype Clock() {
end:
  do
  :: atomic { HELD && !passed -> passed = true; printf("STEP lease of attempt %d passes\n", cur); check() }
  od
}

proctype Reaper() {
end:
  do
  :: atomic { HELD && passed -> rescue(); check() }
  od
}

/* An operator may cancel the job once, in any non-terminal state. */
proctype Operator() {
end:
  atomic { (status == QUEUED || HELD) -> cancel(); check() }
}

init {
  atomic {
    check();
    run Agent(1); run Agent(2); run Late(); run Clock(); run Reaper();
#ifndef NO_CANCEL
    run Operator()
#endif
  }
}

/* (4), the part that needs time: a lease that passed does not stay passed forever, because the
 * reaper's statement is enabled for as long as it has (checked with weak fairness: -a -f). */
ltl lease_ends { [] (passed -> <> !passed) }
