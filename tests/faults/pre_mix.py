"""Seeded faults in the replay's carry of mHC's delayed pre-mix (DeepSeek-V4.1: layer S's
attention collapses its streams with the previous block's FFN pre, so the replay batch must gather
that pre-mix of its kept rows beside their streams)."""

from __future__ import annotations

import swa_bench.replay.replay_batch as replay_batch
from tests.faults.faults import EAGER_BOUNDED, SMOKE, Fault


def _pre_mix_of_the_first_rows(mp):
    """The kept rows read the pre-mix of the batch's first k rows (the streams are gathered
    right): as if the gather indexed the pre-mix by position in the replay batch."""
    real = replay_batch.ReplayBatch.run

    def run(self, run_layers, batch_kv, *inputs, out=None):
        *streams, pre_mix = inputs
        wrong = pre_mix.clone().index_copy_(0, self.rows, pre_mix[: self.num_rows])
        return real(self, run_layers, batch_kv, *streams, wrong, out=out)

    mp.setattr(replay_batch.ReplayBatch, "run", run)


PRE_MIX_FAULTS = [
    Fault("kept rows read the first rows' pre-mix", "the pre-mix gather of the replay batch",
          _pre_mix_of_the_first_rows, (SMOKE, EAGER_BOUNDED)),
]
