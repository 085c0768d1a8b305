"""``python -m hvd_compress.advise``: the command line (the package docstring)."""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch

from hvd_compress.advise.advice import advise, format_advice
from hvd_compress.advise.measure import load_model
from hvd_compress.advise.ranks import launched_ranks


def _world(text: str) -> int:
    """``--world``: a whole number of ranks, 2 or more."""
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 2:
        raise argparse.ArgumentTypeError(f"a whole number of ranks, 2 or more, to project to; got {text!r}")
    return world


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_compress.advise", description=sys.modules[__package__].__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="module:function returning the model, or (model, loss_of)")
    parser.add_argument("--compute-ms", type=float, help="forward + backward ms of one step (without loss_of)")
    parser.add_argument(
        "--methods",
        help="comma-separated registry names, lgreco for L-GreCo over each named compressor it wraps, "
        "and diloco, sparseloco, streaming for the local methods measured to target (default: every one)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the advice as JSON (rank 0)")
    parser.add_argument(
        "--timed-steps",
        type=int,
        default=30,
        help="real training steps timed per setting that could be picked (0: projections alone)",
    )
    parser.add_argument(
        "--world",
        type=_world,
        help="project to this many ranks (links measured on the launched ranks, scaled as the ring algorithms "
        "scale; no timed check); default: the launched ranks",
    )
    args = parser.parse_args(argv)
    model, loss_of = load_model(args.model)
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank: torchrun's local rank, or Open MPI's
        local_rank = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        device = torch.device("cuda", int(local_rank))
    model.to(device)
    ranks = launched_ranks(device)
    advice = advise(
        model,
        loss_of,
        compute_ms=args.compute_ms,
        ranks=ranks,
        methods=args.methods.split(",") if args.methods else None,
        timed_steps=args.timed_steps,
        world=args.world,
    )
    if ranks.rank == 0:
        sys.stdout.write(format_advice(advice) + "\n")  # one write: whole lines under any launcher
        sys.stdout.flush()
        if args.json:
            args.json.write_text(json.dumps(asdict(advice), indent=1) + "\n")
