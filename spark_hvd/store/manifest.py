"""The manifest that commits a store directory: every file's size and (where the writer knew it) SHA-256.

It is written last, as ``_MANIFEST.json``, so its presence means the directory was complete when committed, and its
content lets a reader check that it still is (a torn write, a half-uploaded object, a truncated file). Files that
Spark wrote (prepared Parquet) are recorded by size only: hashing them would mean reading a whole dataset back.

Directories committed by spark_hvd before manifests existed hold an empty (or ``{"time": ...}``) ``_COMMITTED``
marker instead; such a directory cannot be verified and does not count as committed (see docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import IO, Any

#: File name of the manifest inside a committed directory.
MANIFEST = "_MANIFEST.json"
#: The empty marker of spark_hvd versions before manifests (not trusted, only named in messages).
LEGACY_MARKER = "_COMMITTED"
FORMAT = "spark_hvd.manifest/1"
_CHUNK = 1 << 20


def sha256_of(f: IO[bytes]) -> str:
    """Hex SHA-256 of what remains of the open binary file ``f``."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """``files``: posix path relative to the directory -> ``(size in bytes, sha256 hex or None)``."""

    files: dict[str, tuple[int, str | None]]
    time: float = field(default_factory=time.time)

    def dumps(self) -> bytes:
        """The JSON document written as ``_MANIFEST.json``."""
        files = {rel: {"size": size, **({"sha256": sha} if sha else {})} for rel, (size, sha) in self.files.items()}
        return json.dumps({"format": FORMAT, "time": self.time, "files": files}, indent=1, sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes) -> Manifest:
        """Parse a manifest.

        Raises:
            ValueError: not a manifest of this format (a legacy marker, a truncated file, ...).
        """
        try:
            doc: Any = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
            raise ValueError(f"not a {FORMAT} document")
        files = {}
        for rel, entry in doc["files"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
                raise ValueError(f"bad entry for {rel!r}")
            files[str(rel)] = (entry["size"], entry.get("sha256"))
        return cls(files, float(doc.get("time", 0.0)))

    def problem(self, sizes: dict[str, int], sha256: Any) -> str | None:
        """What is wrong with a copy whose files have ``sizes`` (relative path -> bytes), or None when it matches.

        ``sha256(rel)`` gives the hash of a file of the copy; it is called only for files whose size matched.
        """
        for rel, (size, _) in sorted(self.files.items()):
            if rel not in sizes:
                return f"{rel} is missing"
            if sizes[rel] != size:
                return f"{rel} has {sizes[rel]} bytes, the manifest says {size}"
        for rel, (_, digest) in sorted(self.files.items()):
            if digest and sha256(rel) != digest:
                return f"{rel} does not match its SHA-256 in the manifest"
        return None

    def problem_in_local_copy(self, local_dir: str) -> str | None:
        """:meth:`problem` for a downloaded copy in the local directory ``local_dir``."""
        sizes = {}
        for rel in self.files:
            full = os.path.join(local_dir, *rel.split("/"))
            if os.path.isfile(full):
                sizes[rel] = os.path.getsize(full)

        def sha256(rel: str) -> str:
            with open(os.path.join(local_dir, *rel.split("/")), "rb") as f:
                return sha256_of(f)

        return self.problem(sizes, sha256)
