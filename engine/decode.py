"""Batched greedy decode over pages, for the monolithic engine (the oracle).

A :class:`DecodeSlot` is everything decode keeps per request: its page list, its prompt
length, the input token and its position for the next step, and the tokens emitted so far.
It starts from pages (``DecodeSlot.start``): the prefill side contributes the pages, the
prompt length and the first answer token it computed (without one, the first step reads
it from the pages, from the last prompt token). Callers verify the pages (I5) before
creating slots.

The decode rank (:class:`kvferry.cluster.decode.DecodeRank`) does not use this step, on
purpose: the monolithic engine is the oracle a disaggregated run must match bit for bit,
and a bug shared by both sides would pass that comparison. Both call the same model
(``PagedModel.decode_step``) and the same attention; only the bookkeeping around the call
(the page table, positions, stop) is written twice, and the equality tests compare it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .models import PagedModel


@dataclass
class DecodeSlot:
    request_id: str
    page_row: list[int]
    prompt_len: int
    max_tokens: int
    position: int  # where ``token``'s K/V goes at the next step
    token: int
    output: list[int] = field(default_factory=list)
    stopped: bool = False

    @classmethod
    def start(
        cls,
        request_id: str,
        page_row: Sequence[int],
        prompt_len: int,
        last_prompt_token: int,
        max_tokens: int,
        first_token: int | None = None,
        stop_token: int | None = None,
    ) -> DecodeSlot:
        """A slot whose next step follows the prefill's ``first_token`` (already the
        answer's first), or, without one, reads the first token at the last prompt
        position."""
        if first_token is None:  # the first step reads it at the last prompt position
            position, token, output = prompt_len - 1, int(last_prompt_token), []
        else:
            position, token, output = prompt_len, int(first_token), [int(first_token)]
        return cls(
            request_id,
            list(page_row),
            prompt_len,
            max_tokens,
            position,
            token,
            output,
            stopped=stop_token is not None and first_token == stop_token,
        )

    @property
    def done(self) -> bool:
        return self.stopped or len(self.output) >= self.max_tokens


def decode_step(model: PagedModel, kv: torch.Tensor, slots: Sequence[DecodeSlot]) -> None:
    """One greedy step for every slot not done; appends to ``output`` and advances."""
    active = [s for s in slots if not s.done]
    if not active:
        return
    page_size = kv.shape[4]
    for slot in active:
        if slot.position // page_size >= len(slot.page_row):
            raise IndexError(
                f"request {slot.request_id!r}: position {slot.position} beyond its "
                f"{len(slot.page_row)} pages"
            )
    width = max(len(s.page_row) for s in active)
    table = torch.zeros(len(active), width, dtype=torch.int32)
    for i, slot in enumerate(active):
        table[i, : len(slot.page_row)] = torch.tensor(slot.page_row, dtype=torch.int32)
    positions = torch.tensor([s.position for s in active], dtype=torch.int64)
    tokens = torch.tensor([s.token for s in active], dtype=torch.int64)
    prompt_lens = torch.tensor([s.prompt_len for s in active], dtype=torch.int64)
    emitted = model.decode_step(kv, table.to(kv.device), positions, tokens, prompt_lens).tolist()
    for slot, token in zip(active, emitted, strict=True):
        slot.output.append(int(token))
        slot.position += 1
        slot.token = int(token)
        if model.stop_token is not None and token == model.stop_token:
            slot.stopped = True
