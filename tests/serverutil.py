"""Helpers for the Python suites: the port a server bound on port 0 (never bind-release-reuse), waiting for it, starting the autohedge binary."""
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


def wait_http(url, proc, timeout=60):
    """Polls `url` until it answers 200, failing early if `proc` exits."""
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up within {timeout}s")


def start_autohedge(bin_path, args, log):
    """Starts an `autohedge` command that prints `listening on http://ADDR`; returns (proc, addr)."""
    import subprocess

    proc = subprocess.Popen([bin_path, *args], stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    assert "listening on http://" in line, line
    return proc, line.strip().rsplit("http://", 1)[1]
