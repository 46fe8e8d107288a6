"""ZeroMQ CURVE between hosts: the key files, and securing a socket as a server or as a client.

Engines on another host are reached over TCP, and everything on that wire (prompts, outputs, the engine
registry) is encrypted and authenticated with CURVE (curve25519 + a ZAP handler), as ZeroMQ's own
security model does it. The key directory ``launch keys --dir DIR`` writes, in pyzmq's certificate
format (``zmq.auth``), every file mode 0600:

- ``server.key`` / ``server.key_secret``: the engine host's keypair. Gateway hosts need only the public
  ``server.key`` (they check that the engines they reach hold its secret); the engine host needs the secret.
- ``client.key`` / ``client.key_secret``: a gateway host's keypair.
- ``authorized/NAME.key``: the client public keys the engine host accepts, one file per gateway host
  (``launch keys --name NAME``), so authorizing another host never replaces a key already there. A key
  copied there is accepted from the next connection on (the list is read again when an unknown key knocks,
  at most once a second).

The engine host's own processes (expert-parallel members waking each other) connect with the server
keypair, which is always accepted. A refused key is logged (once a minute per key), never its secret.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import re
import shutil
import threading
import time
from dataclasses import dataclass, field

import zmq

log = logging.getLogger("zserve.curve")

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
RESCAN_S = 1.0  # an unknown key re-reads authorized/ at most this often
LOG_EVERY_S = 60.0  # a refused key is logged at most this often
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class KeyFileError(ValueError):
    """A key directory that lacks what this side needs (the message says which file and how to make it)."""


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def write_keys(directory: str, client_only: bool = False, name: str = CLIENT) -> list[str]:
    """Write a new server keypair, a client keypair and ``authorized/NAME.key`` (the client's public key,
    named for the gateway host that holds it); or, ``client_only``, another gateway host's client keypair
    and its ``authorized/NAME.key``, to copy into the engine host's ``authorized/`` beside the keys already
    there. Return the paths written. Existing keys are never overwritten."""
    import zmq.auth

    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a key name: letters, digits, '.', '_' and '-', not starting with '.'")
    names = [CLIENT] if client_only else [SERVER, CLIENT]
    accepted = os.path.join(directory, AUTHORIZED, f"{name}.key")
    for path in [accepted] + [os.path.join(directory, f"{n}.key{s}") for n in names for s in ("", "_secret")]:
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists; keys are never overwritten (choose another --dir)")
    old = os.umask(0o077)  # every file 0600, the directories 0700, from the moment they exist
    try:
        os.makedirs(os.path.join(directory, AUTHORIZED), mode=0o700, exist_ok=True)
        written = []
        for n in names:
            public, secret = zmq.auth.create_certificates(directory, n)
            written += [public, secret]
        shutil.copyfile(os.path.join(directory, f"{CLIENT}.key"), accepted)
        written.append(accepted)
    finally:
        os.umask(old)
    for path in written:
        os.chmod(path, 0o600)
    return written


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _unreadable(path: str, directory: str) -> KeyFileError:
    """A key this process may not read: say as whom it runs, not that the file is missing (os.path.exists
    is False for a file in a directory this user cannot search)."""
    user = _user()
    return KeyFileError(f"{path} is not readable by user {user}, whom this server runs as: give that user the "
                        f"keys (as root: chown -R {user}: {directory})")


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    directory = os.path.dirname(path) or "."
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise KeyFileError(f"{path} is missing (launch keys --dir {directory} writes it)") from None
    except PermissionError:  # the file's mode, or a directory on its way this user may not search
        raise _unreadable(path, directory) from None
    except OSError as e:
        raise KeyFileError(f"{path} cannot be read: {e}") from None
    try:
        public, private = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise KeyFileError(f"{path} is not a CURVE certificate: {e}") from None
    if secret and not private:
        raise KeyFileError(f"{path} holds no secret key")
    return public, private


@dataclass
class CurveKeys:
    """What one side loaded from a key directory. An engine host has ``server_secret`` and accepts the
    ``authorized`` keys; a gateway host has the client pair and the server's public key to check."""

    directory: str
    server_public: bytes  # every key Z85-encoded, as zmq.auth's certificate files hold them
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None
    authorized: set[bytes] = field(default_factory=set)

    @classmethod
    def for_server(cls, directory: str) -> CurveKeys:
        public, secret = _load(os.path.join(directory, f"{SERVER}.key_secret"), secret=True)
        keys = cls(directory, public, secret)
        accepted = os.path.join(directory, AUTHORIZED)
        if os.path.isdir(accepted) and not os.access(accepted, os.R_OK | os.X_OK):
            raise _unreadable(accepted, directory)  # else it would read as empty: "no client key"
        keys.rescan()
        if not keys.authorized:
            raise KeyFileError(f"{os.path.join(directory, AUTHORIZED)} holds no client key: no gateway could connect "
                            "(launch keys writes authorized/NAME.key, one per gateway host)")
        return keys

    @classmethod
    def for_client(cls, directory: str) -> CurveKeys:
        server_public, _ = _load(os.path.join(directory, f"{SERVER}.key"), secret=False)
        public, secret = _load(os.path.join(directory, f"{CLIENT}.key_secret"), secret=True)
        return cls(directory, server_public, client_public=public, client_secret=secret)

    @classmethod
    def load(cls, directory: str) -> CurveKeys:
        """A server's keys where the directory holds the server secret (an engine host), else a client's."""
        if os.path.exists(os.path.join(directory, f"{SERVER}.key_secret")):
            keys = cls.for_server(directory)
            client = os.path.join(directory, f"{CLIENT}.key_secret")
            if os.path.exists(client):  # both roles: one directory copied to every host of a small cluster
                keys.client_public, keys.client_secret = _load(client, secret=True)
            return keys
        return cls.for_client(directory)

    def rescan(self) -> None:
        import zmq.auth

        found = set()
        for path in glob.glob(os.path.join(self.directory, AUTHORIZED, "*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except PermissionError:
                log.warning("ignoring %s: not readable by user %s (chown it to that user)", path, _user())
                continue
            except (ValueError, OSError) as e:
                log.warning("ignoring %s: not a CURVE public key (%s)", path, e)
                continue
            found.add(public)  # Z85 text, as the ZAP handler passes keys
        self.authorized = found

    def pair_for_connecting(self) -> tuple[bytes, bytes]:
        """The keypair this side connects with: its client pair, or on the engine host the server's own."""
        if self.client_secret is not None and self.client_public is not None:
            return self.client_public, self.client_secret
        if self.server_secret is not None:
            return self.server_public, self.server_secret
        raise KeyFileError(f"{self.directory} holds no keypair to connect with")


class _Allowed:
    """The ZAP credentials check: an authorized key (re-reading ``authorized/`` for an unknown one, so a key
    added while serving counts) or the server's own; a refusal is logged, rate-limited per key."""

    def __init__(self, keys: CurveKeys, where: str):
        self.keys = keys
        self.where = where
        self.own = keys.server_public
        self.last_scan = time.monotonic()
        self.logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.own or key in self.keys.authorized:
            return True
        now = time.monotonic()
        if now - self.last_scan >= RESCAN_S:
            self.last_scan = now
            self.keys.rescan()
            if key in self.keys.authorized:
                return True
        if now - self.logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self.logged[key] = now
            if len(self.logged) > 1024:
                self.logged.clear()
            log.warning("%s refused a CURVE client whose public key %s is not in %s", self.where, key.decode(),
                        os.path.join(self.keys.directory, AUTHORIZED))
        return False


_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}


def secure_server(sock: zmq.Socket, keys: CurveKeys, where: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server that accepts only authorized clients. The ZAP handler
    is one thread per ZeroMQ context, started by the first socket secured in it."""
    from zmq.auth.thread import ThreadAuthenticator

    assert keys.server_secret is not None, "a CURVE server needs the server secret key"
    ctx = sock.context
    with _auth_lock:
        if id(ctx) not in _authenticators:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("zserve.curve.zap"))
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=_Allowed(keys, where))
            _authenticators[id(ctx)] = auth
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client that talks only to the holder of the server key."""
    public, secret = keys.pair_for_connecting()
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def tcp_host(endpoint: str) -> str:
    """``tcp://HOST:PORT`` → HOST (brackets kept off an IPv6 address)."""
    rest = endpoint.removeprefix("tcp://")
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def tcp_port(endpoint: str) -> int:
    rest = endpoint.removeprefix("tcp://")
    try:
        return int(rest.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT") from None


def with_port(endpoint: str, port: int) -> str:
    """``tcp://HOST:ANY`` → ``tcp://HOST:PORT``."""
    return f"tcp://{endpoint.removeprefix('tcp://').rsplit(':', 1)[0]}:{port}"


class BindError(RuntimeError):
    """A ZeroMQ socket could not bind its endpoint (the message names the socket, the endpoint and why)."""


def bind(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """Bind ``sock`` at ``endpoint``, or close it and raise ``BindError`` naming ``what``: the process decides
    whether that is fatal (``launch engine``'s registry) or worth a restart (an engine, whose port another process
    may hold for a while)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BindError(f"cannot bind {what} at {endpoint}: {zmq.strerror(e.errno)}") from None
