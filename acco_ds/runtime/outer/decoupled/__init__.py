"""``"mode": "decoupled"`` (Decoupled DiLoCo): learners that never wait for each other, and the syncer that merges
their pseudo-gradients (docs/design/decoupled.md). ``wire``: the checked byte protocol; ``syncer``: one shard of
the syncer (a CPU process: its connections and main loop), with ``merges`` (the merge rule, the log, the
checkpoint) and ``state`` (its arithmetic); ``learner``: the outer loop each rank of a learner runs, with
``exchange`` (sending its Δ, re-sending it after a syncer restart, waiting for the merge) and ``link`` (its
connection and the up-link's fp32 or quantized encoding); ``own_shards``: the shards a launch starts for
itself."""
