"""The ``"acco"`` block of a DeepSpeed JSON config (or of the torch host's config), and every
compatibility rule, once. It imports no host: DeepSpeed and the torch host read the same block.

``acco.py`` holds the block itself (``ACCOConfig``) and the rules on DeepSpeed's own keys beside it;
``rulebook.py`` every refusal of a block on a layout (world, nodes, tp/pp, experts, micro-batches, host); ``local_sgd.py`` the nested blocks (``local_sgd``, ``collectives``, ``compression``,
``emulation``); ``fault_tolerance.py`` the ``fault_tolerance`` block; ``reference.py`` the generated
configuration reference (``python -m acco_ds.config.reference``). Every public name of these modules is
re-exported here: ``from acco_ds.config import ...`` is the config's face.
"""

from .acco import ACCO_KEY, ACCOConfig, check_deepspeed_config, checkpoint_mismatch, parse_acco_config
from .rulebook import Layout, check, refusals, replica_group_size
from .fault_tolerance import (LIGHTHOUSE_ENV, REPLICA_ENV, START_LIGHTHOUSE, FaultToleranceConfig,
                              lighthouse_problem)
from .local_sgd import (EDIT_ONLY, LOCAL_SGD_MODES, OUTER_DEFAULTS, ROUND_MODES, SPARSE, STREAMING,
                        ACCOEmulationConfig, AnomalyConfig, CollectivesConfig, CompressionConfig, LocalSGDConfig,
                        collectives_layout, ranks_per_node, spans_nodes, unknown_keys)

__all__ = ["ACCO_KEY", "ACCOConfig", "ACCOEmulationConfig", "LocalSGDConfig", "AnomalyConfig", "CollectivesConfig",
           "CompressionConfig", "FaultToleranceConfig", "LOCAL_SGD_MODES", "ROUND_MODES", "OUTER_DEFAULTS",
           "EDIT_ONLY", "STREAMING", "SPARSE", "parse_acco_config", "Layout", "refusals", "check",
           "check_deepspeed_config", "replica_group_size", "checkpoint_mismatch",
           "ranks_per_node", "spans_nodes", "collectives_layout", "unknown_keys",
           "lighthouse_problem", "LIGHTHOUSE_ENV", "REPLICA_ENV", "START_LIGHTHOUSE"]
