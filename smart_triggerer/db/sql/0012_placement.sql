-- smart_triggerer schema, version 12: placement that follows load (placement.py).
-- Each instance publishes its load with its heartbeat; each shard's owner publishes the groups it holds.
-- placement: the placement an instance computes (1: rendezvous by capacity, the releases before this
-- one; 2: filters and bounded loads). While any live instance computes 1, every instance computes 1, so a
-- fleet in a rolling upgrade agrees on one map. Older instances read none of these columns: compatible.
ALTER TABLE smart_triggerer.instance
    ADD COLUMN placement smallint NOT NULL DEFAULT 1,
    ADD COLUMN lag_p99_ms real,
    ADD COLUMN rss_mb integer,
    ADD COLUMN accepting boolean NOT NULL DEFAULT true,
    ADD COLUMN limit_groups integer,
    ADD COLUMN shedding text,
    ADD COLUMN fleet_full boolean NOT NULL DEFAULT false;
-- groups: NULL until an owner has loaded the shard and published its count
ALTER TABLE smart_triggerer.shard_lease ADD COLUMN groups integer;
