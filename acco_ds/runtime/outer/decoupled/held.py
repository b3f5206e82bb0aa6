"""The Δ slices a syncer shard holds, kept on disk (``state_dir``) until the merge that takes them is saved, and
removed once no merge ever will: a mixin of ``syncer.Shard`` (state and socket), beside ``merges.MergeRule``.

A slice is written as it is acknowledged, so that a decision replayed after a restart merges it even if its learner
died meanwhile. It is removed when its merge is saved, and when its learner leaves the quorum (``DROP``: silent for
``liveness_s``, or relaunched under a new incarnation). A restarted shard 0 cannot know which learners of the
slices it finds are still alive: it names those no logged decision needs *orphans*, and a learner that does not
speak under the same incarnation within ``liveness_s`` is dropped as if it had gone silent (its slices removed on
every shard, and a follower that connects later hears the DROP too)."""

import glob
import json
import os
import re
import threading
import time

import torch


def durable_write(path: str, write) -> None:
    """``write(file)`` into ``path`` through a temporary file: fsync the file, rename it, fsync the folder, so that a
    crash leaves the old file or the new one, never a torn one."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: str, record: dict) -> None:
    """Append one JSON line and fsync it (and the folder, the first time)."""
    new = not os.path.exists(path)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(os.path.dirname(path) or ".")


class HeldDeltas:
    """The Δ slices a shard holds, also on disk (``state_dir``) until the merge that takes them is saved."""

    def _delta_path(self, learner: int, incarnation: int, base: int) -> str:
        return self._path(f"shard{self.index}-delta-{learner}-{incarnation}-{base}.pt")

    def _keep(self, learner: int, entry: dict) -> None:
        """Write a Δ slice this shard holds next to its checkpoint, fsynced (file and folder): a decision replayed
        after this process or its machine restarted merges it even if its learner died meanwhile (it would wait for
        it forever). The disk is read back only for a logged decision naming the slice, hence this order: shard 0
        logs decisions itself, after joining the writes of the slices they name (``_maybe_merge``), so its write
        runs on a thread from its ACK, beside the READY and the other learners' slices, not before the ACK. A
        follower (j > 0) hears of a decision from shard 0, which decides once the learner's rank 0 said READY,
        after every rank had its ACK: only the ACK orders a follower's write before the decision, so a follower
        fsyncs before it answers ACK (on its rank's path; avoiding that would need a message to shard 0)."""
        if self.state_dir is None:
            return
        key = (learner, entry["incarnation"], entry["base"])
        self._kept(*key)  # the same slice sent again: one write at a time
        rec = {k: entry[k] for k in ("incarnation", "base", "tokens", "steps", "adopted", "delta")}
        if self.index != 0:
            return self._write_delta(self._delta_path(*key), rec)
        writer = threading.Thread(target=self._write_delta, args=(self._delta_path(*key), rec), daemon=True)
        self.writers[key] = writer
        writer.start()

    @staticmethod
    def _write_delta(path: str, rec: dict) -> None:
        durable_write(path, lambda f: torch.save(rec, f))

    def _kept(self, learner: int, incarnation: int, base: int) -> None:
        """Wait until that Δ slice is on disk, if it is being written."""
        writer = self.writers.pop((learner, incarnation, base), None)
        if writer is not None:
            writer.join()

    def _recall(self, learner: int, incarnation: int, base: int) -> None:
        """The Δ slice a decision names and no learner sent to this process: from the disk, if it is there."""
        self._kept(learner, incarnation, base)
        path = None if self.state_dir is None else self._delta_path(learner, incarnation, base)
        if path is None or learner in self.pending or not os.path.exists(path):
            return
        rec = torch.load(path, weights_only=True)  # only tensors and numbers
        self.pending[learner] = {**rec, "ready": None, "conn": None}
        self.say(f"took the pseudo-gradient of learner {learner} (incarnation {incarnation}, base {base}) from {path}")

    def _forget(self, learner: int, incarnation: int, base: int) -> None:
        self._kept(learner, incarnation, base)
        if self.state_dir is not None:
            try:
                os.remove(self._delta_path(learner, incarnation, base))
            except FileNotFoundError:
                pass

    def _orphans(self) -> None:
        """Shard 0 at its start: the learners of the slices on disk that no logged decision names."""
        if self.state_dir is None or self.index != 0:
            return
        named = self._decided_slices()
        for path in glob.glob(self._path(f"shard{self.index}-delta-*.pt")):
            key = _key_of(path)
            if key is not None and key not in named:
                self.orphans[key[:2]] = time.monotonic() + self.liveness_s

    def _expire_orphans(self) -> None:
        """Drop the orphans whose learner did not speak under the same incarnation within ``liveness_s``."""
        now = time.monotonic()
        for (learner, incarnation), deadline in list(self.orphans.items()):
            if self.live.get(learner) == incarnation:
                del self.orphans[(learner, incarnation)]  # it spoke: it re-sends its Δ, as after any restart
            elif now >= deadline:
                del self.orphans[(learner, incarnation)]
                self.say(f"learner {learner} (incarnation {incarnation}) held a pseudo-gradient before this shard "
                         f"restarted and has not spoken for {self.liveness_s:g} s (local_sgd.syncer.liveness_s): "
                         f"dropping it")
                self.dropped_orphans.append((learner, incarnation))
                self._drop(learner, incarnation)

    def _decided_slices(self) -> set:
        """(learner, incarnation, base) of every slice a decision not applied yet names."""
        return {m for members in self.decided.values() for m in members}

    def _forget_all(self, learner: int, incarnation: int) -> None:
        """Remove this shard's slices of a dropped learner (incarnation), except those a decision still names."""
        if self.state_dir is None:
            return
        named = self._decided_slices()
        for path in glob.glob(self._path(f"shard{self.index}-delta-{learner}-{incarnation}-*.pt")):
            key = _key_of(path)
            if key is not None and key not in named:
                self._forget(*key)


def _key_of(path: str):
    """(learner, incarnation, base) of a slice file, or None for another file."""
    m = re.fullmatch(r"shard\d+-delta-(\d+)-(\d+)-(\d+)\.pt", os.path.basename(path))
    return None if m is None else tuple(int(g) for g in m.groups())
