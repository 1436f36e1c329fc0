"""Whether reading a prefix back from the disk tier is worth it: a restore
is started only where it is expected to end sooner than computing the same
tokens would (KVManager.try_admit asks should_restore()); the other
returning prefixes are computed, which gives the very same tokens.

Both sides are measured as the engine runs, each as a decaying cost per
unit (DecayingCost):
- reads: the bytes of the pages a restore read over the restore's wall time
  (start to end), one sample per restore (engine/kv/disk_restore.py). The
  wall time is what a waiting request pays: READER_THREADS readers work on
  one restore's read-ahead window at once, so their per-page times overlap
  and do not add up; and it includes what the readers' own timings leave
  out (the engine taking each read at its next step, host slots to wait
  for). So a restore of N bytes is expected to take N times the cost per
  byte. A restore cut by its deadline is a sample too: what it read in that
  time (nothing read at all makes the cost infinite).
- prefill: the seconds the engine's steps spent on prompt tokens over those
  tokens (the EngineStats prefill_seconds_total / prefill_tokens_total
  split of each step, engine/scheduling/core.py _account).

A prefix's restore would read its disk pages; skipping it computes every
token from its first disk page on (the device and host pages after that
page are reachable only through it). Since both estimates are linear, the
verdict is in effect a comparison of the two rates; a restore longer than
its deadline changes nothing, as a faster reader is faster for the part it
reads before the deadline too.

Until both sides are measured (an engine just started, or restarted: the
estimates live in the engine process), every restore goes ahead, as it did
before this rule: restoring is how the read rate gets measured, and the
first restores after a restart measure the disk as it is then (files not in
the page cache yet). A disk judged slower is measured again now and then
(PROBE_EVERY), since rates change: the page cache warms, the GPU's load
varies, the disk's other users come and go.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# A restore goes ahead when it is expected to take at most 1/RESTORE_MARGIN
# of the time computing its tokens would. The margin leans towards
# computing, because what a restore costs beyond its own wait is not in its
# estimate: restores run one at a time (another returning request waits
# behind it, engine/kv/kv_manager.py), the readers take GIL time from the
# engine's loop, and the estimates are averages of noisy samples (page
# cache hits, mixed prefill/decode steps). A 25% band also keeps the
# verdict from flipping on each sample when the two rates are close.
# Computing costs GPU time the other requests could use, which argues the
# other way; a tier must never make serving slower than no tier, so close
# calls go to computing.
RESTORE_MARGIN = 1.25
# One restore in PROBE_EVERY judged slower goes ahead anyway, to measure
# the disk again. A probe costs its request at most the restore deadline
# (--disk-kv-restore-ms, 300 ms by default) of extra wait, less the
# computing its pages read save; one in 16 spreads that to under 20 ms a
# returning request at worst, small against the 664 ms of mean TTFT that
# restores at 0.8-1.0 GB/s cost on the H200 (32 x 8 turns,
# docs/performance.md), while a disk that became fast is found within 16
# returning prefixes (below: one probe at a fast rate outweighs the old
# estimate).
PROBE_EVERY = 16
# The estimates' memories: each sample's weight halves with every this
# many units measured after it. 256 MiB of reads is about what a restore
# reads before its deadline on the H200's disk (0.8-1.0 GB/s for 300 ms),
# so a new one weighs about half; a probe that finds the disk fast reads
# more in the same time (a 16k-token prefix of the 8B shape is 2.4 GB),
# weighs more, and turns the verdict by itself. 64k prompt tokens is
# 1.5-3.5 s of the 8B shape's prefill on the H200 (19-44k tokens/s), many
# steps' worth of samples.
READ_HALF_LIFE_BYTES = 256 * 2**20
PREFILL_HALF_LIFE_TOKENS = 64 * 1024


@dataclass
class DecayingCost:
    """Seconds per unit (a byte read, a token computed), averaged over the
    recent units: each sample's weight halves with every half_life units
    measured after it. Weighing by units rather than by samples or wall
    clock means a fast sample counts as much as a slow one of the same
    size (a time-weighted mean would let slow samples dominate), and an
    estimate nobody measures for an hour keeps its value until the next
    sample, which then weighs by its size alone."""

    half_life: float
    units: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, units: float, seconds: float) -> None:
        keep = 0.5 ** (units / self.half_life)
        self.units = self.units * keep + units
        self.seconds = self.seconds * keep + seconds
        self.samples += 1

    @property
    def measured(self) -> bool:
        return self.samples > 0

    @property
    def per_unit(self) -> float:
        """Seconds per unit; infinite when only empty samples were taken
        (restores that read nothing before their deadline)."""
        if self.units > 0:
            return self.seconds / self.units
        return math.inf if self.seconds > 0 else 0.0

    @property
    def rate(self) -> float:
        """Units per second (0 when nothing was done in the time measured)."""
        per_unit = self.per_unit
        return 1.0 / per_unit if per_unit > 0 else math.inf


@dataclass
class RestoreCost:
    """The read and prefill estimates, and the verdict on each restore."""

    reads: DecayingCost = field(default_factory=lambda: DecayingCost(READ_HALF_LIFE_BYTES))
    prefill: DecayingCost = field(
        default_factory=lambda: DecayingCost(PREFILL_HALF_LIFE_TOKENS))
    margin: float = RESTORE_MARGIN
    probe_every: int = PROBE_EVERY
    # Restores judged slower since the last that went ahead.
    _judged_slow: int = 0
    # The last verdict (whether the disk was judged slower), to log changes.
    _slow: bool = False

    def note_read(self, nbytes: int, seconds: float) -> None:
        """A restore ended: nbytes of pages read in its seconds of wall time."""
        if seconds > 0:
            self.reads.add(nbytes, seconds)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed tokens of prompts in seconds (its prefill share)."""
        if tokens > 0 and seconds > 0:
            self.prefill.add(tokens, seconds)

    def restore_seconds(self, nbytes: int) -> float:
        return nbytes * self.reads.per_unit

    def compute_seconds(self, tokens: int) -> float:
        return tokens * self.prefill.per_unit

    def should_restore(self, nbytes: int, tokens: int) -> bool:
        """Whether to read nbytes of disk pages rather than compute the
        tokens they would spare; False: the caller computes them (and
        counts a skipped restore). One in probe_every restores judged
        slower goes ahead anyway, to measure the disk again."""
        if not (self.reads.measured and self.prefill.measured):
            return True
        slow = self.restore_seconds(nbytes) * self.margin > self.compute_seconds(tokens)
        if slow != self._slow:
            self._slow = slow
            log.info("disk KV tier: restores now judged %s than computing (reads %.3g MB/s, "
                     "prefill %.3g tokens/s)%s", "slower" if slow else "faster",
                     self.reads.rate / 1e6, self.prefill.rate,
                     f"; computed instead, one in {self.probe_every} read to measure again"
                     if slow else "")
        if not slow:
            self._judged_slow = 0
            return True
        self._judged_slow += 1
        if self._judged_slow >= self.probe_every:
            self._judged_slow = 0
            return True  # a probe
        return False
