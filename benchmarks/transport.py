"""Point-to-point speed of the MPI transport against raw mpi4py, 4 KiB to 256 MiB.

    python benchmarks/transport.py            # launches itself under `mpiexec -n 2`
    mpiexec -n 2 python benchmarks/transport.py [--max-mib 256] [--repeats 7]

Rank 0 streams messages of each size to rank 1, who acknowledges the last one; the time is
rank 0's, from a barrier to the acknowledgement. Side by side, interleaved within every
repeat so that a change of load hits all of them alike:
  raw         mpi4py Send/Recv of one reused numpy buffer
  raw_window  mpi4py Isend, and Irecv posted WINDOW ahead into WINDOW reused numpy buffers
              (the transport's own pattern); ratios and overheads are against the faster of
              the two in each repeat (`raw_best`)
  raw_jax     mpi4py Send straight out of the JAX array the transport sends (its host buffer,
              by address) into a reused numpy buffer: what the wire gives for the memory XLA
              allocated, which can be slower than numpy's (huge pages, below); `direct_vs_raw_jax`
              is the transport's own cost apart from the memory its input lives in
  raw_jax_window  raw_window's receives (WINDOW buffers in turn) of raw_jax's sends (out of
              the JAX buffer): raw mpi4py moving the same memory in the same pattern as the
              transport. Receiving into several buffers in turn is slower than into one (which
              stays warm in the caches), and a pipeline cannot do otherwise: the arrays it
              received last are still in use
  raw_jax_adopt  raw_jax_window, WINDOW + 1 buffers in turn, each made a jax.Array as it
              arrives by the one zero-copy PJRT call the transport uses: the least any transport
              that hands over jax.Arrays does per message, apart from its own bookkeeping
  direct      h2jax MPITransport, zero copy: MPI reads the sender's JAX buffer in place and
              writes aligned buffers the receiving jax.Array adopts; receives posted WINDOW ahead
  staged      h2jax MPITransport through one host copy on each end
  strided     direct, from a (tensor=1) stage to a (tensor=2) one: every message is two
              strided pieces (column halves of the sender's rows), sent by MPI datatypes
              straight out of the JAX buffer, no packing copy
Each size runs enough messages for at least 128 MiB (8 at least, 2000 at most) per variant and
repeat; every figure is the median over repeats, ratios the median of per-repeat ratios.

The work per message, apart from the wire, is measured on 4 KiB messages that have already
arrived (receive side) or are sent into a receiver that is not reading (send side): raw
mpi4py `Recv`/`Isend` against the transport's `prepost` + `recv` (the jax.Array assembled) and
`send`, as wall and CPU time per message.

Goals: direct >= 0.90 of raw for messages of 1 MiB and more (on an idle machine), per-message
overhead above raw <= 10 us at 4 KiB, strided pieces sent without a copy (counted by the
transport). Prints one JSON object, with the load average it ran under.

Where transparent huge pages are `madvise`-only, numpy's large buffers get huge pages and
JAX's do not, so sending straight out of a JAX buffer pays TLB misses a numpy buffer does
not; `--hugepages` evens that out for JAX's allocations (glibc's malloc tunable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
WINDOW = 4  # receives posted ahead
RUN_BYTES = 128 * MIB  # at least this much per variant and repeat
ARRIVED = 1000  # messages in the per-message measurement


def relaunch_under_mpiexec(hugepages: bool) -> int:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ)
    if hugepages:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable, *sys.argv]
    return subprocess.run(cmd, timeout=3600, env=env).returncode


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def boundary_shape(nbytes: int) -> tuple[int, int, int]:
    """[1, rows, cols] f32 of `nbytes`, at least 4 rows (so a column half is strided)."""
    rows = max(4, nbytes // 8192)
    return (1, rows, nbytes // 4 // rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hugepages", action="store_true",
                        help="when relaunching, set GLIBC_TUNABLES=glibc.malloc.hugetlb=1 so JAX's "
                             "host buffers get transparent huge pages like numpy's")
    args = parser.parse_args()

    from h2jax.runtime.jaxsetup import configure_jax
    from h2jax.runtime.ranks import install_abort_on_error, mpi_world_size
    from h2jax.transport.mpi import MPITransport, _batched_put, aligned_empty

    if mpi_world_size() == 1:
        return relaunch_under_mpiexec(args.hugepages)
    configure_jax("cpu", 2)  # before JAX starts
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
    load_before = os.getloadavg()

    def layout(tensor: int):
        mesh = Mesh(np.array(jax.devices()[:tensor]).reshape(1, tensor), ("data", "tensor"))
        return NamedSharding(mesh, P("data", None, "tensor"))

    one = layout(1)
    split = layout(2) if rank == 1 else one  # the strided pair: (tensor=1) -> (tensor=2)
    transports = {"direct": MPITransport([1, 1], path="direct"), "staged": MPITransport([1, 1], path="staged"),
                  "strided": MPITransport([1, 1], path="direct")}
    layouts = {"direct": one, "staged": one, "strided": split}
    ack = np.zeros(1, np.uint8)

    def iterations(nbytes: int) -> int:
        return int(min(2000, max(8, RUN_BYTES // nbytes)))

    def time_raw(buf, iters, source=None) -> float:
        """Rank 0 sends `source` (default: `buf`), rank 1 receives into `buf`."""
        source = buf if source is None else source
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for _ in range(iters):
                comm.Send(source, dest=1, tag=7)
            comm.Recv(ack, source=1, tag=8)
        else:
            for _ in range(iters):
                comm.Recv(buf, source=0, tag=7)
            comm.Send(ack, dest=0, tag=8)
        return time.perf_counter() - t0

    def time_raw_window(bufs, iters, source=None, put=None) -> float:
        """Rank 0 sends `source` (default: `bufs[0]`), rank 1 receives into `bufs` in turn,
        WINDOW receives posted ahead. With `put` (raw_jax_adopt), each received buffer
        becomes a jax.Array by that one PJRT call, kept until the next one: `bufs` then has
        WINDOW + 1 buffers, so none is written while an array holds it."""
        source = bufs[0] if source is None else source
        n, y = len(bufs), None
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            requests = [comm.Isend(source, dest=1, tag=7) for _ in range(iters)]
            MPI.Request.Waitall(requests)
            comm.Recv(ack, source=1, tag=8)
        else:
            posted = [comm.Irecv(bufs[k % n], source=0, tag=7) for k in range(min(WINDOW, iters))]
            for k in range(iters):
                posted[k % WINDOW].Wait()
                if put is not None:
                    y = put([bufs[k % n]])
                if k + WINDOW < iters:
                    posted[k % WINDOW] = comm.Irecv(bufs[(k + WINDOW) % n], source=0, tag=7)
            if y is not None:
                y.block_until_ready()
            comm.Send(ack, dest=0, tag=8)
        return time.perf_counter() - t0

    def jax_bytes(x, nbytes):
        """The JAX array's own host buffer, by address, as MPI sends it (rank 0 only)."""
        if x is None:
            return None
        data = x.addressable_data(0)
        return [MPI.buffer.fromaddress(data.unsafe_buffer_pointer(), nbytes, readonly=True), MPI.BYTE]

    def time_transport(transport, x, iters) -> float:
        tags = [Tag(ACT, 0, k) for k in range(iters)]  # made before the clock starts
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for tag in tags:
                transport.send(tag, x)
            transport.flush()
            comm.Recv(ack, source=1, tag=8)
        else:
            # As the pipeline driver does, receives are posted ahead of need (a window of
            # WINDOW), so the next message moves while this one becomes a jax.Array.
            transport.prepost(tags[:WINDOW])
            for k in range(iters):
                if k + WINDOW < iters:
                    transport.prepost([tags[k + WINDOW]])
                y = transport.recv(tags[k])
            y.block_until_ready()
            comm.Send(ack, dest=0, tag=8)
        return time.perf_counter() - t0

    sizes = [4096 << (2 * i) for i in range(12) if (4096 << (2 * i)) <= args.max_mib * MIB]
    names = ("raw", "raw_window", "raw_jax", "raw_jax_window", "raw_jax_adopt", "direct", "staged", "strided")
    rows = []
    for nbytes in sizes:
        shape = boundary_shape(nbytes)
        iters = iterations(nbytes)
        raw_bufs = [aligned_empty((nbytes,), np.uint8) for _ in range(WINDOW)]
        for b in raw_bufs:
            b[:] = 1
        x = jax.device_put(np.full(shape, 1.0, np.float32), one).block_until_ready() if rank == 0 else None
        adopt_bufs = [aligned_empty(shape, np.float32) for _ in range(WINDOW + 1)]
        for b in adopt_bufs:
            b[...] = 1
        put = _batched_put(shape, np.float32, one, list(one.mesh.devices.flat), copy=False)
        for name, t in transports.items():
            t.connect(shape, np.float32, {rank: layouts[name]})
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeats):  # interleaved, so load changes hit all alike
            times["raw"].append(time_raw(raw_bufs[0], iters))
            times["raw_window"].append(time_raw_window(raw_bufs, iters))
            times["raw_jax"].append(time_raw(raw_bufs[0], iters, jax_bytes(x, nbytes)))
            times["raw_jax_window"].append(time_raw_window(raw_bufs, iters, jax_bytes(x, nbytes)))
            times["raw_jax_adopt"].append(time_raw_window(adopt_bufs, iters, jax_bytes(x, nbytes), put))
            for name, t in transports.items():
                times[name].append(time_transport(t, x, iters))
        best_raw = [min(a, b) for a, b in zip(times["raw"], times["raw_window"])]

        def gib_s(ts):
            return round(nbytes * iters / statistics.median(ts) / (1 << 30), 3)

        def ratio(num, den):  # throughput ratio num/den, median over repeats
            return round(statistics.median(d / n for n, d in zip(times[num], den)), 3)

        rows.append({
            "bytes": nbytes, "iters": iters, "shape": list(shape),
            "raw_best_gib_s": gib_s(best_raw),
            **{f"{n}_gib_s": gib_s(times[n]) for n in names},
            "direct_vs_raw": ratio("direct", best_raw),
            "direct_vs_raw_jax": ratio("direct", times["raw_jax"]),
            "direct_vs_raw_jax_window": ratio("direct", times["raw_jax_window"]),
            "direct_vs_raw_jax_adopt": ratio("direct", times["raw_jax_adopt"]),
            "raw_jax_adopt_vs_raw": ratio("raw_jax_adopt", best_raw),
            "strided_vs_raw": ratio("strided", best_raw),
            "staged_vs_raw": ratio("staged", best_raw),
            "direct_vs_staged": ratio("direct", times["staged"]),
            "direct_overhead_us_per_message": round(statistics.median(
                (d - r) / iters * 1e6 for d, r in zip(times["direct"], best_raw)), 2),
        })
        del x, raw_bufs, adopt_bufs

    # Work per message, apart from the wire: 4 KiB messages that have already arrived.
    shape = boundary_shape(4096)
    t = transports["direct"]
    t.connect(shape, np.float32, {rank: one})
    x = jax.device_put(np.full(shape, 1.0, np.float32), one).block_until_ready() if rank == 0 else None
    buf = aligned_empty((4096,), np.uint8)
    work: dict[str, list[float]] = {k: [] for k in ("raw_recv", "raw_recv_cpu", "h2jax_recv", "h2jax_recv_cpu",
                                                    "raw_send", "raw_send_cpu", "h2jax_send", "h2jax_send_cpu")}
    tags = [Tag(ACT, 0, k) for k in range(ARRIVED)]

    def clocked(key, fn):
        w, c = time.perf_counter(), time.process_time()
        fn()
        work[key].append((time.perf_counter() - w) / ARRIVED * 1e6)
        work[key + "_cpu"].append((time.process_time() - c) / ARRIVED * 1e6)

    in_flight = []

    def raw_sends():
        in_flight.extend(comm.Isend(buf, dest=1, tag=7) for _ in range(ARRIVED))

    def raw_recvs():
        for _ in range(ARRIVED):
            comm.Recv(buf, source=0, tag=7)

    def h2jax_sends():
        for tag in tags:
            t.send(tag, x)

    def h2jax_recvs():
        for tag in tags:
            t.prepost([tag])
            y = t.recv(tag)
        y.block_until_ready()

    for _ in range(args.repeats):
        for kind in ("raw", "h2jax"):
            comm.Barrier()
            if rank == 0:
                clocked(f"{kind}_send", raw_sends if kind == "raw" else h2jax_sends)
                if kind == "raw":
                    MPI.Request.Waitall(in_flight)
                    in_flight.clear()
                else:
                    t.flush()
                comm.Barrier()  # all sent, all buffered at the receiver (eager protocol)
            else:
                comm.Barrier()
                clocked(f"{kind}_recv", raw_recvs if kind == "raw" else h2jax_recvs)
            comm.Barrier()
    work = {k: v for k, v in work.items() if v}
    work_all = comm.gather(work, root=0)

    # Correctness of what the benchmark moved: one more message per variant, compared.
    checks = {}
    for name, tr in transports.items():
        shape = boundary_shape(MIB)
        probe = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        tr.connect(shape, np.float32, {rank: layouts[name]})
        if rank == 0:
            tr.send(Tag(ACT, 0, 0), jax.device_put(probe, one))
            tr.flush()
        else:
            y = tr.recv(Tag(ACT, 0, 0))
            checks[name] = bool(np.array_equal(np.asarray(y), probe)) and y.sharding == layouts[name]
    reports = comm.gather({k: v.describe() for k, v in transports.items()}, root=0)
    checks = comm.bcast(checks, root=1)
    for v in transports.values():
        v.close()
    if rank == 0:
        work = {**work_all[0], **work_all[1]}
        med = {k: round(statistics.median(v), 2) for k, v in work.items()}
        large = [r for r in rows if r["bytes"] >= MIB]
        worst = min((r["direct_vs_raw"] for r in large), default=None)
        worst_same_memory = min((r["direct_vs_raw_jax"] for r in large), default=None)
        worst_same_pattern = min((r["direct_vs_raw_jax_window"] for r in large), default=None)
        worst_adopted = min((r["direct_vs_raw_jax_adopt"] for r in large), default=None)
        adopt_floor = min((r["raw_jax_adopt_vs_raw"] for r in large), default=None)
        at_4k = next((r for r in rows if r["bytes"] == 4096), None)
        sender, receiver = reports[0], reports[1]
        strided_sent = sender["strided"]["send_pieces_strided"]
        strided_messages = sender["strided"]["sends"]
        print(json.dumps({
            "benchmark": "transport",
            "ranks": 2,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "jax": jax.__version__,
            "platform": "cpu",
            "cpus": os.cpu_count(),
            "load_average_1_5_15_min": {"before": [round(v, 2) for v in load_before],
                                        "after": [round(v, 2) for v in os.getloadavg()]},
            "repeats": args.repeats, "window": WINDOW,
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
            "transparent_hugepage": _thp_mode(),
            "paths": {k: {"path": v["path"], "why": v["why"], "assembly": receiver[k]["assembly"]}
                      for k, v in sender.items()},
            "sizes": rows,
            "per_message_4KiB_us": {
                "stream_overhead_above_raw": at_4k and at_4k["direct_overhead_us_per_message"],
                "receive_work": {"raw": med["raw_recv"], "h2jax": med["h2jax_recv"],
                                 "above_raw": round(med["h2jax_recv"] - med["raw_recv"], 2),
                                 "cpu_raw": med["raw_recv_cpu"], "cpu_h2jax": med["h2jax_recv_cpu"]},
                "send_work": {"raw": med["raw_send"], "h2jax": med["h2jax_send"],
                              "above_raw": round(med["h2jax_send"] - med["raw_send"], 2),
                              "cpu_raw": med["raw_send_cpu"], "cpu_h2jax": med["h2jax_send_cpu"]},
            },
            "counters": {
                name: {"sender": {k: sender[name][k] for k in ("sends", "bytes_sent", "send_buffers_zero_copy",
                                                                "send_pieces_strided", "send_buffers_copied",
                                                                "send_copy_bytes")},
                       "receiver": {k: receiver[name][k] for k in ("recvs", "bytes_received", "recv_buffers_adopted",
                                                                    "recv_buffers_copied", "recv_copy_bytes",
                                                                    "recvs_waited")}}
                for name in transports
            },
            "received_equal_sent": checks,
            "goal": {
                "direct_vs_raw_min_at_ge_1MiB": worst,
                "direct_ge_90pct_of_raw_at_ge_1MiB": worst is not None and worst >= 0.9,
                # the same, against raw mpi4py sending out of the same JAX buffer
                "direct_vs_raw_jax_min_at_ge_1MiB": worst_same_memory,
                "direct_ge_90pct_of_raw_jax_at_ge_1MiB": worst_same_memory is not None and worst_same_memory >= 0.9,
                # and against raw mpi4py doing what the transport does: out of the JAX buffer,
                # into WINDOW receive buffers in turn (a pipeline cannot receive every message
                # into one buffer: the arrays it received earlier are still in use)
                "direct_vs_raw_jax_window_min_at_ge_1MiB": worst_same_pattern,
                # and against that plus the one PJRT call per message that makes the buffer a
                # jax.Array (raw_jax_adopt): the least a transport that hands over jax.Arrays
                # does; raw_jax_adopt's own ratio to raw is what that call costs on the wire
                "direct_vs_raw_jax_adopt_min_at_ge_1MiB": worst_adopted,
                "raw_jax_adopt_vs_raw_min_at_ge_1MiB": adopt_floor,
                "receive_work_above_raw_le_10us_at_4KiB": med["h2jax_recv"] - med["raw_recv"] <= 10,
                # CPU time: what the work costs when no other process takes the core meanwhile
                "receive_cpu_work_above_raw_le_10us_at_4KiB": med["h2jax_recv_cpu"] - med["raw_recv_cpu"] <= 10,
                "stream_overhead_le_10us_at_4KiB": at_4k is not None and at_4k["direct_overhead_us_per_message"] <= 10,
                "strided_pieces_sent_without_copy": strided_messages > 0
                and strided_sent == 2 * strided_messages and sender["strided"]["send_copy_bytes"] == 0,
                "direct_faster_than_staged_at_ge_1MiB": all(r["direct_vs_staged"] > 1 for r in large),
            },
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
