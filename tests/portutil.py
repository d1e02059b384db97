"""Finding the port a server bound when it was started on port 0 (never bind-release-reuse)."""
import os
import time


def _socket_inodes(pid):
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_port(proc, timeout=120, host_hex=None):
    """The TCP port `proc` (a Popen) listens on, once it does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            inodes = _socket_inodes(proc.pid)
        except OSError:
            inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                local, state, inode = f[1], f[3], f[9]
                if state == "0A" and inode in inodes:
                    return int(local.rsplit(":", 1)[1], 16)
        time.sleep(0.2)
    raise RuntimeError("no listening socket")
