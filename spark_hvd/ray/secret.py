"""How the job's secret reaches a Ray actor without ever being a Ray object: one-time claims, sealed per actor.

Ray keeps an actor's constructor arguments (and its ``runtime_env``, environment variables included) in its GCS,
readable by anyone who can talk to the cluster, and it moves objects through the object store; neither may ever
hold the job's secret. So the driver (``RayExecutor``) serves the secret itself, over a connection of its own:

* ``SecretHandout`` listens on the driver's Ray node address. It has a *bootstrap key* ``K`` (32 fresh random
  bytes, not the job secret) and, per actor, a *claim id* (16 fresh random bytes). ``K``, the claim id and the
  address are all an actor receives through Ray (``Claim``); all three may be read from the GCS.
* The actor connects; both ends prove ``K`` with the wire's challenge-response (``spark_hvd.core.transport.wire``), so a
  process that read nothing from Ray cannot even ask. The actor sends ``("claim", job id, claim id, A)``, ``A``
  an ephemeral X25519 public key it just made; the driver answers ``(B, nonce, AES-256-GCM(k, secret))`` where
  ``B`` is its own ephemeral public key and ``k = HKDF-SHA256(X25519(a, B), info = job id | claim id | A | B)``.
  The ephemeral private keys never leave either process, so someone who both read ``K`` from the GCS and recorded
  the traffic still cannot decrypt the secret (the wire's frames are authenticated, not encrypted).
* A claim id is good **once**. The driver hands out nothing for an unknown id and nothing a second time: the
  actor whose claim was taken fails to start and the driver raises ``SecretClaimError`` naming the worker, so a
  party that read the GCS and raced an actor to its claim is detected and the job (and its secret) abandoned,
  never used. What is not prevented: an active attacker with GCS access who claims first learns this job's secret
  before the driver notices (the job then stops at ``start()``).
* The listener stops as soon as every actor has its secret (``close()``).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from spark_hvd.core.transport.listener import Listener
from spark_hvd.core.transport.wire import FramedSocket
from spark_hvd.errors import SparkHvdError

logger = logging.getLogger(__name__)

_INFO = b"spark_hvd ray secret handout v1\0"
#: Largest frame either end accepts during a claim (two public keys and a sealed 32-byte secret fit easily).
_MAX_FRAME = 4096


class SecretClaimError(SparkHvdError):
    """A worker could not obtain the job's secret: its claim was unknown, already used, or the exchange failed."""


@dataclass(frozen=True)
class Claim:
    """What one actor gets through Ray to claim the secret (safe to store in Ray's GCS: see the module docstring)."""

    address: tuple[str, int]
    bootstrap_key: bytes = field(repr=False)
    claim_id: str
    job_id: str


def _derive(shared: bytes, job_id: str, claim_id: str, actor_pub: bytes, driver_pub: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    info = b"".join((_INFO, job_id.encode(), b"\0", claim_id.encode(), b"\0", actor_pub, driver_pub))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _aad(job_id: str, claim_id: str) -> bytes:
    return b"".join((_INFO, job_id.encode(), b"\0", claim_id.encode()))


class SecretHandout:
    """The driver's end: hands ``secret`` once to each claim made with ``claim(label)``.

    Args:
        secret: the job's secret.
        job_id: the job's id (bound into every claim).
        host: the address to listen on (the driver's Ray node address; loopback on a one-machine cluster).
        handshake_timeout_s: how long a connection may take to prove the bootstrap key.
    """

    def __init__(self, secret: bytes, job_id: str, host: str = "127.0.0.1",
                 handshake_timeout_s: float = 10.0) -> None:
        self._secret = secret
        self.job_id = job_id
        self._key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._labels: dict[str, str] = {}  # claim id -> label (the worker it was made for)
        self._used: set[str] = set()
        #: labels of claims presented more than once (the second presenter got nothing)
        self.reused: list[str] = []
        #: claims refused because their id was unknown
        self.unknown = 0
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(64)
        self.address: tuple[str, int] = (host, int(sock.getsockname()[1]))
        self._listener = Listener(sock, self._key, self._serve, name="spark-hvd-ray-secret",
                                  handshake_timeout_s=handshake_timeout_s)
        self._listener.start()

    def claim(self, label: str) -> Claim:
        """A fresh one-time claim for the worker ``label`` (e.g. ``"worker 3"``)."""
        claim_id = secrets.token_hex(16)
        with self._lock:
            if self._listener.stopped:
                raise SecretClaimError("the secret handout is closed: no new worker can get this job's secret")
            self._labels[claim_id] = label
        return Claim(self.address, self._key, claim_id, self.job_id)

    def claimed(self, label: str) -> bool:
        """Whether the claim made for ``label`` was used."""
        with self._lock:
            return any(self._labels.get(c) == label for c in self._used)

    def close(self) -> None:
        """Stop listening; claims not yet used can no longer be used. Safe to call twice."""
        self._listener.stop()
        with self._lock:
            self._labels.clear()

    def _serve(self, framed: FramedSocket, peer: str) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        framed.sock.settimeout(10.0)
        request = framed.recv_object(_MAX_FRAME)
        if (not isinstance(request, tuple) or len(request) != 4 or request[0] != "claim"
                or not all(isinstance(x, str) for x in request[1:3]) or not isinstance(request[3], bytes)):
            framed.send_object(("refused", "malformed claim"))
            return
        _, job_id, claim_id, actor_pub = request
        with self._lock:
            label = self._labels.get(claim_id) if job_id == self.job_id else None
            if label is None:
                self.unknown += 1
                answer: tuple[Any, ...] | None = ("refused", "unknown claim")
            elif claim_id in self._used:
                self.reused.append(label)
                answer = ("refused", "claim already used")
            else:
                self._used.add(claim_id)
                answer = None
        if answer is not None:
            logger.warning("RayExecutor: refused a secret claim from %s (%s%s)", peer, answer[1],
                           f", {label}" if label else "")
            framed.send_object(answer)
            return
        mine = X25519PrivateKey.generate()
        driver_pub = mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        try:
            shared = mine.exchange(X25519PublicKey.from_public_bytes(actor_pub))
        except ValueError:
            framed.send_object(("refused", "bad public key"))
            return
        key = _derive(shared, job_id, claim_id, actor_pub, driver_pub)
        nonce = secrets.token_bytes(12)
        sealed = AESGCM(key).encrypt(nonce, self._secret, _aad(job_id, claim_id))
        framed.send_object(("secret", driver_pub, nonce, sealed))


def fetch_secret(claim: Claim, timeout_s: float = 30.0) -> bytes:
    """The actor's end: present ``claim`` to the driver's ``SecretHandout`` and return the job's secret.

    Raises ``SecretClaimError`` when the driver refuses (the claim is unknown or was already used) or the answer
    does not decrypt; ``PeerFailureError`` / ``AuthenticationError`` when the driver cannot be reached or does not
    prove the bootstrap key.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    mine = X25519PrivateKey.generate()
    actor_pub = mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    sock = socket.create_connection(claim.address, timeout=timeout_s)
    framed = FramedSocket(sock, claim.bootstrap_key, f"RayExecutor secret service {claim.address[0]}:"
                                                     f"{claim.address[1]}")
    try:
        framed.handshake("client", timeout_s)
        sock.settimeout(timeout_s)
        framed.send_object(("claim", claim.job_id, claim.claim_id, actor_pub))
        reply = framed.recv_object(_MAX_FRAME)
    finally:
        framed.close()
    if not isinstance(reply, tuple) or not reply or reply[0] != "secret" or len(reply) != 4:
        why = reply[1] if isinstance(reply, tuple) and len(reply) > 1 else repr(reply)
        raise SecretClaimError(f"the driver refused this worker's secret claim ({why}); if it was already used, "
                               "someone who can read Ray's GCS claimed it first")
    _, driver_pub, nonce, sealed = reply
    try:
        shared = mine.exchange(X25519PublicKey.from_public_bytes(driver_pub))
        key = _derive(shared, claim.job_id, claim.claim_id, actor_pub, driver_pub)
        return AESGCM(key).decrypt(nonce, sealed, _aad(claim.job_id, claim.claim_id))
    except (ValueError, InvalidTag) as exc:
        raise SecretClaimError("the secret the driver sent does not decrypt (tampered with on the way?)") from exc
