"""The pure core: the layout model, the policy, the GC and load-report rules, the view.

Nothing here does I/O or reads a clock (import-linter enforces it): the daemon,
the CLI and the backtest all call the same functions with the same inputs.
"""
