"""An :class:`enum.Enum` whose members hash by identity.

``Enum.__hash__`` is a Python-level call (the hash of the member's name); the protocol's
tables look up a ``(state, event)`` pair on every move and the allocator counts pages by
state on every allocation, so on an abort's critical path those calls add up to a few
microseconds. Members are singletons and compare by identity, so identity hashing keeps
``a == b`` ⇒ ``hash(a) == hash(b)``. (Iteration order of a ``set`` of members then varies
between processes; nothing here iterates one to produce output.)
"""

from __future__ import annotations

import enum


class IdentityEnum(enum.Enum):
    __hash__ = object.__hash__
