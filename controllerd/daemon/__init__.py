"""The ``controllerd run`` process: the controller, the runtime (task group,
signals, shutdown), the ops HTTP surface, metrics, logging and the clock.
"""
