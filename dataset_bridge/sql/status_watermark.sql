-- The status trigger's watermarks, in the database it watches (or its watermark_conn_id's), created
-- when missing (dataset_bridge/status_table.py).
CREATE SCHEMA IF NOT EXISTS dataset_bridge;
CREATE TABLE IF NOT EXISTS dataset_bridge.status_watermark (
    status_table text NOT NULL,
    table_name text NOT NULL,
    last_id bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (status_table, table_name)
);
