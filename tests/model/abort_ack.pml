/*
 * kvferry abort-acknowledgement protocol (engine/protocol/README.md, "The
 * protocol", points 1-5, and point 6 with PIPELINE; invariant I4, and I5's
 * "decode reads only what this request wrote").
 *
 * Configuration: two writer ranks (prefill), two owner ranks (decode) with one
 * destination page each, two requests. Request 0 holds both pages first; when an
 * owner releases its page, it hands it to request 1 at once (page reuse: this is
 * where a late write of request 0 would become a leak into request 1).
 *
 * Data plane: a posted write is a bit in inflight[w->o]; it may land at any time
 * (process Network) until the writer's flush of that path completes, or until the
 * writer's process is gone. Severing the path does not stop it: over tcp a
 * resumed writer reconnects and its puts are applied, over shared memory it
 * writes through its own mapping of the pool.
 *
 * Control plane: every message is a bit per request on a directed link. Links
 * lose (the receiver drops the bit), duplicate (the receiver handles the bit and
 * leaves it in place) and reorder (any set bit may be taken first).
 *
 * Faults: a writer may crash (at most MAXCRASH of them): its process is gone,
 * its posted writes no longer land, and an owner on its host can see that it is
 * gone. A writer may stall for any time: owner deadlines (process Clock) may fire
 * before it moves again, after which it may resume, post late and ack late.
 *
 * Release (I4): the owner releases a quarantined page only when every writer of
 * the request has sent a completion notice or an ABORT_ACK (both follow its
 * flush), or, for a writer severed at the abort deadline, when its process is
 * gone. Severing stops new plans to the writer; it is not proof.
 *
 * Configuration switches: MAXFAULT, MAXCRASH (fault budgets per run), WFAIL
 * (writer-side transfer failures), OTHER_ACTS (owner 1, an abstract environment
 * unless BOTH_OWNERS, may abort and sever), FDOOR (front-door aborts),
 * R1_TRANSFER (request 1's own transfer), CHECK_LIVENESS (the LTL property),
 * REMOTE_WRITERS (writers on another host: the owner cannot see their process
 * gone), LANDS_AFTER_EXIT (an assumption broken on purpose: a gone writer's
 * posted writes may still land), SPLIT (below). See README.md for the
 * configurations checked.
 *
 * SPLIT: the writer set differs per owner (decode tensor parallelism over a
 * prefill split that does not line up with it). Owner 0 holds two pages, the
 * first written by writer 0 and the second by writer 1; owner 1 holds one page,
 * written by writer 1. So WRITERS_OF(0) = {0, 1}, WRITERS_OF(1) = {1}, and
 * writer 0 is planned into owner 0 only, writer 1 into both. An owner plans,
 * re-sends ABORT to and severs only the writers of its own pages and releases
 * on proof from exactly those; a writer posts into, notifies and acks exactly
 * the owners it was planned for. Both owners are real (SPLIT implies
 * BOTH_OWNERS). An owner's pages are allocated, read and released together, so
 * a landing write is checked against the owner's pages as one (powner, pstate).
 * Without SPLIT every writer writes every owner's one page.
 *
 * PIPELINE: the pipelined long-prompt path (point 6). A writer posts its first
 * part into each owner it was planned for; once that part landed (its flush) it
 * sends each of them a part notice and posts the rest, then flushes and sends
 * the completion notice. An owner checks a part when its notice arrives and
 * records nothing about the writer (a part proves nothing about later writes);
 * a part that fails its check aborts the request (the owner quarantines). An
 * abort mid-pipeline stops the writer after what is in flight, as before.
 *
 * Mutants (exactly one may be defined, each must yield a counterexample):
 *   MUTANT_RELEASE_ON_SEVER       at the deadline the owner severs the writers
 *                                 that did not ack and releases at once
 *   MUTANT_SINGLE_ACK             the owner releases on one ack (one writer),
 *                                 not on the whole writer set
 *   MUTANT_FREE_SOURCE_AT_ABORT   a writer frees its source pages at the abort,
 *                                 before its flush completes
 *   MUTANT_DROP_SEVERED_ACK       the owner drops a severed writer's late ack
 *                                 (a liveness counterexample: the page stays
 *                                 quarantined although the writer flushed)
 * and, with SPLIT:
 *   MUTANT_RELEASE_FIRST_ACK      an owner releases on the first ack from any of
 *                                 its writers
 *   MUTANT_ACK_ONE_OWNER          a writer acks only the first owner it was
 *                                 planned for (a liveness counterexample: the
 *                                 other owner keeps to I4 and waits for ever)
 *   MUTANT_FIRST_PAGE_WRITERS     an owner takes the writers of its first page
 *                                 for its writer set (waits for notices and
 *                                 proof from those only)
 * and, with PIPELINE:
 *   MUTANT_PART_PROVES            an owner counts a writer's part notice as proof
 *                                 that the writer can write no more
 *   MUTANT_ACK_MID_PIPELINE       a writer aborted between its parts acks at once,
 *                                 without waiting for the flush of what it posted
 */

#define NW 2            /* writer ranks */
#define NO 2            /* owner ranks, one destination page each (SPLIT: two for owner 0) */
#define NR 2            /* requests, taken in order on each page */
#define ALL_W 3         /* bitmask of every writer: the writer set */
#define ALL_O 3         /* bitmask of every owner */
#ifndef MAXCRASH
#define MAXCRASH 1      /* writer crashes per run */
#endif
#ifndef MAXFAULT
#define MAXFAULT 2      /* control messages lost or duplicated per run */
#endif
#ifdef SPLIT
#ifndef BOTH_OWNERS
#define BOTH_OWNERS     /* the split is checked with two real owners */
#endif
#endif

#ifndef WFAIL
#define WFAIL 1
#endif
#ifndef OTHER_ACTS
#define OTHER_ACTS 1    /* the abstract owner 1 may abort and sever */
#endif
#ifndef FDOOR
#ifdef BOTH_OWNERS
#define FDOOR 1
#else
#define FDOOR 0         /* OtherOwner already aborts from outside owner 0 */
#endif
#endif
#define BIT(i)   (1 << (i))
#define L(w, o)  ((w) * NO + (o))       /* index of the link between w and o */
#define WR(w, r) ((w) * NR + (r))       /* index of writer w's state for request r */
#define NONE 2                          /* no request */

#ifdef SPLIT
/* The writers planned into owner o's pages, and those of its first page. */
#define WRITERS_OF(o)     ((o) == 0 -> ALL_W : BIT(1))
#define FIRST_PAGE_W(o)   BIT(((o) == 0 -> 0 : 1))
/* The owners writer w was planned for. */
#define OWNERS_OF(w)      ((w) == 0 -> BIT(0) : ALL_O)
#else
#define WRITERS_OF(o)     ALL_W
#define FIRST_PAGE_W(o)   ALL_W
#define OWNERS_OF(w)      ALL_O
#endif
#define PLANNED(w, o)     ((WRITERS_OF(o) & BIT(w)) != 0)

/* The writers an owner waits for: notices before reading, proof before release. */
#ifdef MUTANT_FIRST_PAGE_WRITERS
#define WAITS_FOR(o)      FIRST_PAGE_W(o)
#else
#define WAITS_FOR(o)      WRITERS_OF(o)
#endif

/* page (owner) states; P_ENV: owner 1 is the abstract environment owner */
#define P_FREE    0
#define P_FILLING 1   /* allocated to cur[o], writes expected */
#define P_READY   2   /* completion notice from every writer: decode reads it */
#define P_QUAR    3   /* aborted: quarantined until proof that no write can land */
#define P_ENV     4   /* page of the abstract owner (see OtherOwner) */

/* writer states, per request */
#define W_IDLE    0   /* no destination yet */
#define W_POST    1   /* posting writes */
#define W_STOP    2   /* aborted: stopped posting, flushing */
#define W_DONE    3   /* flushed, completion notice sent */
#define W_ABORTED 4   /* flushed after abort, ack sent; a tombstone */

/* ---- owners ---- */
byte pstate[NO];
byte powner[NO];        /* request the page belongs to, NONE when free */
byte cur[NO];           /* request the owner is working on; NR when finished */
byte done[NO];          /* writers whose completion notice arrived, for cur */
byte acked[NO];         /* writers whose abort ack arrived, for cur */
bool dl[NO];            /* the owner's current deadline has passed */
bool cut[NO];           /* the abort deadline's severing is done, for cur */

/* ---- writers ---- */
byte wphase[NW * NR];
byte wposted[NW * NR];  /* owners a write was posted to */
byte srcheld[NW];       /* requests whose source pages the writer still holds */
byte wparted[NW];       /* requests whose first part landed and was noticed (PIPELINE) */
bool crashed[NW];       /* the writer's process is gone */
byte crashes;
byte faults;            /* control-message faults so far */

/* ---- data plane ---- */
byte inflight[NW * NO]; /* requests with a write in flight on path w -> o */
bool severed[NW * NO];  /* owner o severed writer w (no proof: writes may land) */

/* ---- control plane: one bit per request ---- */
byte c_dest[NW * NO];   /* o -> w  destination of o's page for the request */
byte c_abort[NW * NO];  /* o -> w  ABORT */
byte c_fdw[NW];         /* front door -> w  ABORT */
byte c_done[NW * NO];   /* w -> o  completion notice (sent after flush) */
byte c_ack[NW * NO];    /* w -> o  ABORT_ACK (sent after flush) */
byte c_abo[NO];         /* anyone -> o  abort notice */
byte c_part[NW * NO];   /* w -> o  part notice (sent after the part's flush; PIPELINE) */
byte parted[NO];        /* writers whose part notice arrived, for cur (nothing proven) */

/* Take bit r of channel c: consume it, or leave it for a later duplicate, or
 * lose it. Only destinations are left for duplicates: every other handler is
 * idempotent, and a duplicate ABORT is indistinguishable from the owner's own
 * re-send, which the model makes whenever it could change anything. */
#define TAKE_DUP(c, r, handle) \
    if \
    :: c = c & ~BIT(r); handle \
    :: faults < MAXFAULT -> faults++; handle \
    :: faults < MAXFAULT -> faults++; c = c & ~BIT(r) \
    fi

#define TAKE(c, r, handle) \
    if \
    :: c = c & ~BIT(r); handle \
    :: faults < MAXFAULT -> faults++; c = c & ~BIT(r) \
    fi

#define FLUSHED(w, r) \
    ((inflight[L(w, 0)] & BIT(r)) == 0 && (inflight[L(w, 1)] & BIT(r)) == 0)

/* ------------------------------------------------------------------ writer */

/* Messages to an owner about a request it has already released would be
 * ignored on arrival; they are not put on the link at all (a state-space
 * reduction, not a behaviour). */
#define TO_OWNER(c, o, r) \
    if :: cur[o] <= r -> c = c | BIT(r) :: else -> skip fi

/* An ack goes to every owner the writer was planned for. */
inline send_ack(w, r) {
    if :: PLANNED(w, 0) -> TO_OWNER(c_ack[L(w, 0)], 0, r) :: else -> skip fi;
#ifdef MUTANT_ACK_ONE_OWNER
    if :: PLANNED(w, 1) && !PLANNED(w, 0) -> TO_OWNER(c_ack[L(w, 1)], 1, r)
       :: else -> skip fi         /* only the first owner planned is acked */
#else
    if :: PLANNED(w, 1) -> TO_OWNER(c_ack[L(w, 1)], 1, r) :: else -> skip fi
#endif
}

inline send_part(w, r) {
    if :: PLANNED(w, 0) -> TO_OWNER(c_part[L(w, 0)], 0, r) :: else -> skip fi;
    if :: PLANNED(w, 1) -> TO_OWNER(c_part[L(w, 1)], 1, r) :: else -> skip fi
}

/* The rest of the prompt after the first part: posted into every owner planned,
 * or, with one of those paths severed, a transfer failure. */
inline post_rest(w, r) {
    if
    :: (PLANNED(w, 0) && severed[L(w, 0)]) || (PLANNED(w, 1) && severed[L(w, 1)]) ->
        wphase[WR(w, r)] = W_STOP;
        TO_OWNER(c_abo[0], 0, r); TO_OWNER(c_abo[1], 1, r)
    :: true ->
        assert(srcheld[w] & BIT(r));
        if :: PLANNED(w, 0) -> inflight[L(w, 0)] = inflight[L(w, 0)] | BIT(r)
           :: else -> skip fi;
        if :: PLANNED(w, 1) -> inflight[L(w, 1)] = inflight[L(w, 1)] | BIT(r)
           :: else -> skip fi
    fi
}

inline send_done(w, r) {
    if :: PLANNED(w, 0) -> TO_OWNER(c_done[L(w, 0)], 0, r) :: else -> skip fi;
    if :: PLANNED(w, 1) -> TO_OWNER(c_done[L(w, 1)], 1, r) :: else -> skip fi
}

/* ABORT for request r reached writer w (from an owner or the front door). */
inline w_on_abort(w, r) {
    if
    :: wphase[WR(w, r)] == W_IDLE ->       /* never started: ack at once */
        wphase[WR(w, r)] = W_ABORTED;
        srcheld[w] = srcheld[w] & ~BIT(r);
        send_ack(w, r)
#ifdef MUTANT_ACK_MID_PIPELINE
    :: wphase[WR(w, r)] == W_POST && (wparted[w] & BIT(r)) ->
        wphase[WR(w, r)] = W_STOP;         /* flushes, but acks before the flush */
        send_ack(w, r)
    :: wphase[WR(w, r)] == W_POST && !(wparted[w] & BIT(r)) ->
#else
    :: wphase[WR(w, r)] == W_POST ->       /* stop posting, then flush */
#endif
        wphase[WR(w, r)] = W_STOP;
#ifdef MUTANT_FREE_SOURCE_AT_ABORT
        srcheld[w] = srcheld[w] & ~BIT(r);
#endif
        skip
    :: wphase[WR(w, r)] == W_STOP -> skip  /* ack follows the flush */
    :: wphase[WR(w, r)] == W_DONE || wphase[WR(w, r)] == W_ABORTED ->
        send_ack(w, r)                     /* finished, or a repeat: (re)ack */
    fi
}

/* A destination from owner o reached writer w: it posts its write to o at once
 * (a stall between the two is the same as a late destination). */
inline w_on_dest(w, o, r) {
    if
    :: (wphase[WR(w, r)] == W_IDLE || wphase[WR(w, r)] == W_POST) &&
       !(wposted[WR(w, r)] & BIT(o)) ->
        if
        :: severed[L(w, o)] ->                /* endpoint closed: transfer failure */
            wphase[WR(w, r)] = W_STOP;
            TO_OWNER(c_abo[0], 0, r); TO_OWNER(c_abo[1], 1, r)
        :: true ->                            /* or reconnected / mapped: it posts */
            assert(srcheld[w] & BIT(r));
            wphase[WR(w, r)] = W_POST;
            inflight[L(w, o)] = inflight[L(w, o)] | BIT(r);
            wposted[WR(w, r)] = wposted[WR(w, r)] | BIT(o)
        fi
    :: else -> skip               /* aborted, finished, or a duplicate: ignore */
    fi
}

/* Every step a writer can take for owner o and request r. An ABORT that finds
 * the writer flushing waits until the flush is over (handling it then would be
 * a no-op; leaving it keeps a retransmitting owner and a flushing writer from
 * looping without progress under weak fairness). */
#define WRITER_STEPS(w, o, r) \
    :: atomic { !crashed[w] && (c_dest[L(w, o)] & BIT(r)) -> \
            TAKE_DUP(c_dest[L(w, o)], r, w_on_dest(w, o, r)) } \
    :: atomic { !crashed[w] && (c_abort[L(w, o)] & BIT(r)) && \
            wphase[WR(w, r)] != W_STOP -> \
            TAKE(c_abort[L(w, o)], r, w_on_abort(w, r)) }

/* Steps that concern the request as a whole. */
#ifdef PIPELINE
#define PARTED(w, r) (wparted[w] & BIT(r))
#else
#define PARTED(w, r) 1
#endif
#define WRITER_REQ_STEPS(w, r) \
    :: atomic { !crashed[w] && (c_fdw[w] & BIT(r)) -> \
            TAKE(c_fdw[w], r, w_on_abort(w, r)) } \
    :: atomic { !PARTED(w, r) && !crashed[w] && wphase[WR(w, r)] == W_POST && \
            wposted[WR(w, r)] == OWNERS_OF(w) && FLUSHED(w, r) -> \
            wparted[w] = wparted[w] | BIT(r);   /* the first part landed */ \
            send_part(w, r); \
            post_rest(w, r) } \
    :: atomic { PARTED(w, r) && !crashed[w] && wphase[WR(w, r)] == W_POST && \
            wposted[WR(w, r)] == OWNERS_OF(w) && FLUSHED(w, r) -> \
            wphase[WR(w, r)] = W_DONE; \
            srcheld[w] = srcheld[w] & ~BIT(r); \
            send_done(w, r) } \
    :: atomic { WFAIL && !crashed[w] && wphase[WR(w, r)] == W_POST -> \
            wphase[WR(w, r)] = W_STOP;         /* prefill-side failure */ \
            TO_OWNER(c_abo[0], 0, r); TO_OWNER(c_abo[1], 1, r) } \
    :: atomic { !crashed[w] && wphase[WR(w, r)] == W_STOP && FLUSHED(w, r) -> \
            wphase[WR(w, r)] = W_ABORTED; \
            srcheld[w] = srcheld[w] & ~BIT(r); \
            send_ack(w, r) }

proctype Writer(byte w) {
end:
    do
    WRITER_STEPS(w, 0, 0)
    WRITER_STEPS(w, 1, 0)
    WRITER_REQ_STEPS(w, 0)
#ifdef R1_TRANSFER
    WRITER_STEPS(w, 0, 1)
    WRITER_STEPS(w, 1, 1)
    WRITER_REQ_STEPS(w, 1)
#endif
    :: atomic { !crashed[w] && crashes < MAXCRASH -> crashes++; crashed[w] = 1;
#ifndef LANDS_AFTER_EXIT
            inflight[L(w, 0)] = 0;       /* process gone: its writes stop landing */
            inflight[L(w, 1)] = 0
#else
            skip                         /* assumption broken: they may still land */
#endif
        }
    od
}

/* ------------------------------------------------------------------- owner */

#define OTHER(o) (1 - (o))

/* The writers this owner severed. */
#define SEVERED_SET(o) \
    ((severed[L(0, o)] -> BIT(0) : 0) | (severed[L(1, o)] -> BIT(1) : 0))

/* The writers whose process the owner can see is gone (same host only). */
#ifdef REMOTE_WRITERS
#define GONE_SET 0
#else
#define GONE_SET ((crashed[0] -> BIT(0) : 0) | (crashed[1] -> BIT(1) : 0))
#endif

/* Writers proven unable to write into the page any more: a completion notice or
 * an ack (each follows the writer's flush), or, for a severed writer, its
 * process gone (the owner checks that only for writers it severed). */
#ifdef MUTANT_PART_PROVES
#define PROVEN(o) (acked[o] | done[o] | parted[o] | (SEVERED_SET(o) & GONE_SET))
#else
#define PROVEN(o) (acked[o] | done[o] | (SEVERED_SET(o) & GONE_SET))
#endif

/* Release: every writer the owner waits for has proven it can write no more. */
#define ALL_PROVEN(o) ((PROVEN(o) & WAITS_FOR(o)) == WAITS_FOR(o))

#if defined(MUTANT_SINGLE_ACK)
#define RELEASABLE(o) ((acked[o] | done[o]) != 0 || ALL_PROVEN(o))
#elif defined(MUTANT_RELEASE_ON_SEVER)
#define RELEASABLE(o) (((PROVEN(o) | SEVERED_SET(o)) & WAITS_FOR(o)) == WAITS_FOR(o))
#elif defined(MUTANT_RELEASE_FIRST_ACK)
#define RELEASABLE(o) ((acked[o] & WAITS_FOR(o)) != 0 || ALL_PROVEN(o))
#else
#define RELEASABLE(o) ALL_PROVEN(o)
#endif

/* The plan: each writer of the owner's pages gets its destinations there. */
inline o_send_dest(o, r) {
    if :: PLANNED(0, o) -> c_dest[L(0, o)] = c_dest[L(0, o)] | BIT(r) :: else -> skip fi;
    if :: PLANNED(1, o) -> c_dest[L(1, o)] = c_dest[L(1, o)] | BIT(r) :: else -> skip fi
}

inline o_send_abort(o, r) {
    if :: PLANNED(0, o) && !(PROVEN(o) & BIT(0)) ->
           c_abort[L(0, o)] = c_abort[L(0, o)] | BIT(r)
       :: else -> skip fi;
    if :: PLANNED(1, o) && !(PROVEN(o) & BIT(1)) ->
           c_abort[L(1, o)] = c_abort[L(1, o)] | BIT(r)
       :: else -> skip fi
}

/* Quarantine at the abort; fan the abort out to writers and the other owner. */
inline o_abort(o) {
    pstate[o] = P_QUAR;
    dl[o] = 0;
    o_send_abort(o, cur[o]);
    TO_OWNER(c_abo[OTHER(o)], OTHER(o), cur[o])
}

/* Release the page; hand it to the next request, if any. Messages about the
 * released request that are still on the way to this owner would be ignored by
 * it, so they are dropped here (a state-space reduction, not a behaviour). */
inline o_release(o) {
    pstate[o] = P_FREE;
    powner[o] = NONE;
    c_done[L(0, o)] = c_done[L(0, o)] & ~BIT(cur[o]);
    c_done[L(1, o)] = c_done[L(1, o)] & ~BIT(cur[o]);
    c_ack[L(0, o)] = c_ack[L(0, o)] & ~BIT(cur[o]);
    c_ack[L(1, o)] = c_ack[L(1, o)] & ~BIT(cur[o]);
    c_abo[o] = c_abo[o] & ~BIT(cur[o]);
    c_part[L(0, o)] = c_part[L(0, o)] & ~BIT(cur[o]);
    c_part[L(1, o)] = c_part[L(1, o)] & ~BIT(cur[o]);
    done[o] = 0; acked[o] = 0; parted[o] = 0; dl[o] = 0; cut[o] = 0;
    cur[o]++;
    if
    :: cur[o] < NR ->
        powner[o] = cur[o];
#ifdef R1_TRANSFER
        pstate[o] = P_FILLING;
        o_send_dest(o, cur[o])
#else
        pstate[o] = P_READY      /* request 1's own transfer is not modelled */
#endif
    :: else -> skip
    fi
}

/* A late ABORT_ACK from a severed writer counts: it follows that writer's flush. */
#ifdef MUTANT_DROP_SEVERED_ACK
#define ACK_COUNTS(o, w) (severed[L(w, o)] -> 0 : BIT(w))
#else
#define ACK_COUNTS(o, w) BIT(w)
#endif

/* Sever a writer that has not proven anything: no more plans to it, its endpoint
 * closed, the router told. Its posted writes may still land (not modelled as an
 * effect on the data plane, because there is none to rely on). */
inline o_sever(o, w) {
    if
    :: PLANNED(w, o) && !(PROVEN(o) & BIT(w)) -> severed[L(w, o)] = 1
    :: else -> skip
    fi
}

/* A part notice: the owner checks the part's pages; it passes (nothing is
 * recorded as proof of the writer) or fails (the request aborts). */
#ifdef PIPELINE
#define OWNER_PART_STEPS(o, w) \
    :: atomic { cur[o] < NR && !severed[L(w, o)] && (c_part[L(w, o)] & BIT(cur[o])) -> \
            TAKE(c_part[L(w, o)], cur[o], parted[o] = parted[o] | BIT(w)); \
            if \
            :: skip                                         /* the part checks */ \
            :: pstate[o] == P_FILLING -> o_abort(o)          /* it does not */ \
            fi }
#else
#define OWNER_PART_STEPS(o, w)
#endif

/* Steps of owner o about writer w. A severed writer's completion notice is
 * dropped (the owner takes nothing but ABORT_ACK from it); its late ack counts.
 * ABORT is retransmitted to every unproven writer, severed ones included, while
 * neither an ABORT nor an ack is on the way between the two (retransmitting
 * then would change nothing a writer can do: it has acked, or it will handle
 * the pending ABORT). */
#define OWNER_STEPS_W(o, w) \
    OWNER_PART_STEPS(o, w) \
    :: atomic { cur[o] < NR && !severed[L(w, o)] && (c_done[L(w, o)] & BIT(cur[o])) -> \
            TAKE(c_done[L(w, o)], cur[o], done[o] = done[o] | BIT(w)); \
            if \
            :: pstate[o] == P_FILLING && (done[o] & WAITS_FOR(o)) == WAITS_FOR(o) -> \
                pstate[o] = P_READY \
            :: else -> skip \
            fi } \
    :: atomic { cur[o] < NR && (c_ack[L(w, o)] & BIT(cur[o])) -> \
            TAKE(c_ack[L(w, o)], cur[o], acked[o] = acked[o] | ACK_COUNTS(o, w)); \
            if \
            :: pstate[o] == P_FILLING && acked[o] -> o_abort(o) /* ack means abort */ \
            :: else -> skip \
            fi } \
    :: atomic { pstate[o] == P_QUAR && PLANNED(w, o) && !(PROVEN(o) & BIT(w)) && \
            !(c_abort[L(w, o)] & BIT(cur[o])) && !(c_ack[L(w, o)] & BIT(cur[o])) -> \
            c_abort[L(w, o)] = c_abort[L(w, o)] | BIT(cur[o]) }   /* retransmit */

proctype Owner(byte o) {
end:
    do
    OWNER_STEPS_W(o, 0)
    OWNER_STEPS_W(o, 1)
    :: atomic { cur[o] < NR && (c_abo[o] & BIT(cur[o])) ->
            TAKE(c_abo[o], cur[o],
                if
                :: pstate[o] == P_FILLING -> o_abort(o)
                :: else -> skip          /* ready: finishes below; quar: repeat */
                fi) }
    :: atomic { pstate[o] == P_FILLING && dl[o] -> o_abort(o) }  /* decode timeout */
    :: atomic { pstate[o] == P_READY -> o_release(o) }   /* decode finished */
    :: atomic { pstate[o] == P_QUAR && RELEASABLE(o) -> o_release(o) }
    :: atomic { pstate[o] == P_QUAR && dl[o] && !cut[o] ->   /* abort deadline */
            cut[o] = 1; o_sever(o, 0); o_sever(o, 1) }
    od
}

/* ------------------------------------------------------------ environment */

/* A write in flight on w -> o for request r lands in page o. */
#define LAND(w, o, r) \
    :: atomic { inflight[L(w, o)] & BIT(r) -> \
            inflight[L(w, o)] = inflight[L(w, o)] & ~BIT(r); \
            assert(powner[o] == r);                 /* I4: never a foreign page */ \
            assert(pstate[o] != P_READY);           /* I5: never under a reader */ \
            assert(srcheld[w] & BIT(r)) }           /* source still holds the KV */

proctype Network() {
end:
    do
    LAND(0, 0, 0) LAND(0, 1, 0) LAND(1, 0, 0) LAND(1, 1, 0)
#ifdef R1_TRANSFER
    LAND(0, 0, 1) LAND(0, 1, 1) LAND(1, 0, 1) LAND(1, 1, 1)
#endif
    od
}

/* Deadlines: each owner's timer may fire at any time while it waits. Weak
 * fairness makes a pending timer fire eventually; the owner then has no choice
 * but to act on it. */
proctype Clock() {
end:
    do
    :: atomic { !dl[0] && (pstate[0] == P_FILLING || pstate[0] == P_QUAR) -> dl[0] = 1 }
#ifdef BOTH_OWNERS
    :: atomic { !dl[1] && (pstate[1] == P_FILLING || pstate[1] == P_QUAR) -> dl[1] = 1 }
#endif
    od
}

#ifndef BOTH_OWNERS
/* Owner 1 as an environment for owner 0. Page 0's safety depends on owner 1
 * only through what owner 1 sends and does, so owner 1 is replaced by a process
 * that may do any of it at any time: fan an abort out to owner 0 and to the
 * writers, and sever a writer (after which that writer's later posts to page 1
 * may fail, a transfer failure, or go through). Page 1 stays request 0's and its writes land
 * there; its own protocol is the same as page 0's, checked with BOTH_OWNERS. */
proctype OtherOwner() {
    bool aborted, cut0, cut1;
end:
    do
    :: atomic { OTHER_ACTS && !aborted -> aborted = 1;
            TO_OWNER(c_abo[0], 0, 0);
            c_abort[L(0, 1)] = c_abort[L(0, 1)] | BIT(0);
            c_abort[L(1, 1)] = c_abort[L(1, 1)] | BIT(0) }
    :: atomic { aborted && !cut0 -> cut0 = 1; severed[L(0, 1)] = 1 }
    :: atomic { aborted && !cut1 -> cut1 = 1; severed[L(1, 1)] = 1 }
    od
}
#endif

#ifdef CHECK_LIVENESS
/* Time passes even when no other process can move. Under weak fairness pan does
 * not extend a run that ends with every process blocked, so without this a stuck
 * quarantine that blocks everything (a crashed writer that cannot be proven gone)
 * would go unseen; with it that run is an infinite, fair one. */
proctype Ticker() {
end:
    do
    :: timeout -> skip        /* enabled only when every other process is blocked */
    od
}
#endif

/* The front door may abort either request at any time, once. */
proctype FrontDoor() {
    bool sent0, sent1;
end:
    do
    :: atomic { FDOOR && !sent0 -> sent0 = 1;
            c_abo[0] = c_abo[0] | BIT(0); c_abo[1] = c_abo[1] | BIT(0);
            c_fdw[0] = c_fdw[0] | BIT(0); c_fdw[1] = c_fdw[1] | BIT(0) }
#ifdef R1_TRANSFER
    :: atomic { !sent1 -> sent1 = 1;
            c_abo[0] = c_abo[0] | BIT(1); c_abo[1] = c_abo[1] | BIT(1);
            c_fdw[0] = c_fdw[0] | BIT(1); c_fdw[1] = c_fdw[1] | BIT(1) }
#endif
    od
}

init {
    atomic {
        pstate[0] = P_FILLING; powner[0] = 0; o_send_dest(0, 0);
#ifdef BOTH_OWNERS
        pstate[1] = P_FILLING; powner[1] = 0; o_send_dest(1, 0);
#else
        pstate[1] = P_ENV; powner[1] = 0; o_send_dest(1, 0);
        cur[1] = NR;        /* nothing sent to owner 1 is modelled as read */
#endif
        srcheld[0] = BIT(0) | BIT(1);
        srcheld[1] = BIT(0) | BIT(1);
        run Owner(0);
#ifdef BOTH_OWNERS
        run Owner(1);
#else
        run OtherOwner();
#endif
        run Writer(0); run Writer(1);
        run Network(); run Clock(); run FrontDoor();
#ifdef CHECK_LIVENESS
        run Ticker();
#endif
        skip
    }
}

#define FREE0 (pstate[0] == P_FREE)
#define FREE1 (pstate[1] == P_FREE)

#ifdef CHECK_LIVENESS
/* Every page is eventually free (and stays free once both requests are over). */
#ifdef BOTH_OWNERS
ltl every_page_freed { <> [] (FREE0 && FREE1) }
#else
ltl every_page_freed { <> [] FREE0 }
#endif
#endif
