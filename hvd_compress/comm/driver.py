"""Runs compressors' rounds on a backend, overlapped and deadlock-free."""

from dataclasses import replace

import torch

from hvd_compress.comm.rounds import Collective, Round

# Collectives whose payloads concatenate: element-wise sums, per-rank byte strings, and
# per-destination rows.
_FUSABLE = (Collective.ALLREDUCE, Collective.ALLGATHER, Collective.ALLTOALL)
# Collectives whose fused payload and result hold a row per rank: members side by side in each.
_BY_RANK = (Collective.ALLGATHER, Collective.ALLTOALL)


class RoundDriver:
    """Starts each gradient's first round as soon as the gradient is ready, starts the next
    round as soon as the previous one lands, and finishes everything in name order. Rounds
    that start together travel together: a fusion bucket's first rounds, and the next rounds
    of a fused collective's members (one collective per kind and dtype, in member order).

    Why it cannot hang: all ranks start the same set of gradients before ``finish``; every
    wait is on the current round of the smallest unfinished name, which every rank submits
    without waiting on anything else first.
    """

    def __init__(self, backend, traffic):
        self.backend = backend
        self.traffic = traffic
        self._inflight = {}  # name, or a bucket key -> (round, handle, round_index)
        self._results = {}
        self._bucket_of = {}
        self._buckets = ()
        self._waiting = {}  # bucket index -> {name: first round}
        self._held = {}  # bucket index -> {name: gradient}, begun together (``hold``)
        self._begin_many = None

    def use_plan(self, plan):
        """Fuses first rounds by ``plan`` (a FusionPlan, or None) from now on."""
        self._bucket_of = plan.bucket_of() if plan is not None else {}
        self._buckets = plan.buckets if plan is not None else ()

    def start(self, name, grad, round_):
        self.traffic.add_gradient(grad)
        bucket = self._bucket_of.get(name)
        if bucket is None:
            self._submit(name, round_, 0)
            return
        self._waiting.setdefault(bucket, {})[name] = round_
        self._start_bucket_if_complete(bucket)

    def hold(self, name, grad, begin_many):
        """As ``start``, but ``grad``'s first round is made later, with those of the rest of its
        fusion bucket: when every member is held, ``begin_many([(name, gradient), ...])`` (in the
        bucket's order) returns their first rounds, so that a compression can work on same-shape
        members in one batched call. A gradient outside the plan is begun at once, alone. The
        bucket's collective waits for its last member either way."""
        self.traffic.add_gradient(grad)
        bucket = self._bucket_of.get(name)
        if bucket is None:
            (round_,) = begin_many([(name, grad)])
            self._submit(name, round_, 0)
            return
        self._begin_many = begin_many
        self._held.setdefault(bucket, {})[name] = grad
        self._start_bucket_if_complete(bucket)

    def leave_out(self, name):
        """``name``'s gradient travels another way from now on (sparse, in the optimizer): its
        bucket in the plan goes without it, and starts if its other members are waiting.
        Called at the same step on every rank, as the plan is used."""
        bucket = self._bucket_of.pop(name, None)
        if bucket is None:
            return
        members = tuple(m for m in self._buckets[bucket].members if m != name)
        self._buckets = tuple(replace(b, members=members) if i == bucket else b for i, b in enumerate(self._buckets))
        self._start_bucket_if_complete(bucket)

    def _start_bucket_if_complete(self, bucket):
        members = self._buckets[bucket].members
        held, waiting = self._held.get(bucket, {}), self._waiting.get(bucket, {})
        if members and len(held) + len(waiting) == len(members):
            rounds = dict(waiting)
            if held:
                names = [name for name in members if name in held]
                rounds.update(zip(names, self._begin_many([(name, held[name]) for name in names])))
            self._held.pop(bucket, None)
            self._waiting.pop(bucket, None)
            # Named by a member too: two optimizers' drivers in one process never share a name.
            self._submit_together(f"bucket{bucket}.{members[0]}", [(name, rounds[name]) for name in members], 0)

    def _submit_together(self, label, rounds, index):
        """One collective per (collective, dtype) among ``rounds`` ([(name, round)], in order):
        round ``index`` of each; unfusable ones alone."""
        groups = {}
        for name, round_ in rounds:
            if round_.collective in _FUSABLE:
                groups.setdefault((round_.collective, round_.payload.dtype), []).append((name, round_))
            else:
                self._submit(name, round_, index)
        for (collective, dtype), members in groups.items():
            if collective is Collective.ALLTOALL:  # (W, c) each: row j of every member goes to rank j
                fused = torch.cat([round_.payload for _, round_ in members], dim=1)
            else:
                fused = torch.cat([round_.payload.reshape(-1) for _, round_ in members])
            key = f"\0{label}.round{index}.{collective.value}.{str(dtype)[6:]}"
            self.traffic.add_payload(fused, collective)
            handle = self.backend.start(f"hvd_compress.{key[1:]}", Round(fused, collective, None))
            self._inflight[key] = (_FusedRounds([n for n, _ in members], [r for _, r in members], label), handle, index)

    def poll(self):
        """Advances every exchange whose collective has landed; never blocks."""
        for key, entry in list(self._inflight.items()):
            if self.backend.done(entry[1]):
                self._advance_any(key, entry, self.backend.wait(entry[1]))

    def finish(self):
        """Waits for every exchange started since the last finish; returns {name: gradient}."""
        if self._waiting or self._held:
            raise RuntimeError(
                f"fusion buckets {sorted(set(self._waiting) | set(self._held))} never got all their "
                f"members; every parameter must be started before finish()"
            )
        while self._inflight:
            key = min(self._inflight)  # buckets ("\0bucket...") first, then names
            entry = self._inflight[key]
            self._advance_any(key, entry, self.backend.wait(entry[1]))
        results, self._results = self._results, {}
        return results

    def _advance_any(self, key, entry, result):
        round_, _, index = entry
        if isinstance(round_, _FusedRounds):
            del self._inflight[key]
            following = []
            for name, member, piece in round_.split(result):
                after = member.then(piece)
                if isinstance(after, Round):
                    following.append((name, after))
                else:
                    self._results[name] = after
            if following:  # the members' next rounds start together, as their first did
                self._submit_together(round_.label, following, index + 1)
        else:
            self._advance(key, round_, result, index)

    def _submit(self, name, round_, index):
        self.traffic.add_payload(round_.payload, round_.collective)
        handle = self.backend.start(f"hvd_compress.{name}.round{index}", round_)
        self._inflight[name] = (round_, handle, index)

    def _advance(self, name, round_, result, index):
        del self._inflight[name]
        following = round_.then(result)
        if isinstance(following, Round):
            self._submit(name, following, index + 1)
        else:
            assert isinstance(following, torch.Tensor)
            self._results[name] = following


class _FusedRounds:
    """The members of one fused collective, and how to cut its result back into their parts."""

    def __init__(self, names, rounds, label):
        self.names, self.rounds, self.label = names, rounds, label

    def split(self, result):
        collective = self.rounds[0].collective
        sizes = [r.payload.shape[1] if collective is Collective.ALLTOALL else r.payload.numel() for r in self.rounds]
        if collective in _BY_RANK:  # rows: one per rank
            pieces = [piece.contiguous() for piece in result.split(sizes, dim=1)]
        else:
            pieces = [piece.view(r.payload.shape) for piece, r in zip(result.split(sizes), self.rounds)]
        return zip(self.names, self.rounds, pieces)
