"""The protocol's words: message kinds, outcomes, abort sources and release reasons.

They are ``str`` enums: each member equals its wire value (``Outcome.FINISHED ==
"finished"``), the control codec refuses any other value as malformed and decodes a good
one to its member, so no bare string stands for a protocol word anywhere.
"""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    """The control messages between ranks (the codec ``kvf.cluster``; fields in
    :mod:`kvferry.cluster.messages`)."""

    PREFILL = "PREFILL"  # router -> writer: the prompt (in chunks), the owner
    ASSIGN = "ASSIGN"  # router -> owner: prompt length, max tokens, the writer set
    PLAN = "PLAN"  # owner -> writer: the destination pages (in chunks)
    NOTICE = "NOTICE"  # writer -> owner, after its flush: what it wrote
    NOTICE_PART = "NOTICE_PART"  # writer -> owner, pipelined: a part of it landed
    TOKENS = "TOKENS"  # owner -> router: generated tokens
    DONE = "DONE"  # owner -> router: the request's outcome
    ABORT = "ABORT"  # any -> the request's ranks: stop
    ABORT_ACK = "ABORT_ACK"  # writer -> owner, after its flush: nothing more will land
    RELEASED = "RELEASED"  # writer/owner -> router: the request's pages are free here
    STATS = "STATS"  # any -> router: pool and transfer figures
    SEVERED = "SEVERED"  # owner -> router: a writer cut off, route nothing to it
    SHUTDOWN = "SHUTDOWN"  # router -> every rank: stop serving
    # a decode group whose members each hold some of the KV heads of a model that mixes
    # heads (cluster.group_decode): the lead steps, each member attends over its heads
    MEMBER_READY = "MEMBER_READY"  # member -> lead: its pages are verified, it can attend
    ATTEND = "ATTEND"  # lead -> member: one layer's query for the member's heads
    ATTENDED = "ATTENDED"  # member -> lead: that layer's attention over its pages
    STEPPED = "STEPPED"  # lead -> member: the step's tokens (the member reports them too)


class Outcome(enum.StrEnum):
    """How a request ended, as its owner reports it (``DONE.outcome``)."""

    FINISHED = "finished"  # every token generated and sent
    FAILED = "failed"  # an error: no pages, transfer, integrity, internal
    ABORTED = "aborted"  # told to stop


class Answer(enum.StrEnum):
    """What the client got, as the router counts it (``kvferry_requests{outcome}``): an
    owner's FINISHED becomes OK only once every token it announced stands in order."""

    OK = "ok"
    REJECTED = "rejected"  # can never fit (400)
    UNAVAILABLE = "unavailable"  # no room or no healthy rank now (503)
    ABORTED = "aborted"  # the client left, the deadline passed, shutdown
    FAILED = "failed"


class AbortSource(enum.StrEnum):
    """Who started an abort (``ABORT.source``)."""

    CLIENT = "client"  # the client went away
    DEADLINE = "deadline"  # the router's request deadline
    SHUTDOWN = "shutdown"  # the router is stopping
    PEER = "peer"  # a rank the request uses was lost
    PREFILL = "prefill"  # the writer could not compute the prompt's KV
    TRANSFER = "transfer"  # a write or notice failed, or the owner's transfer timeout
    DECODE = "decode"  # the owner could not take the request (no pages)
    INTEGRITY = "integrity"  # an I5 check failed
    WRITER = "writer"  # a writer acked an abort the owner had not heard of yet
    INTERNAL = "internal"  # an exception in a rank's own code

    @property
    def answer(self) -> Answer:
        """The client's answer for a request aborted this way."""
        return Answer.ABORTED if self in _CLIENT_SIDE else Answer.FAILED


_CLIENT_SIDE = frozenset({AbortSource.CLIENT, AbortSource.DEADLINE, AbortSource.SHUTDOWN})


class Release(enum.StrEnum):
    """Why a rank freed a request's pages (``RELEASED.how``)."""

    FREED = "freed"  # the request ended with every write known landed
    ACKED = "acked"  # quarantined pages, released on every writer's ack or notice
    SEVERED = "severed"  # quarantined pages, released on proof after severing
    ABORTED = "aborted"  # a writer's source pages, after its ack was flushed
    UNSAFE = "unsafe"  # BROKEN MODE: released without proof
