"""Benchmarks: ``make bench`` (``python -m benchmarks``) writes JSON, markdown and PNG plots to
``benchmarks/results/``. Figures are ratios and medians measured in one run on one machine."""
