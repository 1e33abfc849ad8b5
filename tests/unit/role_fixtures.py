"""Test doubles shared by the role tests (a role on a fake RoleContext)."""

from __future__ import annotations


class FakeOutbox:
    """Records what a role sends instead of opening sockets."""

    def __init__(self) -> None:
        self.sent = []

    def send(self, address, message) -> bool:
        self.sent.append((address, message))
        return True
