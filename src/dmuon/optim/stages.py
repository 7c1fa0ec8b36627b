"""What the optimizers of a model's pipeline stages check together (``DMuon(pp_group=)``).

A weight tied between stages (the embedding on the first stage, the output head on the last) is two
parameters there, one per stage, each routed by its stage's own rule: the embedding to AdamW, the head
to AdamW only when it is named as one (``lm_head``, ``output``, ``head``) or tied to an embedding *on the
same stage*, which a stage split breaks. One copy stepped by Muon and the other by AdamW drift apart
(Megatron-LM #4641). At the first step, the stages compare their embeddings with their Muon matrices.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dmuon.plan.plan import Plan


def check_ties_across_stages(model: nn.Module, plan: Plan, group) -> None:
    """Raises ``ValueError`` on every stage when a Muon matrix on some stage has the shape of an
    ``nn.Embedding`` weight on another (a tied output head, or an untied one named otherwise: both take
    AdamW under Muon's convention), naming both. One object all-gather over ``group``."""
    mine = {
        "embeddings": [(f"{name}.weight" if name else "weight", tuple(m.weight.shape))
                       for name, m in model.named_modules() if isinstance(m, nn.Embedding)],
        "matrices": sorted({(info.name.split("[")[0], tuple(info.param.shape)) for info in plan.infos}),
    }
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
    for k, stage in enumerate(stages):
        for name, shape in stage["matrices"]:
            for j, other in enumerate(stages):
                tied = [e for e, s in other["embeddings"] if s == shape] if j != k else []
                if tied:
                    raise ValueError(
                        f"parameter {name!r} (pipeline rank {k}) goes to Muon but has the shape {shape} of the "
                        f"embedding {tied[0]!r} on pipeline rank {j}: a weight tied across stages must take one "
                        "rule on both, and an output head takes AdamW under Muon's convention; name it as a head "
                        "(lm_head, output, head) or leave it out of Muon (dmuon.prepare(model, select=...))")
