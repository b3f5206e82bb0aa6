"""The outer loops of the local-SGD family, one class per loop on ``base.LocalSGD``, behind ``interface.OuterLoop``."""
