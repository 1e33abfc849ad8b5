"""Cluster membership on internal sockets: CurveZMQ keys derived from a shared secret.

Every process of a cluster reads the same secret file. From it comes one Curve25519 key pair:
servers (inboxes, KV endpoints) present it, clients connect with it, and a ZAP authenticator in
each process admits only clients presenting that same public key. Traffic is encrypted, and a
process without the secret can neither send a message nor read a KV block. Without a secret file
internal sockets are plain TCP, bound to loopback by default.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import zmq
import zmq.utils.z85

from common.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterKeys:
    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret key
        return f"ClusterKeys(public={self.public.decode()[:8]}...)"

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKeys:
        seed = hashlib.sha256(b"splitserve-curve-v1" + secret).digest()
        secret_key = zmq.utils.z85.encode(seed)
        return cls(zmq.curve_public(secret_key), secret_key)

    def serve(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public

    def connect(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: admit a client only if it presents the cluster's public key."""
        return zmq.utils.z85.encode(key) == self.public if len(key) == 32 else \
            key == self.public


@cache
def load_keys(path: str | None) -> ClusterKeys | None:
    if not path:
        return None
    try:
        secret = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    if len(secret) < 16:
        raise ConfigError("the cluster secret must be at least 16 bytes")
    return ClusterKeys.from_secret(secret)


_authenticators: dict[int, object] = {}


def guard_context(ctx: zmq.Context, keys: ClusterKeys | None) -> None:
    """Start (once per context) the ZAP authenticator that admits only cluster members."""
    if keys is None or id(ctx) in _authenticators:
        return
    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=keys)
    _authenticators[id(ctx)] = auth


def stop_guard(ctx: zmq.Context) -> None:
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
