"""Point-to-point throughput of the MPI transport against raw mpi4py, 4 KiB to 256 MiB.

    python benchmarks/transport.py            # launches itself under `mpiexec -n 2`
    mpiexec -n 2 python benchmarks/transport.py [--max-mib 256] [--repeats 3]

Rank 0 streams messages of each size to rank 1, who acknowledges the last one; the time is
rank 0's, from a barrier to the acknowledgement. Side by side in the same run, interleaved:
  raw     mpi4py Send/Recv of one reused numpy buffer (the ceiling)
  direct  h2jax MPITransport, zero copy: DLPack view of the JAX buffer out, adopted aligned
          buffer in (a jax.Array on the receiver's device); receives posted 4 ahead
  staged  h2jax MPITransport through host copies on both ends
Goal: direct >= 90% of raw for messages of 1 MiB and more, and faster than staged there.
Prints one JSON object.

Where transparent huge pages are `madvise`-only, numpy's large buffers get huge pages and
JAX's do not, so sending straight out of a JAX buffer pays TLB misses a numpy buffer does
not; `--hugepages` evens that out for JAX's allocations (glibc's malloc tunable).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20
WINDOW = 4  # receives posted ahead


def relaunch_under_mpiexec(hugepages: bool) -> int:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ)
    if hugepages:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable, *sys.argv]
    return subprocess.run(cmd, timeout=1800, env=env).returncode


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hugepages", action="store_true",
                        help="when relaunching, set GLIBC_TUNABLES=glibc.malloc.hugetlb=1 so JAX's "
                             "host buffers get transparent huge pages like numpy's")
    args = parser.parse_args()

    from h2jax.runtime.jaxsetup import configure_jax
    from h2jax.runtime.ranks import install_abort_on_error, mpi_world_size
    from h2jax.transport.mpi import MPITransport, aligned_empty

    if mpi_world_size() == 1:
        return relaunch_under_mpiexec(args.hugepages)
    configure_jax("cpu", 1)  # before JAX starts
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mpi4py import MPI

    from h2jax.transport.base import ACT, Tag

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run with exactly 2 ranks: mpiexec -n 2 python benchmarks/transport.py")
    install_abort_on_error(comm)
    rank = comm.rank
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    layout = NamedSharding(mesh, P("data", None, "tensor"))
    transports = {p: MPITransport([1, 1], path=p) for p in ("direct", "staged")}

    sizes = [4096 << (2 * i) for i in range(12) if (4096 << (2 * i)) <= args.max_mib * MIB]

    def iterations(nbytes: int) -> int:
        return int(min(1000, max(4, (64 * MIB) // nbytes)))

    def time_raw(buf, iters) -> float:
        ack = np.zeros(1, np.uint8)
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for _ in range(iters):
                comm.Send(buf, dest=1, tag=7)
            comm.Recv(ack, source=1, tag=8)
        else:
            for _ in range(iters):
                comm.Recv(buf, source=0, tag=7)
            comm.Send(ack, dest=0, tag=8)
        return time.perf_counter() - t0

    def time_transport(transport, x, iters) -> float:
        ack = np.zeros(1, np.uint8)
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for k in range(iters):
                transport.send(Tag(ACT, 0, k), x)
            transport.flush()
            comm.Recv(ack, source=1, tag=8)
        else:
            # As the pipeline driver does, receives are posted ahead of need (a window of
            # WINDOW), so the next message moves while this one becomes a jax.Array.
            transport.prepost([Tag(ACT, 0, k) for k in range(min(WINDOW, iters))])
            for k in range(iters):
                if k + WINDOW < iters:
                    transport.prepost([Tag(ACT, 0, k + WINDOW)])
                y = transport.recv(Tag(ACT, 0, k))
            y.block_until_ready()
            comm.Send(ack, dest=0, tag=8)
        return time.perf_counter() - t0

    rows = []
    for nbytes in sizes:
        shape = (1, 1, nbytes // 4)
        iters = iterations(nbytes)
        raw_buf = aligned_empty((nbytes,), np.uint8)
        raw_buf[:] = 1
        x = jax.device_put(np.full(shape, 1.0, np.float32), layout).block_until_ready() if rank == 0 else None
        for t in transports.values():
            t.connect(shape, np.float32, {rank: layout})
        best = {"raw": float("inf"), "direct": float("inf"), "staged": float("inf")}
        for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
            best["raw"] = min(best["raw"], time_raw(raw_buf, iters))
            for name, t in transports.items():
                best[name] = min(best[name], time_transport(t, x, iters))
        gib = {k: nbytes * iters / v / (1 << 30) for k, v in best.items()}
        rows.append({
            "bytes": nbytes, "iters": iters,
            "raw_gib_s": round(gib["raw"], 3),
            "h2jax_direct_gib_s": round(gib["direct"], 3),
            "h2jax_staged_gib_s": round(gib["staged"], 3),
            "direct_vs_raw": round(gib["direct"] / gib["raw"], 3),
            "direct_vs_staged": round(gib["direct"] / gib["staged"], 3),
        })
        del x, raw_buf

    # Correctness of what the benchmark moved: one more message, compared on the receiver.
    shape = (1, 1, MIB // 4)
    probe = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    t = transports["direct"]
    t.connect(shape, np.float32, {rank: layout})
    if rank == 0:
        t.send(Tag(ACT, 0, 0), jax.device_put(probe, layout))
        t.flush()
    else:
        assert np.array_equal(np.asarray(t.recv(Tag(ACT, 0, 0))), probe)
    reports = comm.gather({k: v.describe() for k, v in transports.items()}, root=0)
    for v in transports.values():
        v.close()
    if rank == 0:
        large = [r for r in rows if r["bytes"] >= MIB]
        worst = min((r["direct_vs_raw"] for r in large), default=None)
        print(json.dumps({
            "benchmark": "transport",
            "ranks": 2,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "jax": jax.__version__,
            "platform": "cpu",
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
            "transparent_hugepage": _thp_mode(),
            "paths": {k: {"path": v["path"], "why": v["why"]} for k, v in reports[0].items()},
            "receiver_zero_copy": {k: {"adopted": v["recv_buffers_adopted"], "copied": v["recv_buffers_copied"]}
                                   for k, v in reports[1].items()},
            "sizes": rows,
            "goal": {
                "direct_vs_raw_min_at_ge_1MiB": worst,
                "direct_ge_90pct_of_raw_at_ge_1MiB": worst is not None and worst >= 0.9,
                "direct_faster_than_staged_at_ge_1MiB": all(r["direct_vs_staged"] > 1 for r in large),
            },
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
