"""The rounds of ``acco``, ``dpu`` and ``sync`` (and the local-SGD inner steps): ``RoundDriver`` and its parts."""
