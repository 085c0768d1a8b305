"""Does gradient compression pay for this model, on these ranks and links, and at what setting?
Run it before choosing a method, under the launcher and on the ranks that will train:

    mpirun -np 4 python -m hvd_compress.advise --model examples.models:charlm
    horovodrun -np 16 python -m hvd_compress.advise --model mypackage.models:resnet --json advice.json
    mpirun -np 8 python -m hvd_compress.advise --model examples.models:charlm --world 256  # projected

``--model module:function``: ``function()`` returns the model, or ``(model, loss_of)`` where
``loss_of(model)`` is the loss of one fresh batch of this rank (then compute is measured);
without ``loss_of`` give ``--compute-ms`` (forward + backward of one step on one rank).

What it does, on every rank together:

1. **Codec**: every registered compressor at one to three settings (``SETTINGS``) compresses,
   feeds back error and decompresses this model's gradients on this device, each collective
   answered locally as if every rank had sent the same payload. A step waits for the slowest
   rank (ScaleCom's leader, which selects for all, changes every step), so each timed step
   counts the slowest rank's codec. Counted on the way: the bytes
   each collective carries per step and how many rounds follow one another.
2. **Links**: Horovod's all-reduce, all-gather, broadcast and all-to-all, timed over the ranks
   at sizes from 4 KiB up to the largest message a method would send (Horovod fuses what is
   submitted together into buffers of up to 64 MiB). Between two probe sizes a message's time is
   interpolated on the line through them, beyond the largest extrapolated with the bandwidth of
   the two largest, below the smallest taken as the smallest's: one straight line through all
   sizes would be set by the small ones, which a shaped link's burst lets pass at memory speed,
   and would miss the large messages that decide a step.
3. **Compute**: a few forward and backward passes of ``loss_of`` (the first one untimed).
4. **Projection**: a step is compute + codec + exposed communication, with the messages as
   stock ``hvd.DistributedOptimizer`` issues them. Every gradient's first round is submitted
   during backward and Horovod fuses the all-reduces and all-gathers among them into messages
   of up to 64 MiB (broadcasts and all-to-alls go one per gradient); backward hides what it can
   of these, so their exposed part is max(their time - backward, the last message). A round
   that follows another (PowerSGD's Q after P, ScaleCom's all-reduce after its broadcast) runs
   gradient after gradient once the step synchronises, one message each, all exposed.

5. **Time to target**: a user trains to a quality, not for a number of steps. Where this
   project measured how many steps a setting needs to reach the uncompressed run's quality
   (``python -m benchmarks time_to_quality``), its projected time to target is its projected
   step times that factor (uncompressed: 1), relative to uncompressed's.
6. **Timed check**: under Horovod, with ``loss_of``, real training steps of a copy of the model
   through stock ``hvd.DistributedOptimizer`` (``--timed-steps``, after 5 untimed; SGD at learning
   rate 0) time uncompressed, then the setting the advice would pick, then the next, until the
   best timed one beats every projection not yet timed by 20%, the projection's error measured
   there (at most 4 besides uncompressed). A timed setting's speed-up and time to target come
   from its timed step: the projection leaves out the host work of riding Horovod's hooks,
   Horovod's cycles and ranks that share cores, and on the emulated cluster of "Time to target"
   it had put FP16 10% ahead of uncompressed where training measured it 12% behind.
7. **More ranks than launched** (``--world W``): each codec runs as one of W ranks (its
   collectives answered as if W ranks had sent the same payload: bytes, messages, and an
   all-gather's decoding of W payloads, at W), and each link measured on the launched ranks is
   scaled to W as the ring algorithms scale (``projection.scaled_link``): a hop's latency for
   each further message a rank sends in turn, the rest by the bytes it sends. A hop's latency
   is what the all-reduce's latency has over the all-gather's (W - 1 more messages in turn;
   each latency the intercept of its probes, the smallest less its bytes at the bandwidth);
   the rest of a latency is a collective's fixed start, Horovod's cycle, the same at any W.
   Compute is as measured (the same batch per rank); a step-to-target factor is as measured
   where it was (fewer ranks, a smaller global batch). No timed check: W ranks are not there to
   time.
8. **Across sites**: the local methods (DiLoCo, SparseLoCo, Streaming DiLoCo) at each period
   and codec this project measured to target (``local.py``). One exchange of the codec on this
   model's gradients (a pseudo-gradient has a gradient's shape) is measured as a step's, priced
   on the links all exposed (Streaming DiLoCo: a fragment's ``1/F`` of the bytes, less what
   ``delay`` inner steps hide), and spread over the ``H`` steps of a period; the table shows its
   bytes, codec and communication per step-equivalent. They get a line of their own, not the
   per-step advice (whose timed check runs stock ``hvd.DistributedOptimizer``): the local
   setting with the shortest projected time to target on ``PICK_SEEDS`` seeds, and whether the
   best per-step method reaches the target sooner (then train with that), or that none reached
   it.

It prints one table (method, setting, bytes one rank sends per step, codec and communication
time, projected step, timed step where timed, speed-up over uncompressed, the steps-to-target
factor and projected time to target where measured, and the quality this project measured for
that setting:
``hvd_compress/data/quality_evidence.json``, from ``docs/benchmarks/quality-against-bytes.md``
and ``docs/benchmarks/time_to_quality.json``) and one line of
advice. Where any compressed setting has a steps-to-target factor on at least ``PICK_SEEDS``
seeds, the advice is the setting (or uncompressed) with the shortest projected time to target,
among those, if it beats uncompressed by ``WORTH_IT``; a setting projected sooner on fewer seeds
is named, not picked. Otherwise, it is the fastest setting per step whose measured
quality loss stays within ``QUALITY_LIMITS``, said to rest on step time alone; or "do not
compress: the link is fast enough" when nothing beats uncompressed by ``WORTH_IT``.
L-GreCo is projected over each compressor at the settings this project measured it at (its
quality or steps to target, the anchors a user starts from): rank 0's L-GreCo, at the registry's
preset that decides within a few steps, makes one decision from this model's gradients, and that
per-layer setting is measured and projected as a compressor's (``lgreco/topk density=0.1``: L-GreCo
over ``TopK(density=0.1)``). Its later decisions, from later gradients and residuals, and the
decisions' own cost (rank 0, in the background, every ``decide_every`` steps) are not in the
projection. GraVAC is not projected: its factor follows the compression gain it measures over
training's windows, which one gradient cannot show; its evidence is in
``docs/benchmarks/quality-against-bytes.md``.

The package: ``advice.py`` (``advise()``, ``Advice``, the printed table), ``measure.py`` (compute,
codec and links on the launched ranks), ``projection.py`` (``Link``, ``Candidate``, the messages and
step-time model), ``evidence.py`` (this project's measured quality and steps to target, and the one
line of advice), ``local.py`` (the local methods' candidates and their line), ``ranks.py`` (the
launched ranks, on ``comm/``'s backends and transports), ``cli.py`` (``python -m
hvd_compress.advise``). Each method's rounds are answered locally by ``comm/simulated.py`` and
clocks read by ``comm/timing.py``, as everywhere else.
"""

from hvd_compress.advise.advice import Advice, advise, format_advice
from hvd_compress.advise.cli import main
from hvd_compress.advise.projection import Candidate, Link

__all__ = ["advise", "Advice", "Candidate", "Link", "format_advice", "main"]
