"""One entry point for every benchmark: ``python -m benchmarks <benchmark> [options]``.

Each benchmark is a module of this package with a ``main()`` that reads its options from
``sys.argv``; ``<benchmark> --help`` lists them."""

import importlib
import sys

BENCHMARKS = {
    "advise_check": "advise's projection model fed with the end-to-end run's measurements, against its step times",
    "advise_live": "hvd_compress.advise run on the emulated cluster, against the end-to-end run's step times",
    "batching": "ACP-SGD's low-rank work one layer at a time against one batched call per distinct shape",
    "claims": "the L-GreCo protocol on the word LM: anchors, L-GreCo, ScaleCom in its regime, ablations",
    "codec": "compress + error feedback + decompress per step, against torch's PowerSGD hook",
    "controller_overhead": "L-GreCo's decision time, stall and per-step cost, GraVAC's gain measurement",
    "convergence": "final accuracy / perplexity, compression ratio and wall time of each method, 4 ranks",
    "ddp": "PyTorch DDP on an emulated cluster: no hook, torch's powerSGD_hook, ours through hvd_compress.ddp",
    "elastic": "a worker SIGKILLed and a new one joining under horovodrun elastic; error feedback kept or reset",
    "evidence": "the quality tables of docs/benchmarks/ as the data file hvd_compress.advise prints from",
    "endtoend": "step time of every method on an emulated cluster: compute, compression, exposed communication",
    "fsdp": "FSDP2 / HSDP on an emulated cluster of 2 nodes x 2 ranks: plain HSDP against hvd_compress.fsdp",
    "fusion": "ACP-SGD step time against the fusion buffer size, on an emulated cluster",
    "horovod_suite": "Horovod's own optimizer tests with each compressor injected, both paths, np 2",
    "layouts": "the low-rank codecs' skinny products on the CPU's BLAS, by the layout of their factors",
    "metrics_overhead": "host CPU time per step that a metrics exporter adds (per layer, per write)",
    "outer": "DiLoCo (local steps, compressed pseudo-gradients) against per-step methods, quality and bytes",
    "projection": "alpha-beta projection of the end-to-end results to 8-64 workers and 1-100 Gbit/s",
    "quality": "final quality against bytes sent, a sweep of settings per method, and the seeds' claims",
    "report": "every page and figure here re-rendered from the stored JSON, and this list; nothing measured",
    "scaling": "bytes one rank sends per step at W = 2-32 from the traffic counters, the formula, "
    "where each stops paying",
    "solver": "the L-GreCo DP solver on a realistic instance",
    "time_to_quality": "steps to the uncompressed run's validation loss per method (warmup-stable-decay, seeds)",
    "time_to_target": "time_to_quality's steps to target x step times on an emulated cluster, at settings of r",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        width = max(map(len, BENCHMARKS))
        listing = "\n".join(f"  {name:{width}} {summary}" for name, summary in BENCHMARKS.items())
        print(f"usage: python -m benchmarks <benchmark> [options]\n\nbenchmarks:\n{listing}", file=sys.stderr)
        return 2
    name, options = argv[0], argv[1:]
    sys.argv = [f"python -m benchmarks {name}"] + options
    importlib.import_module(f"benchmarks.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
