"""`vpaged store create | show | verify | remove`: a KV page store (vpaged/memory/store/) from the shell.

A store is named as everywhere else: NAME (files in /dev/shm) or dir:PATH (files under PATH, kept across
restarts). Every error is one line on stderr (`vpaged store: ...`) and exit status 1: a bad name or size, a
store that is missing, damaged, another user's or in use (`remove` without --force); never a traceback.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict

from ..errors import VPagedError
from ..memory.store import PageStore
from .budget import check_page_size, mib, parse_bytes, run_command


def add_parser(sub) -> None:
    p = sub.add_parser(
        "store",
        help="a KV page store that engines of several processes (and restarts) share prefix pages through",
        description="Create, inspect, check or remove a page store: NAME (files in /dev/shm) or dir:PATH (files "
        "under PATH, kept across restarts). Servers use one with vpaged serve --prefix-store NAME|dir:PATH.",
    )
    cmds = p.add_subparsers(dest="store_command", required=True)
    c = cmds.add_parser("create", help="create a store of N pages")
    c.add_argument("name")
    c.add_argument("--pages", type=int, required=True, help="capacity in pages")
    c.add_argument(
        "--page-size",
        default="64KiB",
        help="page size: the KV page size of the caches that will use it (default 64KiB, the host pool's)",
    )
    c.add_argument("--group", action="store_true", help="mode 0660: the owner's group may use it too")
    c.set_defaults(func=cmd_create)
    s = cmds.add_parser("show", help="capacity, pages used / published / pinned, processes, hits, evictions")
    s.add_argument("name")
    s.add_argument("--json", action="store_true", help="print the figures as JSON")
    s.set_defaults(func=cmd_show)
    v = cmds.add_parser("verify", help="read every published page and check it against its checksum")
    v.add_argument("name")
    v.set_defaults(func=cmd_verify)
    r = cmds.add_parser("remove", help="remove the store's files (refused while other processes have it open)")
    r.add_argument("name")
    r.add_argument(
        "--force",
        action="store_true",
        help="remove it even while processes have it open: they keep their copy until they close it",
    )
    r.set_defaults(func=cmd_remove)


def _run(fn, args) -> int:
    return run_command("store", fn, args)


@contextlib.contextmanager
def _opened(name: str):
    store = PageStore.open(name)
    try:
        yield store
    finally:
        with contextlib.suppress(Exception):
            store.close()


def cmd_create(args) -> int:
    def go(a):
        if PageStore.exists(a.name):
            raise VPagedError(f"a store {a.name!r} exists already (vpaged store show / remove {a.name})")
        page_bytes = check_page_size(parse_bytes(a.page_size))
        store = PageStore.open(
            a.name, create=True, capacity_pages=a.pages, page_bytes=page_bytes, mode=0o660 if a.group else 0o600
        )
        store.close()
        print(f"created store {a.name!r}: {a.pages} pages of {page_bytes} bytes ({mib(a.pages * page_bytes)} MiB)")
        return 0

    return _run(go, args)


def cmd_show(args) -> int:
    def go(a):
        with _opened(a.name) as store:
            stats = store.stats()
            processes = store.processes()  # not this command's own
            files = {"index": store.location.index_path, "data": store.data_path}
        if a.json:
            users = [{"pid": pid, "pinned_pages": pinned} for pid, pinned in processes]
            fields = asdict(stats) | {"clients": len(processes)}
            print(json.dumps({"name": a.name, "files": files, **fields, "processes": users}, indent=2))
            return 0
        print(
            f"store {a.name}: {stats.capacity_pages} pages of {stats.page_bytes} bytes "
            f"({mib(stats.capacity_pages * stats.page_bytes)} MiB), {len(processes)} process(es) using it"
            + "".join(f"\n  pid {pid}: {pinned} page(s) pinned" for pid, pinned in processes)
        )
        print(f"  files: {files['index']}, {files['data']}")
        print(
            f"  pages: {stats.used_pages} used, {stats.published_pages} published, {stats.pinned_pages} pinned, "
            f"{stats.writing_pages} being written"
        )
        print(
            f"  since created: {stats.hits} hits, {stats.misses} misses, {stats.published} published, "
            f"{stats.duplicates} duplicates, {stats.evictions} evictions; reclaimed from dead processes: "
            f"{stats.reclaimed_writing} half-written pages, {stats.reclaimed_pins} pins, "
            f"{stats.reclaimed_clients} records"
        )
        return 0

    return _run(go, args)


def cmd_verify(args) -> int:
    def go(a):
        with _opened(a.name) as store:
            checked = store.verify()
        print(f"store {a.name}: {checked} published page(s) checked, every one matches its checksum")
        return 0

    return _run(go, args)


def cmd_remove(args) -> int:
    def go(a):
        if not PageStore.exists(a.name):
            raise VPagedError(f"no store named {a.name!r}")
        if not a.force:
            users = []
            with contextlib.suppress(VPagedError):  # a damaged store can always go
                with _opened(a.name) as store:
                    users = store.processes()
            if users:
                pids = ", ".join(str(pid) for pid, _ in users)
                raise VPagedError(f"store {a.name!r} is open in process(es) {pids}; --force removes it anyway")
        PageStore.remove(a.name)
        print(f"removed store {a.name!r}")
        return 0

    return _run(go, args)
