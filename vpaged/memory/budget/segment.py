"""BudgetSegment: the bytes of a machine-wide shared budget in /dev/shm, read without a lock and checked.

Note (why this shape). Several processes must agree on how many bytes each may map. The agreement lives in
one small POSIX shared-memory file, `/dev/shm/vpaged-budget.NAME`; only counts are shared, every member's
pages stay in its own pool, so no process can see another's K/V. The file must survive anything a member
does: a SIGKILL at any instruction, a SIGSTOP for any time, a truncation by anyone who may write it, members
in other PID namespaces. So it has no lock at all (a stopped process holding one would stall everybody):

- Header: magic, format version, page size, capacity, share policy, lease length, and a crc32 of it all;
  written once, at create, before the file is linked in.
- Member table, copy on write: the grant-relevant records of all members live in one *table buffer*, a crc32
  over its count, generation and records inside it. There are two buffers per member slot, written only by
  that slot's member, and a few scratch buffers (claimed by compare-and-swap on a claim word, released after)
  for callers that own no slot yet (join, `vpaged budget limit`). A 64-bit control word holds (generation,
  active buffer). A change (ledger.py) reads the control word, reads and checks the active buffer,
  computes the new table, writes it into one of its own buffers that is not the active one, then moves the
  control word (g, active) -> (g+1, mine) by compare-and-swap, or starts again. A kill at any instruction
  leaves the active buffer whole; a stopped process holds nothing. Reads are the same without the last two
  steps, and retry while the control word moves under them.
- Status records: what changes often (mapped / live / dormant, the lease, liveness.py) lives in a
  record per slot that only its member writes, as two copies, each with its own sequence number, member
  token and crc32: the writer overwrites the older copy, readers take the newest valid one. report() and the
  lease need no table change.
- Bounds: the mapping is read and written only through vpaged._C.LedgerMapping, whose accesses are bounds
  checked and guarded against SIGBUS (a truncated file: csrc/bindings/shm_ledger.cpp). Every call checks the
  file's size first (fstat); a fault that races it marks the mapping damaged, and the call raises
  BudgetCorruptError. Nothing read from the file is trusted before its checksum passed.
- Permissions: created 0600 (owner only) unless asked for 0660 (a group). Opening refuses a segment of
  another owner unless its group may use it, and any segment other users may read or write.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass

from ... import _C
from ...errors import (
    BudgetCorruptError,
    BudgetExistsError,
    BudgetNotFoundError,
    BudgetPermissionError,
    InvalidArgumentError,
)
from .liveness import FENCED, LEASE_S, USED, boottime_ns, process_start_ticks  # noqa: F401 (re-exported)

SHM_DIR = "/dev/shm"
MAGIC = b"VPBUDGET"
VERSION = 3  # 3: lock-free copy-on-write table buffers, per-member status records and leases (2: one flock)
MAX_MEMBERS = 64
NAME_BYTES = 64  # a member's name, kept whole (longer names are refused at join)
N_SCRATCH = 8
N_BUFFERS = 2 * MAX_MEMBERS + N_SCRATCH
# fullmatch, not match with "$": "$" also matches before a trailing newline ("kv\n" is not a name)
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# magic, version, crc (of the 64 header bytes with this field 0), page size, capacity, max members, owner uid,
# created ns, share policy (policy.POLICY_CODES), lease ms
_HEADER = struct.Struct("<8sIIQQIIQII")
HEADER_BYTES = 64
CONTROL_OFFSET = 64  # (generation << 8) | active buffer
CLAIMS_OFFSET = 128  # N_SCRATCH claim words: 0 free, else the claimer's boottime ns
STATUS_OFFSET = 256
_STATUS = struct.Struct("<QQQQQQQI4x")  # seq, token, lease ns, mapped, live, dormant, updated ns, crc
STATUS_SLOT_BYTES = 2 * _STATUS.size
# state, index, pid, start ticks, pid namespace, token, joined ns, name, model, min, ceiling, granted, asked,
# ask seq, answered seq, demand bytes, demand ns, fenced ns
_RECORD = struct.Struct("<HHIQQQQ64s64sQQQQQQQQQ")
_BUF_HEAD = struct.Struct("<IIQ")  # crc (of what follows it), count, generation
BUFFER_BYTES = _BUF_HEAD.size + MAX_MEMBERS * _RECORD.size
BUFFERS_OFFSET = STATUS_OFFSET + MAX_MEMBERS * STATUS_SLOT_BYTES
_READ_TRIES = 200


def check_budget_name(name: str) -> str:
    """`name` if it names a budget (1-64 of A-Z a-z 0-9 _ . -), else InvalidArgumentError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidArgumentError(f"a budget name is 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
    return name


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, f"vpaged-budget.{check_budget_name(name)}")


def segment_bytes() -> int:
    return BUFFERS_OFFSET + N_BUFFERS * BUFFER_BYTES


def buffer_offset(buffer: int) -> int:
    return BUFFERS_OFFSET + buffer * BUFFER_BYTES


@dataclass
class MemberRecord:
    """One member of a budget: a pool of one process. Bytes throughout; granted is what counts. The fields
    up to min/ceiling/granted, asked, the ask counters and the demand live in the table (changed only by a
    transaction); mapped / live / dormant / updated_ns / lease_ns come from the member's status record."""

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
    demand_bytes: int = 0  # what the member was short of when it last asked (policy.py: starved)
    demand_ns: int = 0  # when it last asked (time.time_ns)
    pidns: int = 0  # the member's PID namespace (liveness.pid_namespace)
    token: int = 0  # random, per join: which process owns the record (pids repeat across namespaces)
    joined_ns: int = 0  # boottime ns of the join (the lease until the first renewal)
    lease_ns: int = 0  # boottime ns of the last renewal (status record)
    fenced_ns: int = 0  # boottime ns when its lease was found expired (state FENCED)
    state: int = USED

    def reserved_bytes(self) -> int:
        """What others cannot take: the grant or the guaranteed minimum, whichever is larger."""
        return max(self.granted_bytes, self.min_bytes)

    def pack(self) -> bytes:
        return _RECORD.pack(
            self.state, self.index, self.pid, self.start_ticks, self.pidns, self.token, self.joined_ns,
            self.name.encode(), self.model.encode(), self.min_bytes, self.ceiling_bytes, self.granted_bytes,
            self.asked_bytes, self.ask_seq, self.answered_seq, self.demand_bytes, self.demand_ns, self.fenced_ns,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes, offset: int) -> MemberRecord:
        f = _RECORD.unpack_from(raw, offset)
        return cls(
            f[1], f[2], f[3], _text(f[7]), _text(f[8]), f[9], f[10], f[11], asked_bytes=f[12], ask_seq=f[13],
            answered_seq=f[14], demand_bytes=f[15], demand_ns=f[16], pidns=f[4], token=f[5], joined_ns=f[6],
            fenced_ns=f[17], state=f[0],
        )  # fmt: skip


@dataclass(frozen=True)
class Snapshot:
    """One validated read of the table: the control word it was read under, the records, and the buffer's
    body (what a change compares its new table with, to skip writing an unchanged one)."""

    control: int
    records: list[MemberRecord]
    body: bytes

    @property
    def generation(self) -> int:
        return self.control >> 8


@dataclass(frozen=True)
class SegmentStatus:
    """What an open segment is now: "ok", "removed" (unlinked), "replaced" (another file under its name: a
    re-created budget to rejoin) or "corrupt" (truncated, overwritten); message says it in a sentence."""

    state: str
    message: str

    @property
    def ok(self) -> bool:
        return self.state == "ok"


class BudgetSegment:
    """An open segment: mapped through a LedgerMapping. Reads are lock-free (snapshot()); changes are made
    by ledger.BudgetLedger."""

    def __init__(self, name: str, fd: int, path: str):
        self.name, self.path, self._fd = name, path, fd
        self.map = _C.LedgerMapping(fd, segment_bytes())
        self._last_ask: tuple[int, int, int] | None = None  # (control word, index, ask counter) last peeked
        try:
            self._check_header()
        except BaseException:
            self.map.close()
            raise

    # ------------------------------------------------------------------------------- create, open, remove
    @classmethod
    def create(
        cls,
        name: str,
        capacity_bytes: int,
        page_size: int,
        mode: int = 0o600,
        policy_code: int = 0,
        lease_s: float = LEASE_S,
    ) -> BudgetSegment:
        path = segment_path(name)
        if mode not in (0o600, 0o660):
            raise InvalidArgumentError(f"a budget's mode is 0o600 (owner) or 0o660 (owner and group), got {mode:#o}")
        lease_ms = int(round(float(lease_s) * 1000))
        if not 100 <= lease_ms <= 3_600_000:
            raise InvalidArgumentError(f"a budget's lease is 0.1 to 3600 s, got {lease_s!r}")
        # Written whole under a temporary name, then linked in: no process ever opens a half-made segment.
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away; the mode is the contract
            os.ftruncate(fd, segment_bytes())
            header = _pack_header(page_size, capacity_bytes, os.geteuid(), time.time_ns(), policy_code, lease_ms)
            os.pwrite(fd, header, 0)
            os.pwrite(fd, struct.pack("<Q", (1 << 8) | 2 * MAX_MEMBERS), CONTROL_OFFSET)  # scratch 0, generation 1
            os.pwrite(fd, pack_table([], 1), buffer_offset(2 * MAX_MEMBERS))
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
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise BudgetCorruptError(f"budget {name!r} ({path}) has {size} bytes: {_fix(name)}")
            magic, version = struct.unpack("<8sI", os.pread(fd, 12, 0))
            if magic == MAGIC and version != VERSION:
                raise BudgetCorruptError(
                    f"budget {name!r} ({path}) has format version {version}, this vpaged reads {VERSION}: {_fix(name)}"
                )
            if size != segment_bytes():
                raise BudgetCorruptError(
                    f"budget {name!r} ({path}) has {size} bytes, not {segment_bytes()}: damaged or of another "
                    f"vpaged version; {_fix(name)}"
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
        except PermissionError:
            raise BudgetPermissionError(
                f"budget {name!r} ({segment_path(name)}) cannot be removed by this user (uid {os.geteuid()}): "
                "ask its owner"
            ) from None

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def file_id(self) -> tuple[int, int]:
        """(device, inode) of the file this segment has open (another file may have its name by now)."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    def close(self) -> None:
        if self._fd >= 0:
            self.map.close()
            os.close(self._fd)
            self._fd = -1

    def status(self) -> SegmentStatus:
        """Whether this open segment is still the budget of its name, and readable (see SegmentStatus)."""
        if self._fd < 0:
            return SegmentStatus("removed", f"budget {self.name!r} is closed here")
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return SegmentStatus("removed", f"budget {self.name!r} ({self.path}) was removed")
        if (there.st_dev, there.st_ino) != self.file_id():
            return SegmentStatus("replaced", f"budget {self.name!r} ({self.path}) was removed and created again")
        try:
            self._check_header()  # read at open only otherwise: a header overwritten since shows here
            self.snapshot()
        except BudgetCorruptError as e:
            return SegmentStatus("corrupt", str(e))
        return SegmentStatus("ok", f"budget {self.name!r} is readable")

    # ----------------------------------------------------------------------------------------- checks
    def check_readable(self) -> None:
        """Raise BudgetCorruptError when the file shrank or an access to it faulted (truncated under us)."""
        if self._fd < 0:
            raise BudgetCorruptError(f"budget {self.name!r} is closed in this process")
        size = os.fstat(self._fd).st_size
        if size < segment_bytes() or self.map.damaged:
            raise BudgetCorruptError(
                f"budget {self.name!r} ({self.path}) was truncated to {size} of {segment_bytes()} bytes while in "
                f"use: {_fix(self.name)}"
            )

    def _check_header(self) -> None:
        self.check_readable()
        raw = self.map.read(0, HEADER_BYTES)
        magic, version, crc, page_size, capacity, max_members, uid, created, policy, lease_ms = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise BudgetCorruptError(
                f"budget {self.name!r} ({self.path}) is not a vpaged budget (bad magic): {_fix(self.name)}"
            )
        if version != VERSION:
            raise BudgetCorruptError(
                f"budget {self.name!r} ({self.path}) has format version {version}, this vpaged reads {VERSION}: "
                f"{_fix(self.name)}"
            )
        if crc != _header_crc(raw) or max_members != MAX_MEMBERS:
            raise BudgetCorruptError(f"budget {self.name!r} ({self.path}) fails its header checksum: {_fix(self.name)}")
        self.page_size, self.capacity_bytes, self.owner_uid, self.policy_code = page_size, capacity, uid, policy
        self.lease_ns = lease_ms * 1_000_000

    def corrupt(self, what: str) -> BudgetCorruptError:
        self.check_readable()  # a truncation explains it better than the symptom
        return BudgetCorruptError(f"budget {self.name!r} ({self.path}) {what}: {_fix(self.name)}")

    # ----------------------------------------------------------------------------------------- reading
    def snapshot(self, figures: bool = True) -> Snapshot:
        """The table as of one generation, checked, with each record's status figures filled in. Retries while
        the control word moves under the read; BudgetCorruptError when the active buffer fails its checks."""
        bad = ""
        for _ in range(_READ_TRIES):
            self.check_readable()
            control = self.map.load64(CONTROL_OFFSET)
            buffer = control & 0xFF
            if buffer >= N_BUFFERS:
                bad = f"names table buffer {buffer} of {N_BUFFERS}"
                continue
            offset = buffer_offset(buffer)
            crc, count, generation = _BUF_HEAD.unpack(self.map.read(offset, _BUF_HEAD.size))
            size = min(count, MAX_MEMBERS) * _RECORD.size
            body = self.map.read(offset + 4, _BUF_HEAD.size - 4 + size)
            if self.map.load64(CONTROL_OFFSET) != control:
                continue  # a change landed while we read: read the new table
            if count > MAX_MEMBERS or generation != control >> 8 or zlib.crc32(body) != crc:
                bad = "fails its member table checksum (written outside vpaged?)"
                continue  # once more, in case the bytes moved under a reader paused between the two loads
            records = [MemberRecord.unpack(body, 12 + i * _RECORD.size) for i in range(count)]
            if figures and records:  # all status records in one read: a change reads them every time
                status = self.map.read(STATUS_OFFSET, MAX_MEMBERS * STATUS_SLOT_BYTES)
                for r in records:
                    if r.state == USED:
                        self._fill_status(r, status)
            return Snapshot(control, records, body[12:])
        raise self.corrupt(bad or "kept changing under a reader")

    def peek_ask_seq(self, index: int) -> int:
        """A member's ask counter (0 when it has no record): what an idle member's thread polls, and a busy
        engine between two steps. Every table change publishes a new control word, so while the word is the
        one the last peek read under, the counter is the one it found: one 8-byte load (and the truncation
        check) instead of reading and checksumming the whole table at each step. Bytes scribbled into the
        table without a new control word are then found by the next full read (any change, grant or state)."""
        self.check_readable()
        last = self._last_ask
        if last is not None and last[1] == index and last[0] == self.map.load64(CONTROL_OFFSET):
            return last[2]
        snap = self.snapshot(figures=False)
        mine = next((r for r in snap.records if r.index == index and r.state == USED), None)
        ask = 0 if mine is None else mine.ask_seq
        self._last_ask = (snap.control, index, ask)
        return ask

    def active_table_offset(self) -> int:
        """Where the active table buffer starts in the file (diagnostics and tests)."""
        return buffer_offset(self.map.load64(CONTROL_OFFSET) & 0xFF)

    # ----------------------------------------------------------------------------------- status records
    def _read_status(self, index: int, status: bytes | None = None) -> list[tuple | None]:
        """Both copies of slot `index`'s status record, None for one that fails its crc (from `status`, the
        whole status area read at once, when given)."""
        if status is None:
            raw, base = self.map.read(STATUS_OFFSET + index * STATUS_SLOT_BYTES, STATUS_SLOT_BYTES), 0
        else:
            raw, base = status, index * STATUS_SLOT_BYTES
        out = []
        for at in (base, base + _STATUS.size):
            c = _STATUS.unpack_from(raw, at)
            out.append(c if c[7] == zlib.crc32(raw[at : at + _STATUS.size - 8]) else None)
        return out

    def _fill_status(self, r: MemberRecord, status: bytes) -> None:
        good = [c for c in self._read_status(r.index, status) if c is not None and c[1] == r.token]
        if good:
            _, _, r.lease_ns, r.mapped_bytes, r.live_bytes, r.dormant_bytes, r.updated_ns, _ = max(good)

    def write_status(self, index: int, token: int, lease_ns: int, mapped: int, live: int, dormant: int) -> None:
        """Overwrite the older (or a damaged) copy of slot `index`'s status record; only the slot's member
        calls this, holding ledger.py's process-wide lock. A kill mid-write leaves the other copy, which
        readers then take."""
        self.check_readable()
        copies = self._read_status(index)
        seq = max((c[0] for c in copies if c is not None), default=0) + 1
        at = next((i for i, c in enumerate(copies) if c is None), None)
        if at is None:
            at = 0 if copies[0][0] <= copies[1][0] else 1
        head = struct.pack("<QQQQQQQ", seq, token, lease_ns, mapped, live, dormant, time.time_ns())
        offset = STATUS_OFFSET + index * STATUS_SLOT_BYTES + at * _STATUS.size
        self.map.write(offset, head + struct.pack("<I4x", zlib.crc32(head)))


def pack_table(records: list[MemberRecord], generation: int) -> bytes:
    """A table buffer: crc32, count, generation, then the records (by index)."""
    body = struct.pack("<IQ", len(records), generation) + b"".join(r.pack() for r in sorted(records, key=_by_index))
    return struct.pack("<I", zlib.crc32(body)) + body


def _by_index(r: MemberRecord) -> int:
    return r.index


def _header_crc(raw: bytes) -> int:
    return zlib.crc32(raw[:12] + b"\0\0\0\0" + raw[16:HEADER_BYTES])


def _pack_header(page_size: int, capacity: int, uid: int, created: int, policy: int, lease_ms: int) -> bytes:
    raw = _HEADER.pack(MAGIC, VERSION, 0, page_size, capacity, MAX_MEMBERS, uid, created, policy, lease_ms)
    raw = raw.ljust(HEADER_BYTES, b"\0")
    return raw[:12] + struct.pack("<I", _header_crc(raw)) + raw[16:]


def _fix(name: str) -> str:
    return f"remove it with `vpaged budget remove {name}` and create it again"


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
