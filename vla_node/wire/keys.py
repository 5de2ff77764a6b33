"""CURVE key files for the transport: one server pair (the node), one client pair, and an allow-list.

Layout of a keys directory (ZeroMQ certificate files, zmq.auth format):

    server.key                     node public key   (clients need it)
    server.key_secret              node secret key   (node only; mode 0600)
    client.key                     client public key
    client.key_secret              client secret key (client only; mode 0600)
    authorized_clients/client.key  the public keys the node accepts (add more .key files to allow more clients)

`vla-node keys --out DIR` creates them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

AUTHORIZED_DIR = "authorized_clients"


@dataclass(frozen=True)
class KeyPaths:
    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized_clients: Path


def key_paths(keys_dir: str | os.PathLike) -> KeyPaths:
    d = Path(keys_dir)
    return KeyPaths(
        server_public=d / "server.key",
        server_secret=d / "server.key_secret",
        client_public=d / "client.key",
        client_secret=d / "client.key_secret",
        authorized_clients=d / AUTHORIZED_DIR,
    )


def create_keys(out_dir: str | os.PathLike) -> KeyPaths:
    """Write a server pair, a client pair and authorized_clients/ holding the client public key.
    Refuses (FileExistsError) when any of those files or the folder already exists."""
    paths = key_paths(out_dir)
    existing = [str(p) for p in vars(paths).values() if p.exists()]
    if existing:
        raise FileExistsError(
            f"refusing to overwrite CURVE keys: {existing} already exist; "
            f"remove them or choose another directory than {str(out_dir)!r}"
        )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(str(out_dir), name)
        os.chmod(secret, 0o600)
    paths.authorized_clients.mkdir()
    shutil.copyfile(paths.client_public, paths.authorized_clients / paths.client_public.name)
    return paths


def load_secret_pair(secret_file: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a *.key_secret file; clear error when absent or not a secret key."""
    path = Path(secret_file)
    if not path.is_file():
        raise FileNotFoundError(
            f"CURVE secret key file {str(path)!r} does not exist (create keys with `vla-node keys --out DIR`)")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{str(path)!r} holds no secret key: expected a *.key_secret file")
    return public, secret


def load_public(public_file: str | os.PathLike) -> bytes:
    """Z85 public key from a *.key (or *.key_secret) file."""
    path = Path(public_file)
    if not path.is_file():
        raise FileNotFoundError(f"CURVE public key file {str(path)!r} does not exist")
    public, _ = zmq.auth.load_certificate(path)
    return public
