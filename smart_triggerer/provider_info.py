"""Airflow provider metadata, so ``airflow providers list`` shows this package."""

from __future__ import annotations

from typing import Any

from smart_triggerer import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-smart-triggerer",
        "name": "Smart Triggerer",
        "description": "Deduplicating, sharded triggerer, deferrable sensors and a dataset bridge.",
        "versions": [__version__],
        "cli": ["smart_triggerer.cli.provider.get_cli_commands"],
        "config": {
            "smart_triggerer": {
                "description": "Settings of the smart triggerer service.",
                "options": {
                    "shards": {
                        "description": "Virtual shards that identity groups hash into; fixed per deployment.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": None,
                        "default": "64",
                    },
                    "lease_seconds": {
                        "description": "How long a shard lease lasts without renewal (seconds).",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "8",
                    },
                    "dedup": {
                        "description": "Run one coroutine per identity group instead of one per trigger.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": None,
                        "default": "True",
                    },
                    "dedup_classpaths": {
                        "description": "Extra foreign trigger classpaths whose kwargs are all identity.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "my.module.MyStateTrigger",
                        "default": "",
                    },
                    "resume_hold_seconds": {
                        "description": "Hold events for tasks deferred more recently than this (seconds); "
                        "Airflow 3.3.2 can fail a task resumed within seconds of its deferral.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "10",
                    },
                    "health_port": {
                        "description": "Port of the health/metrics endpoint (GET /health, GET /metrics); 0 "
                        "picks a free port; empty: no endpoint.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "8795",
                        "default": "",
                    },
                    "health_host": {
                        "description": "Address the health endpoint binds. 127.0.0.1 needs no "
                        "authentication; any other (0.0.0.0 for Kubernetes probes, Prometheus) needs "
                        "health_token.",
                        "version_added": "0.2.0",
                        "type": "string",
                        "example": "0.0.0.0",  # noqa: S104 (an example value, not a bind)
                        "default": "127.0.0.1",
                    },
                    "health_token": {
                        "description": "Bearer token every request to a non-loopback health endpoint must "
                        "carry (Authorization: Bearer <token>).",
                        "version_added": "0.2.0",
                        "type": "string",
                        "sensitive": True,
                        "example": None,
                        "default": "",
                    },
                    "loop_seconds": {
                        "description": "Seconds between the supervisor's loads of new and finished waiters; "
                        "lease_seconds must be at least three loops.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": None,
                        "default": "1",
                    },
                    "event_loop": {
                        "description": "Event loop of the trigger runner subprocess: uvloop (libuv; polls "
                        "come on time under a resume burst) or asyncio (Python's own).",
                        "version_added": "0.2.0",
                        "type": "string",
                        "example": "asyncio",
                        "default": "uvloop",
                    },
                    "placement_epsilon": {
                        "description": "Bounded-load placement: no instance holds more than (1 + this) "
                        "times its capacity-weighted share of the groups while another has room.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": None,
                        "default": "0.25",
                    },
                    "max_loop_lag_ms": {
                        "description": "An instance whose trigger runner's event loop lags more than this "
                        "(p99 over the last 10 s) takes no new shards and hands shards over until under "
                        "half of it for 30 s; 0: off.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": None,
                        "default": "1000",
                    },
                    "max_rss_mb": {
                        "description": "The same for the instance's memory (supervisor and runner RSS, MB), "
                        "back under it; an instance whose RSS did not fall after a step keeps what "
                        "it holds and takes nothing new (CPython seldom gives memory back); 0: off.",
                        "version_added": "0.2.0",
                        "type": "integer",
                        "example": "4096",
                        "default": "0",
                    },
                    "runner_stall_seconds": {
                        "description": "An instance whose trigger runner has not answered for this long "
                        "(a trigger blocked its event loop with a sync call, or the runner process is "
                        "stopped) hands every shard over at once, answers 503 on /health with the cause, "
                        "and takes shards again once the runner answers. Unset: three leases. 0: off.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": "24",
                        "default": "",
                    },
                    "sweep_seconds": {
                        "description": "How often Airflow's clean_unused and the check for waits nothing "
                        "refers to read every trigger and waiting task row (the safety net for trigger "
                        "rows whose task row was deleted); departures are otherwise found without it.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": None,
                        "default": "600",
                    },
                    "coalesce_checks": {
                        "description": "Waits of one runner on the same status table (TableLoadTrigger) or "
                        "on tasks of one DAG run (ExternalDagTrigger) share one query per tick; read where "
                        "the trigger runs.",
                        "version_added": "0.2.0",
                        "type": "boolean",
                        "example": None,
                        "default": "True",
                    },
                },
            },
            "dataset_bridge": {
                "description": "The dataset bridge's inbox (cross-deployment events into this deployment).",
                "options": {
                    "inbox_secrets": {
                        "description": "JSON object: source deployment name -> shared HMAC secret. Empty: "
                        "the inbox (POST /dataset-bridge/inbox) answers 503.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "sensitive": True,
                        "example": '{"deployment_a": "<secret>"}',
                        "default": "",
                    },
                    "inbox_retention_days": {
                        "description": "Days the inbox keeps (source, event id) keys against redelivery; "
                        "older ones are pruned every ten minutes.",
                        "version_added": "0.2.0",
                        "type": "float",
                        "example": "30",
                        "default": "30",
                    },
                    "inbox_allowed_assets": {
                        "description": "JSON object: source deployment name -> list of the assets it may "
                        'create events for, each "uri:<asset URI>" or "name:<asset name>" ("*": any). '
                        "A source not listed may create none.",
                        "version_added": "0.2.0",
                        "type": "string",
                        "example": '{"deployment_a": ["uri:warehouse://dds/h_user", "name:users_loaded"]}',
                        "default": "",
                    },
                },
            },
        },
    }
