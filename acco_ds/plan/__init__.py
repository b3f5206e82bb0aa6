"""``acco-ds plan``: which mode, layout, period and compression, how fast, and whether it fits.

Modules: ``model`` (the time model of each mode's data-parallel part), ``layouts`` (tensor, pipeline and expert
layouts and the search), ``memory`` (model states and activations per rank), ``factors`` (token factors and
their sources), ``literature`` (published cases the model is checked against), ``measure`` (``--measure``
inside a launch), ``parse``, ``report`` and ``command`` (the command). docs/plan.md explains the model.
"""

from .command import main, measure_main, parser, plan_measured
from .parse import PlanError, parse_bandwidth, parse_count, parse_memory
from .report import plan, table

__all__ = ["main", "measure_main", "parser", "plan", "plan_measured", "table", "PlanError", "parse_bandwidth",
           "parse_count", "parse_memory"]
