"""A power-cut and disk-error layer for the soak (issue 48): a FUSE filesystem (fusepy over libfuse2)
that keeps, for every file and directory, what was durable at its last fsync, and on a "power cut"
drops everything written since (file bytes, and directory entries: a create, an unlink, a rename).

Names and metadata live in this process's memory; file bytes in a backing folder (a tmpfs, so a full
disk is real), one blob per inode. A file's durable contents are snapshotted at its first change
after an fsync (a prefix length while it is only appended to, a copy otherwise); a directory's entries
at its first change after an fsyncdir. A cut restores every snapshot, then keeps only what the
durable tree reaches (an inode whose only name was never synced is gone, as on ext4 after a crash)
and recomputes the link counts. The model is the strict POSIX one (LazyFS's): fsync of a file does
not make its name durable, and nothing reaches the disk unasked.

Disk errors are armed through the same layer: the next write, fsync, read or stat (a lookup or
getattr: what exists() and open() ask first) of a path matching a pattern (a regular expression,
searched) fails with EIO, or a write is short; a file is torn or bit-flipped in place. (The kernel
answers a failed revalidation of a cached name with a fresh lookup: a stat error reaches its caller
when armed twice.)

    python bench/powercut.py BACKING MOUNTPOINT CONTROL_SOCKET    # serves until unmounted

`Layer` starts one and talks to it (a JSON line each way on a unix socket): `cut()` returns what was
dropped, `arm()` a fault, `hits()` the faults that fired, `call("replaced", since=t)` the names a
rename replaced since monotonic time t (a reader that found one absent met libfuse's path race, below
in bench/README.md). Mount options: use_ino (st_ino is ours),
hard_remove (an unlinked open file keeps working, no .fuse_hidden names), attr/entry/negative
timeouts 0 (the kernel asks again after a cut); flock and fcntl locks are the kernel's own (no lock op).
"""

from __future__ import annotations

import collections
import errno
import json
import os
import re
import shutil
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = 1


@dataclass
class Node:
    ino: int
    kind: int  # stat.S_IFREG, S_IFDIR or S_IFLNK
    mode: int  # permission bits
    uid: int = 0
    gid: int = 0
    nlink: int = 0  # names in the current tree (a directory's own count is computed)
    size: int = 0
    times: list[int] = field(default_factory=lambda: [time.time_ns()] * 3)  # atime, mtime, ctime
    entries: dict[str, int] | None = None
    target: str = ""


def _err(code: int) -> OSError:
    from fuse import FuseOSError

    return FuseOSError(code)


def _load_fuse():
    import fuse

    return fuse


class PowerCutFS:
    """The filesystem: fusepy's Operations protocol (called as `self(op, *args)`), one lock around all."""

    flag_nullpath_ok = True  # an unlinked open file's operations arrive with no path: served by fh
    use_ns = True

    def __init__(self, backing: Path):
        self.backing = backing
        self.blobs = backing / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, stat.S_IFDIR, 0o755, nlink=1, entries={})}
        self.next_ino = ROOT + 1
        self.fds: dict[int, int] = {}  # ino -> fd of its blob
        self.handles: dict[int, int] = {}  # fh -> ino
        self.opened: dict[int, int] = {}  # ino -> open handles
        self.next_fh = 1
        self.ddata: dict[int, tuple] = {}  # dirty file -> ("prefix", n) | ("copy", path, n)
        self.dents: dict[int, dict[str, int]] = {}  # dirty directory -> its entries at its last fsync
        self.unsynced: dict[int, int] = {}  # ino -> bytes written since its last fsync
        self.orphans: set[int] = set()  # no name in the current tree
        self.faults: list[dict] = []  # armed: {"op", "match", "count"}
        self.fired: list[dict] = []
        self.internal: list[str] = []  # the layer's own bugs (an op that raised): the soak reports them
        # Renames that replaced a name (monotonic time, path), the newest 4096: a reader that found the
        # name absent meanwhile met libfuse's path race, not a missing file (soak invariant (10)).
        self.replaced: collections.deque = collections.deque(maxlen=4096)
        self.stats = {"fsync": 0, "fsyncdir": 0, "cuts": 0}

    # --- fusepy's entry point ------------------------------------------------------------------

    def __call__(self, op: str, *args):
        fn = getattr(self, op, None)
        if fn is None:
            raise _err(errno.ENOSYS)
        with self.lock:
            try:
                return fn(*args)
            except OSError as e:
                if type(e).__name__ == "FuseOSError":
                    raise
                raise _err(e.errno or errno.EIO) from e
            except Exception:  # noqa: BLE001 - a bug of the layer: EIO to the caller, recorded
                self.internal.append(f"{op}{args[:2]!r}: {traceback.format_exc()}")
                print(self.internal[-1], file=sys.stderr, flush=True)
                raise _err(errno.EIO) from None

    # --- the tree ------------------------------------------------------------------------------

    def _resolve(self, path: str | None) -> Node:
        if path is None:
            raise _err(errno.EBADF)
        node = self.nodes[ROOT]
        for part in path.strip("/").split("/"):
            if not part:
                continue
            if node.kind != stat.S_IFDIR:
                raise _err(errno.ENOTDIR)
            ino = node.entries.get(part)
            if ino is None:
                raise _err(errno.ENOENT)
            node = self.nodes[ino]
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self._resolve(head or "/")
        if parent.kind != stat.S_IFDIR:
            raise _err(errno.ENOTDIR)
        return parent, name

    def _node_of(self, path: str | None, fh: int | None) -> Node:
        if fh:
            if fh in self.handles:
                return self.nodes[self.handles[fh]]
            # Opened before a cut: a killed writer's request the kernel delivered late. Never by path
            # (the name may be another file by now).
            raise _err(errno.EBADF)
        return self._resolve(path)

    def _dirty_dir(self, d: Node) -> None:
        if d.ino not in self.dents:
            self.dents[d.ino] = dict(d.entries)
        d.times[1] = d.times[2] = time.time_ns()

    def _new(self, kind: int, mode: int) -> Node:
        from fuse import fuse_get_context

        uid, gid, _ = fuse_get_context()
        n = Node(self.next_ino, kind, mode & 0o7777, uid, gid)
        self.next_ino += 1
        self.nodes[n.ino] = n
        if kind == stat.S_IFDIR:
            n.entries = {}
            self.dents[n.ino] = {}
        elif kind == stat.S_IFREG:
            fd = os.open(self.blobs / str(n.ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self.fds[n.ino] = fd
            self.ddata[n.ino] = ("prefix", 0)
        return n

    def _add(self, d: Node, name: str, n: Node) -> None:
        if len(name.encode()) > 255:
            raise _err(errno.ENAMETOOLONG)
        self._dirty_dir(d)
        d.entries[name] = n.ino
        n.nlink += 1
        self.orphans.discard(n.ino)

    def _drop_name(self, d: Node, name: str) -> None:
        self._dirty_dir(d)
        n = self.nodes[d.entries.pop(name)]
        n.nlink -= 1
        n.times[2] = time.time_ns()
        if n.nlink <= 0:
            self.orphans.add(n.ino)
        self._gc()

    def _gc(self) -> None:
        if not self.orphans:
            return
        kept = {ino for snap in self.dents.values() for ino in snap.values()}
        for ino in list(self.orphans):
            n = self.nodes.get(ino)
            if n is None:
                self.orphans.discard(ino)
            elif n.nlink <= 0 and not self.opened.get(ino) and ino not in kept:
                if n.kind == stat.S_IFDIR and any(self.nodes.get(c) for c in n.entries.values()):
                    for c in n.entries.values():  # a removed directory is empty; a cut may restore one
                        if c in self.nodes and self.nodes[c].nlink <= 0:
                            self.orphans.add(c)
                self._free(ino)

    def _free(self, ino: int) -> None:
        self.orphans.discard(ino)
        self.nodes.pop(ino, None)
        self.dents.pop(ino, None)
        self._drop_snapshot(ino)
        self.unsynced.pop(ino, None)
        fd = self.fds.pop(ino, None)
        if fd is not None:
            os.close(fd)
            (self.blobs / str(ino)).unlink(missing_ok=True)

    def _drop_snapshot(self, ino: int) -> None:
        snap = self.ddata.pop(ino, None)
        if snap and snap[0] == "copy":
            Path(snap[1]).unlink(missing_ok=True)

    def _before_change(self, n: Node, lowest: int) -> None:
        """Snapshot a file's durable bytes before a change that touches bytes from `lowest` on."""
        snap = self.ddata.get(n.ino)
        if snap is None:
            snap = self.ddata[n.ino] = ("prefix", n.size)
        if snap[0] == "prefix" and lowest < snap[1]:
            copy = self.blobs / f"{n.ino}.durable"
            with open(copy, "wb") as out:
                out.write(os.pread(self.fds[n.ino], snap[1], 0))
            self.ddata[n.ino] = ("copy", str(copy), snap[1])

    def _fault(self, op: str, path: str | None, n: Node) -> dict | None:
        where = path or f"<ino {n.ino}>"
        for f in self.faults:
            if f["op"] == op and f["count"] > 0 and re.search(f["match"], where):
                f["count"] -= 1
                hit = {"op": op, "path": where, "time": time.time()}
                self.fired.append(hit)
                return hit
        return None

    # --- operations ----------------------------------------------------------------------------

    def init(self, path):
        pass

    def destroy(self, path):
        pass

    def getattr(self, path, fh=None):
        n = self._node_of(path, fh)
        if self._fault("stat", path, n):
            raise _err(errno.EIO)
        nlink = n.nlink
        if n.kind == stat.S_IFDIR:
            nlink = (1 if n.ino == ROOT else n.nlink) + 1
            nlink += sum(self.nodes[c].kind == stat.S_IFDIR for c in n.entries.values())
        size = n.size if n.kind == stat.S_IFREG else len(n.target) if n.kind == stat.S_IFLNK else 4096
        return {
            "st_ino": n.ino,
            "st_mode": n.kind | n.mode,
            "st_nlink": nlink,
            "st_uid": n.uid,
            "st_gid": n.gid,
            "st_size": size,
            "st_blocks": (size + 511) // 512,
            "st_atime": n.times[0],
            "st_mtime": n.times[1],
            "st_ctime": n.times[2],
        }

    def access(self, path, amode):
        self._resolve(path)
        return 0

    def statfs(self, path):
        v = os.statvfs(self.backing)
        return {
            k: getattr(v, k)
            for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        } | {"f_namemax": 255}

    def readdir(self, path, fh):
        n = self._node_of(path, fh)
        if n.kind != stat.S_IFDIR:
            raise _err(errno.ENOTDIR)
        return [".", "..", *n.entries]

    def opendir(self, path):
        n = self._resolve(path)
        if n.kind != stat.S_IFDIR:
            raise _err(errno.ENOTDIR)
        return self._handle(n)

    def releasedir(self, path, fh):
        return self.release(path, fh)

    def fsyncdir(self, path, datasync, fh):
        n = self._node_of(path, fh)
        if self._fault("fsync", path, n):
            raise _err(errno.EIO)
        self.stats["fsyncdir"] += 1
        self.dents.pop(n.ino, None)
        self._gc()
        return 0

    def mkdir(self, path, mode):
        d, name = self._parent(path)
        if name in d.entries:
            raise _err(errno.EEXIST)
        self._add(d, name, self._new(stat.S_IFDIR, mode))
        return 0

    def rmdir(self, path):
        d, name = self._parent(path)
        n = self._resolve(path)
        if n.kind != stat.S_IFDIR:
            raise _err(errno.ENOTDIR)
        if n.entries:
            raise _err(errno.ENOTEMPTY)
        self._drop_name(d, name)
        return 0

    def create(self, path, mode, fi=None):
        d, name = self._parent(path)
        if name in d.entries:  # the kernel sends CREATE for a name it found absent: a racing create
            raise _err(errno.EEXIST)
        n = self._new(stat.S_IFREG, mode)
        self._add(d, name, n)
        return self._handle(n)

    def _handle(self, n: Node) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = n.ino
        self.opened[n.ino] = self.opened.get(n.ino, 0) + 1
        return fh

    def open(self, path, flags):
        n = self._resolve(path)
        if n.kind == stat.S_IFDIR and flags & (os.O_WRONLY | os.O_RDWR):
            raise _err(errno.EISDIR)
        return self._handle(n)

    def release(self, path, fh):
        ino = self.handles.pop(fh, None)
        if ino is not None and ino in self.opened:
            self.opened[ino] -= 1
            if self.opened[ino] <= 0:
                del self.opened[ino]
                self._gc()
        return 0

    def flush(self, path, fh):
        return 0

    def read(self, path, size, offset, fh):
        n = self._node_of(path, fh)
        if self._fault("read", path, n):
            raise _err(errno.EIO)
        n.times[0] = time.time_ns()
        return os.pread(self.fds[n.ino], size, offset)

    def write(self, path, data, offset, fh):
        n = self._node_of(path, fh)
        if self._fault("write", path, n):
            raise _err(errno.EIO)
        if len(data) > 1 and self._fault("short", path, n):
            data = data[: len(data) // 2]
        self._before_change(n, offset)
        wrote = os.pwrite(self.fds[n.ino], data, offset)
        n.size = max(n.size, offset + wrote)
        n.times[1] = n.times[2] = time.time_ns()
        self.unsynced[n.ino] = self.unsynced.get(n.ino, 0) + wrote
        return wrote

    def truncate(self, path, length, fh=None):
        n = self._node_of(path, fh)
        if n.kind != stat.S_IFREG:
            raise _err(errno.EISDIR)
        self._before_change(n, length)
        os.ftruncate(self.fds[n.ino], length)
        self.unsynced[n.ino] = self.unsynced.get(n.ino, 0) + abs(n.size - length)
        n.size = length
        n.times[1] = n.times[2] = time.time_ns()
        return 0

    def fsync(self, path, datasync, fh):
        n = self._node_of(path, fh)
        if self._fault("fsync", path, n):
            raise _err(errno.EIO)  # the bytes stay unsynced: a later cut drops them
        self.stats["fsync"] += 1
        self._drop_snapshot(n.ino)
        self.unsynced.pop(n.ino, None)
        return 0

    def unlink(self, path):
        d, name = self._parent(path)
        n = self._resolve(path)
        if n.kind == stat.S_IFDIR:
            raise _err(errno.EISDIR)
        self._drop_name(d, name)
        return 0

    def rename(self, old, new):
        sd, sname = self._parent(old)
        dd, dname = self._parent(new)
        src = self._resolve(old)
        if (new.rstrip("/") + "/").startswith(old.rstrip("/") + "/") and new != old:
            raise _err(errno.EINVAL)
        dst_ino = dd.entries.get(dname)
        if dst_ino == src.ino:
            return 0
        if dst_ino is not None:
            dst = self.nodes[dst_ino]
            if dst.kind == stat.S_IFDIR:
                if src.kind != stat.S_IFDIR:
                    raise _err(errno.EISDIR)
                if dst.entries:
                    raise _err(errno.ENOTEMPTY)
            elif src.kind == stat.S_IFDIR:
                raise _err(errno.ENOTDIR)
            self._drop_name(dd, dname)
            self.replaced.append((time.monotonic(), new))
        self._dirty_dir(sd)
        del sd.entries[sname]
        src.nlink -= 1
        self._add(dd, dname, src)
        src.times[2] = time.time_ns()
        return 0

    def link(self, target, source):
        d, name = self._parent(target)
        n = self._resolve(source)
        if n.kind == stat.S_IFDIR:
            raise _err(errno.EPERM)
        if name in d.entries:
            raise _err(errno.EEXIST)
        self._add(d, name, n)
        n.times[2] = time.time_ns()
        return 0

    def symlink(self, target, source):
        d, name = self._parent(target)
        if name in d.entries:
            raise _err(errno.EEXIST)
        n = self._new(stat.S_IFLNK, 0o777)
        n.target = source
        self._add(d, name, n)
        return 0

    def readlink(self, path):
        n = self._resolve(path)
        if n.kind != stat.S_IFLNK:
            raise _err(errno.EINVAL)
        return n.target

    def chmod(self, path, mode):
        n = self._resolve(path)
        n.mode = mode & 0o7777
        n.times[2] = time.time_ns()
        return 0

    def chown(self, path, uid, gid):
        n = self._resolve(path)
        if uid != -1 and uid != 0xFFFFFFFF:
            n.uid = uid
        if gid != -1 and gid != 0xFFFFFFFF:
            n.gid = gid
        return 0

    def utimens(self, path, times=None):
        n = self._resolve(path)
        now = time.time_ns()
        a, m = times if times else (now, now)
        n.times[0], n.times[1], n.times[2] = a, m, now
        return 0

    def getxattr(self, path, name, position=0):
        raise _err(errno.ENODATA)

    def listxattr(self, path):
        return []

    # --- control -------------------------------------------------------------------------------

    def cut(self) -> dict:
        """The power cut: every process using the mount is gone (the caller killed them). Drops every
        byte and directory entry not made durable, and reports what it dropped."""
        out = {"bytes": sum(self.unsynced.values()), "entries": 0, "names": [], "files": 0, "reverted": 0}
        for ino, snap in self.dents.items():
            d = self.nodes.get(ino)
            if d is not None:
                for name in sorted(set(d.entries) | set(snap)):
                    if d.entries.get(name) != snap.get(name):
                        out["entries"] += 1
                        if len(out["names"]) < 8:
                            out["names"].append(f"{self._where(ino)}/{name}")
        for ino, snap in self.dents.items():
            if ino in self.nodes:
                self.nodes[ino].entries = dict(snap)
        self.dents.clear()
        # What the durable tree reaches, and its link counts.
        count: dict[int, int] = {ROOT: 1}
        todo = [ROOT]
        while todo:
            d = self.nodes[todo.pop()]
            for name, c in list(d.entries.items()):
                if c not in self.nodes:  # freed while only the current tree named it: cannot be
                    del d.entries[name]
                    continue
                count[c] = count.get(c, 0) + 1
                if count[c] == 1 and self.nodes[c].kind == stat.S_IFDIR:
                    todo.append(c)
        for ino in list(self.nodes):
            if ino not in count:
                out["files"] += self.nodes[ino].kind == stat.S_IFREG
                self._free(ino)
        for ino, n in self.nodes.items():
            n.nlink = count[ino]
            snap = self.ddata.get(ino)
            if snap is not None:
                fd = self.fds[ino]
                if snap[0] == "copy":
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, Path(snap[1]).read_bytes(), 0)
                os.ftruncate(fd, snap[-1])
                out["reverted"] += n.size != snap[-1] or snap[0] == "copy"
                n.size = snap[-1]
                self._drop_snapshot(ino)
        self.ddata.clear()
        self.unsynced.clear()
        self.handles.clear()
        self.opened.clear()
        self.orphans.clear()
        self.stats["cuts"] += 1
        return out

    def _where(self, ino: int) -> str:
        if ino == ROOT:
            return ""
        for p, n in self.nodes.items():
            if n.kind == stat.S_IFDIR and ino in n.entries.values():
                name = next(k for k, v in n.entries.items() if v == ino)
                return f"{self._where(p)}/{name}"
        return f"<dir {ino}>"

    def rot(self, path: str, how: str, at: float) -> dict:
        """Damage a file in place, durably (the disk's own bytes): 'flip' one bit at fraction `at` of
        it, 'tear' it to that fraction of its length."""
        n = self._resolve(path)
        if n.kind != stat.S_IFREG or n.size == 0:
            raise OSError(errno.EINVAL, f"{path}: not a file with bytes")
        fd, pos = self.fds[n.ino], min(int(n.size * at), n.size - 1)
        if how == "flip":
            b = os.pread(fd, 1, pos)[0]
            os.pwrite(fd, bytes([b ^ 0x10]), pos)
        else:
            os.ftruncate(fd, pos)
            n.size = pos
        self._drop_snapshot(n.ino)
        return {"path": path, "how": how, "offset": pos, "size": n.size}

    def control(self, req: dict) -> dict:
        with self.lock:
            op = req["op"]
            if op == "cut":
                return self.cut()
            if op == "arm":
                self.faults.append({"op": req["fault"], "match": req["match"], "count": req.get("count", 1)})
                return {"armed": len(self.faults)}
            if op == "disarm":
                left = [f for f in self.faults if f["count"] > 0]
                self.faults.clear()
                return {"unfired": left}
            if op == "fired":
                return {"fired": self.fired[req.get("since", 0) :], "n": len(self.fired)}
            if op == "replaced":  # the names replaced by a rename at or after monotonic time `since`
                return {"paths": sorted({p for t, p in self.replaced if t >= req["since"]})}
            if op == "rot":
                return self.rot(req["path"], req["how"], req.get("at", 0.5))
            if op == "stats":
                return {
                    **self.stats,
                    "inodes": len(self.nodes),
                    "dirty_files": len(self.ddata),
                    "dirty_dirs": len(self.dents),
                    "unsynced_bytes": sum(self.unsynced.values()),
                    "internal_errors": self.internal[-3:],
                    "n_internal": len(self.internal),
                }
            raise ValueError(f"unknown control op {op!r}")


def serve(backing: Path, mount: Path, sock: Path) -> None:
    fuse = _load_fuse()
    fs = PowerCutFS(backing)

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                try:
                    reply = fs.control(json.loads(line))
                except Exception as e:  # noqa: BLE001 - the caller sees it
                    reply = {"error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()

    sock.unlink(missing_ok=True)
    server = socketserver.ThreadingUnixStreamServer(str(sock), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    class Ops(fuse.Operations):
        flag_nullpath_ok = True
        use_ns = True
        lock = None  # the kernel's own POSIX locks (and flock: fusepy has no flock op)
        bmap = None
        ioctl = None

        def __call__(self, op, *args):
            return fs(op, *args)

    fuse.FUSE(
        Ops(),
        str(mount),
        foreground=True,
        nothreads=True,
        fsname="powercut",
        use_ino=True,
        hard_remove=True,
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
        big_writes=True,
        direct_io=True,  # no page cache: every read and write reaches the layer (a read EIO, a cut)
        max_write=1 << 20,
    )
    server.shutdown()


class Layer:
    """A PowerCutFS serving `mount` from `backing` in a process of its own."""

    def __init__(self, backing: Path, mount: Path, log: Path | None = None):
        self.backing, self.mount = Path(backing), Path(mount)
        self.mount.mkdir(parents=True, exist_ok=True)
        self.sock = self.backing.parent / f".{self.mount.name}.powercut.sock"
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's for its life
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(backing), str(mount), str(self.sock)],
            stdout=out,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mount) or not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"powercut: the FUSE layer did not mount (exit {self.proc.poll()})")
            time.sleep(0.02)
        self._conn: socket.socket | None = None
        self._file = None
        self._lock = threading.Lock()

    def call(self, op: str, **kw) -> dict:
        with self._lock:
            if self._conn is None:
                self._conn = socket.socket(socket.AF_UNIX)
                self._conn.connect(str(self.sock))
                self._file = self._conn.makefile("rwb")
            self._file.write(json.dumps({"op": op, **kw}).encode() + b"\n")
            self._file.flush()
            reply = json.loads(self._file.readline())
        if "error" in reply:
            raise RuntimeError(f"powercut {op}: {reply['error']}")
        return reply

    def cut(self) -> dict:
        return self.call("cut")

    def arm(self, fault: str, match: str, count: int = 1) -> None:
        self.call("arm", fault=fault, match=match, count=count)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], capture_output=True, check=False)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        if self._conn is not None:
            self._conn.close()


def fuse_unavailable() -> str | None:
    """Why a FUSE mount cannot be made here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (a container without the fuse device)"
    try:
        _load_fuse()
    except (ImportError, OSError) as e:
        return f"fusepy cannot load libfuse2 ({e}); apt-get install libfuse2"
    if os.geteuid() != 0 and not shutil.which("fusermount"):
        return "not root and no fusermount"
    return None


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
