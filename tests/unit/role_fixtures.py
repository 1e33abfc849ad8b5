"""Test doubles shared by the role tests (a role on a fake RoleContext)."""

from __future__ import annotations

from common.plan import ModelOutput


class FakeOutbox:
    """Records what a role sends instead of opening sockets."""

    def __init__(self) -> None:
        self.sent = []

    def send(self, address, message) -> bool:
        self.sent.append((address, message))
        return True


def run_turn(role, gateway: str, token: int = 9) -> list:
    """One instance-loop turn with a fake forward that samples `token` wherever a chunk samples;
    returns the TokenUpdates the role emitted for `gateway`."""
    role.poll()
    plan = role.schedule()
    if not plan.is_empty:
        role.update_from_output(plan, ModelOutput(
            {c.seq_id: token for c in plan.chunks if c.sampling is not None}))
    return role.ctx.pending_tokens.pop(gateway, [])
