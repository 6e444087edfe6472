"""What a process holds open, read from /proc (Linux)."""

from __future__ import annotations

import os


def descriptors(pid: int) -> dict[str, str]:
    """The process's open descriptors and what each is (``socket:[inode]``, a path, ...)."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
    return found
