"""The only code that touches DeepSpeed internals: the engine, the ZeRO-1
optimizer subclass, its checkpoint state, and the
``deepspeed.initialize`` patch."""
