"""The run protocol on a mailbox: where things live and how parties agree through it.

The key layout and the pure decisions over keys (`keyspace`), liveness (`lease`, and the
roll call `rollcall`), the `Exchange` that reads and writes records and payloads
(`protocol`), joining a run (`join`), following a fragment commit by commit (`replica`;
one rank's rows of it, `sharded_replica`), a part written in place (`sharded_part`) and reading
the newest committed model (`committed`). Learners and syncers are built on it.
"""

__all__: list[str] = []
