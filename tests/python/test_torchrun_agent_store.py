"""`nopad train` under a torchrun that shares its agent's TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE=True,
PyTorch 2.4 and later): MASTER_ADDR:MASTER_PORT is then the agent's c10d TCPStore, already bound, and nopad's ranks
meet through it (rank 0 publishes the address of its own listening socket under
nopad/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/bootstrap; the others wait for that key).

Always (CI has no torch): a small TCPStore server written here from PyTorch's wire format (first message VALIDATE +
uint32 0x3C85F7CE; one byte of query type, uint64-length strings, little-endian; SET, GET, CHECK, WAIT, CANCEL_WAIT,
PING) stands in for the agent. 2 nopad ranks started with TORCHELASTIC_USE_AGENT_STORE=True and MASTER_PORT = that
server train the same losses as one process (1e-4 relative); the key of the attempt (restart count 1) is used, not a
stale one of attempt 0 that points nowhere; a rank 1 whose rank 0 never comes stops within its bootstrap timeout
naming the store and the key; an unreachable store and a bad TORCHELASTIC_USE_AGENT_STORE value are refused by name.

When `import torch` works: the same 2 ranks against PyTorch's own TCPStore server (libuv and classic backends; the
published address is read back through torch's client), and the real launcher,
`python -m torch.distributed.run --standalone --nproc_per_node 2 --no-python nopad train ...` (losses equal to one
process) and `nopad bench model` under it (one report, 2 ranks, torchrun).

Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set; needs no MPI."""
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from nopad_checks import check, failures
from nopad_test_support import (NOPAD, SRC, free_port, losses, prepare_sample, run_tiny_train, tiny_bench_cmd,
                                tiny_train_cmd)

# PyTorch's c10d TCPStore protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, TCPStoreLibUvBackend.cpp).
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING = range(14)
MAGIC = 0x3C85F7CE
READY, NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1



class Closed(Exception):
    pass


class FakeStore:
    """A TCPStore server on 127.0.0.1 (a thread per connection). Keys are kept as they arrive on the wire."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.data = {}
        self.cond = threading.Condition()
        self.errors = []       # protocol violations seen
        self.validated = 0     # connections that passed the handshake
        self.queries = []      # names of the queries served
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    @staticmethod
    def _recv(conn, n):
        b = b""
        while len(b) < n:
            chunk = conn.recv(n - len(b))
            if not chunk:
                raise Closed()
            b += chunk
        return b

    def _u64(self, conn):
        return struct.unpack("<Q", self._recv(conn, 8))[0]

    def _str(self, conn):
        return self._recv(conn, self._u64(conn))

    def _client(self, conn):
        try:
            q = self._recv(conn, 1)[0]
            magic = struct.unpack("<I", self._recv(conn, 4))[0]
            if q != VALIDATE or magic != MAGIC:
                self.errors.append(f"first message: query {q}, magic {magic:#x} (want VALIDATE, {MAGIC:#x})")
                return
            with self.cond:
                self.validated += 1
            while True:
                q = self._recv(conn, 1)[0]
                if q == PING:
                    conn.sendall(self._recv(conn, 4))
                    self.queries.append("PING")
                elif q == SET:
                    key, value = self._str(conn), self._str(conn)
                    with self.cond:
                        self.data[key] = value
                        self.cond.notify_all()
                    self.queries.append("SET")
                elif q == GET:
                    key = self._str(conn)
                    with self.cond:
                        value = self.data.get(key, b"")
                    conn.sendall(struct.pack("<Q", len(value)) + value)
                    self.queries.append("GET")
                elif q in (CHECK, WAIT):
                    keys = [self._str(conn) for _ in range(self._u64(conn))]
                    self.queries.append("CHECK" if q == CHECK else "WAIT")
                    with self.cond:
                        ready = all(k in self.data for k in keys)
                    if q == CHECK:
                        conn.sendall(bytes([READY if ready else NOT_READY]))
                    elif not self._wait(conn, keys):
                        return
                else:
                    self.errors.append(f"unexpected query type {q}")
                    return
        except (Closed, OSError):
            pass
        finally:
            conn.close()

    def _wait(self, conn, keys):
        """Answers STOP_WAITING once every key exists; a CANCEL_WAIT meanwhile gets WAIT_CANCELED. False when the
        client closed the connection."""
        while True:
            with self.cond:
                if all(k in self.data for k in keys):
                    conn.sendall(bytes([STOP_WAITING]))
                    return True
                self.cond.wait(0.05)
            if select.select([conn], [], [], 0)[0]:
                b = conn.recv(1)
                if not b:
                    return False
                if b[0] != CANCEL_WAIT:
                    self.errors.append(f"query {b[0]} while a WAIT was pending")
                    return False
                conn.sendall(bytes([WAIT_CANCELED]))
                return True

    def close(self):
        self.sock.close()








def clean_env():
    """This environment without any launcher's variables."""
    drop = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in names}


def launch(argv, ranks, world, store_port, timeout_s="60", restart=0, run_id="test-run", extra_env=None):
    """Starts the given ranks of a `world`-rank job the way torchrun with an agent store does; returns, per rank,
    (exit code, stdout, stderr, seconds)."""
    procs = []
    for rank in ranks:
        env = clean_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT=str(restart),
                   NOPAD_BOOTSTRAP_TIMEOUT_S=timeout_s)
        env.update(extra_env or {})
        procs.append((time.time(), subprocess.Popen(argv, env=env, cwd=SRC, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True)))
    out = []
    for t0, p in procs:
        try:
            o, e = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            e += "\n[killed after 300 s]"
        out.append((p.returncode, o, e, time.time() - t0))
    return out




def check_same_losses(ref, run_dir, what):
    got = losses(run_dir)
    check(len(got) == len(ref) == 6, f"{what}: {len(got)} metrics lines (one writer) vs {len(ref)}")
    for step, (a, b) in enumerate(zip(ref, got), 1):
        check(abs(a - b) <= 1e-4 * abs(a), f"{what}: step {step}: loss {b} vs {a} in one process")
    print(f"  {what}: losses {['%.5f' % x for x in got]}")


def check_trained(res, what):
    for rank, (rc, _, e, _) in enumerate(res):
        check(rc == 0, f"{what}: rank {rank} exit {rc}: {e[-1500:]}")
    ok = all(rc == 0 for rc, _, _, _ in res)
    if ok:
        check("data parallel: 2 ranks (torchrun, tcp" in res[0][2],
              f"{what}: rank 0 does not say 'data parallel: 2 ranks (torchrun, tcp': {res[0][2][-800:]!r}")
    return ok


def fake_store_checks(tmp, data, ref):
    store = FakeStore()
    # A stale key of attempt 0 that points at a port nobody listens on: attempt 1 must not use it.
    store.data[b"/nopad/test-run/0/bootstrap"] = f"127.0.0.1:{free_port()}".encode()
    run = os.path.join(tmp, "fake-store")
    res = launch(tiny_train_cmd(run, data), [0, 1], 2, store.port, restart=1)
    if check_trained(res, "fake store"):
        check_same_losses(ref, run, "2 ranks through a TCPStore (written here)")
    key = b"/nopad/test-run/1/bootstrap"
    addr = store.data.get(key, b"").decode()
    check(addr.startswith("127.0.0.1:") and addr.split(":")[1].isdigit(),
          f"the store holds {addr!r} under {key!r}, want 127.0.0.1:<port> (keys: {sorted(store.data)})")
    check(store.validated >= 2, f"{store.validated} connections passed the handshake, want one per rank")
    check("WAIT" in store.queries and "SET" in store.queries and "GET" in store.queries,
          f"queries served: {store.queries}")
    check(not store.errors, f"protocol errors seen by the store: {store.errors}")
    print(f"  fake store: {key.decode()} = {addr}; queries {sorted(set(store.queries))}; "
          f"{store.validated} handshakes")

    # As if each rank ran on a host of its own (LOCAL_WORLD_SIZE=1): the store is reached through loopback, so rank 0
    # publishes its interfaces' addresses instead (where the host has any), and rank 1 reaches it through them.
    run = os.path.join(tmp, "fake-store-hosts")
    res = launch(tiny_train_cmd(run, data), [0, 1], 2, store.port, run_id="two-hosts",
                 extra_env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    if check_trained(res, "fake store, one rank per host"):
        check_same_losses(ref, run, "2 ranks as on 2 hosts")
    addrs = store.data.get(b"/nopad/two-hosts/0/bootstrap", b"").decode()
    check(addrs and all(a.rsplit(":", 1)[1].isdigit() for a in addrs.split(",")), f"published {addrs!r}")
    print(f"  one rank per host: rank 0 published {addrs}")

    # Only rank 1 comes: rank 0 never publishes. A clear error within the bootstrap timeout (3 s).
    res = launch(tiny_train_cmd(os.path.join(tmp, "alone"), data), [1], 2, store.port, timeout_s="3", run_id="lonely")
    rc, _, e, secs = res[0]
    check(rc != 0, "rank 1 without rank 0 did not fail")
    check(secs < 30, f"rank 1 without rank 0 took {secs:.1f} s to fail (timeout 3 s)")
    for part in ("rank 0 did not publish", "nopad/lonely/0/bootstrap", "NOPAD_BOOTSTRAP_TIMEOUT_S",
                 f"127.0.0.1:{store.port}"):
        check(part in e, f"rank 1's error does not say {part!r}: {e[-600:]!r}")
    print(f"  rank 1 alone: exit {rc} after {secs:.1f} s: {e.strip().splitlines()[-1] if e.strip() else ''}")
    check(not store.errors, f"protocol errors seen by the store: {store.errors}")
    store.close()

    # No store at MASTER_ADDR:MASTER_PORT.
    res = launch(tiny_train_cmd(os.path.join(tmp, "nostore"), data), [1], 2, free_port(), timeout_s="2")
    rc, _, e, secs = res[0]
    check(rc != 0 and "cannot reach torchrun's agent store" in e and secs < 30,
          f"no store: exit {rc} after {secs:.1f} s: {e[-600:]!r}")

    # A value of TORCHELASTIC_USE_AGENT_STORE that is neither true nor false is refused by name.
    res = launch(tiny_train_cmd(os.path.join(tmp, "badvar"), data), [0], 2, free_port(), timeout_s="2",
                 extra_env={"TORCHELASTIC_USE_AGENT_STORE": "maybe"})
    rc, _, e, _ = res[0]
    check(rc != 0 and "TORCHELASTIC_USE_AGENT_STORE" in e, f"bad variable value: exit {rc}: {e[-400:]!r}")


def torch_checks(tmp, data, ref, torch):
    import datetime
    from torch.distributed import TCPStore
    # PyTorch's own server, both backends; the published address read back through PyTorch's client.
    for libuv in (True, False):
        try:
            server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=libuv,
                              timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        except Exception as e:  # a build without libuv
            print(f"  torch TCPStore use_libuv={libuv}: not available ({e})")
            continue
        run = os.path.join(tmp, f"torch-store-{int(libuv)}")
        res = launch(tiny_train_cmd(run, data), [0, 1], 2, server.port, run_id=f"torch{int(libuv)}")
        if check_trained(res, f"torch TCPStore (use_libuv={libuv})"):
            check_same_losses(ref, run, f"2 ranks through torch's TCPStore (use_libuv={libuv})")
            addr = server.get(f"nopad/torch{int(libuv)}/0/bootstrap").decode()
            check(addr.startswith("127.0.0.1:"), f"torch's client reads {addr!r} under the bootstrap key")
        del server

    # The real launcher.
    run = os.path.join(tmp, "torchrun")
    env = clean_env()
    env["NOPAD_BOOTSTRAP_TIMEOUT_S"] = "120"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--no-python"]
    r = subprocess.run(launcher + ["--tee", "3"] + tiny_train_cmd(run, data), env=env, cwd=SRC, capture_output=True,
                       text=True, timeout=600)
    check(r.returncode == 0, f"torchrun: exit {r.returncode}: {r.stdout[-1500:]} {r.stderr[-1500:]}")
    if r.returncode == 0:
        check("data parallel: 2 ranks (torchrun, tcp" in r.stdout + r.stderr,
              f"torchrun: no 'data parallel: 2 ranks (torchrun, tcp' line: {r.stdout[-800:]!r}")
        check_same_losses(ref, run, f"torchrun of torch {torch.__version__}, 2 ranks")

    r1 = subprocess.run(tiny_bench_cmd(data, 8), capture_output=True, text=True, cwd=SRC, env=clean_env())
    r = subprocess.run(launcher + tiny_bench_cmd(data, 4), env=env, cwd=SRC, capture_output=True, text=True,
                       timeout=600)
    check(r.returncode == 0 and r1.returncode == 0, f"bench under torchrun: exit {r.returncode}: {r.stderr[-1500:]}")
    if r.returncode == 0 and r1.returncode == 0:
        reports = [l for l in r.stdout.splitlines() if l.startswith("{")]
        check(len(reports) == 1, f"bench under torchrun: {len(reports)} reports (want rank 0's only)")
        if reports:
            j, one = json.loads(reports[0]), json.loads(r1.stdout)
            check(j["ranks"] == 2 and j["launcher"] == "torchrun" and j["global_batch"] == 8, f"bench report {j}")
            check(abs(j["final_loss"] - one["final_loss"]) <= 1e-5 * abs(one["final_loss"]),
                  f"bench under torchrun: final loss {j['final_loss']} vs one process {one['final_loss']}")
            print(f"  bench model under torchrun: 2 ranks, final loss {j['final_loss']:.5f} "
                  f"(one process {one['final_loss']:.5f})")


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-agent-store-")
    data = os.path.join(tmp, "data")
    r = prepare_sample(data)
    check(r.returncode == 0, f"prepare: {r.stderr}")
    one = os.path.join(tmp, "one")
    r = run_tiny_train(one, data, env=clean_env())
    check(r.returncode == 0, f"single process: {r.stderr[-500:]}")
    ref = losses(one) if r.returncode == 0 else []
    print(f"  one process: losses {['%.5f' % x for x in ref]}")

    fake_store_checks(tmp, data, ref)
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
        print("  torch is not installed: the checks against PyTorch's TCPStore and the real torchrun are skipped")
    if torch is not None:
        torch_checks(tmp, data, ref, torch)

    if failures:
        sys.exit(1)
    print("test_torchrun_agent_store: all checks passed")


if __name__ == "__main__":
    main()
