"""[pipedream]: the asynchronous pipeline's corrections (parallel.schedule =
"pipedream-2bw", issue 30): how an update that lands one step late is corrected
(hpcpipe/optim/delay.py), with its own checks (`validate`). That it needs that schedule is
hpcpipe/config.py's table."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.optim.delay import KINDS as DELAY_CORRECTIONS
from hpcpipe.util.sections import check_choices, require


@dataclass(frozen=True)
class PipeDreamSection:
    """[pipedream]: the asynchronous pipeline's delay correction."""

    # the keys with a list of allowed values (hpcpipe/util/sections.py check_choices)
    CHOICES = {"delay_correction": DELAY_CORRECTIONS}

    # "secant": each update, taken one step late, is corrected to first order for the
    # weights having moved since its gradient (a per-coordinate curvature from consecutive
    # gradients, hpcpipe/optim/delay.py; five more master-sized buffers); "extrapolate":
    # the stream computes on each version moved one more update ahead, W + (W − W_prev),
    # so a gradient is taken about where it lands (one more buffer; with Muon the best
    # measured); "none": as is
    delay_correction: str = "none"
    delay_correction_decay: float = 0.98  # the curvature estimate's running-mean decay


    def validate(self, source: str):
        check_choices(source, "pipedream", self)
        require(source, "pipedream.delay_correction_decay", self.delay_correction_decay,
                0 <= self.delay_correction_decay < 1, "must be in [0, 1)")
