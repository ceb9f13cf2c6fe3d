"""Where a page store's files are, and who may use them.

`NAME` (1-64 of A-Z a-z 0-9 _ . -) is a store in /dev/shm: `vpaged-store-NAME.index` and its data file
`vpaged-store-NAME.<store id>.data`. `dir:PATH` is a store in the directory PATH (created if missing, on
local disk or a tmpfs): `PATH/store.index` and `PATH/store.<store id>.data`; it survives a reboot when PATH
is on disk. The data file is named by the store id its index holds, so two processes creating the same store
at once each write their own data file and only the index that is linked first counts (the other's data file
is removed); a data file whose index never got linked (a creator killed in between) is an orphan that
`PageStore.remove` deletes too.

Permissions: the files are created 0600 (owner only) or 0660 (owner and group). Opening refuses files that
other users may read or write (their pages and counts cannot be trusted, and K/V is private), and files of
another owner unless they are 0660 and this process is in their group.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from dataclasses import dataclass

from ...errors import InvalidArgumentError, StorePermissionError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MODES = (0o600, 0o660)


@dataclass(frozen=True)
class StoreLocation:
    """The files of one store: `spec` as the user gave it, the index path, and how data files are named."""

    spec: str
    index_path: str
    data_prefix: str  # the data file is data_prefix + store id hex + ".data"
    directory: str | None  # dir: stores: the directory (created at create)

    def data_path(self, store_id: bytes) -> str:
        return f"{self.data_prefix}{store_id.hex()}.data"

    def all_data_paths(self) -> list[str]:
        return sorted(glob.glob(glob.escape(self.data_prefix) + "*.data"))


def resolve(spec: object) -> StoreLocation:
    """The location `spec` names: "NAME" (in /dev/shm) or "dir:PATH"; InvalidArgumentError otherwise."""
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"a store is named by a str (NAME or dir:PATH), got {spec!r}")
    if spec.startswith("dir:"):
        path = spec[4:]
        if not path or "\0" in path:
            raise InvalidArgumentError(f"a directory store is dir:PATH with a non-empty PATH, got {spec!r}")
        path = os.path.abspath(path)
        return StoreLocation(spec, os.path.join(path, "store.index"), os.path.join(path, "store."), path)
    if not _NAME_RE.fullmatch(spec):
        raise InvalidArgumentError(
            f"a store name is 1-64 of A-Z a-z 0-9 _ . - (or dir:PATH for a directory store), got {spec!r}"
        )
    base = os.path.join(SHM_DIR, f"vpaged-store-{spec}")
    return StoreLocation(spec, base + ".index", base + ".", None)


def check_mode(mode: object) -> int:
    if mode not in MODES:
        raise InvalidArgumentError(f"a store's mode is 0o600 (owner) or 0o660 (owner and group), got {mode!r}")
    return int(mode)  # type: ignore[arg-type]


def check_owner(spec: str, path: str, st: os.stat_result) -> None:
    """StorePermissionError unless this process may trust and use the file `st` describes."""
    if not stat.S_ISREG(st.st_mode):
        raise StorePermissionError(f"store {spec!r}: {path} is not a regular file")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise StorePermissionError(
            f"store {spec!r}: {path} has mode {stat.S_IMODE(st.st_mode):#o}: other users may read or write it, so "
            "its pages cannot be trusted; remove the store and create it again (0600, or 0660 for a group)"
        )
    if st.st_uid != os.geteuid():
        in_group = st.st_gid in os.getgroups() or st.st_gid == os.getegid()
        if not (st.st_mode & stat.S_IRWXG == (stat.S_IRGRP | stat.S_IWGRP) and in_group):
            raise StorePermissionError(
                f"store {spec!r}: {path} belongs to uid {st.st_uid}, not this process's {os.geteuid()}, and is not "
                "shared with its group (mode 0660): ask its owner to create it for a group, or use your own"
            )
