-- The dataset bridge prunes idempotency keys older than its retention (dataset_bridge/retention.py).
CREATE INDEX asset_event_key_created ON smart_triggerer.asset_event_key (created_at);
