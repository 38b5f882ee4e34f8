"""A seeded fault in the gather of S's per-row publications (two-level candidates): the replay
batch's kept rows read the candidate blocks of the batch's first rows while the streams (and S's
selection) are gathered right. ``swa-bench check`` on a shipped sparse CPU case must fail: E1
compares the kept rows' candidates bitwise with the oracle's gather, and the decoder's index
source then picks among other positions. (S's selection read from the first rows is not seeded
here: another request's positions index past the kept request's keys and crash the step.)"""

from __future__ import annotations

import torch

import swa_bench.replay.replay_batch as replay_batch
from swa_bench.model.forward_context import get_forward_context, region, set_forward_context
from tests.faults.faults import into
from tests.faults.test_faults import run_case_checks

SPARSE = "scenarios/sparse-policies.yaml"
EAGER_BOUNDED = "eager/bounded/T=37"


def _first_rows_for(dtype: torch.dtype):
    """``ReplayBatch.run`` gathering the per-row inputs of ``dtype`` (S's selection: int64; its
    candidate blocks: int32; the streams are floating point) from the batch's first rows."""

    def run(self, run_layers, batch_kv, *inputs, out=None):
        first = torch.arange(self.num_rows, device=self.rows.device)
        with region(get_forward_context().timer, "gather"):
            gathered = [None if t is None else
                        t.index_select(0, first if t.dtype == dtype else self.rows)
                        for t in inputs]
        with set_forward_context(self.forward_context):
            outputs = run_layers(batch_kv, *gathered)
        spread = [o.new_zeros((batch_kv.shape[0], *o.shape[1:])).index_copy_(0, self.rows, o)
                  for o in outputs]
        return tuple(spread) if out is None else into(out, spread)

    return run


def test_candidates_of_the_first_rows_fail_the_checks(monkeypatch):
    monkeypatch.setattr(replay_batch.ReplayBatch, "run", _first_rows_for(torch.int32))
    failed = run_case_checks(SPARSE, EAGER_BOUNDED)
    assert failed and failed[0] == "E1", f"S's candidates of the wrong rows: {failed}"
