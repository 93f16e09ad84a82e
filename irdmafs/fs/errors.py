"""The one error the file system layers raise: ``FsError(errno)``; fs/ops.py turns it into a
FUSEError. Its own module so that every fs module can raise it without importing vfs.py."""

from __future__ import annotations

import os


class FsError(Exception):
    def __init__(self, errno_: int, message: str = ""):
        super().__init__(message or os.strerror(errno_))
        self.errno = errno_
