"""Horovod and mpi4py alone, no hvd_compress: small point-to-point messages on an mpi4py
communicator of our own (isend, iprobe, recv: what L-GreCo's decisions used under MPI) while
Horovod's background thread runs its MPI collectives in the same processes. Run by
docker/soak.sh ("mpi-threads", with SOAK_CONTROLLER=mpi) to tell Open MPI's behaviour with two
threads in MPI apart from ours.

    horovodrun --mpi -np 4 -H c1:2,c2:2 python mpi_threads.py [ROUNDS]

Each round: every rank starts all-reduces on Horovod, then all-gathers a small object over its
own communicator (each wait bounded by 60 s), then waits for the all-reduces. Exits 1, naming
the round and the missing peer, when a message sent never arrives.
"""

import logging
import random
import sys
import time

import horovod.torch as hvd
import torch

DEADLINE_SECONDS = 60.0


def allgather(comm, obj, tag):
    rank, size = comm.Get_rank(), comm.Get_size()
    sends = [comm.isend(obj, dest=r, tag=tag) for r in range(size) if r != rank]
    gathered = [None] * size
    gathered[rank] = obj
    deadline = time.monotonic() + DEADLINE_SECONDS
    for r in range(size):
        if r == rank:
            continue
        while not comm.iprobe(source=r, tag=tag):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no message from rank {r} (tag {tag}) in {DEADLINE_SECONDS} s")
            time.sleep(0.0005)
        gathered[r] = comm.recv(source=r, tag=tag)
    while not all(s.test()[0] for s in sends):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: sends of tag {tag} never completed")
        time.sleep(0.0005)
    return gathered


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    hvd.init()
    torch.set_num_threads(1)
    from mpi4py import MPI

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    comm = MPI.COMM_WORLD.Dup()
    rng = random.Random(hvd.rank())
    start = time.time()
    for round_ in range(rounds):
        sizes = random.Random(round_).choices([16, 4096, 65536], k=4)  # the same on every rank
        handles = [
            hvd.allreduce_async(torch.full((n,), 1.0), name=f"r{round_ % 64}.{i}.{n}") for i, n in enumerate(sizes)
        ]
        try:
            gathered = allgather(comm, (round_, hvd.rank()), tag=round_ % 30000)
        except TimeoutError as error:
            logging.error("round %d: %s", round_, error)
            sys.exit(1)
        assert [g[0] for g in gathered] == [round_] * comm.Get_size(), gathered
        for handle in handles:
            hvd.synchronize(handle)
        time.sleep(rng.random() * 0.002)
        if hvd.rank() == 0 and round_ % 250 == 0:
            logging.info("round %d, %.1f s", round_, time.time() - start)
    if hvd.rank() == 0:
        logging.info("final: %d rounds, %.1f s", rounds, time.time() - start)


if __name__ == "__main__":
    main()
