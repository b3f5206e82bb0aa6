"""The keys of ``"mode": "decoupled"`` (Decoupled DiLoCo: learners that never wait for each other) and how they
combine with the rest of the ``"acco"`` block. The fields live in ``local_sgd``: ``LocalSGDConfig`` takes them
from ``DecoupledKeys`` here; the syncer's own settings are the nested ``local_sgd.syncer`` block,
``SyncerConfig``. This module imports no other config module (``local_sgd`` imports it)."""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

DECOUPLED = "decoupled"
# local_sgd keys that only mode "decoupled" reads.
DECOUPLED_ONLY = ("sync_every_s", "min_quorum", "grace_s", "merge", "staleness", "nesterov_delay", "adopt", "syncer",
                  "tokens_per_step")
# local_sgd keys of other modes that mean nothing to the syncer.
NOT_DECOUPLED = ("fragments", "fragment_sync_delay", "fragment_update_alpha", "staleness_penalty",
                 "outer_momentum_clip", "chunk", "topk", "error_decay", "value_bits", "sync_time_s",
                 "pseudo_grad_clip", "weighting", "anomaly")


class _Block(BaseModel):
    """The settings of ``local_sgd._Documented`` (field docstrings are descriptions, unknown keys refused)."""
    model_config = ConfigDict(use_attribute_docstrings=True, validate_default=True, validate_assignment=True,
                              use_enum_values=True, populate_by_name=True, extra="forbid",
                              arbitrary_types_allowed=True, protected_namespaces=())


class SyncerConfig(_Block):
    """Where the syncer of ``"mode": "decoupled"`` runs and how learners reach it."""

    address: Optional[str] = None
    """``host:port`` of shard 0 of a syncer started with ``acco-ds syncer`` (shard j listens on port + j).
    Left out (the default): the launch starts its own shards, one CPU process per rank of a learner, on the
    ranks of learner 0 (rank j starts shard j), and they live until every learner is done."""

    state_dir: Optional[str] = None
    """Folder where each shard checkpoints θ_g, the outer momentum, the version and the merge log after every
    merge (``shard{j}.pt`` and ``merges.jsonl``); a shard restarted on the same folder resumes from it. Left
    out with the launch's own shards: a temporary folder."""

    timeout_s: float = Field(120.0, gt=0.0, allow_inf_nan=False)
    """Seconds a learner keeps retrying to reach its shard, and waits for the merge that holds its
    pseudo-gradient, before it stops with an error that names the address."""

    host: str = "127.0.0.1"
    """Own shards only: the address they bind to and that learners use (the launch's node of learner 0). Set
    it to that node's address when learners run on other nodes."""

    max_message_mb: float = Field(4096.0, gt=0.0, allow_inf_nan=False)
    """Largest tensor payload a shard or a learner accepts in one message (MiB), checked on its header; a payload
    travels in frames of at most 8 MiB, and ZeroMQ refuses a larger frame before it allocates it."""

    auth_file: Optional[str] = None
    """Path of the secret shared by the learners and ``acco-ds syncer --auth-file``: a file of at least 32 random
    bytes readable by its owner only (``acco-ds syncer --make-secret PATH`` writes one). Every learner rank and
    every shard proves it holds it (CURVE keys derived from it) before a message of theirs is read, and all traffic
    is encrypted. Needed when the syncer listens off loopback. Left out with the launch's own shards: the launch
    makes a secret of its own."""

    liveness_s: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    """Seconds of silence after which shard 0 takes a learner out of the quorum (its pseudo-gradient in flight is
    dropped, so nobody waits for a stopped or hung learner); it is back in as soon as it speaks again. A learner's
    rank 0 pings shard 0 four times per ``liveness_s`` while it trains."""


class DecoupledKeys(_Block):
    """The ``local_sgd`` keys of mode ``decoupled`` (``LocalSGDConfig`` inherits them)."""

    sync_every_s: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """``decoupled`` only: a learner's period ends once this many seconds of wall time passed since it
    started, whatever its step count (its tokens weigh its pseudo-gradient). ``sync_every`` must then be left
    out."""

    min_quorum: StrictInt = Field(1, ge=1)
    """``decoupled`` only: K, the pseudo-gradients the syncer waits for before a merge (capped by the learners
    alive). With K = the number of learners and ``grace_s`` 0 the mode is DiLoCo."""

    grace_s: Union[Annotated[float, Field(ge=0.0, allow_inf_nan=False)], Literal["auto"]] = "auto"
    """``decoupled`` only: seconds the syncer keeps a merge open after the K-th pseudo-gradient arrived, for
    learners close behind; 0 merges at once. ``"auto"``: a tenth of the learners' mean period, measured."""

    merge: Literal["tokens", "equal"] = "tokens"
    """``decoupled`` only: weigh each pseudo-gradient of a merge by its tokens (``tokens``) or alike
    (``equal``)."""

    staleness: Literal["none", "delayed_nesterov"] = "none"
    """``decoupled`` only: ``none`` merges a pseudo-gradient computed from an older global model as it is;
    ``delayed_nesterov`` (Liu et al., arXiv 2401.09135) folds the outer momentum in every ``nesterov_delay``
    merges and applies the plain mean in between."""

    nesterov_delay: Optional[StrictInt] = Field(None, ge=1)
    """``decoupled`` with ``delayed_nesterov`` only: N, merges per momentum update (default: the number of
    learners)."""

    adopt: Literal["wait", "overlap"] = "wait"
    """``decoupled`` only: what a learner does once it sent a pseudo-gradient. ``wait``: it waits for the merge
    that holds it and starts its next period from that global model. ``overlap``: it trains on at once and takes
    the merge at the first inner-step boundary after it arrived, keeping the progress made since the send
    (weights ← global model + that progress); its next period ends once it is long enough and that merge is
    adopted, so it never waits for a merge."""

    tokens_per_step: Optional[StrictInt] = Field(None, ge=1)
    """``decoupled`` only: the tokens one inner step of this learner trains on (micro-batch × sequence length ×
    gradient accumulation × ranks), declared to the syncer when the learner joins; a pseudo-gradient weighs
    ``tokens_per_step`` × its inner steps (``merge: "tokens"``), and the syncer refuses one that claims more.
    Default: 1 (weights by inner steps: right when every learner trains on the same batch per step)."""

    syncer: Optional[SyncerConfig] = None
    """``decoupled`` only: where its syncer runs (default: the launch starts its own shards); see
    ``SyncerConfig``."""



def check_decoupled(acco) -> None:
    """How the decoupled keys combine with ``acco.mode`` and the other blocks (raises ``ValueError`` naming
    the key and the fix)."""
    ls = acco.local_sgd
    given = set(ls.model_fields_set) if ls is not None else set()
    if acco.mode != DECOUPLED:
        stray = [k for k in DECOUPLED_ONLY if k in given]
        if stray:
            raise ValueError(f'acco.local_sgd.{stray[0]} belongs to mode "decoupled" (learners that never wait for '
                             f'each other), not to mode "{acco.mode}": remove it or set acco.mode to "decoupled"')
        return
    ls = ls if ls is not None else DecoupledKeys()
    for key in NOT_DECOUPLED:
        if key in given:
            raise ValueError(f'acco.local_sgd.{key} does not apply to mode "decoupled": its syncer merges whole '
                             f'pseudo-gradients with outer_lr, outer_momentum and nesterov (staleness: "none" or '
                             f'"delayed_nesterov"). Remove {key}')
    if "sync_every_s" in given and "sync_every" in given:
        raise ValueError("acco.local_sgd.sync_every_s (a period ends on wall time) and acco.local_sgd.sync_every "
                         "(a period of a fixed step count) exclude each other: remove one of them")
    if ls.nesterov_delay is not None and ls.staleness != "delayed_nesterov":
        raise ValueError('acco.local_sgd.nesterov_delay is Delayed Nesterov\'s N: it applies with '
                         '"staleness": "delayed_nesterov" only. Remove it or set staleness')
    if ls.staleness == "delayed_nesterov" and ls.nesterov is False:
        raise ValueError('acco.local_sgd.staleness "delayed_nesterov" is a Nesterov outer step: remove '
                         '"nesterov": false or use staleness "none"')
    if acco.fault_tolerance is not None:
        raise ValueError('acco.fault_tolerance (torchft quorums) and acco.mode "decoupled" exclude each other: a '
                         'decoupled learner has no quorum to wait for; its syncer already drops learners that die '
                         'and lets relaunched ones in. Remove acco.fault_tolerance (name the syncer with '
                         'acco.local_sgd.syncer.address to run one launch per learner)')


def layout_name(groups, mp: int, shards, sizes) -> str:
    """A learner's shape as its ranks say it at HELLO (``dp0.tp1.pp1.ep1.n1234.g0a1b2c3d``): data-parallel ranks
    ``k`` (0: any, a dense learner's pieces are moved into the syncer's parts, ``decoupled/layout.py``; with
    experts, ``k``: their partitions are sent as they are), tensor-parallel and pipeline sizes, the largest
    expert-parallel size inside it, the elements of the model at this rank's model-parallel position and a
    checksum of its parameter groups' sizes. A learner that maps onto the unsplit model says
    ``decoupled/canonical.canonical_name`` instead (``dp0.tp0.pp0.ep1``: any data-, tensor-parallel and pipeline
    size). ``groups``: the host's ``ReplicaGroups``; ``mp``: its
    model-parallel size; ``shards``: its ``Shards``; ``sizes``: the elements of each parameter group."""
    import zlib

    import torch.distributed as tdist
    tp = groups.tensor_parallel if mp > 1 else 1
    ep = max([groups.k // tdist.get_world_size(group=g[1]) for g in (shards.gather or []) if g is not None],
             default=1)
    dp = groups.k if any(g is not None for g in (shards.gather or [])) else 0
    check = zlib.crc32(",".join(map(str, sizes)).encode())
    return f"dp{dp}.tp{tp}.pp{mp // tp}.ep{ep}.n{sum(sizes)}.g{check:08x}"


def _shape_words(name: str) -> str:
    dp, tp, pp, ep, n, g = name.split(".")
    ranks = "any number of data-parallel ranks" if dp == "dp0" else f"{dp[2:]} data-parallel rank(s) (experts)"
    if tp == "tp0":  # decoupled/canonical.py: mapped onto the unsplit model
        return (f"{ranks} x any tensor-parallel and pipeline size mapped onto the unsplit model, expert parallel "
                f"{ep[2:]} ({n[1:]} elements of the unsplit model, parameter groups and shapes {g[1:]})")
    return (f"{ranks} x tensor parallel {tp[2:]} x pipeline {pp[2:]}, expert parallel {ep[2:]} ({n[1:]} elements "
            f"at this model-parallel position, parameter groups {g[1:]})")


def shape_refusal(learner: int, name: str, first: str, first_learner: int) -> str:
    """What a syncer shard answers a learner whose shape is not the first learner's (``layout_name``)."""
    return (f'acco.mode "decoupled": learner {learner} runs as {_shape_words(name)}, but learner {first_learner} '
            f"as {_shape_words(first)}. The syncer holds one model cut at fixed places: learners may differ in "
            f"data-parallel size (without experts), and in tensor-parallel and pipeline size when both map onto "
            f"the unsplit model (no experts, every split parameter with Megatron's tensor_model_parallel, "
            f"partition_dim 0 or 1 and partition_stride 1, every stage with the same parameter groups, whose "
            f"concatenation in stage order is the one-stage model's); not in their model (its unsplit shapes: a "
            f"vocabulary padded per tensor-parallel size differs, so pad it to a multiple every size shares), its "
            f"parameter groups, or their expert-parallel sizes. A weight tied across pipeline stages (tied "
            f"embeddings) is on two stages and cannot be mapped (such a learner shares a syncer only with learners "
            f"of its own sizes): launch this learner with the first one's model and sizes, or give it a syncer of "
            f"its own")


def learner_launch_size(acco, world_size: int) -> Optional[int]:
    """A decoupled launch that names its syncer (and no replica_group_size) is one learner: its whole world."""
    ls = acco.local_sgd
    if acco.mode == DECOUPLED and ls is not None and ls.replica_group_size is None and ls.syncer is not None \
            and ls.syncer.address:
        return world_size
    return None


__all__ = ["SyncerConfig", "DecoupledKeys", "learner_launch_size", "check_decoupled", "layout_name", "shape_refusal",
           "DECOUPLED", "DECOUPLED_ONLY", "NOT_DECOUPLED"]
