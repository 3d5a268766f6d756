"""Reading the small files an operator names: the config, secrets, CA bundles, keys.

Each is read whole, at start and again on every SIGHUP, on the event loop. So a
path that names a FIFO, a device or anything else that is not a regular file is
refused rather than read: opening a FIFO blocks until a writer comes (the whole
daemon would freeze on SIGHUP), and ``/dev/zero`` never ends (it would fill the
memory). Nor is a file larger than :data:`MAX_FILE_BYTES` read: none of these
is anywhere near that size, so a larger one is a mistake.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Final

#: Bytes, at most, of one config file, secret, CA bundle, certificate or key.
MAX_FILE_BYTES: Final = 16 * 1024 * 1024


def read_regular(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed).

    Never blocks on a FIFO (opened non-blocking, then refused) and never reads
    more than ``limit + 1`` bytes.

    Raises:
        OSError: it cannot be opened or read, is a directory, is not a regular
            file, or holds more than ``limit`` bytes; ``strerror`` says which.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(
                errno.EINVAL,
                "not a regular file (a pipe, socket or device cannot be read again on SIGHUP)",
                os.fspath(path),
            )
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", os.fspath(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_special(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` exists and is not a regular file or a directory (a FIFO, a
    socket, a device), following symlinks; False if it cannot be looked at."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))
