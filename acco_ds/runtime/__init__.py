"""The runtime every algorithm runs on, free of DeepSpeed, in three rooms:

* ``rounds``: the round machinery every host drives: ``driver`` (``RoundDriver``), ``job`` (one round's
  communication as named phases), ``buffers`` (flat accumulator and communication buffers, their memory
  plan), ``update`` (the sharded inner update, Peek or commit), ``views`` (committed-weight views),
  ``state`` (what a checkpoint adds), ``stats`` (figures and words), ``host_memory``;
* ``comm``: the communication side: ``worker`` (the communication thread, its own process group and CUDA
  stream), ``collectives`` (reduce-scatter / all-gather with optimal bytes per backend, node-aware
  layouts), ``compression`` (block-quantized collectives with error feedback), ``groups``;
* ``outer``: the outer loops of the local-SGD family: ``interface`` (what a host calls, the registry),
  ``base`` (anchor, momentum, average, install, state), one module per loop (``diloco``, ``co2``,
  ``edit``, ``streaming``), ``update`` (the outer optimizer step), ``words``.

``dtypes`` (DeepSpeed's dtype names) serves all three; ``reshard`` maps a checkpoint's per-rank pieces into
another layout (another world size or replica layout) for the hosts' loads.
"""
