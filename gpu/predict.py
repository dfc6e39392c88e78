"""What the simulator's cost model charges for the ops a replay executes.

Block ops use `CostModel.op_cost_s` (per block, the model's geometry,
calibrated if the run was). Writes and decode attention are not separate
terms in the cost model; their share of its roofline memory term is used:
kv_bytes_per_token / (hbm_bw * efficiency.memory) per token written, and the
same per context token a decode reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Predictor:
    """Seconds per unit of each kind (a block for block ops, a token for write and attention)."""

    unit_s: Mapping[str, float]
    block_bytes: int  # one block of the simulated model, all layers, K and V
    model: str
    gpu: str
    sliding_window: int | None = None  # the run's window, resolved as the simulator does

    def __call__(self, kind: str, units: int) -> float:
        return self.unit_s.get(kind, 0.0) * units


def predictor(config: Mapping[str, Any], source: str = "config.json") -> Predictor:
    """The cost model of the run described by `config` (a run's config.json)."""
    from kvsim.sim.engine.config import SimConfig
    from kvsim.sim.engine.cost_model import CostModel

    cfg = SimConfig.from_run_config(dict(config), source=source)
    cost = CostModel.from_config(cfg)
    per_token = cost.kv_bytes_per_token / (cost.gpu.hbm_bw * cost.calibration.memory)
    unit = {**cost.op_cost_s, "write": per_token, "attention": per_token}
    return Predictor(unit, cost.kv_bytes_per_block, cost.model.name, cost.gpu.name, cost.sliding_window)
