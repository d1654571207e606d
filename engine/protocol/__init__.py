"""The abort protocol's core: the owner's and the writer's state machines as tables.

Sans-IO: no processes, sockets or clocks. A rank turns what arrives (a message, a timer,
a settled batch) into an event with an ``on_*`` function of :mod:`.owner` or
:mod:`.writer`, moves the request's book with ``step``, and carries out the effects the
table entry lists. The same functions drive the unit tests' walk of every (state, event)
pair and the simulator. ``python -m kvferry.engine.protocol`` prints both tables.
"""

from .owner import (
    OWNER_TABLE,
    OwnerBook,
    OwnerDo,
    OwnerEvent,
    OwnerState,
    owner_table,
    render_owner_table,
)
from .proof import GoneFacts, Proof, gone_proof, is_justified, justification
from .table import Move
from .words import AbortSource, Answer, Kind, Outcome, Release
from .writer import (
    WRITER_TABLE,
    WriterBook,
    WriterDo,
    WriterEvent,
    WriterState,
    render_writer_table,
)

__all__ = [
    "OWNER_TABLE",
    "WRITER_TABLE",
    "AbortSource",
    "Answer",
    "GoneFacts",
    "Kind",
    "Move",
    "Outcome",
    "OwnerBook",
    "OwnerDo",
    "OwnerEvent",
    "OwnerState",
    "Proof",
    "Release",
    "WriterBook",
    "WriterDo",
    "WriterEvent",
    "WriterState",
    "gone_proof",
    "is_justified",
    "justification",
    "owner_table",
    "render_owner_table",
    "render_writer_table",
]
