"""The data pipeline: load history, policy backtest and what-if reports (DESIGN §2).

Layers, from pure to I/O (the pure ones import no I/O library, no pandas):

* :mod:`.load` — a topic's load over time and over the hash space (pure);
* :mod:`.simulate` — replays a load through ``layout`` + ``policy.decide`` (pure);
* :mod:`.variants` — policy variants from one TOML file (pure);
* :mod:`.traces` — importers: NAB-style CSV series, recorded Parquet history;
* :mod:`.engines` — runs traces x variants locally (pandas, a process per core)
  or on Spark (batches of (trace, variant) groups, one task each), same function both ways;
* :mod:`.report` — ``metrics.csv``, ``report.md`` and PNG plots;
* :mod:`.recorder` — follows etcd (and the audit topic) into Parquet;
* :mod:`.cli` — the ``backtest`` and ``record`` subcommands.

pandas, pyarrow, pyspark and matplotlib are the optional ``spark`` extra: only
``engines``, ``report``, ``recorder`` and ``traces`` (history import) need them.
"""
