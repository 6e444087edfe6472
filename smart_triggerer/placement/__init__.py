"""Pure bookkeeping, the same in every instance from the same inputs: which instance holds which shard
(``shards``, ``rendezvous``) and which tasks wait in one coroutine (``groups``). No database, no ORM."""
