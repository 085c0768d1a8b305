"""Times the L-GreCo DP solver on a random but realistic instance.

    python -m benchmarks.solver [--layers 500 --candidates 64 --steps 10000 --repeats 5]

Candidates are ranks 1..C of a low-rank compressor: a layer of shape (m, n) sends rank * (m + n)
floats, and its error at rank r is the norm of the singular values beyond r, which decay as a
power law. The budget is the error of the uniform default rank C / 2, as in L-GreCo. With
--spread the errors fall geometrically instead, so each layer's candidates span much of the
budget and the DP rows stay wide: a harder case than real gradients give.
"""

import argparse
import statistics
import time

import numpy as np

from hvd_compress.control.solver import solve


def lowrank_instance(layers, candidates, spread, seed=0):
    """(sizes, errors) of shape (layers, candidates); both monotone in the rank."""
    rng = np.random.default_rng(seed)
    rows, cols = rng.integers(candidates, 4096, layers), rng.integers(candidates, 4096, layers)
    ranks = np.arange(1, candidates + 1)
    sizes = np.outer(rows + cols, ranks) * 4.0
    scale = rng.lognormal(0.0, 1.0, layers)
    if spread:
        return sizes, scale[:, None] * 2.0 ** (-ranks / rng.uniform(2, 8, (layers, 1)))
    errors = np.empty((layers, candidates))
    for layer, decay in enumerate(rng.uniform(0.3, 1.5, layers)):
        energy = (scale[layer] * np.arange(1.0, min(rows[layer], cols[layer]) + 1) ** -decay) ** 2
        beyond = np.cumsum(energy[::-1])[::-1]  # beyond[r] = energy of singular values r+1, ...
        errors[layer] = np.sqrt(np.append(beyond, 0.0)[ranks])
    return sizes, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spread", action="store_true", help="geometric errors: wide DP rows")
    args = parser.parse_args()
    sizes, errors = lowrank_instance(args.layers, args.candidates, args.spread)
    default = args.candidates // 2 - 1
    budget = errors[:, default].sum()
    walls, cpus = [], []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        _, total_size, total_error = solve(sizes, errors, budget, args.steps)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    kind = "geometric (--spread)" if args.spread else "power-law"
    print(
        f"solve(): {args.layers} layers x {args.candidates} candidates, steps {args.steps}, "
        f"{kind} errors, {args.repeats} repeats"
    )
    print(
        f"wall median {statistics.median(walls):.4f} s, min {min(walls):.4f} s "
        f"(cpu median {statistics.median(cpus):.4f} s)"
    )
    print(
        f"size / uniform default rank {default + 1}: {total_size / sizes[:, default].sum():.4f}, "
        f"error / budget: {total_error / budget:.4f}"
    )


if __name__ == "__main__":
    main()
