"""What the simulator's cost model charges for the ops a replay executes.

Block ops use `CostModel.op_cost_s` (per block, the model's geometry,
calibrated if the run was). Writes and decode attention are not separate
terms in the cost model; their share of its roofline memory term is used:
kv_bytes_per_token / (hbm_bw * efficiency.memory) per token written, and the
same per context token a decode reads. Each kernel the replay launches adds
the calibration's `launch_s` of its kind: a replay launches one small kernel a
layer a step, whose fixed GPU time dwarfs its bytes (a 1-token write).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsim.sim.engine.cost_model import Calibration


@dataclass(frozen=True)
class Predictor:
    """Seconds per unit of each kind (a block for block ops, a token for write and attention),
    and per kernel launch of each kind."""

    unit_s: Mapping[str, float]
    block_bytes: int  # one block of the simulated model, all layers, K and V
    model: str
    gpu: str
    sliding_window: int | None = None  # the run's window, resolved as the simulator does
    launch_s: Mapping[str, float] = field(default_factory=dict)

    def __call__(self, kind: str, units: int) -> float:
        """Seconds for `units` of `kind` at the simulated model's bytes."""
        return self.unit_s.get(kind, 0.0) * units

    def launches(self, kind: str, launches: int) -> float:
        """Seconds for `launches` kernel launches of `kind` (whatever bytes each moves)."""
        return self.launch_s.get(kind, 0.0) * launches

    def replay_s(self, kind: str, units: int, launches: int, scale: float) -> float:
        """A replay's time for `units` of `kind` in `launches` kernels, its bytes `scale` times the
        simulated model's: the bytes' share scales, the launches' does not."""
        return self(kind, units) * scale + self.launches(kind, launches)


def predictor(config: Mapping[str, Any], source: str = "config.json",
              calibration: Calibration | None = None) -> Predictor:
    """The cost model of the run described by `config` (a run's config.json), priced with
    `calibration` instead of the run's own where given."""
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.cost_model import CostModel

    cfg = SimConfig.from_run_config(dict(config), source=source)
    cost = CostModel.from_config(cfg, calibration)
    per_token = cost.kv_bytes_per_token / (cost.gpu.hbm_bw * cost.calibration.memory)
    unit = {**cost.op_cost_s, "write": per_token, "attention": per_token}
    return Predictor(unit, cost.kv_bytes_per_block, cost.model.name, cost.gpu.name, cost.sliding_window,
                     cost.calibration.launch_costs())
