-- Asset-watcher events that carry an idempotency key: one asset event per (asset, key), ever.
-- Written in the same transaction as the asset event, so a redelivered event (a triggerer that died
-- between storing an event and acknowledging its source) finds its key and creates nothing.
CREATE TABLE smart_triggerer.asset_event_key (
    asset_id integer NOT NULL,
    idempotency_key text NOT NULL,
    trigger_id integer,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset_id, idempotency_key)
);
