"""Data files hashed as they are read, so that a trace's manifest describes exactly the bytes it traced.

A trace hashes its data files when it starts (the manifest records each file's sha256), then reads them
again to trace them. HashedFile hashes the bytes that second reading takes, as it takes them; once a file
is read to its end (finish() reads what an early stop left unread, only to hash it) the hash must be the
recorded one, or DataChanged names the file: a file edited between the two readings, or while it is read,
stops the trace instead of being traced with contents its manifest does not describe.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

RETAIN = 1 << 18  # bytes: a read may step back this far (buffers, a line scanned ahead) and is then compared


class DataChanged(ValueError):
    """A data file's bytes as the trace read them are not those it hashed when it started."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        super().__init__(message)
        self.path = str(path)


class HashedFile(io.RawIOBase):
    """A file read as raw bytes, each byte hashed the first time it is read (sha256 of bytes [0, hashed)).
    A read that steps back over bytes already hashed (up to RETAIN) must find them unchanged. expected: the
    sha256 the whole file must have (None: hash only; the digest is then just reported)."""

    def __init__(self, path: str | os.PathLike, expected: str | None = None) -> None:
        super().__init__()
        self.path, self.expected = Path(path), expected
        self.raw = open(path, "rb", buffering=0)
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.tail = bytearray()  # the last RETAIN bytes hashed, to compare a read that steps back
        self.finished = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def readinto(self, buffer) -> int:
        at = self.raw.tell()
        n = self.raw.readinto(buffer)
        if n:
            self._hash(at, bytes(memoryview(buffer)[:n]))
        return n

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    def _hash(self, at: int, data: bytes) -> None:
        if at > self.hashed:
            raise RuntimeError(f"{self.path}: a read at byte {at} skipped bytes from {self.hashed} on, which were never hashed")
        again = min(at + len(data), self.hashed) - at  # bytes read before: they must not have changed
        if again > 0:
            kept_from = self.hashed - len(self.tail)
            if at < kept_from:
                raise RuntimeError(f"{self.path}: a read at byte {at} stepped back past the {RETAIN} bytes kept to compare it")
            if self.tail[at - kept_from : at - kept_from + again] != data[:again]:
                raise self._changed(f"bytes {at} to {at + again} read twice differ")
        fresh = data[max(again, 0) :]
        if fresh:
            self.digest.update(fresh)
            self.hashed += len(fresh)
            self.tail += fresh
            if len(self.tail) > RETAIN:
                del self.tail[: len(self.tail) - RETAIN]

    def finish(self) -> str:
        """Hash the bytes not read yet (where the trace stopped early: read only to hash them), check the
        whole against expected, and return the sha256. Idempotent."""
        if not self.finished:
            if self.raw.closed:  # its reader was closed before reading got to the end
                self.raw = open(self.path, "rb", buffering=0)
            self.raw.seek(self.hashed)
            for block in iter(lambda: self.raw.read(1 << 20), b""):
                self._hash(self.hashed, block)
            self.finished = True
            if self.closed:
                self.raw.close()
            found = self.digest.hexdigest()
            if self.expected is not None and found != self.expected:
                raise self._changed(f"sha256 {self.expected[:12]}... when the trace started, {found[:12]}... as it was read")
        return self.digest.hexdigest()

    def _changed(self, what: str) -> DataChanged:
        return DataChanged(
            self.path,
            f"{self.path} changed while being traced ({what}): the trace stops rather than record contents its "
            "manifest does not describe; run the trace again once the file stays as it is",
        )
