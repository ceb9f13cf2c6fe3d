"""BudgetSegment: the bytes of a machine-wide shared budget in /dev/shm, their lock, and who is alive.

Note (why this shape). Several processes must agree on how many bytes each may map. The agreement lives in
one small POSIX shared-memory file, `/dev/shm/vpaged-budget.NAME`: a header (magic, format version, page
size, capacity, a checksum of these fixed fields) and a table of member records. Only counts are shared;
every member's pages stay in its own pool, so no process can see another's K/V.

- Lock: `flock(LOCK_EX)` on the segment's file. The kernel drops it when its holder dies, so a member
  killed inside a critical section never wedges the others (no robust mutex needed). flock excludes open
  file descriptions, not threads: a process-local lock is taken first.
- Integrity: a crc32 of the header's fixed fields and one of the member table, rewritten on every locked
  write and checked on every locked read. A segment failing either, or of another size or version, is
  refused with BudgetCorruptError naming the fix (`vpaged budget remove NAME`).
- Liveness: a member record keeps its pid and the pid's start time (from /proc/PID/stat), so a reused pid is
  not mistaken for the member. Whoever takes the lock reaps records whose process is gone (or a zombie):
  a member killed with SIGKILL is freed at the next locked call of any other member.
- Permissions: created 0600 (owner only) unless asked for 0660 (a group). Opening refuses a segment of
  another owner unless its group may use it, and any segment other users may read or write.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass

from ..errors import (
    BudgetCorruptError,
    BudgetExistsError,
    BudgetNotFoundError,
    BudgetPermissionError,
    InvalidArgumentError,
)

SHM_DIR = "/dev/shm"
MAGIC = b"VPBUDGET"
VERSION = 2  # 2: the share policy in the header, each member's demand in its record
MAX_MEMBERS = 64
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# magic, version, fixed crc, page size, capacity bytes, max members, owner uid, created ns, table crc, share
# policy (fair_share.POLICY_CODES)
_HEADER = struct.Struct("<8sIIQQIIQII")
# state, pid, start ticks, name, model, min, ceiling, granted, mapped, live, dormant, asked, ask seq,
# answered seq, updated ns, demand bytes, demand ns
_MEMBER = struct.Struct("<IIQ32s64sQQQQQQQQQQQQ")
_FREE, _USED = 0, 1
ASK_SEQ_OFFSET = 4 + 4 + 8 + 32 + 64 + 8 * 7  # of a member record: what an idle member's thread polls


def segment_path(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgumentError(f"a budget name is 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
    return os.path.join(SHM_DIR, f"vpaged-budget.{name}")


def segment_bytes(max_members: int = MAX_MEMBERS) -> int:
    return _HEADER.size + max_members * _MEMBER.size


@dataclass
class MemberRecord:
    """One member of a budget: a pool of one process. Bytes throughout; granted is what counts."""

    index: int
    pid: int
    start_ticks: int
    name: str
    model: str
    min_bytes: int
    ceiling_bytes: int
    granted_bytes: int = 0  # charged against the budget: the pool's limit
    mapped_bytes: int = 0  # pages in use in the pool (as last reported)
    live_bytes: int = 0  # of them, read by live sequences / tensors
    dormant_bytes: int = 0  # of them, kept only for reuse (freed slots, cached prefixes)
    asked_bytes: int = 0  # others want this much back
    ask_seq: int = 0  # bumped at each ask; the member's thread polls it
    answered_seq: int = 0  # the last ask the member handled
    updated_ns: int = 0
    demand_bytes: int = 0  # what the member was short of when it last asked (fair_share.py: starved)
    demand_ns: int = 0  # when it last asked (time.time_ns)

    def reserved_bytes(self) -> int:
        """What others cannot take: the grant or the guaranteed minimum, whichever is larger."""
        return max(self.granted_bytes, self.min_bytes)

    def pack(self) -> bytes:
        return _MEMBER.pack(
            _USED, self.pid, self.start_ticks, self.name.encode()[:32], self.model.encode()[:64], self.min_bytes,
            self.ceiling_bytes, self.granted_bytes, self.mapped_bytes, self.live_bytes, self.dormant_bytes,
            self.asked_bytes, self.ask_seq, self.answered_seq, self.updated_ns, self.demand_bytes, self.demand_ns,
        )  # fmt: skip


def process_start_ticks(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):  # killed but not yet waited for: its memory is already gone
        return None
    return int(fields[19])


class BudgetSegment:
    """An open segment: mapped, with its lock. Every read or write of the member table is done inside
    `locked()`, which checks the checksums first and rewrites the table's after."""

    def __init__(self, name: str, fd: int, path: str):
        self.name, self.path, self._fd = name, path, fd
        self._mm = mmap.mmap(fd, segment_bytes())
        self._thread_lock = threading.Lock()
        self._check_header()

    # ------------------------------------------------------------------------------- create, open, remove
    @classmethod
    def create(
        cls, name: str, capacity_bytes: int, page_size: int, mode: int = 0o600, policy_code: int = 0
    ) -> BudgetSegment:
        path = segment_path(name)
        if mode not in (0o600, 0o660):
            raise InvalidArgumentError(f"a budget's mode is 0o600 (owner) or 0o660 (owner and group), got {mode:#o}")
        # Written whole under a temporary name, then linked in: no process ever opens a half-made segment.
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away; the mode is the contract
            table = bytes(MAX_MEMBERS * _MEMBER.size)
            header = _pack_header(
                page_size, capacity_bytes, MAX_MEMBERS, os.geteuid(), time.time_ns(), zlib.crc32(table), policy_code
            )
            os.write(fd, header + table)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise BudgetExistsError(
                    f"a budget named {name!r} exists ({path}): open it, or `vpaged budget remove {name}` first"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return cls(name, fd, path)

    @classmethod
    def open(cls, name: str) -> BudgetSegment:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BudgetNotFoundError(
                f"no budget named {name!r} ({path}): create it with `vpaged budget create {name} --bytes N`"
            ) from None
        except PermissionError:
            raise BudgetPermissionError(
                f"budget {name!r} ({path}) belongs to another user and its mode does not let this one join"
            ) from None
        try:
            _check_owner(name, path, os.fstat(fd))
            if os.fstat(fd).st_size != segment_bytes():
                raise BudgetCorruptError(
                    f"budget {name!r} ({path}) has {os.fstat(fd).st_size} bytes, not {segment_bytes()}: damaged or of "
                    f"another vpaged version; remove it with `vpaged budget remove {name}` and create it again"
                )
            return cls(name, fd, path)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def remove(name: str) -> bool:
        """Unlink the segment (processes that have it open keep their copy until they close it)."""
        try:
            os.unlink(segment_path(name))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        if self._fd >= 0:
            self._mm.close()
            os.close(self._fd)
            self._fd = -1

    # ----------------------------------------------------------------------------------------- header
    def _header(self) -> tuple:
        return _HEADER.unpack_from(self._mm, 0)

    def _check_header(self) -> None:
        magic, version, crc, page_size, capacity, max_members, uid, created, _table_crc, policy = self._header()
        fix = f"remove it with `vpaged budget remove {self.name}` and create it again"
        if magic != MAGIC:
            raise BudgetCorruptError(f"budget {self.name!r} ({self.path}) is not a vpaged budget (bad magic): {fix}")
        if version != VERSION:
            raise BudgetCorruptError(
                f"budget {self.name!r} ({self.path}) has format version {version}, this vpaged reads {VERSION}: {fix}"
            )
        if crc != _fixed_crc(page_size, capacity, max_members, uid, created, policy) or max_members != MAX_MEMBERS:
            raise BudgetCorruptError(f"budget {self.name!r} ({self.path}) fails its header checksum: {fix}")
        self.page_size, self.capacity_bytes, self.owner_uid, self.policy_code = page_size, capacity, uid, policy

    # ----------------------------------------------------------------------------------------- the table
    @contextlib.contextmanager
    def locked(self, write: bool = True):
        """Hold the budget's lock; yields the live member records (dead ones already reaped). Changes made
        to the records are written back when the block ends without an error (write=False: a reading call,
        written back only when it reaped a dead member)."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._check_header()
                records = self._read_table()
                live = [r for r in records if process_start_ticks(r.pid) == r.start_ticks]
                yield live
                if write or len(live) != len(records):
                    self._write_table(live)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read_table(self) -> list[MemberRecord]:
        table = self._mm[_HEADER.size : segment_bytes()]
        if zlib.crc32(table) != self._header()[8]:
            raise BudgetCorruptError(
                f"budget {self.name!r} ({self.path}) fails its member table checksum (written outside vpaged?): "
                f"remove it with `vpaged budget remove {self.name}` and create it again"
            )
        out = []
        for i in range(MAX_MEMBERS):
            f = _MEMBER.unpack_from(table, i * _MEMBER.size)
            if f[0] == _USED:
                out.append(MemberRecord(i, f[1], f[2], _text(f[3]), _text(f[4]), *f[5:]))
        return out

    def _write_table(self, records: list[MemberRecord]) -> None:
        table = bytearray(MAX_MEMBERS * _MEMBER.size)
        for r in records:
            table[r.index * _MEMBER.size : (r.index + 1) * _MEMBER.size] = r.pack()
        self._mm[_HEADER.size : segment_bytes()] = bytes(table)
        struct.pack_into("<I", self._mm, _HEADER.size - 8, zlib.crc32(table))

    def free_index(self, records: list[MemberRecord]) -> int | None:
        taken = {r.index for r in records}
        return next((i for i in range(MAX_MEMBERS) if i not in taken), None)

    def peek_ask_seq(self, index: int) -> int:
        """A member's ask counter, read without the lock (a torn read only wakes the member early)."""
        return struct.unpack_from("<Q", self._mm, _HEADER.size + index * _MEMBER.size + ASK_SEQ_OFFSET)[0]


def _fixed_crc(page_size: int, capacity: int, max_members: int, uid: int, created: int, policy: int) -> int:
    fixed = struct.pack("<IQQIIQI", VERSION, page_size, capacity, max_members, uid, created, policy)
    return zlib.crc32(MAGIC + fixed)


def _pack_header(
    page_size: int, capacity: int, max_members: int, uid: int, created: int, table_crc: int, policy: int
) -> bytes:
    crc = _fixed_crc(page_size, capacity, max_members, uid, created, policy)
    return _HEADER.pack(MAGIC, VERSION, crc, page_size, capacity, max_members, uid, created, table_crc, policy)


def _check_owner(name: str, path: str, st: os.stat_result) -> None:
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise BudgetPermissionError(
            f"budget {name!r} ({path}) has mode {stat.S_IMODE(st.st_mode):#o}: other users may read or write it, "
            f"so its counts cannot be trusted; remove it (`vpaged budget remove {name}`) and create it again (0600)"
        )
    if st.st_uid != os.geteuid():
        group_ok = st.st_mode & stat.S_IRWXG == (stat.S_IRGRP | stat.S_IWGRP) and st.st_gid in os.getgroups() + [
            os.getegid()
        ]
        if not group_ok:
            raise BudgetPermissionError(
                f"budget {name!r} ({path}) belongs to uid {st.st_uid}, not this process's {os.geteuid()}, and is "
                "not shared with its group (mode 0660): ask its owner to create it for a group, or use your own"
            )


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")
