"""The runtime every algorithm runs on, free of DeepSpeed:

* ``buffers``: the flat accumulator / communication buffers and their memory plan;
* ``comm``: the communication thread (own process group, own CUDA stream);
* ``collectives``: reduce-scatter / all-gather with optimal bytes per backend;
* ``update``: the inner (sharded optimizer) update, Peek or commit;
* ``job``: one round's communication job as named phases, and its result;
* ``stats``: per-round statistics the engine reads;
* ``dtypes``: DeepSpeed's dtype names.
"""
