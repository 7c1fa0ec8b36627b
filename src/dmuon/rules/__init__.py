"""Per-tensor update rules: torch.optim.Muon's and torch.optim.AdamW's, on whatever rows a rank holds.

No collectives here: the runtime decides where each rule runs.
"""

from dmuon.rules.adamw import adamw_group_step
from dmuon.rules.muon import ADJUST_LR_FNS, adjusted_lr, apply_update, momentum_update, peek_direction

__all__ = ["ADJUST_LR_FNS", "adamw_group_step", "adjusted_lr", "apply_update", "momentum_update", "peek_direction"]
