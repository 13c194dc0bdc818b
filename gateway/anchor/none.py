"""The ``none`` backend: signed checkpoints only, verifiable offline; nothing goes on a chain.

``submit`` records nothing anywhere and returns an empty reference; ``status`` is always
``not_anchored``; ``find`` never finds anything; ``verify`` accepts only the empty reference (it
has nothing to check: the signed checkpoint is the proof, verified by gateway.core.checkpoint) and
refuses any claim of a chain transaction, which this backend could not have made.
"""

from __future__ import annotations

from typing import Any

from gateway.anchor.base import Anchor, AnchorMismatch, Confirmation, Submitted


class NoneBackend:
    """No chain: signed checkpoints only; every anchor is confirmed at once and proves nothing more."""

    name = "none"

    async def submit(self, anchor: Anchor) -> Submitted:
        return Submitted(backend=self.name, anchor_id=anchor.anchor_id, ref="")

    async def status(self, submitted: Submitted) -> Confirmation:
        return Confirmation(state="not_anchored", ref=submitted.ref)

    async def verify(self, anchor: Anchor, receipt_ref: str) -> None:
        if receipt_ref:
            raise AnchorMismatch("the none backend anchors nothing on a chain; a chain reference cannot be its own")

    async def find(self, anchor: Anchor) -> str | None:
        return None

    async def check_contract(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "anchors_on_chain": False}

    async def close(self) -> None:
        return None
