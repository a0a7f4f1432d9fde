"""Bytes across a stage boundary and transfer time: topology-aware resharding vs broadcast.

    python benchmarks/reshard.py              # launches itself under `mpiexec -n 2`
    mpiexec -n 2 python benchmarks/reshard.py [--shape 4,512,4096] [--repeats 5]

Rank 0 is a (data=1, tensor=tensor_src) stage, rank 1 a (data=1, tensor=tensor_dst) stage,
each on its own CPU devices; an activation [micro_batch, seq, d_model] (f32) moves from the
first to the second through the MPI transport, with `reshard_plan` (each receiving device
gets only its d_model block) or `broadcast_plan` (each receiving device gets the whole
slice). Bytes across are the transports' own counters: what the sender handed to MPI and what
MPI reports it delivered to the receiver, each checked against the plan's total; the counters
also say how many pieces went as strided MPI datatypes (no packing copy) and how many bytes
either end copied (the naive receiver cuts its block out of the slice it got). Time is rank
0's, from a barrier to the receiver's acknowledgement that the jax.Array is assembled
(median). Expected byte ratio broadcast / topology-aware: tensor_dst. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PAIRS = [(1, 8), (2, 4), (4, 2), (8, 1)]


def relaunch_under_mpiexec() -> int:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", "2", sys.executable, *sys.argv]
    return subprocess.run(cmd, timeout=1800).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,512,4096", help="micro_batch,seq,d_model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))

    from h2jax.runtime.jaxsetup import configure_jax
    from h2jax.runtime.ranks import install_abort_on_error, mpi_world_size
    from h2jax.transport.mpi import MPITransport

    if mpi_world_size() == 1:
        return relaunch_under_mpiexec()
    configure_jax("cpu", max(max(p) for p in PAIRS))  # before JAX starts
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mpi4py import MPI

    from h2jax.transport import reshard
    from h2jax.transport.base import ACT, Tag

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run with exactly 2 ranks: mpiexec -n 2 python benchmarks/reshard.py")
    install_abort_on_error(comm)
    rank = comm.rank
    x_host = (np.arange(np.prod(shape), dtype=np.float32) % 1009).reshape(shape)
    nbytes = x_host.nbytes
    rows = []
    step = 0
    for t_src, t_dst in PAIRS:
        tensor = t_src if rank == 0 else t_dst
        mesh = Mesh(np.array(jax.devices()[:tensor]).reshape(1, tensor), ("data", "tensor"))
        layout = NamedSharding(mesh, P("data", None, "tensor"))
        x = jax.device_put(x_host, layout).block_until_ready() if rank == 0 else None
        row = {"tensor_src": t_src, "tensor_dst": t_dst, "activation_bytes": nbytes}
        for mode in ("topology", "broadcast"):
            transport = MPITransport([1, 1], reshard_mode=mode)
            transport.connect(shape, np.float32, {rank: layout})
            times = []
            for rep in range(args.repeats + 1):  # the first is a warm-up
                comm.Barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    transport.send(Tag(ACT, 0, step), x)
                    transport.flush()
                    comm.recv(source=1, tag=9)
                else:
                    y = transport.recv(Tag(ACT, 0, step)).block_until_ready()
                    if rep == 0:
                        assert y.sharding == layout
                        np.testing.assert_array_equal(np.asarray(y), x_host)
                    comm.send(True, dest=0, tag=9)
                if rep:
                    times.append(time.perf_counter() - t0)
                step += 1
            # What crossed, from the transports' own counters: the bytes the sender handed to
            # MPI and the bytes MPI reports it delivered to the receiver, per message.
            sender, receiver = comm.allgather(transport.describe())
            sent = sender["bytes_sent"] // sender["sends"]
            delivered = receiver["bytes_received"] // receiver["recvs"]
            src = reshard.Layout(1, t_src)
            dst = reshard.Layout(1, t_dst)
            plan_fn = reshard.reshard_plan if mode == "topology" else reshard.broadcast_plan
            transfers = plan_fn(src, dst, shape, 4)
            planned = reshard.total_bytes(transfers)
            if not sent == delivered == planned:
                raise SystemExit(f"{mode} {t_src}->{t_dst}: sent {sent} B, MPI delivered {delivered} B, "
                                 f"the plan moves {planned} B per message")
            row[mode] = {
                "bytes_across": delivered,
                "bytes_planned": planned,
                "bytes_sent": sent,
                "messages": len(transfers),
                "strided_pieces_sent": sender["send_pieces_strided"] // sender["sends"],
                "strided_pieces_received": receiver["recv_pieces_strided"] // receiver["recvs"],
                "bytes_copied_sender": sender["send_copy_bytes"] // sender["sends"],
                "bytes_copied_receiver": receiver["recv_copy_bytes"] // receiver["recvs"],
                "median_ms": round(1e3 * statistics.median(times), 3) if rank == 0 else None,
                "gib_s_of_activation": round(nbytes / statistics.median(times) / (1 << 30), 3) if rank == 0 else None,
            }
            transport.close()
        row["byte_ratio_broadcast_over_topology"] = row["broadcast"]["bytes_across"] / row["topology"]["bytes_across"]
        row["expected_byte_ratio"] = t_dst
        if rank == 0:
            row["time_ratio_broadcast_over_topology"] = round(
                row["broadcast"]["median_ms"] / row["topology"]["median_ms"], 3
            )
        rows.append(row)
    if rank == 0:
        print(json.dumps({
            "benchmark": "reshard",
            "ranks": 2,
            "shape": list(shape),
            "dtype": "float32",
            "note": "both stages share one host: 'bytes_across' is what would cross the inter-stage link",
            "load_average_1_5_15_min": [round(v, 2) for v in os.getloadavg()],
            "pairs": rows,
            "byte_ratio_matches_tensor_dst": all(
                r["byte_ratio_broadcast_over_topology"] == r["expected_byte_ratio"] for r in rows
            ),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
