"""The commands: ``acco-ds`` (``report``: what acco_ds will use here, and its subcommands ``memory`` and
``plan``), ``acco-ds-run`` (``run``: an unmodified script with ``acco_ds.patch()`` applied) and ``acco-ds-warm``
(``warm``: ranks forked from a parent that imported torch, DeepSpeed and acco_ds once). No library code
imports them."""
